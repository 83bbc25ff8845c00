"""Checkpoints of the whole training state, written by every trainer rank on its own: no
filesystem is shared between ranks, or between the ranks and the driver.

A checkpoint ``<root>/step-<n>/`` holds
- ``trainer/``: the model and optimizer shards (torch.distributed.checkpoint: each rank writes its
  own ``__<rank>_0.distcp``, rank 0 the ``.metadata``) and, per rank, its scheduler, step counters
  and every RNG state (``trainer_rank<r>_of<world>.pt``); with ``format: tar`` each rank's part
  packed into one uncompressed ``trainer-rank<r>.tar`` instead (never gzip: multi-GB FSDP
  checkpoints took minutes to compress for almost no gain);
- ``driver.json`` (step, weight version), written at commit;
- ``COMPLETE``, the manifest of every file, written last; then ``<root>/latest`` moves.

Saving (``RankCheckpointer.save``, collective): rank 0 first withdraws any earlier copy of the
step (``kuberl.storage.withdraw_from``); then each rank hands its live state to a background
thread that writes it into the rank's own scratch directory and uploads it. Training goes on at
once: the state is not copied, so the rank's next optimizer step waits (``fence``) until the
write has read it; the rollout of the next step, which never touches the trainer's state,
overlaps the write, and the upload overlaps everything. The driver (``CheckpointManager``) waits
in a thread of its own for every rank's upload to be durable, then has rank 0 commit, then prune.

Restoring (``RankCheckpointer.load``, collective) reads straight from the checkpoint URI on
every rank (byte ranges through fsspec for s3/gs; the mounted path for pvc and local roots).
"""

from __future__ import annotations

import copy
import io
import json
import logging
import shutil
import tarfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from kuberl import metrics as pod_metrics
from kuberl.plan import Checkpoints, Resume
from kuberl.storage import (checkpoint_to_restore, commit_records, latest_checkpoint, prune_checkpoints, stage,
                            step_uri, upload_dir, verify_checkpoint, withdraw_from)
from kuberl.storage import filesystems
from kuberl.storage.errors import StorageError, with_retries
from kuberl.uri import parse

log = logging.getLogger("kuberl.train")
DRIVER_STATE = "driver.json"
TRAINER_DIR = "trainer"
# tarfile copies members in 16 KiB blocks by default: packing a 2.5 GB trainer dir took ~2.3 s
# instead of ~0.7 s with 1 MiB blocks (bench/checkpoint.py).
TAR_COPY_BUFSIZE = 1 << 20
# The Ray concurrency group the driver's waits and rank 0's commit run in, beside training.
CONCURRENCY_GROUP = "checkpoint"


def extra_name(rank: int, world_size: int) -> str:
    return f"trainer_rank{rank}_of{world_size}.pt"


def tar_name(rank: int) -> str:
    return f"trainer-rank{rank}.tar"


def fetch_tar_parts(uri: str, world_size: int, local: Path) -> Path:
    """Stage every rank's tar of checkpoint ``uri`` into its own directory below ``local`` (the
    stager's one safe extraction: no links, devices or sparse members, sizes bounded) and gather
    their trainer files; returns that trainer directory."""
    shutil.rmtree(local, ignore_errors=True)
    trainer = local / TRAINER_DIR
    for rank in range(world_size):
        stage(parse(uri).join(tar_name(rank)), local / str(rank))
        trainer.mkdir(parents=True, exist_ok=True)
        for item in (local / str(rank) / TRAINER_DIR).iterdir():
            item.replace(trainer / item.name)
    return trainer


def find_checkpoint(resume: Resume) -> str | None:
    """The checkpoint a run restores, from the plan alone: the newest complete one under the
    job's own root, else the one the spec names (which must be complete), else none."""
    if resume.newest_under:
        found = latest_checkpoint(resume.newest_under)
        if found:
            return found
    if resume.explicit:
        found = checkpoint_to_restore(resume.explicit)
        if found is None:
            raise StorageError(f"spec.checkpoint.resume {resume.explicit}: no complete checkpoint there; "
                               f"point it at a step-<n> checkpoint or a root that has one, or use auto")
        return found
    return None


