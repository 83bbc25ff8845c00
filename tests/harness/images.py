"""The container images the real nodes run, built daemonless from images/Dockerfile's targets.

podman (Debian's, with runc and the cgroupfs cgroup manager: crun refuses this machine's hybrid
cgroups) builds into its own storage under ~/.cache/kuberl/containers. The public Python bases
cannot be pulled here, so every build gets BASE_IMAGE=the local base: Debian bookworm made
with debootstrap from Debian's packages, Python 3.11.2 as Debian patches it (bookworm's python3.11
carries the distribution's security fixes), with `python`/`pip` linked into /usr/local/bin like the
python:*-slim images. What the build downloads (PyPI, Debian) goes through this machine's
TLS-intercepting proxy, whose CA only the host's bundle holds: the build mounts that bundle over
the image's for its RUN steps only, so it is never part of an image.

An image is cached under a tag keyed by the hash of its target name, the shared Dockerfile,
uv.lock, pyproject.toml and kuberl's sources (and the base): a present tag is never rebuilt, and
podman's layer cache keeps a code change from reinstalling the locked dependencies. `import_into`
streams an image into nodes' containerds, each getting only the layers it lacks, under the
public name the manifests use (ghcr.io/kuberl/<name>:<version>).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterable

from tests.harness import oci_stream
from tests.harness.build import BuildError, _cache_lock
from tests.harness.components import KUBERNETES_VERSION, cache_dir
from tests.harness.nodes import EVICTION_FREE_PERCENT

REPO_ROOT = Path(__file__).resolve().parents[2]
# One target per image (`--target NAME`), sharing the build stages.
DOCKERFILE = REPO_ROOT / "images" / "Dockerfile"
# The images the real-node tests run; `worker` needs CUDA and is not built here.
NAMES = ("operator", "stager", "worker-cpu")
PUBLIC_REPOSITORY = "ghcr.io/kuberl"
# Where the images the harness imports into nodes live: the public names and the local base's.
KUBERL_REPOSITORIES = (PUBLIC_REPOSITORY, "localhost/kuberl")
VERSION = "0.1.0"

DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = os.environ.get("KUBERL_DEBIAN_MIRROR", "http://deb.debian.org/debian")
BASE_PACKAGES = ("python3", "python3-pip", "ca-certificates")
# The host's CA bundle (it holds the proxy's CA); mounted read-only into RUN steps only.
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
# Within the host's hard limits (nofile 20000): runc fails to start a container asking for more.
ULIMITS = ("nofile=10000:10000", "nproc=10000:10000")
# The pause image of the Kubernetes release (kubeadm's PauseVersion), built from its own source.
PAUSE_IMAGE = "registry.k8s.io/pause:3.10.2"


class ImageError(BuildError):
    """An image could not be built or imported; the message says which step and where its log is."""


def storage_dir() -> Path:
    return cache_dir() / "containers"


def podman_argv(*args: str) -> list[str]:
    root = storage_dir()
    return [
        "podman",
        f"--root={root / 'storage'}",
        f"--runroot={root / 'run'}",
        "--runtime=runc",
        "--cgroup-manager=cgroupfs",
        "--events-backend=file",
        *args,
    ]


def _log_dir() -> Path:
    path = cache_dir() / "build-logs"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run(argv: list[str], log: Path, what: str, **kwargs) -> None:
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        proc = subprocess.run(["nice", "-n", "10", *argv], stdout=out, stderr=subprocess.STDOUT, **kwargs)
    if proc.returncode != 0:
        raise ImageError(f"{what} failed (exit {proc.returncode}); full log {log}:\n{_log_tail(log)}")


def _log_tail(log: Path, lines: int = 30) -> str:
    return "".join(log.read_text(errors="replace").splitlines(keepends=True)[-lines:])


def check_tools() -> None:
    missing = [tool for tool in ("podman", "runc", "debootstrap") if shutil.which(tool) is None]
    if missing:
        raise ImageError(
            f"missing {', '.join(missing)}: the real nodes' images are built with Debian's podman, runc and "
            "debootstrap; `bash .ci/setup --tests` installs them (apt-get install podman runc debootstrap)"
        )


def image_exists(tag: str) -> bool:
    return subprocess.run(podman_argv("image", "exists", tag), capture_output=True).returncode == 0


# -- the local base ---------------------------------------------------------------------------

_ROOTFS_RECIPE = f"debootstrap --variant=minbase --include={','.join(BASE_PACKAGES)} {DEBIAN_SUITE}"
# What python:*-slim offers on top: PATH, `python` and `pip` on it, and pip allowed to install
# system-wide (no PEP 668 marker). SSL_CERT_FILE points uv at the image's own (Debian's) CA
# bundle, where builds find the proxy's CA mounted.
_BASE_DOCKERFILE = """FROM {rootfs}
ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \\
    SSL_CERT_FILE=/etc/ssl/certs/ca-certificates.crt
