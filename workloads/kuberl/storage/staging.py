"""``stage(src, dst)``: copy a model or checkpoint from s3/gs/hf/pvc/local into a pod-local
directory, verified, atomically and resumably (what ``kuberl stage`` and resolve() run)."""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shutil
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kuberl.storage import checksums, filesystems
from kuberl.storage.checksums import Checksum
from kuberl.storage.download import (RemoteFile, already_verified, download_files, list_source,
                                     remove_stale_parts)
from kuberl.storage.errors import StorageError, explain, with_retries
from kuberl.storage.archive import extract_tar
from kuberl.storage.checkpoints import COMPLETE
from kuberl.storage.manifest import (COMPLETE_NAME, FileRecord, Journal, load_verified, withdraw_complete,
                                     write_complete)
from kuberl.storage.progress import Progress, log
from kuberl.storage.safepath import PART_SUFFIX
from kuberl.api.uri import ParsedURI, parse

DEFAULT_WORKERS = 32
DEFAULT_PART_SIZE = 8 << 20


@dataclass(frozen=True)
class StageResult:
    source: str
    dst: Path
    files: int               # files in DST that make up the source
    bytes: int
    downloaded_files: int    # fetched by this run
    downloaded_bytes: int
    skipped_files: int       # already verified by an earlier run
    seconds: float
    manifest: Path           # DST/.complete

    @property
    def gbps(self) -> float:
        return self.downloaded_bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def stage(src: str, dst: str | Path, *, workers: int = DEFAULT_WORKERS,
          part_size: int = DEFAULT_PART_SIZE, checksum: str = "auto", exclude: Sequence[str] = (),
          unpack_tar: bool = True, attempts: int = 5, progress_stream: TextIO | None = None,
          log_interval_s: float = 10.0) -> StageResult:
    """Copy ``src`` into directory ``dst``; see the module docstring of kuberl.storage.

    ``checksum``: "auto" verifies, besides sizes, the fastest checksum the store gives
    (CRC32C, CRC32, else MD5: kuberl.storage.checksums); "size" verifies sizes only. ``exclude``: glob patterns on the
    relative path. A source naming one ``.tar`` object is unpacked into ``dst`` (uncompressed
    tar only, through kuberl.storage.archive) unless ``unpack_tar`` is False. A source holding a
    checkpoint manifest (a top-level ``COMPLETE``) must hold exactly the files it lists. A
    local or ``pvc://`` source may not link out of itself or its claim (list_source).
    """
    if checksum not in ("auto", "size"):
        raise ValueError(f"checksum must be 'auto' or 'size', not {checksum!r}")
    if workers < 1 or part_size < 1:
        raise ValueError("workers and part_size must be positive")
    parsed = parse(src, "source")
    dst = Path(dst).absolute()
    dst.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if parsed.info.hub:
        return _stage_hf(parsed, dst, workers, exclude, started)
    fs = filesystems.filesystem(parsed, max_connections=workers)
    root = filesystems.root_path(parsed)
    files = list_source(fs, parsed, root, src, exclude=exclude, attempts=attempts)
    recorded = check_against_manifest(fs, files, src, exclude, attempts)
    files = [dataclasses.replace(f, checksum=checksums.best(recorded.get(f.rel), f.checksum))
             for f in files]
    options = dict(workers=workers, part_size=part_size, verify=checksum == "auto",
                   attempts=attempts)
    if unpack_tar and len(files) == 1 and files[0].key == root and root.endswith(".tar"):
        return _stage_tar(fs, files[0], src, dst, options, started, progress_stream, log_interval_s)

    remove_stale_parts(dst)
    todo, kept = already_verified(files, dst, load_verified(dst, src))
    records = list(kept)
    progress = Progress(f"stage {src}", sum(f.size for f in todo), len(todo),
                        stream=progress_stream, interval_s=log_interval_s)
    journal = Journal(dst, src, kept)
    try:
        def verified(record: FileRecord) -> None:
            journal.append(record)
            records.append(record)

        stats = download_files(fs, todo, dst, src, progress=progress, on_verified=verified,
                               **options)
    finally:
        journal.close()
        progress.close()
    manifest = write_complete(dst, src, records)
    result = StageResult(src, dst, len(records), sum(r.size for r in records), stats.files,
                         stats.bytes, len(kept), time.monotonic() - started, manifest)
    log.info(f"staged {src} -> {dst}: {result.files} files, {result.bytes} bytes "
             f"({result.downloaded_files} downloaded, {result.skipped_files} already verified) "
             f"in {result.seconds:.1f}s")
    return result


def verify_checkpoint(uri: str, *, attempts: int = 5) -> None:
    """Refuse checkpoint ``uri`` unless its files are exactly what its COMPLETE lists (what a
    restore that reads in place, without staging, checks first)."""
    parsed = parse(uri, "checkpoint")
    fs = filesystems.filesystem(parsed)
    root = filesystems.root_path(parsed)
    files = list_source(fs, parsed, root, uri, attempts=attempts)
    if not any(f.rel == COMPLETE for f in files):
        raise StorageError(f"{uri}: no {COMPLETE}: not a complete checkpoint; restore another step")
    check_against_manifest(fs, files, uri, (), attempts)


