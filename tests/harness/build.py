"""Build the control-plane binaries from Go modules into ~/.cache/kuberl/bin.

Each binary lands as `<component>-<version>`; a present binary is never
rebuilt. A build writes to a temporary name and renames it when complete, so
an interrupted build never leaves a half binary behind. A file lock keeps two
builders (a developer and a test session) from racing on the same cache.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from tests.harness.components import (
    COMPONENTS,
    REQUIRED,
    GO_MIN_VERSION,
    Component,
    bin_dir,
    binary_path,
    cache_dir,
    data_path,
    is_built,
)


class BuildError(RuntimeError):
    """A component could not be built; the message says which and why."""


class GoToolchainError(BuildError):
    """Go is missing or older than the pinned modules need."""


def go_binary() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if Path("/usr/local/go/bin/go").exists() else None)
    if go is None:
        raise GoToolchainError(
            "Go toolchain not found on PATH: the test control plane is built from Go modules. "
            f"Install Go >= {GO_MIN_VERSION[0]}.{GO_MIN_VERSION[1]} (https://go.dev/dl) and put `go` on PATH."
        )
    return go


def check_go() -> str:
    """Return the go executable, raising GoToolchainError if missing or too old."""
    go = go_binary()
    out = subprocess.run([go, "env", "GOVERSION"], capture_output=True, text=True, env=_go_env())
    match = re.match(r"go(\d+)\.(\d+)", out.stdout.strip())
    if out.returncode != 0 or match is None:
        raise GoToolchainError(f"`{go} env GOVERSION` failed: {out.stderr.strip() or out.stdout.strip()}")
    found = (int(match.group(1)), int(match.group(2)))
    if found < GO_MIN_VERSION:
        raise GoToolchainError(
            f"Go {found[0]}.{found[1]} at {go} is too old: the pinned Kubernetes, etcd and KubeRay modules "
            f"need Go >= {GO_MIN_VERSION[0]}.{GO_MIN_VERSION[1]}. Install a newer Go (https://go.dev/dl)."
        )
    return go


def _go_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        GOFLAGS="-trimpath",
        # Static binaries; no cgo also keeps the cold build shorter.
        CGO_ENABLED="0",
        # Never fetch another toolchain: the version check above is the contract.
        GOTOOLCHAIN="local",
    )
    return env


def _run(cmd: list[str], cwd: Path, log: Path) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(["nice", "-n", "10", *cmd], cwd=cwd, env=_go_env(), stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-30:])
        raise BuildError(f"`{' '.join(cmd)}` failed in {cwd} (exit {proc.returncode}); full log {log}:\n{tail}")


def _kubernetes_staging_replaces(go: str, version: str, workdir: Path, log: Path) -> list[str]:
    """The k8s.io staging modules of k8s.io/kubernetes@version, from its go.mod."""
    out = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{version}"],
        cwd=workdir,
        env=_go_env(),
        capture_output=True,
        text=True,
    )
    info = json.loads(out.stdout) if out.stdout.strip() else {}
    if out.returncode != 0 or "GoMod" not in info:
        log.write_text(out.stdout + out.stderr)
        raise BuildError(f"cannot download k8s.io/kubernetes@{version}: {info.get('Error') or out.stderr.strip()}")
    text = Path(info["GoMod"]).read_text()
    staging = re.findall(r"^\s*(k8s\.io/[\w.-]+)\s+=>\s+\./staging/", text, flags=re.M)
    if not staging:
        raise BuildError(f"no staging replace directives found in {info['GoMod']}")
    return staging


def _prepare_module(go: str, component: Component, log: Path) -> Path:
    """Write the throwaway go.mod of `component.group` and resolve its packages."""
    workdir = cache_dir() / "build" / component.group
    workdir.mkdir(parents=True, exist_ok=True)
    members = [c for c in COMPONENTS.values() if c.group == component.group]
    stamp = workdir / ".resolved"
    wanted = "\n".join(sorted(f"{c.package}@{c.version}" for c in members) + [c.main_go for c in members if c.main_go])
    if stamp.exists() and stamp.read_text() == wanted:
        return workdir
    gomod = f"module kuberl.dev/clusterbuild/{component.group}\n\ngo {GO_MIN_VERSION[0]}.{GO_MIN_VERSION[1]}\n"
    if component.module == "k8s.io/kubernetes":
        staging_version = "v0." + component.version.split(".", 1)[1]
        replaces = _kubernetes_staging_replaces(go, component.version, workdir, log)
        gomod += "\nreplace (\n" + "".join(f"\t{m} => {m} {staging_version}\n" for m in replaces) + ")\n"
    (workdir / "go.mod").write_text(gomod)
    (workdir / "go.sum").unlink(missing_ok=True)
    _run([go, "get", *(f"{c.package}@{c.version}" for c in members)], workdir, log)
    mains = [c for c in members if c.main_go]
    if mains:
        # Our own main package: every module it imports, at the versions `go get` chose.
        (main,) = mains  # one main package per throwaway module
        (workdir / "main.go").write_text(main.main_go)
        _run([go, "mod", "tidy"], workdir, log)
    stamp.write_text(wanted)
    return workdir


def _atomic_write(target: Path, write) -> None:
    """Call write(partial_path), then rename onto target: never a half file."""
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        write(partial)
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)


def _install_data_files(go: str, component: Component, workdir: Path, log: Path) -> None:
    out = subprocess.run(
        [go, "list", "-m", "-f", "{{.Dir}}", component.module], cwd=workdir, env=_go_env(), capture_output=True, text=True
    )
    if out.returncode != 0:
        raise BuildError(f"cannot locate the source of {component.module}: {out.stderr.strip()}")
    source = Path(out.stdout.strip())
    docs = []
    for rel in component.data_files:
        path = source / rel
        if not path.is_file():
            raise BuildError(f"{component.module}@{component.version} has no {rel}: the pinned version changed layout")
        docs.append(path.read_text().strip() + "\n")
    _atomic_write(data_path(component.name), lambda p: p.write_text("---\n".join(docs)))


def build_component(go: str, component: Component, log: Path) -> float:
    """Build one component; return seconds spent (0 when already present)."""
    if is_built(component.name):
        return 0.0
    started = time.monotonic()
    workdir = _prepare_module(go, component, log)
    target = binary_path(component.name)
    if not target.exists():
        ldflags = " ".join(["-s", "-w", *component.ldflags])

        def compile_to(partial: Path) -> None:
            package = "." if component.main_go else component.package
            tags = [f"-tags={','.join(component.tags)}"] if component.tags else []
            _run([go, "build", *tags, f"-ldflags={ldflags}", "-o", str(partial), package], workdir, log)
            partial.chmod(0o755)

        _atomic_write(target, compile_to)
    if component.data_files:
        _install_data_files(go, component, workdir, log)
    return time.monotonic() - started


@contextmanager
def _cache_lock(name: str = ".build.lock"):
    cache_dir().mkdir(parents=True, exist_ok=True)
    with (cache_dir() / name).open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def missing_components(names: list[str] | None = None) -> list[str]:
    return [n for n in (names or REQUIRED) if not is_built(n)]


def build(names: list[str] | None = None, out=sys.stdout) -> dict[str, float]:
    """Build every missing component (the control plane's by default: not the optional ones);
    return build seconds per component."""
    names = names or REQUIRED
    unknown = sorted(set(names) - set(COMPONENTS))
    if unknown:
        raise BuildError(f"unknown component(s) {unknown}; known: {sorted(COMPONENTS)}")
    if not missing_components(names):
        return {n: 0.0 for n in names}
    go = check_go()
    bin_dir().mkdir(parents=True, exist_ok=True)
    logs = cache_dir() / "build-logs"
    logs.mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    with _cache_lock():
        for name in names:
            component = COMPONENTS[name]
            log = logs / f"{component.binary_name}.log"
            seconds = build_component(go, component, log)
            times[name] = seconds
            state = f"built in {seconds:7.1f} s" if seconds else "present"
            print(f"{component.binary_name:40s} {state}   {binary_path(name)}", file=out, flush=True)
    return times