RUN ln -sf /usr/bin/python3 /usr/local/bin/python \\
 && ln -sf /usr/bin/pip3 /usr/local/bin/pip \\
 && rm -f /usr/lib/python3.11/EXTERNALLY-MANAGED
CMD ["python3"]
"""


def _rootfs_tag() -> str:
    return f"localhost/kuberl/debootstrap-{DEBIAN_SUITE}:{hashlib.sha256(_ROOTFS_RECIPE.encode()).hexdigest()[:12]}"


def base_tag() -> str:
    dockerfile = _BASE_DOCKERFILE.format(rootfs=_rootfs_tag())
    return f"localhost/kuberl/base-{DEBIAN_SUITE}:{hashlib.sha256(dockerfile.encode()).hexdigest()[:12]}"


def build_base(out=sys.stdout) -> float:
    """The local stand-in for python:3.11-slim-bookworm; returns seconds spent (0 when present)."""
    tag = base_tag()
    if image_exists(tag):
        return 0.0
    began = time.monotonic()
    log = _log_dir() / "image-base.log"
    log.write_text("")
    if not image_exists(_rootfs_tag()):
        _import_debootstrap(log)
    with tempfile.TemporaryDirectory(dir=cache_dir()) as context:
        Path(context, "Dockerfile").write_text(_BASE_DOCKERFILE.format(rootfs=_rootfs_tag()))
        _run(podman_argv("build", *(f"--ulimit={u}" for u in ULIMITS), "-t", tag, context), log, "podman build of the local base")
    seconds = time.monotonic() - began
    print(f"{'image base (' + tag + ')':60s} built in {seconds:7.1f} s", file=out, flush=True)
    return seconds


def _import_debootstrap(log: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="base-", dir=cache_dir()))
    try:
        rootfs = work / "rootfs"
        _run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE, str(rootfs), DEBIAN_MIRROR],
            log,
            "debootstrap of the local base",
        )
        for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for entry in (rootfs / cache).glob("*"):
                if entry.is_file():
                    entry.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "--numeric-owner", "-cf", "-", "."], stdout=subprocess.PIPE)
        _run(podman_argv("import", "-", _rootfs_tag()), log, "podman import of the debootstrap root", stdin=tar.stdout)
        tar.wait()
    finally:
        shutil.rmtree(work, ignore_errors=True)


# -- the pause image --------------------------------------------------------------------------


def build_pause(out=sys.stdout) -> float:
    """registry.k8s.io/pause from build/pause/linux/pause.c of the Kubernetes release, static."""
    if image_exists(PAUSE_IMAGE):
        return 0.0
    began = time.monotonic()
    source = _kubernetes_source() / "build" / "pause" / "linux" / "pause.c"
    log = _log_dir() / "image-pause.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(dir=cache_dir()) as context:
        version = PAUSE_IMAGE.rsplit(":", 1)[1]
        _run(["gcc", "-Os", "-static", f'-DVERSION="{version}"', "-o", f"{context}/pause", str(source)], log, "compiling pause.c")
        Path(context, "Dockerfile").write_text('FROM scratch\nCOPY pause /pause\nUSER 65535:65535\nENTRYPOINT ["/pause"]\n')
        _run(podman_argv("build", "-t", PAUSE_IMAGE, context), log, "podman build of the pause image")
    seconds = time.monotonic() - began
    print(f"{'image ' + PAUSE_IMAGE:60s} built in {seconds:7.1f} s", file=out, flush=True)
    return seconds


def _kubernetes_source() -> Path:
    from tests.harness.build import _go_env, check_go

    go = check_go()
    workdir = cache_dir() / "build" / f"kubernetes-{KUBERNETES_VERSION}"
    result = subprocess.run(
        [go, "mod", "download", "-json", f"k8s.io/kubernetes@{KUBERNETES_VERSION}"],
        cwd=workdir if workdir.is_dir() else None, env=_go_env(), capture_output=True, text=True,
    )
    info = json.loads(result.stdout or "{}")
    if result.returncode != 0 or "Dir" not in info:
        raise ImageError(f"cannot locate the k8s.io/kubernetes@{KUBERNETES_VERSION} source: {info.get('Error') or result.stderr}")
    return Path(info["Dir"])


# -- the images of images/Dockerfile -------------------------------------------------------


def _source_files() -> list[Path]:
    files = [REPO_ROOT / "uv.lock", REPO_ROOT / "pyproject.toml", REPO_ROOT / "README.md"]
    for tree in ("workloads", "operator"):
        files += sorted(
            p for p in (REPO_ROOT / tree).rglob("*")
            if p.is_file() and "__pycache__" not in p.parts and not any(part.endswith(".egg-info") for part in p.parts)
        )
    return files


def image_key(name: str) -> str:
    """Hash of what the image is built from: its target in the shared Dockerfile, the lock,
    kuberl's sources, the base."""
    digest = hashlib.sha256(base_tag().encode())
    digest.update(b"--target\0" + name.encode() + b"\0images/Dockerfile\0" + DOCKERFILE.read_bytes() + b"\0")
    for path in _source_files():
        digest.update(str(path.relative_to(REPO_ROOT)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def local_tag(name: str) -> str:
    return f"localhost/kuberl/{name}:{image_key(name)}"


def public_name(name: str) -> str:
    return f"{PUBLIC_REPOSITORY}/{name}:{VERSION}"


def uv_cache_dir() -> Path:
    path = Path(os.environ.get("UV_CACHE_DIR") or Path.home() / ".cache" / "uv")
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_image(name: str, out=sys.stdout) -> float:
    """Build images/Dockerfile's target `name` on the local base unless cached; returns seconds spent."""
    tag = local_tag(name)
    if image_exists(tag):
        return 0.0
    began = time.monotonic()
    log = _log_dir() / f"image-{name}.log"
    log.write_text("")
    argv = podman_argv(
        "build",
        "--layers",
        "--network=host",
        *(f"--ulimit={u}" for u in ULIMITS),
        f"--build-arg=BASE_IMAGE={base_tag()}",
        f"--volume={HOST_CA_BUNDLE}:/etc/ssl/certs/ca-certificates.crt:ro",
        # The host's uv cache instead of the Dockerfile's cache mount (which takes precedence over
        # a volume at its own path): `.ci/setup` has already downloaded every locked wheel into
        # it (several GB for torch), so the builds download almost nothing.
        f"--volume={uv_cache_dir()}:/host-uv-cache",
        "--build-arg=UV_CACHE_DIR=/host-uv-cache",
        "-f", str(DOCKERFILE),
        f"--target={name}",
        "-t", tag,
        str(REPO_ROOT),
    )
    _run(argv, log, f"podman build of images/Dockerfile --target {name}")
    _drop_older(name, tag)
    seconds = time.monotonic() - began
    print(f"{'image ' + tag:60s} built in {seconds:7.1f} s", file=out, flush=True)
    return seconds


def _drop_older(name: str, keep: str) -> None:
    """Remove the image's earlier builds and the layers only they used: the cache holds one of each
    (the worker-cpu image is several GB)."""
    listing = subprocess.run(podman_argv("images", "--format", "{{.Repository}}:{{.Tag}}", f"localhost/kuberl/{name}"),
                             capture_output=True, text=True).stdout.split()
    older = [t for t in listing if t != keep]
    if older:
        subprocess.run(podman_argv("rmi", *older), capture_output=True)
    subprocess.run(podman_argv("image", "prune", "-f"), capture_output=True)


def build(names: tuple[str, ...] = NAMES, base: bool | None = None, out=sys.stdout) -> dict[str, float]:
    """The pause image, the local base (when `base`, or when `names` need it) and `names`;
    returns build seconds per image (0 when cached)."""
    check_tools()
    storage_dir().mkdir(parents=True, exist_ok=True)
    times: dict[str, float] = {}
    # A lock of its own: image builds need not wait for the Go builds, nor the other way round.
    with _cache_lock(".images.lock"):
        if base or (base is None and names):
            times["base"] = build_base(out)
        times["pause"] = build_pause(out)
        for name in names:
            times[name] = build_image(name, out)
    return times


def missing_images(names: tuple[str, ...] = NAMES) -> list[str]:
    if shutil.which("podman") is None:
        return ["base", "pause", *names]
    return [n for n, tag in [("base", base_tag()), ("pause", PAUSE_IMAGE), *((n, local_tag(n)) for n in names)] if not image_exists(tag)]


def layer_sizes(tag: str) -> dict[str, int]:
    """Uncompressed size of each layer of podman's image `tag`, by its diff digest (what a
    `ctr images import` of the saved archive names the layer's blob in containerd's content store).
    Sizes come from containers/storage's own layer index."""
    out = subprocess.run(podman_argv("image", "inspect", "--format", "{{json .RootFS.Layers}}", tag),
                         capture_output=True, text=True, check=True)
    index = json.loads((storage_dir() / "storage" / "overlay-layers" / "layers.json").read_text())
    sizes = {layer["diff-digest"]: layer.get("diff-size", 0) for layer in index if "diff-digest" in layer}
    layers = json.loads(out.stdout)
    unknown = [digest for digest in layers if digest not in sizes]
    if unknown:
        raise ImageError(f"{tag}: layers {unknown} are not in {storage_dir()}'s layer index")
    return {digest: sizes[digest] for digest in layers}


def import_need(layers: dict[str, int], present: list[set[str]]) -> int:
    """Bytes an import of an image with `layers` (digest -> size) writes into nodes that hold the
    `present` digests: each missing layer twice (blob and unpacked snapshot) per node."""
    return 2 * sum(size for digests in present for digest, size in layers.items() if digest not in digests)


def repository(name: str) -> str:
    """An image name without its tag: `ghcr.io/kuberl/worker-cpu:0.1.0` -> `ghcr.io/kuberl/worker-cpu`
    (a registry's port, as in `localhost:5000/x`, is not a tag)."""
    head, _, last = name.rpartition("/")
    return f"{head}/{last.split(':', 1)[0]}" if head else last.split(":", 1)[0]


def superseded(held: Iterable[str], name: str) -> list[str]:
    """The images of a node (`held`: its image names) that an import of kuberl's image `name`
    replaces: those of the same repository, i.e. the earlier build under the same public name and
    an earlier base under its older hash tag. Never an image outside kuberl's repositories: the
    pause image (and anything else) cannot be pulled back here."""
    repo = repository(name)
    if not repo.startswith(tuple(f"{r}/" for r in KUBERL_REPOSITORIES)):
        return []
    return sorted(h for h in held if repository(h) == repo)


def import_fits(need: int, free: int, total: int) -> bool:
    """Whether `free` bytes of a `total`-byte disk hold an import that writes `need` bytes and still
    leave the reserve: a tenth of the need for pods' logs and emptyDirs, plus 3 % of the disk, three
    times the kubelets' eviction threshold (`nodes.EVICTION_FREE_PERCENT`) that other writers on
    this shared disk must not push it past: under it a kubelet deletes every image no pod is using,
    the pause image among them, and no pod starts after that."""
    return free - need >= need // 10 + total * 3 * EVICTION_FREE_PERCENT // 100


def room_for_import(tag: str, present: list[set[str]], directory: Path) -> bool:
    """Whether an import of `tag` into nodes holding the `present` content digests (one set per
    node) fits on `directory`'s disk with the reserve of `import_fits`."""
    usage = shutil.disk_usage(directory)
    return import_fits(import_need(layer_sizes(tag), present), usage.free, usage.total)


def check_room_for_import(tag: str, present: list[set[str]], directory: Path) -> None:
    """Each node's containerd keeps an imported layer twice (the blob, and it unpacked); layers a
    node already holds (`present`: its content digests, one set per node) cost nothing. Fail
    before an import would leave less than `import_fits`'s reserve: a full disk does not just fail
    the import, the nodes' kubelets then reclaim space by deleting images nothing can pull back
    (the pause image among them), and every pod after that fails to start."""
    need = import_need(layer_sizes(tag), present)
    usage = shutil.disk_usage(directory)
    if not import_fits(need, usage.free, usage.total):
        raise ImageError(f"importing {tag} into {len(present)} node(s) needs about {need / 2**30:.1f} GiB under "
                         f"{directory} and a reserve of {(need // 10 + usage.total * 3 * EVICTION_FREE_PERCENT // 100) / 2**30:.1f} GiB; "
                         f"{usage.free / 2**30:.1f} GiB are free. Free some space (old /tmp/kuberl-cluster-* "
                         f"directories of killed runs, `podman --root {storage_dir()} image prune`, "
                         f"{cache_dir() / 'node-store'} when no test runs), or use fewer real nodes.")


HELD_DURING_IMPORT = "-held-during-import"


def import_into(ctrs: list[list[str]], image: str, name: str, logs: list[Path]) -> None:
    """Stream podman's `image` into containerds (one argv prefix `ctr` each, log beside it) as
    `name`: one `podman save` feeds them all at once, since the save (re-reading every layer of a
    7 GB image) costs as much as an import. Each containerd gets only the layers it lacks
    (tests/harness/oci_stream.py): a code change sends worker-cpu's code layer alone.

    The image `name` named before stays held under a second name until the import is done.
    `ctr images import` moves `name` to the new image before it unpacks it, and unpacking skips
    the layers whose snapshots exist, without holding them: the base layers that the old image
    shares with the new one are then held by nothing, and a garbage collection in between (any
    container a kubelet removes starts one) deletes them under the unpack, which fails with
    "parent snapshot ... does not exist" (containerd/containerd#3787; it failed CI on 2026-11-28).
    Held, they also stay in the content store, which the layers left out rely on."""
    if image != name:
        subprocess.run(podman_argv("tag", image, name), check=True, capture_output=True)
    held = f"{name}{HELD_DURING_IMPORT}"
    holding = [_ctr_logged([*ctr, "-n", "k8s.io", "images", "tag", "--force", name, held], log)  # no: `name` is new
               for ctr, log in zip(ctrs, logs)]
    present = [content_digests(ctr) for ctr in ctrs]
    save = subprocess.Popen(podman_argv("save", "--format=docker-archive", name), stdout=subprocess.PIPE,
                            stderr=logs[0].open("a"))
    imports = []
    for ctr, log in zip(ctrs, logs):
        argv = [*ctr, "-n", "k8s.io", "images", "import", "-"]
        with log.open("a") as out:
            out.write(f"$ {' '.join(argv)}\n")
        imports.append((subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log.open("a"), stderr=subprocess.STDOUT), log))
    sent = False
    try:
        oci_stream.send_oci_layouts(save.stdout, name, [proc.stdin for proc, _ in imports], present)
        sent = True
    except BrokenPipeError:  # an import died: its exit status and log say why
        pass
    finally:
        # However the stream ended (an error of its own too), each import sees its input end and
        # exits before the held names go.
        if not sent:
            save.kill()
        for proc, _ in imports:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
        failed = [log for proc, log in imports if proc.wait() != 0]
        for ctr, log, holds in zip(ctrs, logs, holding):
            if holds:  # --sync: the old image's own layers are free when this returns (the room checks)
                _ctr_logged([*ctr, "-n", "k8s.io", "images", "rm", "--sync", held], log)
    if save.wait() != 0 or failed:
        tails = "".join(f"\n--- the end of {log} ---\n{_log_tail(log)}" for log in failed or logs[:1])
        raise ImageError(f"importing {name} into containerd failed{tails}")


def content_digests(ctr: list[str]) -> set[str]:
    """The digests in a containerd's content store (the layers an import need not send)."""
    return set(subprocess.run([*ctr, "-n", "k8s.io", "content", "ls", "-q"], capture_output=True, text=True,
                              check=True).stdout.split())


def _ctr_logged(argv: list[str], log: Path) -> bool:
    """Run a ctr command, its output into `log`; whether it succeeded."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        out.flush()
        return subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT).returncode == 0


__all__ = ["ImageError", "NAMES", "PAUSE_IMAGE", "build", "import_into", "local_tag", "missing_images", "public_name"]
