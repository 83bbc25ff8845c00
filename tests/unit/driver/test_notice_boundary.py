"""What the driver does at a step boundary after a preemption notice (``kuberl.driver.notices``):
it checkpoints the step just completed and waits for the commit; when the notice came from the
head, its own pod (KubeRay deleting the whole cluster, as for a Kueue preemption), it begins no
next step: one would be lost with the head, and run again by the next attempt.

The real Driver with test_async_driver.py's stand-ins (engines, trainer, weight sync, checkpoints)
and a stand-in for the notice board, which is a Ray actor fed by the pods' preStop hooks
(tests/engine/driver/test_notice_hook.py runs the real board and hook)."""

from __future__ import annotations

import threading
import time

from kuberl.driver.loop import EXIT_PREEMPTED

from tests.unit.driver.test_async_driver import Checkpoints, _driver, tiny  # noqa: F401 - tiny: a fixture

HOLD_SECONDS = 1.0  # long enough for a step of the stand-ins to begin, were it going to


class Board:
    """Stand-in for kuberl.driver.notices.Notices: ``pod`` gives notice during step ``at``."""

    def __init__(self, pod: str, head: bool, at: int):
        self.pod, self.head, self.at = pod, head, at
        self.boundaries: list[tuple[int, bool]] = []  # (step, in_flight), as the driver reported them
        self.holding = threading.Event()

    def take(self, step: int, in_flight: bool = True) -> tuple[list[str], bool]:
        self.boundaries.append((step, in_flight))
        if not in_flight:
            self.holding.set()
        return ([self.pod], self.head) if (step, in_flight) == (self.at, True) else ([], False)

    def recovering(self, active: bool) -> None:
        raise AssertionError("no trainer rank is lost here")


def test_when_the_head_gives_notice_no_step_begins_after_the_commit(tiny, tmp_path):  # noqa: F811
    driver = _driver(tiny, tmp_path, Checkpoints(), totalSteps=5)
    driver.engines.hold = False
    driver.notices = Board("job-head-x", head=True, at=2)
    outcome: list = []
    run = threading.Thread(target=lambda: outcome.append(driver.run()))
    run.start()
    assert driver.notices.holding.wait(60), driver.notices.boundaries
    time.sleep(HOLD_SECONDS)
    # Step 2 is checkpointed (no interval is due) and the driver holds: step 3 never trains.
    assert set(driver.checkpoints.saved) == {2} and len(driver.trainer.batches) == 2 and run.is_alive()
    assert driver.notices.boundaries == [(1, True), (2, True), (2, False)]  # later notices wait for nothing
    driver.preemption.requested = True  # the SIGTERM the head gets once its hook has seen the commit
    run.join(10)
    [(code, results)] = outcome
    assert (code, len(results), driver.step) == (EXIT_PREEMPTED, 2, 2)


def test_after_a_trainer_pods_notice_the_run_goes_on(tiny, tmp_path):  # noqa: F811
    """A trainer pod going is recovered in place (same attempt): the step in flight is
    checkpointed and the run goes on."""
    driver = _driver(tiny, tmp_path, Checkpoints(), totalSteps=4)
    driver.engines.hold = False
    driver.notices = Board("job-trainer-worker-x", head=False, at=2)
    code, results = driver.run()
    assert (code, len(results), set(driver.checkpoints.saved)) == (0, 4, {2})
    assert (2, False) not in driver.notices.boundaries
