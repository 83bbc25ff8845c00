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
    checksum: str        # what was verified beyond the size: "md5" or "size"


def load_verified(dst: Path) -> dict[str, FileRecord]:
    """Files recorded as verified by an earlier run, from ``.complete`` and the journal."""
    records: dict[str, FileRecord] = {}
    complete = dst / COMPLETE_NAME
    try:
        for item in json.loads(complete.read_text())["files"]:
            records[item["path"]] = FileRecord(**item)
    except FileNotFoundError:
        pass
    except (ValueError, KeyError, TypeError):
        pass  # a damaged marker proves nothing: every file is checked against the listing again
    try:
        lines = (dst / JOURNAL_NAME).read_text().splitlines()
    except FileNotFoundError:
        lines = []
    for line in lines:
        try:
            record = FileRecord(**json.loads(line))
        except (ValueError, TypeError):
            continue  # the last line may be torn by a kill mid-write
        records[record.path] = record
    return records


class Journal:
    """Appends one JSON line per verified file; safe to call from many threads."""

    def __init__(self, dst: Path):
        self._file = open(dst / JOURNAL_NAME, "a", encoding="utf-8")
        self._lock = threading.Lock()

    def append(self, record: FileRecord) -> None:
        line = json.dumps(asdict(record)) + "\n"
        with self._lock:
            self._file.write(line)
            self._file.flush()

    def close(self) -> None:
        self._file.close()


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
