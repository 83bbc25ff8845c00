"""Where a profiled step leaves the GPU idle: the gaps between its kernels and what the host was
doing in each, from a ``torch.profiler`` Chrome trace (issue 36).

A step whose kernels sum to less than its wall time loses the difference to host time between
kernels: a sync that drains the queue, then Python until the next launch. The kernel tables of
``--profile`` cannot show that; this reads the trace's timeline instead. Each gap is charged to
what the launching thread was running in its middle (the innermost Python frames when the trace
was taken ``with_stack``, else operators and CUDA runtime calls), and to the runtime call that
launched the kernel ending it.

    python bench/gpu_gaps.py trace.json.gz [--top 15] [--min-us 20]
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
# Frames of the code under test, named in a gap before the library frames under them.
OWN_CODE = ("kuberl/", "torchtitan/", "bench/")
HOST_CATEGORIES = {"cpu_op", "python_function", "cuda_runtime", "cuda_driver", "user_annotation"}


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _frame(event: dict) -> str:
    name = event["name"]
    if event.get("cat") == "python_function":  # "path/to/file.py(123): function"
        where, _, fn = name.partition(": ")
        return f"{fn} ({where.rsplit('/', 1)[-1]})" if fn else name
    return name


def idle_report(path: str, *, top: int = 15, min_us: float = 20.0) -> str:
    """A text report: the window, GPU busy and idle time, and the ``top`` longest gaps."""
    events = _load(path)
    gpu = sorted((e for e in events if e.get("cat") in GPU_CATEGORIES), key=lambda e: e["ts"])
    host = [e for e in events if e.get("cat") in HOST_CATEGORIES]
    if not gpu or not host:
        return f"{path}: no GPU or host events"
    launches = {e["args"]["correlation"]: e for e in host
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    # Per host thread, its events by start: the forward launches from the caller's thread, the
    # backward from autograd's device thread; a gap is looked up on the thread that ended it.
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in host:
        by_thread[(e["pid"], e["tid"])].append(e)
    index = {}
    for key, items in by_thread.items():
        items.sort(key=lambda e: e["ts"])
        index[key] = ([e["ts"] for e in items], max(e["dur"] for e in items))

    def covering(key, t: float) -> list[dict]:
        if key not in index:
            return []
        starts, longest = index[key]
        items = by_thread[key]
        lo, hi = bisect.bisect_left(starts, t - longest), bisect.bisect_right(starts, t)
        return sorted((e for e in items[lo:hi] if e["ts"] + e["dur"] >= t), key=lambda e: (e["ts"], -e["dur"]))

    def where(kernel: dict, start: float, length: float) -> tuple[str, str]:
        """(what the launching thread ran in the gap's middle, the launch call); a runtime call of
        over 100 us that returned inside the gap (a sync that drained the queue) is named first."""
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return "(launch not traced)", "?"
        key = (launch["pid"], launch["tid"])
        stack = covering(key, start + length / 2)
        starts, longest = index[key]
        lo, hi = bisect.bisect_left(starts, start - longest), bisect.bisect_right(starts, start + length)
        waits = [e for e in by_thread[key][lo:hi] if e.get("cat") in ("cuda_runtime", "cuda_driver") and e["dur"] > 100
                 and start <= e["ts"] + e["dur"] <= start + length]
        prefix = f"after {max(waits, key=lambda e: e['dur'])['name']}: " if waits else ""
        own = [e for e in stack if e.get("cat") == "python_function" and any(
            m in e["name"] for m in OWN_CODE)]
        ops = [e for e in stack if e.get("cat") != "python_function"]
        parts = ([_frame(own[-1])] if own else []) + [_frame(e) for e in (ops[:1] + ops[-1:] if len(ops) > 1 else ops)]
        if not parts:
            parts = [_frame(stack[-1])] if stack else ["(thread idle: waiting on another thread)"]
        return prefix + " > ".join(parts), launch["name"]

    window_start = min(e["ts"] for e in host)
    window_end = max(max(e["ts"] + e["dur"] for e in host), max(k["ts"] + k["dur"] for k in gpu))
    busy, gaps, edge = 0.0, [], window_start
    for k in gpu:
        end = k["ts"] + k["dur"]
        if k["ts"] > edge:
            gaps.append((k["ts"] - edge, edge, k))
        if end > edge:
            busy += end - max(edge, k["ts"])
            edge = end
    tail = window_end - edge
    counted = [g for g in gaps if g[0] >= min_us]
    lines = [f"window {(window_end - window_start) / 1e3:.1f} ms: GPU busy {busy / 1e3:.1f} ms, idle "
             f"{(sum(g[0] for g in gaps) + max(tail, 0.0)) / 1e3:.1f} ms (before the first kernel "
             f"{(gaps[0][0] if gaps and gaps[0][1] == window_start else 0.0) / 1e3:.1f} ms, after the last "
             f"{tail / 1e3:.1f} ms; {len(counted)} gaps >= {min_us:g} us: {sum(g[0] for g in counted) / 1e3:.1f} ms)"]
    charged: dict[str, float] = defaultdict(float)
    for length, start, kernel in counted:
        charged[where(kernel, start, length)[0]] += length
    lines.append("idle charged to what the launching thread ran in the gap's middle (ms):")
    for name, total in sorted(charged.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {total / 1e3:8.2f}  {name}")
    lines.append(f"the {top} longest gaps:")
    for length, start, kernel in sorted(gaps, key=lambda g: -g[0])[:top]:
        host_at, launch = where(kernel, start, length)
        lines.append(f"  {length / 1e3:7.2f} ms at +{(start - window_start) / 1e3:.1f} ms, before "
                     f"{kernel['name'][:50]!r} ({launch}): {host_at}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", help="a torch.profiler Chrome trace (.json or .json.gz)")
    parser.add_argument("--top", type=int, default=15)
    parser.add_argument("--min-us", type=float, default=20.0)
    args = parser.parse_args(argv)
    print(idle_report(args.trace, top=args.top, min_us=args.min_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
