"""Where a command's CPU goes, against what the machine's cores give: CI's time floor.

Runs a command (in a process group of its own) and samples every process on the machine: each
one's CPU time (``/proc/<pid>/stat``) every ``--interval`` seconds, and the machine's busy time
(``/proc/stat``) over the run. At the end it prints the machine's busy CPU-seconds, the floor
they set on the wall time (busy CPU-seconds / cores: no scheduling of the same work finishes
sooner), the wall time against that floor, and the CPU-seconds per kind of process. A process
that lives less than one interval is missed by the per-process table, not by the busy total.

    python bench/ci_cpu.py [--interval 2] [--json out.json] -- bash .ci/run

Measured with it: docs/development.md, "Full CI, 2026-11-29 05:27-06:22 UTC".
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
# A Go binary built by the test harness is named with its version: kube-apiserver-v1.36.3.
_VERSION_SUFFIX = re.compile(r"-v?\d+(\.\d+)+$")


def kind(argv: list[str], comm: str) -> str:
    """The kind of process that ``argv`` (its command line) and ``comm`` (its kernel name) show:
    the title a process gave itself (``ray::TrainerActor``, ``VLLM::Worker``), a Python process's
    module or script, else the program's name without a version suffix; ``[comm]`` for a process
    with no command line left (a kernel thread, or one that has exited but not been reaped)."""
    if not argv:
        return f"[{comm}]"
    program = os.path.basename(argv[0])
    if "::" in program:  # setproctitle's title, the whole command line
        return program.split()[0].split(".")[0]
    if program.startswith("python"):
        rest = argv[1:]
        for index, arg in enumerate(rest):
            if arg == "-m" and index + 1 < len(rest):
                return f"python -m {rest[index + 1]}"
            if arg == "-c":
                return "python -c " + " ".join(rest[index + 1:])[:50]
            if not arg.startswith("-"):
                return f"python {script_name(arg)}"
        return "python"
    return _VERSION_SUFFIX.sub("", program)


def script_name(path: str) -> str:
    """A script's path below its site-packages (``ray/dashboard/agent.py``), a console script's
    name (``/opt/kuberl/bin/ray``: ``ray``), else the path as given."""
    if "site-packages/" in path:
        return path.split("site-packages/", 1)[1]
    if "/bin/" in path:
        return os.path.basename(path)
    return path


def busy_ticks(stat_line: str) -> int:
    """The busy ticks of ``/proc/stat``'s first line: all but idle and iowait."""
    fields = [int(x) for x in stat_line.split()[1:]]
    return sum(fields[:8]) - fields[3] - fields[4]


def machine_busy_ticks(proc: Path = Path("/proc")) -> int:
    """The machine's busy ticks since boot, all cores."""
    return busy_ticks((proc / "stat").read_text().splitlines()[0])


def process_ticks(stat: str) -> tuple[int, str]:
    """(user + system ticks, start time) of one ``/proc/<pid>/stat``; the name may hold spaces
    and parentheses, so the fields are counted from the last ``)``."""
    fields = stat.rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12]), fields[19]


class Sampler:
    """Each process's CPU ticks at first and last sight, keyed by (pid, start time) so that a
    reused pid is another process, and the kind it last showed (a process may rename itself)."""

    def __init__(self, proc: Path = Path("/proc")):
        self.proc = proc
        self.first: dict[tuple[str, str], int] = {}
        self.last: dict[tuple[str, str], int] = {}
        self.kinds: dict[tuple[str, str], str] = {}

    def sample(self, *, baseline: bool = False) -> None:
        """Read every process once; at the ``baseline``, what each has used so far is left out."""
        for entry in self.proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                ticks, started = process_ticks((entry / "stat").read_text())
                argv = [a for a in (entry / "cmdline").read_bytes().decode(errors="replace").split("\0") if a]
                comm = "" if argv else (entry / "comm").read_text().strip()  # needed only without argv
            except OSError:  # gone between the listing and the read
                continue
            key = (entry.name, started)
            self.first.setdefault(key, ticks if baseline else 0)  # one started during the run: all of it
            self.last[key] = ticks
            self.kinds[key] = kind(argv, comm)

    def seconds_by_kind(self) -> collections.Counter:
        out: collections.Counter = collections.Counter()
        for key, ticks in self.last.items():
            out[self.kinds[key]] += (ticks - self.first[key]) / TICKS_PER_SECOND
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between samples of every process")
    parser.add_argument("--top", type=int, default=30, help="how many kinds of process to print")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("command", nargs="+", help="the command to run, after --")
    args = parser.parse_args(argv)

    cores = os.cpu_count() or 1
    sampler = Sampler()
    sampler.sample(baseline=True)
    busy_start, started = machine_busy_ticks(), time.monotonic()
    command = subprocess.Popen(args.command, start_new_session=True)
    try:
        while command.poll() is None:
            sampler.sample()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        os.killpg(command.pid, signal.SIGTERM)  # the command's whole process group, nothing else
        command.wait()
    sampler.sample()
    wall = time.monotonic() - started
    busy = (machine_busy_ticks() - busy_start) / TICKS_PER_SECOND
    by_kind = sampler.seconds_by_kind()
    floor = busy / cores

    print(f"command exited {command.returncode} after {wall:.0f} s")
    print(f"machine busy {busy:.0f} CPU-s of {cores * wall:.0f} ({busy / (cores * wall):.0%} of {cores} cores); "
          f"{sum(by_kind.values()):.0f} CPU-s attributed to processes seen")
    print(f"floor (busy CPU-s / {cores} cores) {floor:.0f} s; wall / floor {wall / floor:.2f}")
    for name, seconds in by_kind.most_common(args.top):
        print(f"{seconds:9.1f}  {seconds / busy:5.1%}  {name}")
    if args.json:
        args.json.write_text(json.dumps({
            "command": args.command, "exit": command.returncode, "wall_s": wall, "cores": cores,
            "busy_cpu_s": busy, "floor_s": floor, "cpu_s_by_kind": dict(by_kind.most_common()),
        }, indent=2))
    return command.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