def check_against_manifest(fs, files: list[RemoteFile], src: str, exclude: Sequence[str],
                           attempts: int) -> dict[str, Checksum]:
    """A source whose top level holds ``COMPLETE`` is a checkpoint: refuse it unless the listing
    holds exactly the files COMPLETE lists, at the listed sizes (and store identities, where
    COMPLETE records them). A step rewritten or torn after it was vouched for is never staged.
    Returns the CRC32Cs COMPLETE records (kuberl's uploads compute them), by relative path."""
    marker = next((f for f in files if f.rel == COMPLETE), None)
    if marker is None:
        return {}
    try:
        listed = {item["path"]: item for item in json.loads(
            with_retries(lambda: fs.cat_file(marker.key), uri=src, attempts=attempts))["files"]}
    except (ValueError, KeyError, TypeError) as exc:
        raise StorageError(f"{src}: its {COMPLETE} manifest is unreadable ({exc}); the checkpoint "
                           f"cannot be verified; restore another step") from exc
    listed = {rel: item for rel, item in listed.items()
              if not any(fnmatch.fnmatch(rel, pattern) for pattern in exclude)}
    present = {f.rel: f for f in files if f.rel != COMPLETE}
    problems = [f"{rel} is missing" for rel in sorted(set(listed) - set(present))]
    problems += [f"{rel} is not in it" for rel in sorted(set(present) - set(listed))]
    for rel in sorted(set(listed) & set(present)):
        want, got = listed[rel], present[rel]
        if want.get("size") != got.size or (want.get("etag") and want["etag"] != got.etag):
            problems.append(f"{rel} has {got.size} bytes (etag {got.etag}), {COMPLETE} lists "
                            f"{want.get('size')} (etag {want.get('etag')})")
    if problems:
        raise StorageError(f"{src}: the files do not match its {COMPLETE} manifest ("
                           f"{'; '.join(problems[:5])}{'; ...' if len(problems) > 5 else ''}): the "
                           f"checkpoint was changed after it was completed; restore another step")
    return {rel: Checksum("crc32c", item["crc32c"], f"its {COMPLETE} (recorded at upload)")
            for rel, item in listed.items() if isinstance(item.get("crc32c"), str)}


def _stage_tar(fs, archive: RemoteFile, src: str, dst: Path, options: dict, started: float,
               progress_stream: TextIO | None, log_interval_s: float) -> StageResult:
    """Download one ``.tar`` object and unpack it into ``dst``; nothing reaches ``dst`` unless
    every member passes kuberl.storage.archive's checks (regular files and directories only,
    names inside ``dst``, sizes within the archive)."""
    manifest = dst / COMPLETE_NAME
    try:
        previous = json.loads(manifest.read_text())
    except (FileNotFoundError, ValueError):
        previous = None
    if previous and previous.get("source") == src and previous.get("archive_etag") == archive.etag \
            and all(_has_size(dst, f["path"], f["size"]) for f in previous.get("files", [])):
        return StageResult(src, dst, len(previous["files"]), previous["total_bytes"], 0, 0,
                           len(previous["files"]), time.monotonic() - started, manifest)
    work = dst / f".untar{PART_SUFFIX}"
    shutil.rmtree(work, ignore_errors=True)
    (work / "archive").mkdir(parents=True)
    try:
        name = archive.rel
        progress = Progress(f"stage {src}", archive.size, 1, stream=progress_stream,
                            interval_s=log_interval_s)
        try:
            download_files(fs, [archive], work / "archive", src, progress=progress,
                           on_verified=lambda record: None, **options)
        finally:
            progress.close()
        tree = work / "tree"
        tree.mkdir()
        members = extract_tar(work / "archive" / name, tree, src)
        records = [FileRecord(m.path, m.size, archive.etag, "tar") for m in members]
        withdraw_complete(dst)
        for entry in tree.iterdir():
            target = dst / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            os.replace(entry, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    manifest = write_complete(dst, src, records, {"archive_etag": archive.etag})
    total = sum(r.size for r in records)
    return StageResult(src, dst, len(records), total, 1, archive.size, 0,
                       time.monotonic() - started, manifest)


def _has_size(dst: Path, rel: str, size: int) -> bool:
    path = dst.joinpath(*rel.split("/"))
    return path.is_file() and not path.is_symlink() and path.stat().st_size == size


def _stage_hf(parsed: ParsedURI, dst: Path, workers: int, exclude: Sequence[str],
              started: float) -> StageResult:
    """Hugging Face repos go through huggingface_hub (token from HF_TOKEN, endpoint from
    HF_ENDPOINT), which verifies and resumes its own downloads."""
    from huggingface_hub import snapshot_download

    withdraw_complete(dst)
    try:
        snapshot_download(parsed.bucket, revision=parsed.revision, local_dir=dst,
                          max_workers=workers, ignore_patterns=list(exclude) or None)
    except Exception as exc:  # noqa: BLE001 - turned into a message naming the URI
        raise explain(exc, parsed.original) from exc
    records = []
    for path in sorted(dst.rglob("*")):
        rel = path.relative_to(dst).as_posix()
        if path.is_file() and not rel.startswith(".cache/") and rel not in (COMPLETE_NAME,):
            records.append(FileRecord(rel, path.stat().st_size, parsed.revision, "hf"))
    manifest = write_complete(dst, parsed.original, records)
    total = sum(r.size for r in records)
    return StageResult(parsed.original, dst, len(records), total, len(records), total, 0,
                       time.monotonic() - started, manifest)
