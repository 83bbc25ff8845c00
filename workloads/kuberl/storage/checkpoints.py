"""Checkpoint layout on s3://, gs:// or a local path.

``<root>/step-<9-digit step>/`` holds one checkpoint. It is complete once its ``COMPLETE``
object (a JSON manifest) exists; COMPLETE is written after every other object is uploaded, and
``<root>/latest`` (text: the directory name) moves only after COMPLETE, so a reader never picks a
half-uploaded checkpoint, whatever moment the writer died at.

Writers that upload from several places (each trainer rank its own shards) call
``withdraw_from`` before anything of a step is written (a step written again, after resuming from
an older one or with ``resume: never`` on a reused root, must never look complete while it holds
a mix of old and new objects), then ``commit_records`` once every part is durable.

``<root>/epoch`` fences out a lost trainer group: every new group claims the next generation
number (``claim_epoch``), and a withdraw or a commit that names an older one is refused
(``StaleEpoch``): a rank of a group the driver has replaced can no longer change the root.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict
from pathlib import Path

from kuberl.storage import filesystems
from kuberl.storage.checksums import crc32c_of_bytes
from kuberl.storage.errors import StorageError, with_retries
from kuberl.storage.upload import upload_dir
from kuberl.api.uri import ParsedURI, parse

COMPLETE = "COMPLETE"
LATEST = "latest"
EPOCH = "epoch"
_STEP_DIR = re.compile(r"^step-(\d{9})$")


def checkpoint_dirname(step: int) -> str:
    if not 0 <= step < 10**9:
        raise ValueError(f"checkpoint step must be in [0, 1e9), got {step}")
    return f"step-{step:09d}"


def _write_small(fs, parsed: ParsedURI, path: str, data: bytes, uri: str) -> None:
    if parsed.is_cloud:  # an object PUT is atomic
        with_retries(lambda: fs.pipe_file(path, data), uri=uri)
        return
    tmp = Path(path + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def commit_checkpoint(local_dir: str | Path, root_uri: str, step: int) -> str:
    """Upload ``local_dir`` as checkpoint ``step`` under ``root_uri``; return its URI."""
    withdraw_from(root_uri, step)
    records = upload_dir(local_dir, parse(root_uri, "checkpoint.uri").join(checkpoint_dirname(step)))
    return commit_records(root_uri, step, [asdict(r) for r in records])


def step_uri(root_uri: str, step: int) -> str:
    return parse(root_uri, "checkpoint.uri").join(checkpoint_dirname(step))


class StaleEpoch(StorageError):
    """A rank of a trainer group that a newer group has replaced tried to change the root."""


# The epoch file holds a decimal number and a newline; more than this is not kuberl's.
EPOCH_MAX_BYTES = 32


def _stored_epoch(fs, root: str, uri: str) -> int:
    path = f"{root}/{EPOCH}"
    if not with_retries(lambda: fs.exists(path), uri=uri):
        return 0
    # Only the head: the bucket's owner, not kuberl, decides what the file holds.
    head = with_retries(lambda: fs.cat_file(path, start=0, end=EPOCH_MAX_BYTES + 1), uri=uri)
    text = head.decode("ascii", errors="replace").strip()
    if len(head) > EPOCH_MAX_BYTES or not text.isdigit():
        raise StorageError(f"{uri}/{EPOCH}: not a trainer-group epoch (kuberl writes a number there: "
                           f"found {text[:EPOCH_MAX_BYTES]!r}); it fences replaced trainer groups out of "
                           f"the root. Delete it (only while no job writes checkpoints under {uri}) or "
                           f"point checkpoint.uri at a root of its own")
    return int(text)


def claim_epoch(root_uri: str) -> int:
    """A new trainer group's generation number under ``root_uri``: one more than the last group's
    (across attempts too, as the number lives in the store). From now on that group's ranks are
    fenced out (``check_epoch``)."""
    parsed = parse(root_uri, "checkpoint.uri")
    fs = filesystems.filesystem(parsed)
    root = filesystems.root_path(parsed)
    if not parsed.is_cloud:
        fs.makedirs(root, exist_ok=True)
    epoch = _stored_epoch(fs, root, root_uri) + 1
    _write_small(fs, parsed, f"{root}/{EPOCH}", f"{epoch}\n".encode(), root_uri)
    return epoch


def check_epoch(root_uri: str, epoch: int | None, what: str) -> None:
    """Refuse ``what`` (a write to the root) by a group of ``epoch`` once a newer group has claimed
    the root; ``None``: a writer outside any trainer group (``commit_checkpoint``), not fenced."""
    if epoch is None:
        return
    parsed = parse(root_uri, "checkpoint.uri")
    current = _stored_epoch(filesystems.filesystem(parsed), filesystems.root_path(parsed), root_uri)
    if current > epoch:
        raise StaleEpoch(f"{root_uri}: {what} refused: it comes from trainer group epoch {epoch}, which a new "
                         f"group (epoch {current}) replaced after a trainer rank was lost; only the new group "
                         f"writes checkpoints")


def withdraw_from(root_uri: str, step: int, epoch: int | None = None) -> list[str]:
    """Before checkpoint ``step`` is written: delete it and every complete checkpoint after it
    (a later step under this root belongs to a run that this one replaces), each COMPLETE first
    so that a half-deleted checkpoint never looks complete. Returns the URIs removed. ``epoch``:
    the writing trainer group's (``check_epoch``)."""
    check_epoch(root_uri, epoch, f"withdrawing checkpoint step {step}")
    parsed = parse(root_uri, "checkpoint.uri")
    fs = filesystems.filesystem(parsed)
    root = filesystems.root_path(parsed)
    removed = []
    for later in [s for s in _complete_steps(fs, root, root_uri) if s >= step]:
        _remove_step(fs, root, later, complete=True, uri=root_uri)
        removed.append(parsed.join(checkpoint_dirname(later)))
    path = f"{root}/{checkpoint_dirname(step)}"
    if with_retries(lambda: fs.exists(path), uri=root_uri):  # an earlier, incomplete attempt
        _remove_step(fs, root, step, complete=False, uri=root_uri)
    return removed


