"""Mapping object keys to paths under a destination directory without ever leaving it."""

from __future__ import annotations

from pathlib import Path

from kuberl.storage.errors import StorageError

# Names stage() itself writes into a destination; a source object may not overwrite them.
COMPLETE_NAME = ".complete"
JOURNAL_NAME = ".kuberl-stage.journal"
PART_SUFFIX = ".kuberl-part"
RESERVED_TOP_LEVEL = {COMPLETE_NAME, JOURNAL_NAME}


def relpath_problem(rel: str) -> str | None:
    """Why ``rel`` (a '/'-separated path below a destination) may not be written, or None.

    Refuses absolute paths, '.', '..' and empty segments, backslashes and NUL bytes, and the names
    stage() reserves for its own bookkeeping.
    """
    parts = rel.split("/")
    if (not rel or rel.startswith("/") or "\\" in rel or "\x00" in rel
            or any(p in ("", ".", "..") for p in parts)):
        return "it would write outside the destination (absolute, '.', '..' or empty path segments)"
    if parts[0] in RESERVED_TOP_LEVEL or any(p.endswith(PART_SUFFIX) for p in parts):
        return "the name is reserved for kuberl's staging bookkeeping"
    return None


def checked_relpath(rel: str, uri: str) -> str:
    """Return ``rel`` (a key below the source root) if it stays inside DST (see relpath_problem)."""
    problem = relpath_problem(rel)
    if problem:
        raise StorageError(f"{uri}: refusing object key {rel!r}: {problem}")
    return rel


def target_path(dst: Path, rel: str, uri: str) -> Path:
    """The path of key ``rel`` under ``dst``; parent directories are created, and refused when a
    symlink already on disk would lead them outside ``dst``."""
    target = dst.joinpath(*rel.split("/"))
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.parent.resolve().is_relative_to(dst.resolve()):
        raise StorageError(f"{uri}: refusing object key {rel!r}: {target.parent} is a symlink "
                           f"that leads outside the destination {dst}")
    return target
