"""status.progress.activity (``kuberl.driver.report``): what the driver does, shown once it has
lasted ``after_s`` and cleared when it ends, so that short phases cost no status patch. The
rule is pure (``activity_shown``); the board's thread is checked with a short ``after_s`` and a
recording ``send`` (its patches of the real API server: tests/cluster/driver/test_report.py)."""

from __future__ import annotations

import threading
import time

from kuberl.driver.report import ActivityBoard, activity_shown

GENERATE = ("generate", 100.0, "2026-11-26T18:00:00Z")
TRAIN = ("train", 105.0, "2026-11-26T18:00:05Z")


def test_an_activity_shows_once_it_has_lasted_after_s_and_not_before():
    assert activity_shown(GENERATE, None, 100.5, 2.0) == (None, 1.5)  # not yet: look again in 1.5 s
    assert activity_shown(GENERATE, None, 102.0, 2.0) == (GENERATE, None)
    assert activity_shown(GENERATE, GENERATE, 150.0, 2.0) == (GENERATE, None)  # shown: stays


def test_a_shown_activity_that_ended_is_cleared_at_once_and_the_next_shows_after_after_s():
    assert activity_shown(None, GENERATE, 105.0, 2.0) == (None, None)
    assert activity_shown(TRAIN, GENERATE, 105.5, 2.0) == (None, 1.5)  # never the one the driver left
    assert activity_shown(TRAIN, GENERATE, 107.0, 2.0) == (TRAIN, None)  # replaced in one patch
    # The same activity begun again is another one: its own time counts.
    again = ("generate", 110.0, "2026-11-26T18:00:10Z")
    assert activity_shown(again, GENERATE, 110.5, 2.0) == (None, 1.5)


class Sent(list):
    def __init__(self):
        super().__init__()
        self.arrived = threading.Condition()

    def __call__(self, status):
        with self.arrived:
            self.append(status["progress"])
            self.arrived.notify_all()

    def wait(self, count: int, timeout: float = 10.0) -> list:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self) >= count, timeout), list(self)
        return list(self)


def test_the_board_patches_only_activities_that_last_and_clears_them():
    sent = Sent()
    board = ActivityBoard(sent, after_s=0.3)
    for _ in range(20):  # short phases, as at 1 s steps: nothing sent
        board.set("generate")
        board.set("train")
        board.set(None)
    board.set("generate")
    [shown] = sent.wait(1)
    assert shown["activity"] == "generate" and shown["activitySince"].endswith("Z")
    board.set("train")  # the shown one ended: cleared at once, train not yet
    assert sent.wait(2)[1] == {"activity": None, "activitySince": None}
    assert sent.wait(3)[2]["activity"] == "train"
    board.close()  # the run is over: cleared, the thread gone
    assert sent.wait(4)[3] == {"activity": None, "activitySince": None}
    time.sleep(0.5)
    assert len(sent) == 4 and not board._thread.is_alive()
