"""`python -m tests.harness build|images|up|down`: the test control plane by hand.

build   build every missing component of the control plane into ~/.cache/kuberl/bin (idempotent);
        `build kueue` builds the optional Kueue (fixture `kueue`)
images  build the images of images/Dockerfile (and the local base, the pause image) with podman (cached)
up      start a cluster in the foreground; prints `export KUBECONFIG=...`;
        Ctrl-C (or `down` from another shell) stops it.
        `up --real-nodes 2 --images` runs real pods: two containerd + kubelet nodes with
        kube-proxy and CoreDNS, and the images imported (ghcr.io/kuberl/<name>:<version>)
down    stop the cluster that `up` started
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from tests.harness.build import BuildError, build
from tests.harness.components import cache_dir


def _state_file() -> Path:
    return cache_dir() / "cluster" / "up.json"


def _cmd_build(args: argparse.Namespace) -> int:
    began = time.monotonic()
    try:
        times = build(args.components or None)
    except BuildError as err:
        print(f"build failed: {err}", file=sys.stderr)
        return 1
    print(f"built {sum(1 for t in times.values() if t)} of {len(times)} components in {time.monotonic() - began:.1f} s")
    return 0


def _cmd_images(args: argparse.Namespace) -> int:
    from tests.harness import images

    began = time.monotonic()
    try:
        times = images.build(tuple(args.names) or images.NAMES)
    except BuildError as err:
        print(f"image build failed: {err}", file=sys.stderr)
        return 1
    print(f"built {sum(1 for t in times.values() if t)} of {len(times)} images in {time.monotonic() - began:.1f} s")
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from tests.harness.harness import Cluster

    state = _state_file()
    if state.exists():
        previous = json.loads(state.read_text())
        try:
            os.kill(previous["pid"], 0)
            print(f"a cluster is already up (pid {previous['pid']}): KUBECONFIG={previous['kubeconfig']}", file=sys.stderr)
            return 1
        except ProcessLookupError:
            state.unlink()
    if _cmd_build(argparse.Namespace(components=None)) != 0:
        return 1
    kwok_nodes = args.nodes if args.nodes is not None else (0 if args.real_nodes else 3)
    cluster = Cluster(nodes=kwok_nodes, kuberay=not args.no_kuberay, real_nodes=args.real_nodes)
    cluster.start()
    if args.images:
        for step, seconds in cluster.load_images().items():
            cluster.startup_seconds[step] = seconds
    state.parent.mkdir(parents=True, exist_ok=True)
    state.write_text(json.dumps({"pid": os.getpid(), "kubeconfig": str(cluster.kubeconfig), "logs": str(cluster.log_dir)}))
    print(f"cluster ready in {cluster.startup_seconds['total']:.1f} s")
    for step, seconds in cluster.startup_seconds.items():
        print(f"  {step:36s} {seconds:7.2f} s")
    print(f"logs: {cluster.log_dir}")
    print(f"export KUBECONFIG={cluster.kubeconfig}")
    print("Ctrl-C or `python -m tests.harness down` stops it.", flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    try:
        while not stop.wait(1.0):
            cluster.check_alive()
    finally:
        cluster.stop()
        state.unlink(missing_ok=True)
        print("cluster stopped")
    return 0


def _cmd_down(args: argparse.Namespace) -> int:
    state = _state_file()
    if not state.exists():
        print("no cluster is up")
        return 0
    pid = json.loads(state.read_text())["pid"]
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        state.unlink(missing_ok=True)
        print("no cluster is up (stale state removed)")
        return 0
    deadline = time.monotonic() + 60
    while state.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    if state.exists():
        print(f"cluster process {pid} did not stop within 60 s", file=sys.stderr)
        return 1
    print("cluster stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.harness", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p_build = sub.add_parser("build", help="build missing components")
    p_build.add_argument("components", nargs="*", help="component names (default: all)")
    p_build.set_defaults(fn=_cmd_build)
    p_up = sub.add_parser("up", help="start a cluster in the foreground")
    p_up.add_argument("--nodes", type=int, default=None, help="number of fake GPU (KWOK) nodes (default 3, 0 with --real-nodes)")
    p_up.add_argument("--real-nodes", type=int, default=0, help="number of real nodes: containerd + kubelet (needs root)")
    p_up.add_argument("--images", action="store_true", help="with --real-nodes: build and import the images of images/Dockerfile")
    p_up.add_argument("--no-kuberay", action="store_true", help="no KubeRay (neither its CRDs nor its operator)")
    p_up.set_defaults(fn=_cmd_up)
    p_images = sub.add_parser("images", help="build the images of images/Dockerfile (cached)")
    p_images.add_argument("names", nargs="*", help="image names, i.e. targets of images/Dockerfile (default: operator stager worker-cpu)")
    p_images.set_defaults(fn=_cmd_images)
    p_down = sub.add_parser("down", help="stop the cluster started by `up`")
    p_down.set_defaults(fn=_cmd_down)
    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