class RankCheckpointer:
    """One trainer rank's side of checkpoints. ``worker`` is its ``TrainerWorker``; ``scratch``
    a directory no other rank uses (in a pod: under the pod's own emptyDir)."""

    def __init__(self, worker: Any, checkpoints: Checkpoints, scratch: Path):
        import torch.distributed as dist

        self.worker = worker
        self.spec = checkpoints
        self.scratch = Path(scratch)
        self.rank, self.world_size = worker.rank, worker.world_size
        # dcp's own collectives run from the writer thread while training issues others on the
        # default group: a group of their own keeps the two orders apart (gloo: dcp exchanges
        # only plans and metadata, small Python objects).
        self.group = dist.new_group(backend="gloo")
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-write")
        self._written = threading.Event()
        self._written.set()
        self._uploads: dict[int, Future] = {}

    # --- saving ------------------------------------------------------------------------------

    def fence(self) -> None:
        """Block until the last save has read the live state: call before changing it."""
        self._written.wait()

    def save(self, step: int) -> float:
        """Start checkpoint ``step`` of this rank (collective). Returns the seconds it blocked."""
        import torch.distributed as dist

        started = time.perf_counter()
        self.fence()
        if self.rank == 0:
            withdraw_from(self.spec.root, step)
        dist.barrier()  # nothing of the step is uploaded before rank 0 withdrew the old one
        state, extra = self.worker.checkpoint_state()
        local = self.scratch / f"step-{step}"
        shutil.rmtree(local, ignore_errors=True)
        local.mkdir(parents=True)
        self._written.clear()
        self._uploads[step] = self._writer.submit(self._write_and_upload, step, state, extra, local)
        return time.perf_counter() - started

    def _write_and_upload(self, step: int, state: dict, extra: dict, local: Path) -> list[dict]:
        import torch
        import torch.distributed.checkpoint as dcp

        try:
            started = time.perf_counter()
            if self.worker.device.type == "cuda":
                torch.cuda.set_device(self.worker.device)
            trainer_dir = local / TRAINER_DIR
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(trainer_dir)), process_group=self.group)
            torch.save(extra, trainer_dir / extra_name(self.rank, self.world_size))
        finally:
            self._written.set()
        if self.spec.format == "tar":
            with tarfile.open(local / tar_name(self.rank), "w", copybufsize=TAR_COPY_BUFSIZE) as tar:
                tar.add(trainer_dir, arcname=TRAINER_DIR)
            shutil.rmtree(trainer_dir)
        nbytes = sum(f.stat().st_size for f in local.rglob("*") if f.is_file())
        pod_metrics.record_checkpoint(time.perf_counter() - started, nbytes)
        try:
            records = upload_dir(local, step_uri(self.spec.root, step))
        finally:
            shutil.rmtree(local, ignore_errors=True)
        return [asdict(r) for r in records]

    def uploaded(self, step: int) -> list[dict]:
        """This rank's files of checkpoint ``step``, once durable in the store; raises what the
        write or the upload raised."""
        return self._uploads.pop(step).result()

    def commit(self, step: int, files: list[dict], driver_state: dict) -> str:
        """Rank 0, after every rank's ``uploaded``: COMPLETE, ``latest``, then keep-N pruning."""
        extra = {DRIVER_STATE: (json.dumps({**driver_state, "step": step}, indent=1) + "\n").encode()}
        uri = commit_records(self.spec.root, step, files, extra)
        prune_checkpoints(self.spec.root, self.spec.keep)
        return uri

    def close(self) -> None:
        """Wait for the writes and uploads under way (their errors are the driver's to see)."""
        self._writer.shutdown(wait=True)

    # --- restoring ---------------------------------------------------------------------------

    def load(self, uri: str) -> dict:
        """Restore checkpoint ``uri`` into this rank (collective); returns the driver's state."""
        import torch

        self.fence()
        parsed = parse(uri, "checkpoint")
        fs = filesystems.filesystem(parsed)
        base = filesystems.root_path(parsed)
        local = None
        try:
            # Read in place, so verified first: exactly the files COMPLETE lists, at their sizes.
            try:
                verify_checkpoint(uri)
                refused = None
            except StorageError as err:
                refused = str(err)
            self._all_or_none(refused)
            if self.spec.format == "tar" or with_retries(lambda: fs.exists(f"{base}/{tar_name(0)}"), uri=uri):
                # One tar per rank: this rank fetches every rank's part (dcp may read any of them).
                local = self.scratch / "restore"
                reader_path, reader_fs = str(fetch_tar_parts(uri, self.world_size, local)), None
            else:
                reader_path, reader_fs = f"{base}/{TRAINER_DIR}", (fs if parsed.is_cloud else None)
            extra_path = f"{reader_path}/{extra_name(self.rank, self.world_size)}"
            extra_fs = reader_fs or filesystems.filesystem(parse("/", "local path"))
            self._require(extra_fs, extra_path, uri)
            extra = torch.load(io.BytesIO(with_retries(lambda: extra_fs.cat_file(extra_path), uri=uri)),
                               weights_only=True)
            self.worker.restore_state(lambda state: self._dcp_load(state, reader_path, reader_fs), extra)
        finally:
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)
        return json.loads(with_retries(lambda: fs.cat_file(f"{base}/{DRIVER_STATE}"), uri=uri))

    def _require(self, fs, path: str, uri: str) -> None:
        """Every rank finds its own part, or all raise together."""
        found = with_retries(lambda: fs.exists(path), uri=uri)
        self._all_or_none(None if found else (
            f"{uri}: trainer rank {self.rank} finds no {extra_name(self.rank, self.world_size)}: the "
            f"checkpoint was written by a different number of trainer ranks; resume with the same world size"))

    def _all_or_none(self, problem: str | None) -> None:
        """Every rank goes on, or every rank raises, naming every rank's problem: a rank raising
        alone would leave the others waiting in the next collective (ranks can disagree: each
        lists the store itself)."""
        import torch.distributed as dist

        problems: list[str | None] = [None] * self.world_size
        dist.all_gather_object(problems, problem, group=self.group)
        if any(problems):
            raise StorageError("; ".join(dict.fromkeys(p for p in problems if p)))

    def _dcp_load(self, state: dict, path: str, fs) -> None:
        import torch.distributed.checkpoint as dcp

        if fs is None:
            reader = dcp.FileSystemReader(path)
        else:
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

            # fsspec's own instance for the URL would not know kuberl's endpoint and credential
            # rules (kuberl.storage.filesystems): read through the same filesystem as the rest.
            reader = FsspecReader(path)
            reader.fs.fs = fs
            reader.path = path
        dcp.load(state, storage_reader=reader, process_group=self.group)


