"""Run ``python -m kuberl_operator`` under cProfile in every thread (the asyncio loop with kopf's
watches, and the reconcile and apply threads); the merged stats go to the first argument when the
operator exits. ``bench/operator_scale.py --profile PATH`` starts the operator through it.

    python bench/profile_operator.py OUT.prof --namespace NS ...
    python -c "import pstats; pstats.Stats('OUT.prof').sort_stats('tottime').print_stats(30)"
"""

from __future__ import annotations

import atexit
import cProfile
import pstats
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


def _dump(path: str) -> None:
    profiles[0].disable()
    stats = pstats.Stats(profiles[0])
    for profile in profiles[1:]:
        stats.add(profile)
    stats.dump_stats(path)


if __name__ == "__main__":
    out, sys.argv = sys.argv[1], ["kuberl_operator", *sys.argv[2:]]
    threading.Thread.run = _profiled_run
    atexit.register(_dump, out)
    from kuberl_operator.__main__ import main

    profiles[0].enable()
    sys.exit(main())
