"""The one tar extraction in kuberl: ``kuberl stage X.tar`` and checkpoint restore both use it.

It does not rely on tarfile's ``filter='data'``: the Pythons the images and venvs ran before
3.11.13 / 3.12.11 / 3.13.4 let a chain of symlink members write outside the target through that
filter. kuberl's own archives (``tar.add`` of a checkpoint directory) hold only directories and
regular files, so everything else is refused before a byte is written:

- links of either kind, devices, FIFOs and sparse members;
- names that are absolute, hold '.', '..' or empty segments, backslashes or NUL, or that stage()
  reserves for its bookkeeping (a leading ``./``, as ``tar -C dir .`` writes, is accepted);
- a member whose declared data does not lie inside the archive file (a 10 KiB archive cannot
  declare 1 TiB), and names that appear twice.

Files are then written by this module, not by tarfile: each directory on the way is created here
(and must be a real directory, never a symlink), each file is opened with ``O_EXCL|O_NOFOLLOW``,
so nothing that already exists below ``dest`` is overwritten or followed.
"""

from __future__ import annotations

import os
import shutil
import stat
import tarfile
from dataclasses import dataclass
from pathlib import Path

from kuberl.storage.errors import StorageError
from kuberl.storage.safepath import relpath_problem

COPY_BUFSIZE = 1 << 20


@dataclass(frozen=True)
class Member:
    path: str   # '/'-separated, relative to the destination
    size: int


def _member_name(member: tarfile.TarInfo, source: str) -> str | None:
    """The checked relative path of ``member``; None for the archive's own root (``.``)."""
    name = member.name
    while name.startswith("./"):
        name = name[2:]
    name = name.rstrip("/") if member.isdir() else name
    if name in ("", "."):
        return None
    problem = relpath_problem(name)
    if problem:
        raise StorageError(f"{source}: refusing archive member {member.name!r}: {problem}; "
                           f"nothing was unpacked")
    return name


def _kind(member: tarfile.TarInfo) -> str:
    if member.issym() or member.islnk():
        return f"a link to {member.linkname!r}"
    if member.ischr() or member.isblk():
        return "a device"
    if member.isfifo():
        return "a FIFO"
    if member.issparse():
        return "a sparse file"
    return f"of tar type {member.type!r}"


def checked_members(tar: tarfile.TarFile, archive_size: int, source: str) -> list[tuple[tarfile.TarInfo, str]]:
    """Every member of ``tar`` with its checked path, or StorageError naming the first bad one."""
    out: list[tuple[tarfile.TarInfo, str]] = []
    seen: set[str] = set()
    # Checked as tarfile reads each header: a member declaring more data than the archive holds
    # is refused before tarfile trips over the missing bytes.
    for member in tar:
        regular = member.isfile() and not member.issparse()
        if not (regular or member.isdir()):
            raise StorageError(f"{source}: refusing archive member {member.name!r}: it is {_kind(member)}; "
                               f"only directories and regular files are unpacked (kuberl's own archives "
                               f"hold nothing else); nothing was unpacked")
        rel = _member_name(member, source)
        if regular and member.offset_data + member.size > archive_size:
            raise StorageError(f"{source}: refusing archive member {member.name!r}: it declares "
                               f"{member.size} bytes, more than the {archive_size}-byte archive holds; "
                               f"the archive is truncated or crafted; nothing was unpacked")
        if rel is None:
            continue
        if rel in seen:
            raise StorageError(f"{source}: refusing archive member {member.name!r}: the name appears "
                               f"twice; nothing was unpacked")
        seen.add(rel)
        out.append((member, rel))
    return out


def _real_dir(path: Path, source: str) -> None:
    """Create directory ``path`` or accept it only when it is a real directory (not a symlink)."""
    try:
        os.mkdir(path, 0o755)
        return
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(path).st_mode):
        raise StorageError(f"{source}: refusing to unpack into {path}: it exists and is not a "
                           f"directory (a symlink is never followed)")


def extract_tar(archive: str | Path, dest: str | Path, source: str) -> list[Member]:
    """Unpack uncompressed tar ``archive`` into existing directory ``dest``; return the files written.

    ``source`` names the archive in messages (its URI). Every member is checked before the first
    is written: a refused archive (StorageError naming the member and the reason) writes nothing.
    An archive whose data ends early fails part-way, so callers unpack into a fresh directory.
    """
    archive, dest = Path(archive), Path(dest)
    try:
        with tarfile.open(archive, mode="r:") as tar:
            members = checked_members(tar, archive.stat().st_size, source)
            written = []
            for member, rel in members:
                parts = rel.split("/")
                directory = dest
                for part in parts[:-1] if member.isfile() else parts:
                    directory = directory / part
                    _real_dir(directory, source)
                if member.isdir():
                    continue
                target = dest.joinpath(*parts)
                fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with os.fdopen(fd, "wb") as out, tar.extractfile(member) as data:
                    shutil.copyfileobj(data, out, COPY_BUFSIZE)
                    if out.tell() != member.size:
                        raise StorageError(f"{source}: archive member {member.name!r} declares "
                                           f"{member.size} bytes but holds {out.tell()}; the archive is "
                                           f"truncated")
                written.append(Member(rel, member.size))
    except tarfile.ReadError as exc:
        raise StorageError(f"{source}: not an uncompressed tar archive ({exc}); checkpoints are "
                           f"stored as plain .tar (gzip costs minutes on multi-GB checkpoints)") from exc
    except tarfile.TarError as exc:
        raise StorageError(f"{source}: damaged tar archive: {exc}") from exc
    except FileExistsError as exc:
        raise StorageError(f"{source}: refusing to unpack {exc.filename}: it already exists "
                           f"(nothing is overwritten)") from exc
    except OSError as exc:
        raise StorageError(f"{source}: unpacking into {dest} failed: {exc}") from exc
    return written
