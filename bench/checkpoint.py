"""Checkpoint save and load through kuberl's path vs a plain sequential write and read of the same
bytes on the same disk, in the same run (issues 11 and 15).

One process, one gloo rank, CPU. The state: a stack of ``Linear(dim, dim)`` layers in fp32, each
``fully_shard``-ed (FSDP2, as the trainer does) on a 1-rank mesh, plus AdamW state made real by
one forward/backward/step, so model + exp_avg + exp_avg_sq come to ``--size-gb`` (grads freed).
What is timed is kuberl's own code, not a copy of it (``RankCheckpointer``, the trainer rank's side
of checkpoints, on the real ``TrainerWorker.checkpoint_state``/``restore_state``):

- stall (headline): ``RankCheckpointer.save`` returns; training goes on from here. The write
  runs in the background from the live state (no copy); the rank's next optimizer step waits for
  it (``fence``), so what training sees beyond the stall depends on what runs in between (in
  GRPO: the next rollout and log-probs, which never touch the trainer's state).
- written: until the background write has read the state (``fence`` returns): the stall an
  optimizer step would see if it came at once, i.e. a synchronous save.
- durable: until ``uploaded`` returns (written, packed for tar, copied to the checkpoint root) and
  ``commit`` wrote COMPLETE, ``latest`` and pruned with keep=1. The root is an absolute path on the
  same disk: what a user with ``pvc://`` or a mounted volume gets (object stores are left to
  bench/staging.py's servers). Format dcp and format tar.
- tar vs gzip: a trainer dir packed as ``RankCheckpointer`` packs it (uncompressed ``tarfile``) and
  with gzip (``--gzip-level``, default 6 as gzip(1)) for contrast.
- load: ``RankCheckpointer.load`` (straight from the root: dcp.load + set_state_dict + extra).
- reference: the same state tensors written back to back into one file (unbuffered ``write`` of
  each tensor's memory, then ``fsync``), and read back with ``readinto`` into the same tensors.

Page cache (no drop_caches: others share the machine): every write measurement ends with an
``fsync`` of each file it left on disk, inside the timed interval ("written": dcp.save fsyncs its
data files itself; "durable": the committed checkpoint). Before every read measurement the files
read are synced and evicted from the page cache with ``posix_fadvise(DONTNEED)`` (per file, no
root needed), so reads start cold in this VM. Loads are checked: the state is zeroed before each
load and compared with the saved values after.

GB/s everywhere is the state's tensor bytes over the wall time, so ratios are ratios of times.
Each timed row is the best of ``--repeat`` rounds (the median is shown too: a shared VM disk is
noisy), rows interleaved within a round; gzip runs once. Run it under ``nice`` on shared machines:

    nice .venv/bin/python bench/checkpoint.py [--size-gb 2.5] [--dir /tmp] [--json out.json]

The last line is the headline: the stall training sees as a fraction of the plain write's time
for the same bytes (goal <= 0.2).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from kuberl.common.ports import unclaimed_port

GOAL = 0.2


def _files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def fsync_tree(path: Path) -> None:
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def evict_tree(path: Path) -> None:
    """Sync, then drop these files' pages from the page cache (clean pages only, hence the sync)."""
    for f in _files(path):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in _files(path))


def mount_of(path: Path) -> str:
    """'<device> <fstype> (rotational=<0|1>)' of the mount holding ``path``."""
    path = str(Path(path).resolve())
    best = ("?", "?", "?")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            dev, mnt, fstype = line.split()[:3]
            if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best[1]):
                best = (dev, mnt, fstype)
    except OSError:
        pass
    rota = "?"
    name = Path(best[0]).name
    for candidate in (name, name.rstrip("0123456789")):
        flag = Path(f"/sys/block/{candidate}/queue/rotational")
        if flag.exists():
            rota = flag.read_text().strip()
            break
    return f"{best[0]} {best[2]} (rotational={rota})"


def build_state(size_bytes: int, dim: int):
    """An FSDP2 stack of Linear layers on a 1-rank CPU mesh and AdamW after one step; returns
    (model, optimizer, scheduler, tensors): tensors are the local shards of every parameter and
    optimizer state tensor (the bytes a checkpoint must carry)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    per_dim = lambda d: 12 * d * (d + 1)  # noqa: E731  fp32 weight + bias, x3 (param, exp_avg, exp_avg_sq)
    dim = max(8, min(dim, int((size_bytes / 12) ** 0.5)))
    layers = max(1, round(size_bytes / per_dim(dim)))
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (1,))
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.randn(2, dim)).square().mean().backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    tensors = []
    for p in model.parameters():
        tensors.append(local(p.detach()))
        for key in ("exp_avg", "exp_avg_sq"):
            tensors.append(local(optimizer.state[p][key]))
    return model, optimizer, scheduler, tensors, dim, layers


def fingerprint(tensors) -> list[float]:
    import torch

    return [float(t.sum(dtype=torch.float64)) for t in tensors]


def _view(t):
    return memoryview(t.numpy()).cast("B")


def plain_write(tensors, path: Path) -> int:
    """The reference: every tensor's bytes back to back into one file, unbuffered, then fsync."""
    total = 0
    with open(path, "wb", buffering=0) as f:
        for t in tensors:
            view = _view(t)
            while view:
                n = f.write(view)
                view = view[n:]
                total += n
        os.fsync(f.fileno())
    return total


