"""The operator exactly as the chart's Deployment runs it, but as a local process: KWOK nodes have
no container runtime, so the Deployment's pod never really starts. The command and arguments are
taken from the installed Deployment object; only the listen addresses change (loopback, free
ports) and a kubeconfig holding the chart ServiceAccount's token replaces the in-cluster identity."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from kuberl.common.ports import unclaimed_port


# Flags the local process must set itself; everything else comes from the Deployment.
LOCAL_FLAGS = ("--metrics-port", "--metrics-address", "--liveness", "--kubeconfig")


def deployment_command(deployment: dict) -> list[str]:
    container, = deployment["spec"]["template"]["spec"]["containers"]
    command = list(container["command"])
    executable = shutil.which(command[0], path=str(Path(sys.executable).parent))
    if executable is None:
        raise AssertionError(f"the chart's operator command {command[0]!r} is not installed next to {sys.executable}")
    args = [a for a in container.get("args", []) if not a.startswith(LOCAL_FLAGS)]
    return [executable, *command[1:], *args]


class OperatorProcess:
    def __init__(self, deployment: dict, kubeconfig: Path, log: Path) -> None:
        self.metrics_port, self.health_port = unclaimed_port(), unclaimed_port()
        self.argv = [*deployment_command(deployment), "--kubeconfig", str(kubeconfig),
                     "--metrics-address", "127.0.0.1", f"--metrics-port={self.metrics_port}",
                     f"--liveness=http://127.0.0.1:{self.health_port}/healthz"]
        self.log_path = log
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 60) -> "OperatorProcess":
        env = dict(os.environ)
        env.pop("KUBERNETES_SERVICE_HOST", None)  # never fall back to an in-cluster identity
        self.log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.argv, stdout=self.log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while not self._healthy():
            if self.proc.poll() is not None:
                raise AssertionError(f"operator exited with {self.proc.returncode}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"operator not healthy after {timeout:.0f} s:\n{self.tail()}")
            time.sleep(0.2)
        return self

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.health_port}/healthz", timeout=2) as resp:
                return resp.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