class CheckpointManager:
    """The driver's side: when to save, and the commit that follows every rank's upload.

    ``trainer`` is the ``TrainerGroup`` (``save_checkpoint``, ``checkpoint_uploaded``,
    ``commit_checkpoint``, ``find_checkpoint``, ``load_checkpoint``)."""

    def __init__(self, checkpoints: Checkpoints, resume: Resume, trainer: Any,
                 on_committed: Callable[[str, int], None] = lambda uri, step: None):
        self.spec = checkpoints
        self.resume = resume
        self.trainer = trainer
        self.on_committed = on_committed
        self._committer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-commit")
        self._pending: Future | None = None

    @property
    def enabled(self) -> bool:
        return self.spec.root is not None

    def due(self, step: int) -> bool:
        return self.enabled and step % self.spec.interval_steps == 0

    def save(self, step: int, driver_state: dict[str, Any]) -> float:
        """Start checkpoint ``step`` on every rank; commit it in the background once all are
        durable. Returns the stall training saw."""
        self.wait()  # one checkpoint in flight at a time; also surfaces the previous one's error
        stall = self.trainer.save_checkpoint(step)
        self._pending = self._committer.submit(self._commit, step, copy.deepcopy(driver_state))
        return stall

    def _commit(self, step: int, driver_state: dict) -> str:
        files = self.trainer.checkpoint_uploaded(step)
        uri = self.trainer.commit_checkpoint(step, files, driver_state)
        self.on_committed(uri, step)
        return uri

    def wait(self) -> str | None:
        """Block until the pending checkpoint is committed; re-raise its error."""
        pending, self._pending = self._pending, None
        return pending.result() if pending else None

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._committer.shutdown(wait=True)

    def restore(self) -> dict[str, Any] | None:
        """Restore what the plan says into every rank; the driver's state, or None (fresh run)."""
        source = self.trainer.find_checkpoint(self.resume)
        if source is None:
            return None
        state = self.trainer.load_checkpoint(source)
        log.info("resumed from %s (step %d)", source, state["step"])
        return state