def _remove_step(fs, root: str, step: int, *, complete: bool, uri: str) -> None:
    path = f"{root}/{checkpoint_dirname(step)}"
    if complete:
        with_retries(lambda: fs.rm_file(f"{path}/{COMPLETE}"), uri=uri)
    try:
        with_retries(lambda: fs.rm(path, recursive=True), uri=uri)
    except StorageError:
        if with_retries(lambda: fs.exists(path), uri=uri):
            raise


def commit_records(root_uri: str, step: int, files: list[dict], extra: dict[str, bytes] | None = None,
                   epoch: int | None = None) -> str:
    """Commit checkpoint ``step`` whose ``files`` (FileRecord dicts, paths relative to the step)
    are all durable: write ``extra`` (small files, e.g. the driver's state), then COMPLETE, then
    move ``latest``. Returns the checkpoint's URI. ``epoch``: the committing trainer group's,
    checked before COMPLETE and again before ``latest`` moves (``check_epoch``)."""
    what = f"committing checkpoint step {step}"
    check_epoch(root_uri, epoch, what)
    parsed = parse(root_uri, "checkpoint.uri")
    name = checkpoint_dirname(step)
    uri = parsed.join(name)
    fs = filesystems.filesystem(parsed)
    root = filesystems.root_path(parsed)
    files = list(files)
    if not parsed.is_cloud:
        fs.makedirs(f"{root}/{name}", exist_ok=True)
    for rel, data in (extra or {}).items():
        _write_small(fs, parsed, f"{root}/{name}/{rel}", data, uri)
        files.append({"path": rel, "size": len(data), "etag": None, "checksum": "size",
                      "crc32c": crc32c_of_bytes(data)})
    manifest = {
        "step": step,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "total_bytes": sum(f["size"] for f in files),
        "files": sorted(files, key=lambda f: f["path"]),
    }
    _write_small(fs, parsed, f"{root}/{name}/{COMPLETE}",
                 (json.dumps(manifest, indent=1) + "\n").encode(), uri)
    check_epoch(root_uri, epoch, what)
    _write_small(fs, parsed, f"{root}/{LATEST}", name.encode(), root_uri)
    return uri


def _complete_steps(fs, root: str, uri: str) -> list[int]:
    found = with_retries(lambda: fs.glob(f"{root}/step-*/{COMPLETE}"), uri=uri)
    steps = []
    for path in found:
        match = _STEP_DIR.match(path.rstrip("/").split("/")[-2])
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def latest_checkpoint(root_uri: str) -> str | None:
    """The URI of the newest complete checkpoint under ``root_uri``, or None if there is none."""
    parsed = parse(root_uri, "checkpoint.uri")
    fs = filesystems.filesystem(parsed)
    root = filesystems.root_path(parsed)
    try:
        pointed = with_retries(lambda: fs.cat_file(f"{root}/{LATEST}"), uri=root_uri)
    except StorageError:  # no readable pointer: fall back to the listing
        pointed = b""
    name = pointed.decode("utf-8", "replace").strip()
    if _STEP_DIR.match(name) and with_retries(lambda: fs.exists(f"{root}/{name}/{COMPLETE}"),
                                              uri=root_uri):
        return parsed.join(name)
    steps = _complete_steps(fs, root, root_uri)
    return parsed.join(checkpoint_dirname(steps[-1])) if steps else None


def checkpoint_to_restore(uri: str) -> str | None:
    """``uri`` names one checkpoint (``.../step-<n>``) or a checkpoint root: the checkpoint to
    restore, or None when the root has no complete one yet (a first run)."""
    parsed = parse(uri, "checkpoint.resume")
    if not _STEP_DIR.match(parsed.path.rstrip("/").rsplit("/", 1)[-1]):
        return latest_checkpoint(uri)
    fs = filesystems.filesystem(parsed)
    if not with_retries(lambda: fs.exists(f"{filesystems.root_path(parsed)}/{COMPLETE}"), uri=uri):
        raise StorageError(f"{uri}: this checkpoint has no {COMPLETE} marker (its upload never finished); "
                           f"resume from its root to take the newest complete one")
    return uri


def prune_checkpoints(root_uri: str, keep: int) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints, and incomplete ones older than
    the newest complete one (abandoned attempts; a newer incomplete one may still be uploading).
    Returns the URIs removed."""
    if keep < 1:
        raise ValueError(f"checkpoint.keep must be >= 1, got {keep}")
    parsed = parse(root_uri, "checkpoint.uri")
    fs = filesystems.filesystem(parsed)
    root = filesystems.root_path(parsed)
    complete = _complete_steps(fs, root, root_uri)
    if not complete:
        return []
    kept = set(complete[-keep:])
    try:
        entries = with_retries(lambda: fs.ls(root, detail=False), uri=root_uri)
    except StorageError:  # the root vanished since the glob: nothing to prune
        return []
    removed = []
    for entry in sorted(entries):
        match = _STEP_DIR.match(entry.rstrip("/").split("/")[-1])
        if not match:
            continue
        step = int(match.group(1))
        if step in kept or (step not in complete and step > complete[-1]):
            continue
        # COMPLETE goes first, so a half-deleted checkpoint never looks complete.
        _remove_step(fs, root, step, complete=step in complete, uri=root_uri)
        removed.append(parsed.join(checkpoint_dirname(step)))
    return removed
