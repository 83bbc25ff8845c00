"""How fast the kuberl operator turns many RLTrainingJobs into RayJobs, against a real API server.

Starts the test control plane (etcd, kube-apiserver, kube-controller-manager, scheduler, KWOK
nodes, the real KubeRay operator), starts ``python -m kuberl_operator`` as a subprocess, creates
``--jobs`` RLTrainingJobs at ``--rate`` per second and watches what appears:

- create -> RayJob created (the operator rendered and created it),
- create -> status.phase set (the operator's first status write),
- RayJob created -> RayCluster created (KubeRay's step, the reference measured in the same run),

plus the operator's peak RSS (VmHWM). Latencies are wall-clock times at which one watching
client saw each object appear, so watch delivery is included for both operators alike.

    python bench/operator_scale.py --jobs 1000 --rate 20 --json out.json
    python bench/operator_scale.py --jobs 300 --rate 10 --profile operator.prof   # where its time goes
    python bench/operator_scale.py --jobs 300 --rate 10 --py-spy operator.txt     # where its CPU goes
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.harness.harness import Cluster  # noqa: E402  (the repo's harness, not an installed package)

NAMESPACE = "bench"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    index = min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))
    return ordered[index]


WATCHED = {  # plural: (group, version) of each kind the operator watches in the namespace
    "rltrainingjobs": ("kuberl.dev", "v1alpha1"), "rayjobs": ("ray.io", "v1"), "rayclusters": ("ray.io", "v1"),
    "pods": ("", "v1"), "configmaps": ("", "v1"),
}


def _watch(kubeconfig: str, plural: str, needs_phase: bool, out, stop, events) -> None:
    """In a process of its own: put (name, monotonic time) on ``out`` when each object in the
    namespace first appears (with ``needs_phase``: first has status.phase), and count every watch
    event in ``events`` (the operator's watch of the same kind gets the same ones)."""
    import kubernetes

    client = kubernetes.config.new_client_from_config(config_file=kubeconfig)
    group, version = WATCHED[plural]
    if group:
        custom = kubernetes.client.CustomObjectsApi(client)
        args = (custom.list_namespaced_custom_object, group, version, NAMESPACE, plural)
    else:
        core = kubernetes.client.CoreV1Api(client)
        args = (getattr(core, f"list_namespaced_{plural[:-1].replace('configmap', 'config_map')}"), NAMESPACE)
    seen: set[str] = set()
    resource_version = None
    out.put(None)  # ready: the first list+watch follows
    while not stop.is_set():
        try:
            # deserialize=False: plain dicts, not the client's models (pods would cost this process
            # the CPU the machine's other parts need).
            for event in kubernetes.watch.Watch().stream(*args, timeout_seconds=60, deserialize=False,
                                                         resource_version=resource_version):
                obj = event["object"]
                resource_version = obj["metadata"].get("resourceVersion") or resource_version
                if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                    with events.get_lock():
                        events.value += 1
                name = obj["metadata"]["name"]
                if name not in seen and event["type"] in ("ADDED", "MODIFIED") \
                        and (not needs_phase or (obj.get("status") or {}).get("phase")):
                    seen.add(name)
                    out.put((name, time.monotonic()))
                if stop.is_set():
                    break
        except Exception:  # a dropped watch is re-opened: list+watch replays ADDED events
            resource_version = None
            time.sleep(0.2)


class Watcher:
    """Records the first time each object of ``plural`` appears (with ``needs_phase``: has a
    status.phase). Each watch runs in a process of its own and stamps the time there: in threads
    of this process, which also creates the jobs, the watches lagged behind the API server by
    seconds under load (a RayJob seen after the status the operator writes after creating it).
    CLOCK_MONOTONIC is one clock for every process of the machine."""

    def __init__(self, kubeconfig: str, plural: str, needs_phase: bool = False) -> None:
        self.seen: dict[str, float] = {}
        spawn = multiprocessing.get_context("spawn")  # not fork: this process runs threads
        self._queue = spawn.Queue()
        self.stop = spawn.Event()
        self.events = spawn.Value("q", 0)  # watch events of this kind (ADDED, MODIFIED, DELETED)
        self.ready = threading.Event()
        self._process = spawn.Process(target=_watch, args=(kubeconfig, plural, needs_phase, self._queue,
                                                           self.stop, self.events), daemon=True)
        self._drain = threading.Thread(target=self._collect, daemon=True)

    def start(self) -> None:
        self._process.start()
        self._drain.start()

    def _collect(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                self.ready.set()
            else:
                self.seen.setdefault(*item)


def job_manifest(name: str) -> dict:
    manifest = yaml.safe_load((REPO / "examples" / "grpo-tiny-cpu.yaml").read_text())
    manifest["metadata"] = {"name": name, "namespace": NAMESPACE}
    return manifest


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (/proc/PID/stat fields 14 and 15)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_peak_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def server_stamped(custom) -> list[float]:
    """create -> RayJob by the API server's own clock: the RayJob's creationTimestamp minus its
    RLTrainingJob's (whole seconds, so +-1 s), with no watch in between to lag under load."""
    def made(group: str, version: str, plural: str) -> dict[str, datetime]:
        items = custom.list_namespaced_custom_object(group, version, NAMESPACE, plural)["items"]
        return {o["metadata"]["name"]: datetime.fromisoformat(o["metadata"]["creationTimestamp"]) for o in items}

    jobs, ray_jobs = made("kuberl.dev", "v1alpha1", "rltrainingjobs"), made("ray.io", "v1", "rayjobs")
    return [(ray_jobs[n] - jobs[n]).total_seconds() for n in jobs if n in ray_jobs]


def _stop(process: subprocess.Popen, sig: int = signal.SIGTERM, wait: float = 30) -> None:
    """Send ``sig``; if the process has not exited after ``wait`` seconds, kill it."""
    process.send_signal(sig)
    try:
        process.wait(timeout=wait)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def run(jobs: int, rate: float, timeout: float, profile: str | None = None, py_spy: str | None = None) -> dict:
    import kubernetes

    with Cluster() as cluster:
        # Through the API, not kubectl: the bench then needs no kubectl binary where it runs.
        client = cluster.api_client()
        crds = REPO / "crds" / "rltrainingjobs.kuberl.dev.yaml"  # the CRD and its admission policy
        kubernetes.utils.create_from_yaml(client, yaml_file=str(crds))
        kubernetes.client.CoreV1Api(client).create_namespace({"metadata": {"name": NAMESPACE}})
        crd = next(yaml.safe_load_all(crds.read_text()))["metadata"]["name"]
        for _ in range(600):
            if cluster.crd_established(crd):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError(f"CRD {crd} not Established within 60 s")
        custom = kubernetes.client.CustomObjectsApi(client)
        kubeconfig = str(cluster.kubeconfig)
        watchers = {"rayjob": Watcher(kubeconfig, "rayjobs"), "raycluster": Watcher(kubeconfig, "rayclusters"),
                    "status": Watcher(kubeconfig, "rltrainingjobs", needs_phase=True),
                    # Counted only: every event of these reaches the operator's watches too.
                    "pod": Watcher(kubeconfig, "pods"), "configmap": Watcher(kubeconfig, "configmaps")}
        for w in watchers.values():
            w.start()
        for w in watchers.values():
            if not w.ready.wait(60):
                raise RuntimeError("a watcher process did not start within 60 s")
        log = open(cluster.workdir / "logs" / "kuberl-operator.log", "wb")
        launch = [sys.executable, str(REPO / "bench" / "profile_operator.py"), profile] if profile else \
            [sys.executable, "-m", "kuberl_operator"]
        operator = subprocess.Popen(
            [*launch, "--namespace", NAMESPACE, "--kubeconfig", str(cluster.kubeconfig),
             "--metrics-port", "0", "--liveness", "", "--log-level", "WARNING"],
            stdout=log, stderr=subprocess.STDOUT)
        # py-spy samples the running operator from outside (no slowdown, unlike cProfile);
        # --nonblocking: it does not pause the operator to read its stacks.
        sampler = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "--nonblocking",
                                    "--format", "raw", "--rate", "100", "--output", py_spy,
                                    "--pid", str(operator.pid)],
                                   stdout=log, stderr=subprocess.STDOUT) if py_spy else None
        try:
            time.sleep(3)  # the operator's watches are open before the first job arrives
            created: dict[str, float] = {}

            def create(name: str) -> None:
                began = time.monotonic()
                custom.create_namespaced_custom_object("kuberl.dev", "v1alpha1", NAMESPACE, "rltrainingjobs", job_manifest(name))
                created[name] = began

            names = [f"job-{i:05d}" for i in range(jobs)]
            start = time.monotonic()
            with ThreadPoolExecutor(max_workers=8) as pool:
                for i, name in enumerate(names):
                    delay = start + i / rate - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    pool.submit(create, name)
            create_seconds = time.monotonic() - start
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if all(len(watchers[k].seen) >= jobs for k in ("rayjob", "raycluster", "status")):
                    break
                time.sleep(0.5)
            peak = rss_peak_mib(operator.pid)
            stamped = server_stamped(custom)
            cpu = cpu_seconds(operator.pid)
            wall = time.monotonic() - start
            events = {k: w.events.value for k, w in watchers.items() if k != "status"}
            events["rltrainingjob"] = watchers["status"].events.value
        finally:
            if sampler is not None:
                _stop(sampler, signal.SIGINT, wait=120)  # py-spy writes its output on SIGINT
            if profile:
                # The profiled operator dumps on SIGUSR1 (kopf keeps SIGTERM and SIGINT for its
                # graceful stop, which waits for every reconcile in flight).
                Path(profile).unlink(missing_ok=True)
                operator.send_signal(signal.SIGUSR1)
                for _ in range(240):
                    if Path(profile).exists():
                        break
                    time.sleep(0.5)
            _stop(operator)
            for w in watchers.values():
                w.stop.set()

        ray_jobs, clusters, status = (watchers[k].seen for k in ("rayjob", "raycluster", "status"))
        to_ray_job = [ray_jobs[n] - created[n] for n in names if n in ray_jobs and n in created]
        to_status = [status[n] - created[n] for n in names if n in status and n in created]
        # RayCluster names are <rayjob>-<suffix>.
        by_job = {c.rsplit("-", 1)[0]: t for c, t in clusters.items()}
        to_cluster = [by_job[n] - ray_jobs[n] for n in names if n in by_job and n in ray_jobs]
        return {
            "jobs": jobs, "rate_per_s": rate, "create_seconds": round(create_seconds, 2),
            "complete": {"rayjob": len(to_ray_job), "status": len(to_status), "raycluster": len(to_cluster),
                         "rayjob_server": len(stamped)},
            "kuberl_create_to_rayjob_s": {"p50": percentile(to_ray_job, 0.5), "p99": percentile(to_ray_job, 0.99)},
            "kuberl_create_to_status_s": {"p50": percentile(to_status, 0.5), "p99": percentile(to_status, 0.99)},
            "kuberl_create_to_rayjob_server_s": {"p50": percentile(stamped, 0.5), "p99": percentile(stamped, 0.99)},
            "kuberay_rayjob_to_raycluster_s": {"p50": percentile(to_cluster, 0.5), "p99": percentile(to_cluster, 0.99)},
            "operator_peak_rss_mib": round(peak, 1),
            "operator_cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
            "operator_cpu_ms_per_job": round(1000 * cpu / jobs, 1),
            "watch_events_per_job": {k: round(n / jobs, 2) for k, n in sorted(events.items())},
            # Events differ between runs with how far KubeRay got in the window: per event compares runs.
            "operator_cpu_ms_per_event": round(1000 * cpu / max(1, sum(events.values())), 2),
            "load_average_1m": os.getloadavg()[0],
            "mean_create_to_rayjob_s": statistics.fmean(to_ray_job) if to_ray_job else float("nan"),
        }


