"""CUDA IPC handles: colocated trainer and engine share GPU buffers without copying them.

``share`` runs in the trainer process, ``open_handle`` in the vLLM worker on the same GPU. The
handle carries the sender's CUDA device index; the receiver substitutes its own, because
each process numbers the GPUs it sees from 0 (CUDA_VISIBLE_DEVICES differs between them).
"""

from __future__ import annotations

import pickle

import torch

# Position of the device index in the argument tuple of torch's CUDA tensor rebuild function.
_DEVICE_ARG = 6


def share(buf: torch.Tensor) -> bytes:
    """A handle to the CUDA tensor ``buf`` (which the caller keeps alive), pickled to bytes:
    vLLM's RPC serializer passes bytes through but not the rebuild function inside the handle."""
    from torch.multiprocessing.reductions import reduce_tensor

    if buf.device.type != "cuda":
        raise ValueError("weightSync.method ipc shares CUDA memory; the trainer's tensors are on "
                         f"{buf.device} (use nccl or checkpoint without GPUs)")
    return pickle.dumps(reduce_tensor(buf))


def open_handle(handle: bytes, device: torch.device) -> torch.Tensor:
    # Only ever a handle made by ``share`` in this job's own trainer process.
    rebuild, args = pickle.loads(handle)
    args = list(args)
    args[_DEVICE_ARG] = device.index if device.index is not None else torch.cuda.current_device()
    return rebuild(*args)
