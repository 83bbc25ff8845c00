"""Download progress: a bar (bytes, rate, ETA) on a terminal, periodic log lines otherwise
(init-container logs are not terminals, and a carriage-return bar would be unreadable there)."""

from __future__ import annotations

import logging
import sys
import threading
import time
from typing import TextIO

log = logging.getLogger("kuberl.storage")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    def __init__(self, label: str, total_bytes: int, total_files: int, *,
                 stream: TextIO | None = None, interval_s: float = 10.0):
        self.label = label
        self.total_bytes = total_bytes
        self.total_files = total_files
        self.done_bytes = 0
        self.done_files = 0
        self._lock = threading.Lock()
        self._start = time.monotonic()
        self._interval = interval_s
        self._last_log = self._start
        stream = stream if stream is not None else sys.stderr
        self._bar = None
        if stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=label, file=stream, dynamic_ncols=True)

    def add_bytes(self, n: int) -> None:
        with self._lock:
            self.done_bytes += n
            if self._bar is not None:
                self._bar.update(n)
                return
            now = time.monotonic()
            if now - self._last_log < self._interval:
                return
            self._last_log = now
            line = self._line(now)
        log.info(line)

    def add_file(self) -> None:
        with self._lock:
            self.done_files += 1

    def _line(self, now: float) -> str:
        elapsed = max(now - self._start, 1e-9)
        rate = self.done_bytes / elapsed
        left = self.total_bytes - self.done_bytes
        eta = f"{left / rate:.0f}s" if rate > 0 else "?"
        pct = 100.0 * self.done_bytes / self.total_bytes if self.total_bytes else 100.0
        return (f"{self.label}: {_human(self.done_bytes)} / {_human(self.total_bytes)} ({pct:.0f}%), "
                f"{self.done_files}/{self.total_files} files, {_human(rate)}/s, ETA {eta}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        else:
            log.info(self._line(time.monotonic()))
