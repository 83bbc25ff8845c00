"""Reward functions the reward-worker tests name by import path, as a job's spec.reward.function would."""

from __future__ import annotations

import os
import time
from pathlib import Path

# Long enough for Ray to start every worker process on a loaded machine.
BARRIER_SECONDS = 120


def concurrent_length_shaped(batch):
    """A verifier that proves its calls run at the same time: each call notes its process id in
    extra_info's pid_dir, then waits until extra_info's `parties` calls have noted theirs (up to
    BARRIER_SECONDS). Shaped by length: extra_info's weight times the share of the budget used."""
    pid_dir = Path(batch[0].extra_info["pid_dir"])
    parties = batch[0].extra_info["parties"]
    (pid_dir / str(os.getpid())).write_text(f"{batch[0].group}\n")
    deadline = time.monotonic() + BARRIER_SECONDS
    while len(list(pid_dir.iterdir())) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(f"only {len(list(pid_dir.iterdir()))} of {parties} reward calls ran at once")
        time.sleep(0.05)
    return [x.extra_info["weight"] * x.response_tokens / x.max_response_tokens for x in batch]


def wrong_count(batch):
    return [0.0] * (len(batch) - 1)


def hang_or_fail(batch):
    """A verifier that hangs or fails on the samples extra_info marks. Marked "hang": it notes its
    process id in extra_info's pid_dir and sleeps an hour. Marked "fail": it raises once a hung
    call has noted its pid (up to BARRIER_SECONDS), so the hung one is running when the step fails.
    Unmarked: 0."""
    marks = {x.extra_info.get("mark") for x in batch}
    pid_dir = Path(batch[0].extra_info["pid_dir"])
    if "hang" in marks:
        (pid_dir / str(os.getpid())).write_text("hung\n")
        time.sleep(3600)
    if "fail" in marks:
        deadline = time.monotonic() + BARRIER_SECONDS
        while not any(pid_dir.iterdir()) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError("the verifier is down")
    return [0.0] * len(batch)


def die_once(batch):
    """The first call's worker process dies (as when its pod is deleted); later calls score 1."""
    marker = Path(batch[0].extra_info["pid_dir"]) / "died"
    if not marker.exists():
        marker.write_text(f"{os.getpid()}\n")
        os._exit(1)
    return [1.0] * len(batch)
