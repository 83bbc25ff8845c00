"""Reading a torch.distributed.checkpoint without running what its files hold.

dcp's own reader unpickles ``.metadata`` with ``pickle.load`` and every non-tensor value in the
shards (the optimizer's ``lr``, ``betas``...) with ``torch.load(weights_only=False)``: bytes planted
in a checkpoint's prefix (by anyone who may write the bucket, a leaked key, or a trainer pod) would
run as code in every trainer rank on resume. Here nothing of a checkpoint is unpickled except by
an allow-list:

- ``.metadata`` by ``load_metadata``: only the classes dcp writes into it may be named, and the
  result must look as dcp writes it (shards named ``__<rank>_<n>.distcp``, no stream transforms)
  before dcp sees it;
- shard values and each rank's ``.pt`` by torch's weights-only unpickler (``load_weights_only``).

The bytes are still the bucket's: whoever may write it can change the weights that training
resumes from, but cannot run code in the trainers.
"""

from __future__ import annotations

import enum
import io
import pickle
import re
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

from kuberl.storage.errors import StorageError

METADATA = ".metadata"
# Every global a .metadata written by dcp.save names (torch 2.13; tests/engine/driver/test_checkpoint.py
# restores a real one), besides torch's dtypes. Each is a plain data class or a lookup: called
# with whatever arguments a pickle gives, none of them does I/O or runs code. (A pickle can still
# set attributes on what it builds, the enum's shared members included: bad data, never code.)
_METADATA_GLOBALS = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the directory dcp.save wrote to
})
# The shard files FileSystemWriter writes; a name with a "/" or ".." would read outside the step.
_SHARD = re.compile(r"__\d+_\d+\.distcp")
_TORCH_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_FIX = "delete this checkpoint, or resume from another one that kuberl wrote"


class _MetadataUnpickler(pickle.Unpickler):
    """pickle's documented way to restrict globals: every GLOBAL, STACK_GLOBAL, INST, OBJ and
    extension code resolves through ``find_class``; persistent ids are refused by default."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return _enum_member
        if (module, name) in _METADATA_GLOBALS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it names {module}.{name}, which dcp never writes into {METADATA}")


def _enum_member(cls: Any, name: Any) -> Any:
    """``builtins.getattr`` as a .metadata may use it: Python 3.11.13+ (the images' Python) pickles
    an enum member as ``getattr(EnumClass, "NAME")`` (``TensorProperties``' memory format,
    ``_MEM_FORMAT_ENCODING``). Only a member of an enum the allow-list let through is given; any
    other attribute of anything is refused."""
    if isinstance(cls, type) and issubclass(cls, enum.Enum) and isinstance(name, str) and name in cls.__members__:
        return cls[name]
    raise pickle.UnpicklingError(f"it asks for getattr({getattr(cls, '__name__', type(cls).__name__)}, {name!r}), "
                                 f"which is no member of an enum dcp writes")


def load_metadata(data: bytes, where: str) -> Metadata:
    """The dcp ``Metadata`` pickled in ``data`` (read from ``where``, which messages name),
    unpickled only through the allow-list and checked to be as dcp.save writes it."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any failure is a refusal
        raise StorageError(f"{where}: refusing to unpickle it: {exc} (a planted file there could run "
                           f"code in every trainer rank); {_FIX}") from None
    problem = _metadata_problem(metadata)
    if problem:
        raise StorageError(f"{where}: not a torch.distributed.checkpoint metadata file as kuberl writes it: "
                           f"{problem}; {_FIX}")
    return metadata


def _metadata_problem(metadata: Any) -> str | None:
    if not isinstance(metadata, Metadata):
        return f"it holds a {type(metadata).__name__}"
    if not isinstance(metadata.state_dict_metadata, dict) or not isinstance(metadata.storage_data, dict):
        return "no state_dict_metadata or storage_data mapping"
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo):
            return f"storage_data holds a {type(info).__name__}"
        if not (isinstance(info.relative_path, str) and _SHARD.fullmatch(info.relative_path)):
            return f"storage_data names the file {info.relative_path!r}, not a shard __<rank>_<n>.distcp"
        if info.transform_descriptors:
            return f"storage_data asks for stream transforms {info.transform_descriptors!r}"
    return None


def load_weights_only(data: bytes | io.BytesIO, where: str) -> Any:
    """``torch.load`` of untrusted bytes through torch's weights-only unpickler (tensors and
    plain containers), failures named by ``where``."""
    try:
        return torch.load(data if isinstance(data, io.BytesIO) else io.BytesIO(data), weights_only=True)
    except Exception as exc:  # noqa: BLE001 - untrusted bytes: any failure is a refusal
        # torch's own text advises weights_only=False, never what to do here: only its culprit is kept.
        culprit = _TORCH_GLOBAL.search(str(exc))
        reason = (f"it names {culprit.group(1)}, which torch's weights-only unpickler does not allow" if culprit
                  else f"not tensors and plain data as torch.save writes them ({type(exc).__name__})")
        raise StorageError(f"{where}: refusing to unpickle it: {reason} (a planted file there could run code "
                           f"in every trainer rank); {_FIX}") from None


class WeightsOnlyLoadPlanner(DefaultLoadPlanner):
    """dcp's default load planner, except that non-tensor values are unpickled weights-only (the
    default planner uses ``weights_only=False``). ``where``: the checkpoint's trainer directory,
    for messages."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        shard = self.metadata.storage_data[read_item.storage_index].relative_path
        loaded = load_weights_only(value, f"{self.where}/{shard} ({read_item.dest_index.fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _VettedMetadata:
    """A dcp reader that hands dcp the metadata ``load_metadata`` vetted beforehand, where dcp's
    own ``read_metadata`` would unpickle the file (and, failing that, a rank-local one)."""

    vetted: Metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.vetted.storage_meta is None:
            self.vetted.storage_meta = StorageMeta()
        self.vetted.storage_meta.load_id = self.load_id  # as dcp's own reader does
        return self.vetted


class _VettedFileSystemReader(_VettedMetadata, FileSystemReader):
    pass


class _VettedFsspecReader(_VettedMetadata, FsspecReader):
    pass


def vetted_reader(path: str, fs: Any, metadata: Metadata) -> FileSystemReader:
    """A dcp storage reader of the checkpoint directory ``path`` (through fsspec filesystem
    ``fs``, or the local filesystem when None) that uses ``metadata`` instead of reading it."""
    if fs is None:
        reader: FileSystemReader = _VettedFileSystemReader(path)
    else:
        # fsspec's own instance for the URL would not know kuberl's endpoint and credential
        # rules (kuberl.storage.filesystems): read through the same filesystem as the rest.
        reader = _VettedFsspecReader(path)
        reader.fs.fs = fs
        reader.path = path
    reader.vetted = metadata
    return reader