def plain_read(tensors, path: Path) -> int:
    total = 0
    with open(path, "rb", buffering=0) as f:
        for t in tensors:
            view = _view(t)
            while view:
                n = f.readinto(view)
                if not n:
                    raise EOFError(f"{path} ended early")
                view = view[n:]
                total += n
    return total


def pack_tar(src: Path, dst: Path, mode: str, level: int | None = None) -> None:
    """As RankCheckpointer packs a rank's trainer dir (mode "w"), or with gzip for contrast."""
    from kuberl.train.checkpoint import TAR_COPY_BUFSIZE

    kwargs = {"compresslevel": level} if level is not None else {}
    with tarfile.open(dst, mode, copybufsize=TAR_COPY_BUFSIZE, **kwargs) as tar:
        tar.add(src, arcname=src.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gb", type=float, default=2.5,
                        help="model + AdamW state in GB (1e9 bytes); default 2.5")
    parser.add_argument("--dim", type=int, default=2048, help="Linear layer width (smaller for tiny sizes)")
    parser.add_argument("--dir", default=tempfile.gettempdir(),
                        help="where to write (the disk under test); default the temp dir")
    parser.add_argument("--repeat", type=int, default=5, help="rounds; each row reports its best")
    parser.add_argument("--gzip-level", type=int, default=6)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    args = parser.parse_args(argv)

    import torch
    import torch.distributed as dist

    from kuberl.job.plan import Checkpoints
    from kuberl.train.checkpoint import TRAINER_DIR, RankCheckpointer
    from kuberl.train.worker import TrainerConfig, TrainerWorker

    class BenchWorker(TrainerWorker):
        """The real checkpoint_state/restore_state on a state built here (no model, no Ray)."""

        def __init__(self, model, optimizer, scheduler):  # noqa: D107 - deliberately not super()
            self.rank, self.world_size, self.device = 0, 1, torch.device("cpu")
            self.config = TrainerConfig()  # the defaults: the whole model trains (no LoRA)
            self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
            self.optimizer_steps, self.skipped_steps = 1, 0
            self.before_update = lambda: None

    own_group = not dist.is_initialized()
    if own_group:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{unclaimed_port()}", rank=0,
                                world_size=1)
    elif dist.get_world_size() != 1:
        raise SystemExit("run this benchmark in a process without a multi-rank process group")
    work = Path(tempfile.mkdtemp(prefix="kuberl-ckpt-bench-", dir=args.dir))
    try:
        model, optimizer, scheduler, tensors, dim, layers = build_state(int(args.size_gb * 1e9), args.dim)
        worker = BenchWorker(model, optimizer, scheduler)
        state_bytes = sum(t.numel() * t.element_size() for t in tensors)
        expected = fingerprint(tensors)

        def zero_state():
            for t in tensors:
                t.zero_()

        def check_loaded(what):
            if fingerprint(tensors) != expected:
                raise SystemExit(f"{what} did not restore the saved state")

        samples: dict[str, list[float]] = {}
        facts: dict[str, int] = {}

        def record(name, seconds):
            samples.setdefault(name, []).append(seconds)

        plain = work / "plain.bin"
        roots = {fmt: work / f"root-{fmt}" for fmt in ("dcp", "tar")}
        savers = {fmt: RankCheckpointer(worker, Checkpoints(root=str(roots[fmt]), interval_steps=1, keep=1, format=fmt,
                                                            export_hugging_face=False, export_uri=None),
                                        work / f"scratch-{fmt}")
                  for fmt in ("dcp", "tar")}
        step = 0
        try:
            for _ in range(args.repeat):
                # reference write
                plain.unlink(missing_ok=True)
                t0 = time.perf_counter()
                facts["plain_file_bytes"] = plain_write(tensors, plain)
                record("plain write", time.perf_counter() - t0)

                for fmt, saver in savers.items():
                    step += 1
                    t0 = time.perf_counter()
                    saver.save(step)
                    t1 = time.perf_counter()
                    saver.fence()  # dcp.save fsyncs the data files it writes
                    t2 = time.perf_counter()
                    files = saver.uploaded(step)
                    committed = Path(saver.commit(step, files, {"weight_version": step}))
                    fsync_tree(committed)
                    t3 = time.perf_counter()
                    record(f"durable {fmt}", t3 - t0)
                    if fmt == "dcp":
                        record("stall", t1 - t0)
                        record("written", t2 - t0)
                        facts["checkpoint_bytes"] = tree_bytes(committed)

                # tar packaging (what format=tar does) of a trainer dir, fsynced
                trainer_dir = next(roots["dcp"].glob(f"step-*/{TRAINER_DIR}"))
                archive = work / "pack.tar"
                archive.unlink(missing_ok=True)
                t0 = time.perf_counter()
                pack_tar(trainer_dir, archive, "w")
                fsync_tree(archive)
                record("tar package", time.perf_counter() - t0)
                facts["tar_bytes"] = archive.stat().st_size
                archive.unlink()

                # reference read, cold
                zero_state()
                evict_tree(plain)
                t0 = time.perf_counter()
                plain_read(tensors, plain)
                record("plain read", time.perf_counter() - t0)
                check_loaded("plain read")

                # our load, straight from the committed checkpoint, cold
                for fmt, saver in savers.items():
                    zero_state()
                    evict_tree(roots[fmt])
                    committed = sorted(roots[fmt].glob("step-*"))[-1]
                    t0 = time.perf_counter()
                    saver.load(str(committed))
                    record(f"load {fmt}", time.perf_counter() - t0)
                    check_loaded(f"load ({fmt})")
        finally:
            for saver in savers.values():
                saver.close()

        # gzip for contrast, once (it is the slow one)
        archive = work / "pack.tar.gz"
        t0 = time.perf_counter()
        pack_tar(trainer_dir, archive, "w:gz", args.gzip_level)
        fsync_tree(archive)
        record("gzip package", time.perf_counter() - t0)
        facts["gzip_bytes"] = archive.stat().st_size
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if own_group:
            dist.destroy_process_group()

    rows_spec = [
        # (key, label, what, reference)
        ("plain write", "plain write (reference)", "tensors -> 1 file, write+fsync", "plain write"),
        ("stall", "stall (training resumes)", "RankCheckpointer.save returns", "plain write"),
        ("written", "written (state free again)", "background dcp write + fsync", "plain write"),
        ("durable dcp", "durable, dcp", "written + copied to root + commit", "plain write"),
        ("durable tar", "durable, tar", "written + tar + copied + commit", "plain write"),
        ("tar package", "tar package (ours)", "trainer dir -> .tar, fsync", "plain write"),
        ("gzip package", f"gzip package (-{args.gzip_level})", "trainer dir -> .tar.gz, fsync", "plain write"),
        ("plain read", "plain read (reference)", "1 file -> tensors, cold", "plain read"),
        ("load dcp", "load, dcp", "RankCheckpointer.load from root, cold", "plain read"),
        ("load tar", "load, tar", "stage + untar + load, cold", "plain read"),
    ]
    best = {key: min(v) for key, v in samples.items()}
    rows = []
    for key, label, what, ref in rows_spec:
        seconds = best[key]
        rows.append({"name": key, "label": label, "what": what, "seconds": seconds,
                     "median_seconds": statistics.median(samples[key]), "samples": samples[key],
                     "gbps": state_bytes / seconds / 1e9, "reference": ref,
                     "ratio": best[ref] / seconds})
    ratio = {r["name"]: r["ratio"] for r in rows}
    result = {
        "machine": f"{platform.node()} {os.cpu_count()} CPUs, {platform.machine()}",
        "disk": mount_of(Path(args.dir)), "dir": str(args.dir),
        "size_gb": args.size_gb, "state_bytes": state_bytes, "layers": layers, "dim": dim,
        "tensors": len(tensors), "repeat": args.repeat, "gzip_level": args.gzip_level,
        **facts, "rows": rows,
        "stall_over_plain_write": best["stall"] / best["plain write"],
        "written_over_plain_write": best["written"] / best["plain write"],
        "durable_over_plain_write": best["durable dcp"] / best["plain write"],
        "load_vs_plain_read": ratio["load dcp"],
        "goal_stall_over_plain_write": GOAL,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")

    print(f"state: {state_bytes / 1e9:.2f} GB fp32 ({layers} x Linear({dim}, {dim}) FSDP2 params + "
          f"AdamW exp_avg/exp_avg_sq, {len(tensors)} tensors); dcp checkpoint "
          f"{facts['checkpoint_bytes'] / 1e9:.2f} GB on disk, gzip {facts['gzip_bytes'] / 1e9:.2f} GB")
    print(f"disk: {result['disk']} at {args.dir}; {os.cpu_count()} CPUs; best of {args.repeat} "
          f"(gzip once); GB/s = state bytes / wall time; writes fsynced, reads cold")
    print(f"{'row':<26} {'what':<38} {'best s':>7} {'median':>7} {'GB/s':>7} {'vs ref':>7}")
    for r in rows:
        print(f"{r['label']:<26} {r['what']:<38} {r['seconds']:>7.2f} {r['median_seconds']:>7.2f} "
              f"{r['gbps']:>7.3f} {r['ratio']:>7.2f}")
    print(f"load = {ratio['load dcp']:.2f}x plain read; written = {result['written_over_plain_write']:.2f} and "
          f"durable = {result['durable_over_plain_write']:.2f} of the plain write's time; "
          f"tar package = {best['gzip package'] / best['tar package']:.1f}x faster than gzip")
    print(f"headline: stall training sees = {result['stall_over_plain_write']:.3f} of the plain write's time "
          f"({best['stall']:.3f} s vs {best['plain write']:.3f} s; goal <= {GOAL})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
