"""status.progress.activity from the driver's side: each part of a step is named as the driver
enters it (generate, train, sync) and ended as it leaves it, so what the board shows
(``kuberl.driver.report.ActivityBoard``: tests/unit/driver/test_activity.py) is what runs now.
The trainer group, engine pool and weight sync are the recording stand-ins of
tests/engine/driver/standins.py; the reporter records the activities into the same calls."""

from __future__ import annotations

from kuberl.driver.report import StatusReporter
from tests.engine.driver.standins import Calls, standin_driver


class ActivityReporter(StatusReporter):
    def __init__(self, calls: Calls):
        super().__init__()
        self.calls = calls

    def activity(self, name):
        self.calls.record(f"activity {name}")


def test_each_part_of_a_step_is_an_activity_named_before_it_and_ended_after_it(ray_session, tmp_path):
    calls = Calls()
    standin_driver(tmp_path, calls, reporter=ActivityReporter(calls)).run(max_steps=2)
    step = ["activity generate", "generate", "activity None",
            "activity train", "log_probs", "train_step", "activity None",
            "activity sync", "sync", "activity None"]
    assert calls == step + step
