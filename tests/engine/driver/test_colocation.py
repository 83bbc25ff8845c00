"""Colocation in the driver loop: engines sleep once the step's rollout is done, while the trainer
ranks compute log-probs and step, and wake before the weight sync and the next rollout.

The trainer group, engine pool and weight sync here are recording stand-ins: what releases GPU
memory is vLLM's sleep mode, which exists only on GPUs (vLLM's CPU worker logs and ignores it,
tests/engine/rollout/test_engine.py), and no GPU machine here has vLLM. What is under test is the order
the driver keeps, on the real Driver with the real tokenizer, data and rewards (the reward
workers are Ray tasks: the tests share the session's Ray, `ray_session`)."""

from __future__ import annotations

from tests.engine.driver.standins import Calls, standin_driver


def test_colocated_engines_sleep_while_the_trainer_steps(ray_session, tmp_path):
    calls = Calls()
    driver = standin_driver(tmp_path, calls, colocate=True)
    driver.train_step(0)
    driver.train_step(1)
    assert calls == ["generate", "sleep", "log_probs", "train_step", "wake_up", "sync"] * 2


def test_engines_on_their_own_gpus_never_sleep(ray_session, tmp_path):
    calls = Calls()
    standin_driver(tmp_path, calls).train_step(0)
    assert calls == ["generate", "log_probs", "train_step", "sync"]


def test_colocated_engines_get_the_gpus_of_trainer_ranks_on_one_node():
    """GPU accounting: colocated engines ask Ray for no GPU; each takes tensorParallelSize GPUs
    that trainer ranks of one node hold, so every GPU is counted once."""
    import pytest

    from kuberl.rollout.pool import colocated_devices

    slots = [("n1", "0"), ("n2", "0"), ("n1", "1"), ("n2", "1"), ("n1", "2"), ("n1", "3")]
    assert colocated_devices(slots, 2) == [("n1", ["0", "1"]), ("n1", ["2", "3"]), ("n2", ["0", "1"])]
    assert colocated_devices(slots, 1)[:2] == [("n1", ["0"]), ("n1", ["1"])]
    with pytest.raises(ValueError, match="not a multiple"):
        colocated_devices(slots[:3], 2)
