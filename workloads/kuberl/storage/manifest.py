"""The records that make staging resumable: a journal appended as each file is verified, and
the ``.complete`` manifest written when the whole source is in place.

The journal is not fsynced: it protects against the stager being killed (container restart,
OOM, SIGKILL), after which the page cache still holds every byte written; a node crash loses the
pod-local volume anyway.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kuberl.storage.safepath import COMPLETE_NAME, JOURNAL_NAME


@dataclass(frozen=True)
class FileRecord:
    path: str            # '/'-separated, relative to the destination
    size: int
    etag: str | None     # the store's identity for this content (S3 ETag, GCS generation, ...)
    checksum: str        # what was verified: "crc32c", "crc32", "md5" or just the "size"
    # The file's CRC32C (base64, as stores write it) where kuberl computed it from the local
    # file at upload (upload_dir): a checkpoint's COMPLETE carries it, and staging the
    # checkpoint verifies it end to end, on any store, multipart objects included.
    crc32c: str | None = None


def load_verified(dst: Path, source: str) -> dict[str, FileRecord]:
    """Files an earlier run recorded as verified copies of ``source``, from ``.complete`` and the
    journal. Records of another source count for nothing: a directory reused for a different
    source is checked against the new listing from scratch."""
    records: dict[str, FileRecord] = {}
    try:
        complete = json.loads((dst / COMPLETE_NAME).read_text())
        if complete["source"] == source:
            for item in complete["files"]:
                records[item["path"]] = FileRecord(**item)
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        pass  # a damaged marker proves nothing: every file is checked against the listing again
    try:
        lines = (dst / JOURNAL_NAME).read_text().splitlines()
    except FileNotFoundError:
        lines = []
    if not lines or _journal_source(lines[0]) != source:
        return records
    for line in lines[1:]:
        try:
            record = FileRecord(**json.loads(line))
        except (ValueError, TypeError):
            continue  # the last line may be torn by a kill mid-write
        records[record.path] = record
    return records


def _journal_source(line: str) -> str | None:
    try:
        return json.loads(line)["source"]
    except (ValueError, KeyError, TypeError):
        return None


class Journal:
    """One run's record of verified files: a ``{"source": ...}`` line, then one JSON line per
    verified file; ``append`` is safe to call from many threads.

    Opening it withdraws ``.complete``: from then on the directory changes, and a run killed
    part-way must not leave a marker vouching for a mix of old and new files. The records still
    valid (``carried``) are written first, so that kill costs no re-download."""

    def __init__(self, dst: Path, source: str, carried: list[FileRecord] = ()):
        tmp = dst / (JOURNAL_NAME + ".tmp")
        with open(tmp, "w", encoding="utf-8") as out:
            out.write(json.dumps({"source": source}) + "\n")
            out.writelines(json.dumps(asdict(r)) + "\n" for r in carried)
        os.replace(tmp, dst / JOURNAL_NAME)
        withdraw_complete(dst)
        self._file = open(dst / JOURNAL_NAME, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def append(self, record: FileRecord) -> None:
        line = json.dumps(asdict(record)) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


def withdraw_complete(dst: Path) -> None:
    """Remove ``dst/.complete`` before anything in ``dst`` changes."""
    (dst / COMPLETE_NAME).unlink(missing_ok=True)


def write_complete(dst: Path, source: str, records: list[FileRecord],
                   extra: dict | None = None) -> Path:
    """Atomically write ``dst/.complete`` and drop the journal it supersedes."""
    body = {
        "source": source,
        "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_bytes": sum(r.size for r in records),
        "files": [asdict(r) for r in sorted(records, key=lambda r: r.path)],
        **(extra or {}),
    }
    tmp = dst / (COMPLETE_NAME + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    os.replace(tmp, dst / COMPLETE_NAME)
    (dst / JOURNAL_NAME).unlink(missing_ok=True)
    return dst / COMPLETE_NAME
