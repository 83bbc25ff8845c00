"""The kernel's CPU-list format ("0-55,112-167"), as sysfs and cgroup files write it."""

from __future__ import annotations

from collections.abc import Iterable


class CpuListError(ValueError):
    """A CPU list could not be parsed; the message names the file it came from."""


def parse_cpulist(text: str, source: str = "cpu list") -> frozenset[int]:
    """Parse "0-3,8,10-11" into {0, 1, 2, 3, 8, 10, 11}; an empty string is the empty set."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        first, sep, last = part.partition("-")
        try:
            lo = int(first)
            hi = int(last) if sep else lo
        except ValueError:
            raise CpuListError(f"{source}: {part!r} is not a CPU number or range like '0-55'") from None
        if lo < 0 or hi < lo:
            raise CpuListError(f"{source}: {part!r} is not an ascending CPU range")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """Format CPUs the way the kernel does: sorted, runs collapsed ("0-13,112-125")."""
    ordered = sorted(set(cpus))
    runs: list[str] = []
    start = prev = None
    for cpu in ordered:
        if prev is not None and cpu == prev + 1:
            prev = cpu
            continue
        if start is not None:
            runs.append(f"{start}-{prev}" if prev != start else str(start))
        start = prev = cpu
    if start is not None:
        runs.append(f"{start}-{prev}" if prev != start else str(start))
    return ",".join(runs)
