"""The driver's half of the two-stage suspend (docs/operations.md): after each step it asks whether
spec.suspend stands; if so it checkpoints, reports heldForSuspend and starts no next step until
the suspend is withdrawn (or the operator has the cluster deleted). A resumed attempt first
clears the flag the attempt before it may have left, since the operator deletes the cluster at
once while the flag is true and the checkpoint has caught up with progress.

The trainer group, engine pool and weight sync are recording stand-ins (tests/engine/driver/standins.py);
the reporter records what the driver would patch into status."""

from __future__ import annotations

from kuberl.driver import loop as driver_module
from kuberl.driver.report import StatusReporter
from tests.engine.driver.standins import Calls, standin_driver


class RecordingReporter(StatusReporter):
    """Answers spec.suspend from ``answers`` (then False) and records each report in ``calls``."""

    def __init__(self, calls: Calls, answers: list[bool]):
        self.calls = calls
        self.answers = list(answers)

    def progress(self, step, total_steps, reward, tokens_per_second, busy=None):
        self.calls.record(f"progress {step}")

    def held_for_suspend(self, held):
        self.calls.record(f"held {held}")

    def suspend_requested(self):
        answer = self.answers.pop(0) if self.answers else False
        self.calls.record(f"suspend? {answer}")
        return answer


def _generation_and_reports(calls: Calls) -> list[str]:
    return [c for c in calls if c == "generate" or c.split()[0] in ("progress", "held", "suspend?")]


def test_a_suspend_holds_after_the_step_and_a_withdrawn_one_trains_on(ray_session, tmp_path, monkeypatch):
    monkeypatch.setattr(driver_module, "SUSPEND_POLL_SECONDS", 0.0)
    calls = Calls()
    driver = standin_driver(tmp_path, calls, reporter=RecordingReporter(calls, [True, True, False]))
    driver.run(max_steps=2)
    assert _generation_and_reports(calls) == [
        "generate", "progress 1", "suspend? True",
        # Held: no generation while the suspend stands; withdrawn, the flag goes and step 2 runs.
        "held True", "suspend? True", "suspend? False", "held False",
        "generate", "progress 2", "suspend? False"]


def test_a_resumed_driver_clears_the_held_flag_before_its_first_step(ray_session, tmp_path):
    calls = Calls()
    driver = standin_driver(tmp_path, calls, reporter=RecordingReporter(calls, []))
    driver.step = 3  # as restore() leaves it
    driver.run(max_steps=1)
    assert _generation_and_reports(calls) == ["held False", "generate", "progress 4", "suspend? False"]


def test_a_fresh_driver_reports_nothing_before_its_first_step(ray_session, tmp_path):
    calls = Calls()
    standin_driver(tmp_path, calls, reporter=RecordingReporter(calls, [])).run(max_steps=1)
    assert _generation_and_reports(calls)[:2] == ["generate", "progress 1"]
