"""`kuberl preemption-notice --wait-seconds N`: the preStop hook of the head and trainer pods.

Kubernetes runs it when the pod is to go (``kubectl delete pod``, a node drain, a spot notice),
before SIGTERM, within the pod's grace period. It joins the job's Ray cluster from inside the pod,
tells the driver's notice board (``kuberl.driver.notices``) which pod is going, and waits until a
checkpoint covering the step in flight is committed, then exits so the pod goes; the driver's
in-place recovery (or, for the head, the operator's next attempt) restores that checkpoint.

The head's hook says so (``--head``): the driver's own pod is going, so the driver begins no step
after that commit (it would be lost with the head). It never holds a pod for nothing: no driver
(no board), a driver that dies meanwhile, a driver recovering its trainer group (nothing more
can be checkpointed then), or a job without checkpoint.uri returns at once; so does a head that
is gone (KubeRay deleting the whole cluster: the GCS port answers nothing, as once the head's own
hook has returned), and joining Ray may take at most ``CONNECT_SECONDS``
(Ray's own client retries for minutes); past ``--wait-seconds`` it gives up (the newest
checkpoint before is what is restored). It always exits 0: a failed hook only adds an Event, and
the pod goes all the same. What it did is printed, and the driver logs each notice; the kubelet
keeps a hook's output only when it fails, so the pods' hook also writes its line to the
container's own log (``--log``, ``kubectl logs``).

A worker pod knows the head by KubeRay's head Service (``ray start --address=<cluster>-head-svc``),
and KubeRay deletes that Service with the RayCluster: when the whole cluster goes (a Kueue
preemption, a suspend) the Service is gone at once, while the pods wait in their preStop hooks, so
the name no longer resolves while the head and its GCS still run (seen in pods: the trainer's hook
let its pod go 3 s in, no checkpoint).
The Ray node in this pod is still connected to that GCS, so the hook takes the GCS's address from
that connection instead (``gcs_address``), and gives notice as the head would: the head is going
too, so the driver begins no step after the commit, whichever of the two notices comes first.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time
from collections import Counter

from kuberl.api.contract import NOTICE_ACTOR, RAY_NAMESPACE

# Asking the board whether the commit came: one small actor call. Often, since the hooks of a
# whole cluster race: the head's, released, lets the head go and the board goes with it, and a hook
# that asks only after that cannot tell its commit came (in pods, polling every 0.5 s, the
# trainer's hook found the board gone after the commit and said the driver ended before it).
POLL_SECONDS = 0.1
# Joining Ray and finding the board: seconds, even on a busy node; longer means a head in trouble.
CONNECT_SECONDS = 45
GCS_PROBE_SECONDS = 3


def gcs_address(address: str) -> tuple[str | None, bool]:
    """The Ray cluster's GCS as host:port (``address``, or this node's cluster for "auto"), or
    None when it accepts no connection: a head that is gone answers nothing, and Ray's client would
    retry it for minutes. A host name that no longer resolves (KubeRay's head Service, deleted with
    the RayCluster) is replaced by the address this pod's Ray processes are connected to on the
    GCS's port; the second value says so: the whole Ray cluster is going."""
    # What ray.init resolves "auto" with, and splits host:port (IPv6 too) with.
    from ray._common.network_utils import build_address, parse_address
    from ray._private.services import canonicalize_bootstrap_address

    try:
        host, port = parse_address(canonicalize_bootstrap_address(address) or "") or ("", "")
        port = int(port)
    except ValueError:
        return None, False
    try:
        socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
        hosts, unresolved = [host], False
    except OSError:
        hosts, unresolved = connected_peers(port), True
    for candidate in hosts:
        try:
            socket.create_connection((candidate, port), timeout=GCS_PROBE_SECONDS).close()
        except OSError:
            continue
        return build_address(candidate, port), unresolved
    return None, unresolved


def connected_peers(port: int) -> list[str]:
    """The addresses that this network namespace (the pod's) holds established TCP connections to
    on ``port``, the most connected first."""
    import psutil

    peers = Counter(conn.raddr.ip for conn in psutil.net_connections("tcp")
                    if conn.status == psutil.CONN_ESTABLISHED and conn.raddr and conn.raddr.port == port)
    return [peer for peer, _ in peers.most_common()]


def notify(address: str, pod: str, head: bool, deadline: float, connected: threading.Event) -> str:
    """Tell the driver ``pod`` (the head, if ``head``) is going and wait, until the monotonic
    ``deadline``, for the checkpoint covering the step in flight; what happened, as one line.
    ``connected`` is set once the board is found (or known to be absent)."""
    import ray

    gcs, cluster_going = gcs_address(address)
    if gcs is None:
        connected.set()
        return "the Ray cluster's head does not answer: no driver to checkpoint"
    # With the head's name gone its RayCluster is deleted: the head goes too, so, as for the head's
    # own notice, no step may begin after the commit (it would run again in the next attempt).
    head = head or cluster_going
    ray.init(address=gcs, namespace=RAY_NAMESPACE, logging_level=logging.WARNING, log_to_driver=False)
    try:
        board = ray.get_actor(NOTICE_ACTOR, namespace=RAY_NAMESPACE)
    except ValueError:
        connected.set()
        return "no kuberl driver is running in this Ray cluster: nothing to checkpoint"
    connected.set()
    try:
        step = ray.get(board.notice.remote(pod, head))
        if step is None:
            return "the job has no checkpoint.uri: nothing to checkpoint"
        while time.monotonic() < deadline:
            if released := ray.get(board.released.remote(step)):
                return released
            time.sleep(POLL_SECONDS)
    except ray.exceptions.RayActorError:
        return "the driver ended before the checkpoint: the newest checkpoint before is restored"
    return f"no checkpoint of step {step} was committed in time (raise scheduling.terminationGracePeriodSeconds)"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kuberl preemption-notice", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wait-seconds", type=float, required=True,
                        help="hold the pod at most this long (its grace period less Ray's stop)")
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: this pod's own)")
    parser.add_argument("--head", action="store_true",
                        help="this is the head pod, the driver's own: no step begins after the commit")
    parser.add_argument("--log", metavar="PATH",
                        help="also append the outcome line to PATH (the pods' hook: the container's own log)")
    args = parser.parse_args(argv)
    pod = os.environ.get("HOSTNAME", "this pod")
    started = time.monotonic()
    deadline = started + args.wait_seconds
    outcome: list[str] = []
    connected = threading.Event()

    def run() -> None:
        try:
            outcome.append(notify(args.address, pod, args.head, deadline, connected))
        except Exception as exc:  # noqa: BLE001 - whatever it is, the pod must go: say it and return
            outcome.append(f"could not reach the driver ({type(exc).__name__}: {exc})")
            connected.set()

    # Ray calls can block (a head dying meanwhile): these deadlines bound everything.
    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    if connected.wait(min(CONNECT_SECONDS, args.wait_seconds)):
        worker.join(max(0.0, deadline - time.monotonic()))
    line = outcome[0] if outcome else f"gave up after {time.monotonic() - started:.0f} s"
    said = f"kuberl preemption-notice {pod}: {line} ({time.monotonic() - started:.1f} s)"
    print(said, flush=True)
    if args.log:
        try:
            with open(args.log, "a") as log:
                log.write(said + "\n")
        except OSError as exc:
            print(f"could not write to {args.log}: {exc}", file=sys.stderr)
    sys.stderr.flush()
    # Not sys.exit: a Ray call still blocked in the thread would hold the interpreter's exit.
    os._exit(0)