def table(result: dict) -> str:
    rows = [("kuberl: create -> RayJob created", result["kuberl_create_to_rayjob_s"], result["complete"]["rayjob"]),
            ("kuberl: create -> status set", result["kuberl_create_to_status_s"], result["complete"]["status"]),
            ("kuberl: create -> RayJob, creationTimestamps", result["kuberl_create_to_rayjob_server_s"],
             result["complete"]["rayjob_server"]),
            ("KubeRay: RayJob -> RayCluster (reference)", result["kuberay_rayjob_to_raycluster_s"], result["complete"]["raycluster"])]
    lines = [f"{result['jobs']} RLTrainingJobs created at {result['rate_per_s']}/s over {result['create_seconds']} s",
             f"{'step':44s} {'p50 s':>8s} {'p99 s':>8s} {'seen':>6s}"]
    lines += [f"{name:44s} {v['p50']:8.3f} {v['p99']:8.3f} {n:6d}" for name, v, n in rows]
    lines.append(f"{'operator peak RSS (MiB)':44s} {result['operator_peak_rss_mib']:8.1f}")
    lines.append(f"{'operator CPU s / wall s':44s} {result['operator_cpu_s']:8.1f} {result['wall_s']:8.1f}"
                 f"   (machine load average {result['load_average_1m']:.1f})")
    lines.append(f"{'operator CPU ms per job / per watch event':44s} {result['operator_cpu_ms_per_job']:8.1f} "
                 f"{result['operator_cpu_ms_per_event']:8.2f}")
    lines.append("watch events per job: " + ", ".join(f"{k} {v}" for k, v in result["watch_events_per_job"].items()))
    ratio = result["kuberl_create_to_rayjob_s"]["p99"] / result["kuberay_rayjob_to_raycluster_s"]["p99"]
    result["headline_ratio"] = ratio
    lines.append(f"headline: kuberl create->RayJob p99 / KubeRay RayJob->RayCluster p99 = {ratio:.2f}x "
                 f"(goal: p99 <= 1 s, RSS <= 256 MiB)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=1000, help="RLTrainingJobs to create")
    p.add_argument("--rate", type=float, default=20.0, help="creations per second")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for every object after the last create")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    p.add_argument("--profile", metavar="PATH",
                   help="run the operator under cProfile (every thread; slows it) and write the stats to PATH")
    p.add_argument("--py-spy", metavar="PATH",
                   help="sample the operator with py-spy (no slowdown) and write its collapsed stacks to PATH")
    args = p.parse_args(argv)
    if args.jobs < 1 or args.rate <= 0:
        p.error("--jobs must be >= 1 and --rate > 0")
    result = run(args.jobs, args.rate, args.timeout, args.profile, args.py_spy)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
