"""``kuberl-operator`` / ``python -m kuberl_operator``: run the operator against the current
kubeconfig (or in-cluster credentials).

Leader election: with ``--peering NAME`` replicas coordinate through kopf's peering objects (the
KopfPeering/ClusterKopfPeering CRDs must be installed) and only the highest-priority one acts;
``--standalone`` (the default, what the chart runs with its single replica and Recreate
strategy) skips peering.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import kopf
from prometheus_client import start_http_server

from kuberl_operator.handlers import Controller, NoDiffBase, register
from kuberl_operator.kube import Kube, load_client
from kuberl_operator.metrics import Metrics
from kuberl_operator.reconcile import Settings


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="kuberl-operator", description="Reconcile RLTrainingJobs into KubeRay RayJobs.")
    scope = p.add_mutually_exclusive_group()
    scope.add_argument("--namespace", "-n", action="append", default=[], metavar="NS",
                       help="watch this namespace (repeatable; glob patterns allowed)")
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (needs a ClusterRole)")
    leader = p.add_mutually_exclusive_group()
    leader.add_argument("--standalone", action="store_true", default=True,
                        help="no leader election: run exactly one replica (default)")
    leader.add_argument("--peering", metavar="NAME",
                        help="leader election through kopf peering object NAME (replicas > 1)")
    p.add_argument("--priority", type=int, default=0, help="peering priority of this replica")
    p.add_argument("--kubeconfig", help="kubeconfig file (default: in-cluster, then $KUBECONFIG)")
    p.add_argument("--metrics-address", default="0.0.0.0", help="address of the /metrics endpoint")
    p.add_argument("--metrics-port", type=int, default=8080, help="port of the /metrics endpoint (0: off)")
    p.add_argument("--liveness", default="http://0.0.0.0:8081/healthz",
                   help="kopf liveness endpoint URL ('' to disable)")
    p.add_argument("--restart-backoff", type=float, default=10.0,
                   help="seconds before the first restart of a failed RayJob; doubles per restart")
    p.add_argument("--restart-backoff-max", type=float, default=300.0, help="cap of the restart backoff")
    p.add_argument("--resync", type=float, default=60.0, help="seconds between full resyncs of every job")
    p.add_argument("--workers", type=int, default=16,
                   help="reconciles running at once (threads: the kubernetes client blocks on I/O)")
    p.add_argument("--gpu-hour-price", type=float, default=None, metavar="PRICE",
                   help="price of one GPU-hour: each job's status.cost.estimatedCost (default: no estimate)")
    p.add_argument("--cost-refresh", type=float, default=300.0,
                   help="seconds between writes of a running job's growing status.cost (pod changes: at once)")
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = p.parse_args(argv)
    if not args.namespace and not args.all_namespaces:
        p.error("give --namespace NS (repeatable) or --all-namespaces")
    for value, flag in ((args.restart_backoff, "--restart-backoff"), (args.restart_backoff_max, "--restart-backoff-max"),
                        (args.resync, "--resync"), (args.workers, "--workers"), (args.cost_refresh, "--cost-refresh")):
        if value <= 0:
            p.error(f"{flag} must be > 0, got {value}")
    if args.gpu_hour_price is not None and not 0 <= args.gpu_hour_price < float("inf"):
        p.error(f"--gpu-hour-price (chart value operator.gpuHourPrice) must be a number >= 0, got {args.gpu_hour_price}")
    return args


async def run(args: argparse.Namespace) -> None:
    settings = Settings(restart_backoff_seconds=args.restart_backoff,
                        restart_backoff_max_seconds=args.restart_backoff_max, resync_seconds=args.resync,
                        cost_refresh_seconds=args.cost_refresh, gpu_hour_price=args.gpu_hour_price)
    asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(args.workers, thread_name_prefix="reconcile"))
    registry = kopf.OperatorRegistry()
    register(registry)
    metrics = Metrics(lambda: controller.job_phases(), statuses=lambda: controller.job_statuses())
    controller = Controller(Kube(load_client(args.kubeconfig, pool_size=args.workers)), settings, metrics)
    if args.metrics_port:
        start_http_server(args.metrics_port, args.metrics_address, registry=controller.metrics.registry)

    operator_settings = kopf.OperatorSettings()
    # Only kopf's warnings become Events (not one "Handler succeeded" per pod change); the
    # operator posts its own transition events explicitly.
    operator_settings.posting.level = logging.WARNING
    operator_settings.watching.server_timeout = 300
    # kopf writes nothing to the objects: with event handlers and indices only (no on.create/
    # update/timer) it keeps no progress annotations and no finalizers, and the diff base is
    # never read. Its per-object event queues need no tuning: kopf 1.45 removed time batching
    # (``queueing``: each object's worker handles its events in order, and our handlers only
    # index and trigger, which coalesces), and ``--workers`` bounds the reconciles, the costly part.
    operator_settings.persistence.diffbase_storage = NoDiffBase()
    resync = asyncio.create_task(controller.queue.resync_forever())
    try:
        await kopf.operator(
            registry=registry,
            settings=operator_settings,
            memo=kopf.Memo(controller=controller),
            standalone=args.peering is None,
            peering_name=args.peering,
            priority=args.priority,
            liveness_endpoint=args.liveness or None,
            clusterwide=args.all_namespaces,
            namespaces=args.namespace,
        )
    finally:
        resync.cancel()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level != "DEBUG":
        # kopf logs every handler run per object at INFO: one line per pod change.
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
        # One access line per liveness probe.
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    if args.kubeconfig:
        # kopf's own login reads $KUBECONFIG.
        os.environ["KUBECONFIG"] = args.kubeconfig
    asyncio.run(run(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
