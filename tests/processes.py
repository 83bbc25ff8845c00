"""Whether a process still runs, for tests that check a process was killed."""

from __future__ import annotations

import time
from pathlib import Path


def alive(pid: int) -> bool:
    """Gone, or a zombie waiting for a parent to reap it (an orphan's new parent may never), is
    not running."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def running(pids: list[int], within_s: float = 30.0) -> list[int]:
    """Those of ``pids`` still running once all have stopped or ``within_s`` has passed: a killed
    process stops when the kernel next schedules it, and Ray's raylet kills a cancelled worker on
    its own time."""
    deadline = time.monotonic() + within_s
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]
