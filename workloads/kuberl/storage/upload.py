"""Parallel upload of a local directory (checkpoints) to s3://, gs:// or a local path."""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

from kuberl.storage import filesystems
from kuberl.storage.checksums import crc32c_of_file
from kuberl.storage.errors import StorageError, with_retries
from kuberl.storage.manifest import FileRecord
from kuberl.storage.progress import log
from kuberl.api.uri import parse


def upload_dir(local: str | Path, uri: str, *, workers: int = 16,
               attempts: int = 5) -> list[FileRecord]:
    """Upload every file below ``local`` to ``uri``/<relative path>; verify the sizes the store
    reports afterwards. Symlinks are refused (they could publish files from outside ``local``).
    The records carry each file's CRC32C, for a checkpoint's COMPLETE."""
    local = Path(local)
    parsed = parse(uri, "upload destination")
    if not local.is_dir():
        raise StorageError(f"upload to {uri}: {local} is not a directory")
    fs = filesystems.filesystem(parsed, max_connections=workers)
    root = filesystems.root_path(parsed)
    files: list[tuple[Path, str]] = []
    for path in sorted(local.rglob("*")):
        if path.is_symlink():
            raise StorageError(f"upload to {uri}: refusing symlink {path}; copy the file instead")
        if path.is_file():
            files.append((path, path.relative_to(local).as_posix()))

    def put(path: Path, rel: str) -> str:
        dest = f"{root}/{rel}"
        if not parsed.is_cloud:
            fs.makedirs(dest.rsplit("/", 1)[0], exist_ok=True)
        # Read once more from the page cache (~20 GB/s hashing): a checksum the downloader can
        # verify whatever the store keeps (multipart uploads keep none of the whole object).
        crc32c = crc32c_of_file(path)
        with_retries(lambda: fs.put_file(str(path), dest), uri=f"{uri}/{rel}", attempts=attempts,
                     log=log.warning)
        return crc32c

    with cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kuberl-upload") as pool:
        crcs = [future.result() for future in [pool.submit(put, path, rel) for path, rel in files]]
    listed = with_retries(lambda: fs.find(root, detail=True), uri=uri, attempts=attempts)
    records = []
    for (path, rel), crc32c in zip(files, crcs):
        size = path.stat().st_size
        info = listed.get(f"{root}/{rel}")
        if info is None or int(info["size"]) != size:
            raise StorageError(f"upload to {uri}: {rel} has {size} bytes locally but the store "
                               f"reports {None if info is None else info['size']}")
        records.append(FileRecord(rel, size, None, "size", crc32c))
    return records
