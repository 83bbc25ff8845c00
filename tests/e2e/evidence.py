"""What explains a failed e2e test, kept after its pods are gone.

A job's attempt that ends takes its Ray cluster with it (the operator deletes the RayJob within
seconds), and with it the driver's log, the engines' output and the pods' own logs. ``PodLogs``
streams every container's log of every pod in the namespace to a file as it is written, from the
moment the container starts (each container instance its own file: a restarted container's
earlier run stays), so the log of a pod deleted a second after the failure is whole here.
``keep`` adds what only the live cluster knows at the failure: the namespace's events (probe
failures, kills, scheduling), the pods' descriptions, and while the head is up Ray's own view
(``ray status``: pending resource demands; ``ray list actors``: an engine waiting or dead).
The driver's log is the RayJob submitter pod's (``ray job submit`` follows the job's output, and
Ray forwards every actor's stdout and stderr to it, the engines' included). When KubeRay deletes a
whole Ray cluster (a Kueue preemption, a suspend) it deletes the submitter first, and the driver
runs on while the head's preStop hook holds the head: so from the moment a head pod is going,
the driver's own log file on it is copied too (``<head pod>.driver.log``), until the pod is gone.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from pathlib import Path

from tests.harness.harness import Cluster

log = logging.getLogger(__name__)

SUBMITTER_LABEL = "batch.kubernetes.io/job-name"  # KubeRay's submitter Job's pods carry it
POLL_SECONDS = 2.0
TAIL_LINES = 120  # of the driver's log, in a failure's report
FOLLOW_TRIES = 5  # opening a container's log stream, each POLL_SECONDS after the last dropped
HEAD_SELECTOR = ("ray.io/node-type", "head")  # KubeRay's label on head pods
DRIVER_LOG_ON_HEAD = "/tmp/ray/session_latest/logs/job-driver-*.log"  # Ray's file of a job's driver output


class PodLogs:
    """Streams every container's log in ``namespace`` to ``directory``; see the module docstring."""

    def __init__(self, cluster: Cluster, namespace: str, directory: Path):
        from kubernetes import client

        self.cluster = cluster
        self.namespace = namespace
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        # One client per thread that uses it: the poller's, and each follower makes its own.
        self._core = client.CoreV1Api(cluster.api_client())
        self._followed: set[tuple[str, str, int]] = set()  # (pod uid, container, restart count)
        self._drivers: list[tuple[str, Path]] = []  # (submitter Job, its pod's log file), as they started
        self._heads_going: set[str] = set()  # uids of going head pods whose driver log is copied
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="e2e-pod-logs", daemon=True)

    def start(self) -> "PodLogs":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_SECONDS):
            try:
                pods = self._core.list_namespaced_pod(self.namespace).items
            except Exception as exc:  # the API server restarting, a closed cluster: try again
                log.debug("listing pods: %s", exc)
                continue
            for pod in pods:
                try:
                    self._follow_new_containers(pod)
                    self._copy_driver_log_if_going(pod)
                except Exception as exc:  # never let one odd pod end the evidence of all the others
                    log.warning("following the logs of pod %s: %s", pod.metadata.name, exc)

    def _copy_driver_log_if_going(self, pod) -> None:
        key, value = HEAD_SELECTOR
        if (pod.metadata.labels or {}).get(key) != value or pod.metadata.deletion_timestamp is None \
                or pod.metadata.uid in self._heads_going:
            return
        self._heads_going.add(pod.metadata.uid)
        threading.Thread(target=self._copy_driver_log, args=(pod.metadata.name,),
                         name=f"e2e-driver-{pod.metadata.name}", daemon=True).start()

    def _copy_driver_log(self, pod: str) -> None:
        """Copies the driver's log file from going head pod ``pod`` every POLL_SECONDS while it
        can; the last copy is the whole log but what its last seconds wrote."""
        path = self.directory / f"{pod}.driver.log"
        while not self._stop.is_set():
            try:
                copied = self.cluster.kubectl("exec", pod, "-n", self.namespace, "--", "bash", "-c",
                                              f"cat {DRIVER_LOG_ON_HEAD}", check=False, timeout=30)
            except subprocess.TimeoutExpired:  # a busy node: the pod may still be there
                continue
            if copied.returncode != 0:
                return
            path.write_text(copied.stdout)
            time.sleep(POLL_SECONDS)

    def _follow_new_containers(self, pod) -> None:
        statuses = [*(pod.status.init_container_statuses or []), *(pod.status.container_statuses or [])]
        for status in statuses:
            key = (pod.metadata.uid, status.name, status.restart_count)
            if key in self._followed or not status.state or not (status.state.running or status.state.terminated):
                continue
            self._followed.add(key)
            path = self.directory / f"{pod.metadata.name}.{status.name}.{status.restart_count}.log"
            path.touch()  # before a test can see it as a driver's log: its follower opens it later
            submitter = (pod.metadata.labels or {}).get(SUBMITTER_LABEL)
            if submitter and status.restart_count == 0:
                self._drivers.append((submitter, path))
            threading.Thread(target=self._follow, args=(pod.metadata.name, status.name, path),
                             name=f"e2e-log-{path.name}", daemon=True).start()

    def _follow(self, pod: str, container: str, path: Path) -> None:
        """Appends the container's log to ``path`` as it is written. A stream that drops while the
        container runs (seen in pods: a trainer's, a minute before its pod went) is opened again and read
        past what is here already; one that cannot be, the pod gone, ends with a line saying so."""
        from kubernetes import client, config

        core = client.CoreV1Api(config.new_client_from_config(config_file=str(self.cluster.kubeconfig)))
        written = 0
        with path.open("ab") as out:
            for _ in range(FOLLOW_TRIES):
                try:
                    stream = core.read_namespaced_pod_log(pod, self.namespace, container=container, follow=True,
                                                          _preload_content=False)
                    skip = written
                    for chunk in stream.stream(4096):
                        cut = min(skip, len(chunk))
                        chunk, skip = chunk[cut:], skip - cut
                        out.write(chunk)
                        out.flush()
                        written += len(chunk)
                    return  # the container ended: its whole log is here
                except Exception as exc:  # a dropped stream, or the pod went: what came before is kept
                    error = exc
                    time.sleep(POLL_SECONDS)
            out.write(f"\n[e2e evidence: the log stream ended: {type(error).__name__}: {error}]\n".encode())

    def driver_logs(self, job: str) -> list[Path]:
        """The log files of the drivers of ``job``'s attempts (its RayJobs' submitter pods)."""
        return [path for submitter, path in self._drivers if submitter.startswith(job)]

    def keep(self, why: str) -> str:
        """Writes the events, the pods' descriptions and Ray's view to the directory; returns a
        report naming the directory and ending with the tail of the newest driver log."""
        name = why.replace("/", "_").replace(" ", "_")[:80]
        kept = self.directory / f"failure-{name}"
        kept.mkdir(exist_ok=True)
        run = lambda *args: self.cluster.kubectl(*args, check=False, timeout=60)  # noqa: E731
        events = run("get", "events", "-n", self.namespace, "--sort-by=.lastTimestamp", "-o", "wide")
        (kept / "events.txt").write_text(events.stdout + events.stderr)
        described = run("describe", "pods", "-n", self.namespace)
        (kept / "pods-described.txt").write_text(described.stdout + described.stderr)
        heads = run("get", "pods", "-n", self.namespace, "-l", "ray.io/node-type=head", "-o", "name")
        for head in heads.stdout.split():
            for what, command in (("ray-status", "ray status -v"), ("ray-actors", "ray list actors --detail")):
                out = run("exec", head, "-n", self.namespace, "--", "bash", "-c", f"timeout 60 {command}")
                (kept / f"{head.split('/')[-1]}.{what}.txt").write_text(out.stdout + out.stderr)
        report = [f"kept evidence in {self.directory} (pod logs, one file per container run) and {kept} "
                  f"(events, pods described, Ray's status and actors)"]
        for _, path in self._drivers[-1:]:
            lines = path.read_text(errors="replace").splitlines()
            report.append(f"--- the driver's log {path}, last {TAIL_LINES} of {len(lines)} lines:")
            report += lines[-TAIL_LINES:]
        return "\n".join(report)
