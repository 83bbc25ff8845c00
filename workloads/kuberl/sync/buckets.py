"""Weights on the wire: parameter metadata, size-bounded buckets, and packing into flat buffers.

Sender and receivers compute the same bucket plan from the same metadata, so a bucket is sent as
one flat byte buffer with no per-bucket header; the receiver cuts it into views by offset.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Offsets inside a bucket are aligned so that every dtype view of the byte buffer is legal.
ALIGN = 16


@dataclass(frozen=True)
class ParamMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * self.torch_dtype.itemsize


def to_wire(metas: list[ParamMeta]) -> list[list]:
    """Plain lists: vLLM's RPC serializer turns dataclasses into dicts on the way to its workers."""
    return [[m.name, list(m.shape), m.dtype] for m in metas]


def from_wire(items: list) -> list[ParamMeta]:
    out = []
    for item in items:
        if isinstance(item, ParamMeta):
            out.append(item)
        elif isinstance(item, dict):
            out.append(ParamMeta(item["name"], tuple(item["shape"]), item["dtype"]))
        else:
            name, shape, dtype = item
            out.append(ParamMeta(name, tuple(shape), dtype))
    return out


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class Bucket:
    metas: tuple[ParamMeta, ...]
    offsets: tuple[int, ...]
    nbytes: int


def plan_buckets(metas: list[ParamMeta], bucket_bytes: int) -> list[Bucket]:
    """Consecutive parameters grouped into buckets of at most ``bucket_bytes`` (a larger tensor
    travels alone in its own bucket)."""
    if bucket_bytes <= 0:
        raise ValueError(f"weightSync.bucketSizeMB must be positive, got {bucket_bytes} bytes")
    buckets: list[Bucket] = []
    cur: list[ParamMeta] = []
    offsets: list[int] = []
    size = 0
    for meta in metas:
        need = _aligned(meta.nbytes)
        if cur and size + need > bucket_bytes:
            buckets.append(Bucket(tuple(cur), tuple(offsets), size))
            cur, offsets, size = [], [], 0
        cur.append(meta)
        offsets.append(size)
        size += need
    if cur:
        buckets.append(Bucket(tuple(cur), tuple(offsets), size))
    return buckets


def pack(bucket: Bucket, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
    """Copy ``tensors`` (in ``bucket.metas`` order) into the uint8 buffer ``out``."""
    if len(tensors) != len(bucket.metas):
        raise ValueError(f"bucket holds {len(bucket.metas)} parameters, got {len(tensors)} tensors")
    for meta, offset, tensor in zip(bucket.metas, bucket.offsets, tensors):
        if tuple(tensor.shape) != meta.shape or tensor.dtype != meta.torch_dtype:
            raise ValueError(f"{meta.name}: expected {meta.shape} {meta.dtype}, got "
                             f"{tuple(tensor.shape)} {dtype_name(tensor.dtype)}")
        view(bucket, out, meta, offset).copy_(tensor)
    return out


def view(bucket: Bucket, buf: torch.Tensor, meta: ParamMeta, offset: int) -> torch.Tensor:
    return buf[offset:offset + meta.nbytes].view(meta.torch_dtype).view(meta.shape)


def unpack(bucket: Bucket, buf: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) views into ``buf``, in the order the sender packed them."""
    if buf.numel() < bucket.nbytes:
        raise ValueError(f"bucket buffer has {buf.numel()} bytes, the plan needs {bucket.nbytes}")
    return [(meta.name, view(bucket, buf, meta, offset))
            for meta, offset in zip(bucket.metas, bucket.offsets)]
