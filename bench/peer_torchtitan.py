"""torchtitan, the peer, training the dense model of ``bench/train_speed.py`` on one GPU (issue 20).

torchtitan is PyTorch's reference FSDP2 trainer. This runs its own pieces, built the way its
``Trainer`` builds them (``torchtitan/train.py``, release 0.2.2, the last that runs on torch 2.11):
its Qwen3 model at our dense preset's shape, ``parallelize_qwen3`` (activation checkpointing,
per-block ``torch.compile``, FSDP2 when there is more than one rank), its compiled cross-entropy
loss, its AdamW (fused) and LR scheduler, and its train step (gradient accumulation over
micro-batches, loss normalised by the step's token count, ``clip_grad_norm_``, optimizer step).
On one GPU torchtitan applies no FSDP and trains under bf16 autocast (``maybe_enable_amp``), which
is what this does too. Only the data differs: random tokens instead of its Hugging Face data
loader, as ``train_speed.py`` uses random tokens.

torchtitan and its small pure-Python dependencies are not kuberl's dependencies; put them in a
folder first (the GPU machine has torch and transformers but cannot reach PyPI):

    pip download --no-deps -d wheels torchtitan==0.2.2 tyro einops torchdata tomli \
        docstring-parser typeguard shtab rich markdown-it-py mdurl pygments
    mkdir site && for w in wheels/*.whl; do python -m zipfile -e $w site; done
    PYTHONPATH=workloads python bench/peer_torchtitan.py --torchtitan-site site --json peer.json

torchtitan's Qwen3 package imports its Hugging Face data loaders, hence ``datasets`` and pyarrow,
which do not fit what can be carried to the GPU machine; when ``datasets`` is missing a stand-in
module is registered that raises on any use, so a run that did reach the data path would fail.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_speed import (PRESETS, GcClock, _init_single_process_env, make_config, matmul_tflops,  # noqa: E402
                         profile_step, step_flops)


def _import_torchtitan(site: str | None):
    if site:
        sys.path.insert(0, os.path.abspath(site))
    try:
        import datasets  # noqa: F401
    except ImportError:
        stand_in = types.ModuleType("datasets")

        def _absent(*_a, **_k):
            raise RuntimeError("bench/peer_torchtitan.py: the datasets package is absent; torchtitan's data "
                               "loaders are not used by this benchmark")

        stand_in.Dataset = stand_in.IterableDataset = type("Dataset", (), {"__init__": _absent})
        stand_in.load_dataset = stand_in.interleave_datasets = _absent
        sys.modules["datasets"] = stand_in
        stand_in_distributed = types.ModuleType("datasets.distributed")
        stand_in_distributed.split_dataset_by_node = _absent
        sys.modules["datasets.distributed"] = stand_in_distributed
    import torchtitan

    return torchtitan


def run_peer(name: str, preset: dict, args, *, ac_mode: str, ac_option: str, local_batch: int,
             device: torch.device, peak: float) -> dict:
    from torchtitan.components.loss import build_cross_entropy_loss
    from torchtitan.components.lr_scheduler import build_lr_schedulers
    from torchtitan.components.optimizer import build_optimizers
    from torchtitan.config import TORCH_DTYPE_MAP, ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3
    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
    from torchtitan.models.qwen3.model.model import Qwen3Model

    torch._dynamo.reset()
    seq, samples = preset["seq_len"], preset["samples"]
    job = ConfigManager().parse_args([
        "--model.name", "qwen3", "--training.seq_len", str(seq), "--training.local_batch_size", str(local_batch),
        "--training.global_batch_size", str(samples), "--training.steps", str(args.warmup + args.steps),
        "--optimizer.lr", "1e-5", "--optimizer.implementation", "fused", "--lr_scheduler.warmup_steps", "0",
        "--activation_checkpoint.mode", ac_mode, "--activation_checkpoint.selective_ac_option", ac_option,
        "--compile.enable", "--job.dump_folder", "/tmp/peer_torchtitan",  # compiles model and loss by default
    ])
    model_args = Qwen3ModelArgs(dim=preset["hidden_size"], n_layers=preset["num_hidden_layers"],
                                n_heads=preset["num_attention_heads"], n_kv_heads=preset["num_key_value_heads"],
                                vocab_size=preset["vocab_size"], head_dim=preset["head_dim"],
                                hidden_dim=preset["dense_intermediate_size"], max_seq_len=seq,
                                enable_weight_tying=False)
    model_args.update_from_config(job)
    world = dist.get_world_size()
    dims = ParallelDims(dp_shard=-1, dp_replicate=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=world)
    with torch.device("meta"):
        model = Qwen3Model(model_args)
    model = parallelize_qwen3(model, dims, job)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    loss_fn = build_cross_entropy_loss(job)
    optimizers = build_optimizers([model], job.optimizer, dims)
    schedulers = build_lr_schedulers(optimizers, job.lr_scheduler, job.training.steps)
    amp = dist_utils.maybe_enable_amp(dims, job.training.mixed_precision_param, device.type)
    accumulation = samples // local_batch
    generator = torch.Generator().manual_seed(1)
    micro_batches = [torch.randint(0, preset["vocab_size"], (local_batch, seq + 1), generator=generator)
                     for _ in range(accumulation)]

    def train_step() -> float:
        optimizers.zero_grad()
        total_tokens = torch.tensor(float(samples * seq), device=device)
        losses = []
        for tokens in micro_batches:  # Trainer.train_step, non-pipelined branch
            tokens = tokens.to(device, non_blocking=True)
            inputs, labels = tokens[:, :-1], tokens[:, 1:]
            with amp:
                pred = model(inputs)
                loss = loss_fn(pred, labels) / total_tokens
            del pred
            loss.backward()
            losses.append(loss.detach())
        dist_utils.clip_grad_norm_(list(model.parameters()), job.training.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        return torch.stack(losses).sum().item()  # the host sync Trainer's logging does too

    times, clock = [], GcClock()
    torch.cuda.synchronize()
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            torch.cuda.reset_peak_memory_stats()
            clock.start()
        start = time.perf_counter()
        loss = train_step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    clock.stop()
    if args.profile:
        profile_step(train_step, name, args)
    step_s = statistics.median(times)
    config = make_config(preset, moe=False)
    lengths = [seq] * samples
    flops = step_flops(config, lengths, scored=sum(lengths))  # torchtitan scores every position
    result = {"variant": name, "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
              "tokens_per_s": sum(lengths) / step_s, "tflops_per_gpu": flops / step_s / world / 1e12,
              "mfu": flops / step_s / world / (peak * 1e12), "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30,
              "tokens_per_step": sum(lengths), "loss": loss, "ac": f"{ac_mode}:{ac_option}",
              "gc_seconds": clock.seconds, "gc_collections": clock.collections,
              "local_batch": local_batch, "fsdp": dims.fsdp_enabled,
              "param_dtype": str(TORCH_DTYPE_MAP[job.training.mixed_precision_param])}
    del model, optimizers, schedulers
    gc.collect()
    torch.cuda.empty_cache()
    return result


VARIANTS = {  # name: (activation_checkpoint.mode, selective_ac_option, local batch size)
    "selective-op": ("selective", "op", 4),  # torchtitan's Qwen3 configs' default mode
    "selective-2": ("selective", "2", 4),    # every other block, like our checkpoint every 2nd layer
    "selective-4": ("selective", "4", 4),    # every 4th block, like our checkpoint every 4th layer
    "full": ("full", "2", 4),
    "none": ("none", "2", 1),
    "none-4": ("none", "2", 4),  # no checkpointing at 4 x 4096 (fits a 141 GB H200)
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--torchtitan-site", help="folder holding torchtitan 0.2.2 and its pure-Python dependencies")
    parser.add_argument("--variants", default="selective-op,selective-2,full", help=f"comma-separated of {sorted(VARIANTS)}")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="profile two more steps per variant: this many kernels by GPU time, and the GPU's idle gaps")
    parser.add_argument("--trace-dir", metavar="DIR", help="with --profile: keep each variant's Chrome traces here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a GPU (torchtitan's compiled training path)")
    torchtitan = _import_torchtitan(args.torchtitan_site)
    _init_single_process_env()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    peak = matmul_tflops(device)
    preset = PRESETS["h100"]
    results = []
    for name in args.variants.split(","):
        mode, option, local_batch = VARIANTS[name]
        try:
            row = run_peer(f"torchtitan {name}", preset, args, ac_mode=mode, ac_option=option,
                           local_batch=local_batch, device=device, peak=peak)
        except torch.OutOfMemoryError as exc:
            row = {"variant": f"torchtitan {name}", "error": f"out of memory: {str(exc)[:160]}"}
            gc.collect()
            torch.cuda.empty_cache()
        results.append(row)
        print(f"done {row}", flush=True)
    version = getattr(torchtitan, "__version__", "0.2.2")
    print(f"\ntorchtitan {version}, {torch.cuda.get_device_name(device)}, torch {torch.__version__}, "
          f"bf16 matmul {peak:.1f} TFLOP/s")
    for r in results:
        if "error" in r:
            print(f"{r['variant']:<28} {r['error']}")
        else:
            print(f"{r['variant']:<28} {r['step_s']:>7.3f} s {r['tokens_per_s']:>9.0f} tok/s "
                  f"{r['tflops_per_gpu']:>7.1f} TFLOP/s {r['mfu']:>6.1%} {r['peak_mem_gib']:>6.1f} GiB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "torchtitan": version,
                       "matmul_tflops": peak, "results": results}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
