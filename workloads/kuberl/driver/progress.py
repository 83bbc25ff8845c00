"""What a local `kuberl train` shows on its console: the steps (step/total, reward, tokens/s, ETA)
and the run's events (checkpoint saved, resumed from, validation, warnings and errors); every
other line (vLLM's, Ray's workers', the driver's own INFO lines) goes to a log file it names.

On a terminal the steps are a live bar (tqdm); anywhere else (CI, a pipe, a file) one plain line
per step. Inside a RayJob none of this applies: the driver's log lines go to stdout as they
always did, since KubeRay keeps the pod's logs and the in-pod tests parse its "step N/M k=v"
lines; `-v` asks for the same on a local run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator, Mapping, TextIO

from kuberl.driver.report import StatusReporter

LOG_FILE = "kuberl-train.log"
LOGS, BAR, LINES = "logs", "bar", "lines"


def console_mode(*, verbose: bool, in_ray_job: bool, is_tty: bool) -> str:
    """LOGS (every log line on the console: a RayJob's pod, or -v), BAR (a terminal) or LINES."""
    if verbose or in_ray_job:
        return LOGS
    return BAR if is_tty else LINES


def format_duration(seconds: float | None) -> str:
    """``45s``, ``3m05s``, ``2h04m``; ``?`` while unknown."""
    if seconds is None:
        return "?"
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def eta_seconds(steps_timed: int, seconds: float, steps_left: int) -> float | None:
    """Time left at the mean pace of the steps timed so far; None before any is timed."""
    if steps_timed <= 0:
        return None
    return seconds / steps_timed * steps_left


def step_status(reward: float | None, tokens_per_second: float | None, eta: float | None) -> str:
    return (f"reward {'n/a' if reward is None else f'{reward:.4f}'}"
            f" tokens/s {'n/a' if tokens_per_second is None else f'{tokens_per_second:.1f}'}"
            f" eta {format_duration(eta)}")


def step_line(step: int, total: int, reward: float | None, tokens_per_second: float | None,
              eta: float | None) -> str:
    """The plain line of one step: ``step 3/40 reward 0.4531 tokens/s 812.3 eta 1m20s``."""
    return f"step {step}/{total} {step_status(reward, tokens_per_second, eta)}"


class Display:
    """One run's progress on ``console``: a tqdm bar (``bar``) or one line per step.

    Thread-safe: checkpoints are committed, and reported, from their own thread."""

    def __init__(self, console: TextIO, *, bar: bool, clock: Callable[[], float] = time.monotonic):
        self.console = console
        self.bar = bar
        self.clock = clock
        self._lock = threading.Lock()
        self._tqdm = None
        self._last = 0
        self._timed_from: tuple[int, float] | None = None

    def start(self, step: int, total: int, last: int) -> None:
        """The run goes from ``step`` to ``last`` of the job's ``total`` steps."""
        with self._lock:
            self._last = last
            if self.bar:
                from tqdm import tqdm

                self._tqdm = tqdm(total=total, initial=step, file=self.console, unit="step", desc="train",
                                  dynamic_ncols=True, bar_format="{desc} {bar} {n_fmt}/{total_fmt}{postfix}")

    def step(self, step: int, total: int, reward: float | None, tokens_per_second: float | None) -> None:
        with self._lock:
            now = self.clock()
            # Timed from the end of the run's first step: it also waited for the engine's warm-up.
            if self._timed_from is None:
                self._timed_from = (step, now)
            first, since = self._timed_from
            eta = eta_seconds(step - first, now - since, max(self._last, step) - step)
            if self._tqdm is not None:
                self._tqdm.set_postfix_str(step_status(reward, tokens_per_second, eta), refresh=False)
                self._tqdm.update(step - self._tqdm.n)
            else:
                self._print(step_line(step, total, reward, tokens_per_second, eta))

    def event(self, text: str) -> None:
        """A line of its own (above the bar, on a terminal)."""
        with self._lock:
            if self._tqdm is not None:
                self._tqdm.write(text, file=self.console)
            else:
                self._print(text)

    def close(self) -> None:
        with self._lock:
            if self._tqdm is not None:
                self._tqdm.close()
                self._tqdm = None

    def _print(self, text: str) -> None:
        print(text, file=self.console, flush=True)


class ConsoleReporter(StatusReporter):
    """A local run's reporter: the base one's log lines (into the log file), and the display."""

    def __init__(self, display: Display):
        super().__init__()
        self.display = display

    def progress(self, step: int, total_steps: int, reward: float | None,
                 tokens_per_second: float | None, busy: Mapping[str, float] | None = None) -> None:
        super().progress(step, total_steps, reward, tokens_per_second, busy)
        self.display.step(step, total_steps, reward, tokens_per_second)

    def validation(self, step: int, reward: float) -> None:
        super().validation(step, reward)
        self.display.event(f"validation at step {step}: reward {reward:.4f}")

    def checkpoint(self, uri: str, step: int) -> None:
        super().checkpoint(uri, step)
        self.display.event(f"checkpoint step {step} saved: {uri}")

    def resumed(self, uri: str, step: int) -> None:
        super().resumed(uri, step)
        self.display.event(f"resumed from {uri} (step {step})")


class ConsoleHandler(logging.Handler):
    """Log records the console still shows: kuberl's own warnings, and every error."""

    def __init__(self, display: Display):
        super().__init__()
        self.display = display
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or (record.levelno >= logging.WARNING
                                                   and record.name.split(".")[0] == "kuberl")

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.display.event(self.format(record))
        except Exception:  # noqa: BLE001 - logging's own contract: a handler never raises
            self.handleError(record)


@contextlib.contextmanager
def logs_to_file(path: Path) -> Iterator[TextIO]:
    """Everything this process writes to stdout and stderr (its own logging, Ray's copies of its
    workers' output, native libraries' writes to fd 1 and 2), and what its children inherit, goes
    to ``path`` (appended: a rerun keeps the run before's log); yields the console.

    An exception leaving the block goes into the file too, and then, with the console restored,
    Python prints it there in full: a failed run says why on the console."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    except OSError as exc:
        raise SystemExit(f"kuberl train: cannot write the log file {path}: {exc.strerror}; "
                         "pick another --work-dir, or pass -v to log to the console") from None
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    console = os.fdopen(os.dup(saved[0]), "w", buffering=1)
    log_file = os.fdopen(fd, "w", buffering=1)  # the file itself, whatever sys.stderr is (pytest's)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    print(f"==== kuberl train {time.strftime('%Y-%m-%d %H:%M:%S')} (pid {os.getpid()})", file=log_file)
    try:
        yield console
    except BaseException as exc:
        if not (isinstance(exc, SystemExit) and not isinstance(exc.code, str)):
            sys.stderr.flush()
            traceback.print_exc(file=log_file)
        raise
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
        console.close()
        log_file.close()
