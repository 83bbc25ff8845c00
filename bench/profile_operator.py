"""Run ``python -m kuberl_operator`` under cProfile in every thread (the asyncio loop with kopf's
watches, and the reconcile and apply threads); the merged stats go to the first argument on
SIGUSR1 (written to a temporary name, then renamed: the file appears whole). Not at exit: kopf's
graceful stop on SIGTERM waits for the reconciles in flight, longer than a bench waits.
``bench/operator_scale.py --profile PATH`` starts the operator through it.

    python bench/profile_operator.py OUT.prof --namespace NS ...
    python -c "import pstats; pstats.Stats('OUT.prof').sort_stats('tottime').print_stats(30)"
"""

from __future__ import annotations

import cProfile
import os
import pstats
import signal
import sys
import threading

profiles = [cProfile.Profile()]
_run = threading.Thread.run


def _profiled_run(self: threading.Thread) -> None:
    profile = cProfile.Profile()
    profiles.append(profile)
    profile.enable()
    try:
        _run(self)
    finally:
        profile.disable()


class _Snapshot:
    """A profile's stats so far, read while its thread runs on. ``pstats.Stats(profile)`` would
    call ``profile.disable()``, which from another thread frees the running thread's call stack."""

    def __init__(self, profile: cProfile.Profile) -> None:
        profile.snapshot_stats()
        self.stats = profile.stats

    def create_stats(self) -> None:
        """What ``pstats`` calls before reading ``stats``: nothing more to collect."""


def _dump(path: str) -> None:
    stats = pstats.Stats(*(_Snapshot(profile) for profile in list(profiles)))
    stats.dump_stats(f"{path}.tmp")
    os.replace(f"{path}.tmp", path)


if __name__ == "__main__":
    out, sys.argv = sys.argv[1], ["kuberl_operator", *sys.argv[2:]]
    threading.Thread.run = _profiled_run
    # Python runs the handler in the main thread, which runs the asyncio loop (kopf installs
    # handlers for SIGINT and SIGTERM only).
    signal.signal(signal.SIGUSR1, lambda *_: _dump(out))
    from kuberl_operator.__main__ import main

    profiles[0].enable()
    sys.exit(main())
