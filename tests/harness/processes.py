"""Child processes of the test control plane: started in their own process
group, logged to a file, stopped with SIGTERM then SIGKILL, and tied to the
life of the Python process that started them (PR_SET_PDEATHSIG), so that no
component outlives a crashed or killed test session.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

_PR_SET_PDEATHSIG = 1
_CLONE_NEWNET = 0x40000000
_libc = ctypes.CDLL(None, use_errno=True)


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: the kernel sends SIGKILL to the
    # child when the thread that forked it exits, however it exits.
    _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _child_setup(netns: str | None, cgroup_procs: list[Path]):
    """What runs in the child before exec: die with the parent; join a network namespace (only
    the network: kubelet and containerd must share the host's mounts) and cgroups, so that what
    the component starts (containerd's shims and containers) is found there at teardown."""

    def setup() -> None:
        _die_with_parent()
        for procs in cgroup_procs:
            procs.write_text(str(os.getpid()))
        if netns is not None:
            fd = os.open(netns, os.O_RDONLY)
            if _libc.setns(fd, _CLONE_NEWNET) != 0:
                os._exit(126)
            os.close(fd)

    return setup


class Process:
    """One long-running component, its command line and its log file."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        log: Path,
        env: dict[str, str] | None = None,
        netns: str | None = None,
        cgroup_procs: list[Path] = (),
    ) -> None:
        self.name = name
        self.argv = argv
        self.log = log
        self.env = env
        self.netns = netns
        self.cgroup_procs = list(cgroup_procs)
        self._popen: subprocess.Popen | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            out.write(f"$ {' '.join(self.argv)}\n".encode())
            out.flush()
            self._popen = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,
                preexec_fn=_child_setup(self.netns, self.cgroup_procs),
            )

    @property
    def pid(self) -> int | None:
        return self._popen.pid if self._popen else None

    def exited(self) -> int | None:
        """The exit code if the process has ended, else None."""
        return self._popen.poll() if self._popen else None

    def check_alive(self) -> None:
        code = self.exited()
        if code is not None:
            raise ComponentExited(self, code)

    def terminate(self) -> None:
        """Send SIGTERM to the process group (no wait)."""
        if self._popen is not None and self._popen.poll() is None:
            try:
                os.killpg(self._popen.pid, signal.SIGTERM)  # start_new_session: pid == pgid
            except ProcessLookupError:
                pass

    def reap(self, deadline: float) -> None:
        """Wait until `deadline` (time.monotonic) for the process to end, then SIGKILL its group."""
        if self._popen is None:
            return
        while time.monotonic() < deadline and self._popen.poll() is None:
            time.sleep(0.05)
        try:
            os.killpg(self._popen.pid, signal.SIGKILL)  # also reaps anything it left in its group
        except ProcessLookupError:
            pass
        self._popen.wait()

    def stop(self, grace: float = 5.0) -> None:
        self.terminate()
        self.reap(time.monotonic() + grace)


class ComponentExited(RuntimeError):
    def __init__(self, process: Process, code: int) -> None:
        tail = ""
        if process.log.exists():
            tail = "".join(process.log.read_text(errors="replace").splitlines(keepends=True)[-25:])
        super().__init__(f"{process.name} exited with code {code}; log {process.log}:\n{tail}")
        self.process = process
