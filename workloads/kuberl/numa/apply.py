"""Applying a placement to the running process: CPU affinity through os.sched_setaffinity and a
preferred-node memory policy through libnuma's integer API, loaded with ctypes.

Only libnuma's integer functions are called (numa_available, numa_max_node,
numa_set_preferred): the bitmask API (struct bitmask pointers) is what made an earlier
ctypes binding segfault. The policy is read back with get_mempolicy(mode only, no node mask),
because numa_set_preferred returns nothing and the kernel may refuse it (seccomp,
missing CAP_SYS_NICE).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from collections.abc import Iterable

log = logging.getLogger("kuberl.numa")

MPOL_PREFERRED = 1
MPOL_PREFERRED_MANY = 5


def set_cpu_affinity(cpus: Iterable[int]) -> int:
    """Pin every thread of this process to ``cpus`` (sched_setaffinity acts on one thread, and
    torch or Ray may have started threads already); returns how many threads were pinned."""
    cpus = frozenset(cpus)
    pinned = 0
    for tid in sorted(int(name) for name in os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # the thread ended since listdir
            continue
        pinned += 1
    return pinned


@functools.cache
def load_libnuma() -> ctypes.CDLL | None:
    """libnuma.so.1 with the integer functions typed, or None when it is missing or reports
    that the kernel has no NUMA support."""
    try:
        lib = ctypes.CDLL("libnuma.so.1", use_errno=True)
    except OSError:
        return None
    lib.numa_available.argtypes = []
    lib.numa_available.restype = ctypes.c_int
    if lib.numa_available() < 0:
        return None
    lib.numa_max_node.argtypes = []
    lib.numa_max_node.restype = ctypes.c_int
    lib.numa_set_preferred.argtypes = [ctypes.c_int]
    lib.numa_set_preferred.restype = None
    lib.numa_set_localalloc.argtypes = []
    lib.numa_set_localalloc.restype = None
    # long get_mempolicy(int *mode, unsigned long *nodemask, unsigned long maxnode, void *addr, unsigned flags)
    lib.get_mempolicy.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_uint]
    lib.get_mempolicy.restype = ctypes.c_long
    return lib


def memory_policy_mode() -> int | None:
    """The calling thread's memory policy mode (0 default, 1 preferred, ...); None without libnuma."""
    lib = load_libnuma()
    if lib is None:
        return None
    mode = ctypes.c_int(-1)
    if lib.get_mempolicy(ctypes.byref(mode), None, 0, None, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"get_mempolicy: {os.strerror(errno)}")
    return mode.value


def prefer_memory_node(node: int) -> tuple[bool, str]:
    """Make the calling thread (and threads it starts later) allocate on ``node`` first.
    Returns (applied, what happened) and never raises: the policy is an optimisation."""
    lib = load_libnuma()
    if lib is None:
        return False, "unchanged: libnuma.so.1 not loadable or NUMA unavailable"
    max_node = lib.numa_max_node()
    if not 0 <= node <= max_node:
        return False, f"unchanged: node {node} outside libnuma's 0..{max_node}"
    lib.numa_set_preferred(node)
    try:
        mode = memory_policy_mode()
    except OSError as exc:
        return False, f"unknown: {exc}"
    if mode not in (MPOL_PREFERRED, MPOL_PREFERRED_MANY):
        return False, "unchanged: the kernel refused set_mempolicy (seccomp or missing CAP_SYS_NICE)"
    return True, f"preferred node {node}"


def reset_memory_policy() -> None:
    """Back to the default (local) allocation policy for the calling thread."""
    lib = load_libnuma()
    if lib is not None:
        lib.numa_set_localalloc()
