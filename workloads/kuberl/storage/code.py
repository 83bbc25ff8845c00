"""``stage_code(uri, dst, sha256)``: the job's own Python code from a URI, pinned by digest
(``spec.reward.source.uri``, ``spec.agent.source.uri``; ``kuberl stage --sha256``).

The URI names one file: a ``.py`` module, or an uncompressed ``.tar`` of a directory (unpacked by
kuberl.storage.archive, which refuses links, traversal and every other surprise). The file is
fetched by ``stage`` (verified against the store's checksums), then its sha256 is compared with
the one the job pins; only a match reaches ``dst``, which is replaced as a whole: a directory
holding anything but the pinned code is never left behind.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from kuberl.api.types import CodeSource
from kuberl.storage.archive import extract_tar
from kuberl.storage.errors import StorageError
from kuberl.storage.manifest import COMPLETE_NAME
from kuberl.storage.staging import stage

CHUNK = 1 << 20


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def stage_code(uri: str, dst: str | Path, sha256: str, *, field: str = "source") -> Path:
    """Fetch ``uri`` (``field`` names it in errors), check its sha256, and make ``dst`` the
    directory of its code; return ``dst``."""
    dst = Path(dst).absolute()
    dst.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".code-", dir=dst.parent))
    try:
        stage(uri, work / "fetched", unpack_tar=False, progress_stream=None)
        files = [p for p in (work / "fetched").rglob("*") if p.is_file() and p.name != COMPLETE_NAME]
        if len(files) != 1 or files[0].parent != work / "fetched":
            raise StorageError(f"{field}.uri: {uri} holds {len(files)} files; it must name one .py "
                               f"module or one .tar archive")
        got = sha256_of(files[0])
        if got != sha256:
            raise StorageError(f"{field}.sha256: {uri} has sha256 {got}, the job pins {sha256}: the file "
                               f"changed since the digest was taken; pin the new digest (sha256sum) "
                               f"or restore the file")
        tree = work / "tree"
        tree.mkdir()
        if files[0].name.endswith(".tar"):
            extract_tar(files[0], tree, uri)
        else:
            shutil.copyfile(files[0], tree / files[0].name)
        if dst.exists():
            shutil.rmtree(dst)
        tree.rename(dst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return dst


def code_dir(path: str | None, source: CodeSource | None, work: Path, *, field: str) -> str | None:
    """The local directory of a run plan's code path (``paths.reward_code``, ``paths.agent_code``)
    for ``source``: a directory (the mounted or staged copy in a pod) as it is, the source's URI
    (``kuberl train``) fetched into ``work`` by ``stage_code``."""
    if path is None or source is None or source.sha256 is None or Path(path).is_dir():
        return path
    return str(stage_code(path, work, source.sha256, field=field))
