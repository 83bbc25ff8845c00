"""Trainer speed on one GPU (issue 20): dense MFU before/after, packed vs padded RL batches,
grouped MoE vs the stock loop, and peak memory of log-prob + entropy, chunked vs unchunked.

Runs the trainer ranks' own code (``kuberl.train.worker.TrainerWorker``: FSDP2, bf16 mixed
precision, the GRPO loss with entropy, AdamW) with random weights built from configs, in one
process (or under torchrun). Every MFU is over the bf16 matmul rate measured at the start of the
same run (8192^3 bf16 products, median of 20), not a datasheet number.

    PYTHONPATH=workloads python bench/train_speed.py --json out.json
    PYTHONPATH=workloads python bench/train_speed.py --preset tiny          # CPU smoke run

Model FLOPs: 6 x matmul parameters per token for the decoder layers (MoE: active experts), the
LM head only at the positions scored (response tokens), and causal attention within each
sample; recompute is not counted.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

from kuberl.common.ports import unclaimed_port
from kuberl.common.samples import Sample, TrainBatch
from kuberl.train.logprobs import chunked_logprobs_entropy, full_logprobs_entropy
from kuberl.train.model import ModelOptions
from kuberl.train.worker import TrainerConfig, TrainerWorker

PRESETS = {
    # The dense model of issue 20 (1.98B, Qwen3-30B-A3B's layer shape with a dense MLP); the MoE
    # at a depth whose fp32 weights, gradients and AdamW moments fit one 80 GB H100.
    "h100": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, dense_intermediate_size=6144, seq_len=4096,
                 moe_layers=8, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=768,
                 samples=8, pack_samples=32, pack_prompt=128, pack_response=(64, 4096), memory_tokens=16384),
    "tiny": dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, dense_intermediate_size=128, seq_len=128,
                 moe_layers=2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 samples=4, pack_samples=8, pack_prompt=8, pack_response=(4, 128), memory_tokens=256),
}


def make_config(preset: dict, moe: bool):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=preset["vocab_size"], hidden_size=preset["hidden_size"],
                  num_attention_heads=preset["num_attention_heads"],
                  num_key_value_heads=preset["num_key_value_heads"], head_dim=preset["head_dim"],
                  max_position_embeddings=max(8192, preset["seq_len"]), tie_word_embeddings=False, use_cache=False)
    if not moe:
        return Qwen3Config(**common, num_hidden_layers=preset["num_hidden_layers"],
                           intermediate_size=preset["dense_intermediate_size"])
    return Qwen3MoeConfig(**common, num_hidden_layers=preset["moe_layers"],
                          intermediate_size=preset["dense_intermediate_size"],
                          moe_intermediate_size=preset["moe_intermediate_size"], num_experts=preset["num_experts"],
                          num_experts_per_tok=preset["num_experts_per_tok"], decoder_sparse_step=1,
                          norm_topk_prob=True, output_router_logits=False)


def step_flops(config, lengths: list[int], scored: int) -> float:
    """Model FLOPs of one training step (forward + backward = 3 x forward)."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    attn_params = h * q_dim * 2 + h * kv_dim * 2
    if getattr(config, "num_experts", None):
        mlp_params = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size + h * config.num_experts
    else:
        mlp_params = 3 * h * config.intermediate_size
    tokens = sum(lengths)
    forward = 2 * layers * (attn_params + mlp_params) * tokens + 2 * config.vocab_size * h * scored
    # QK^T and AV: 2 matmuls x 2 FLOPs x q_dim per causal (query, key) pair, n(n+1)/2 pairs.
    forward += layers * 2 * 2 * q_dim * sum(n * (n + 1) / 2 for n in lengths)
    return 3 * forward


def matmul_tflops(device: torch.device) -> float:
    n = 8192
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * n ** 3 / statistics.median(times) / 1e12


def uniform_batch(n: int, seq_len: int, vocab: int, seed: int) -> TrainBatch:
    rng = random.Random(seed)
    prompt = seq_len // 8
    return TrainBatch([Sample(prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                              response_ids=[rng.randrange(vocab) for _ in range(seq_len - prompt)],
                              advantage=rng.uniform(-1, 1), group=i) for i in range(n)])


def rl_batch(n: int, prompt: int, response: tuple[int, int], vocab: int, seed: int) -> TrainBatch:
    """Response lengths uniform in ``response`` (inclusive), like an RL rollout's."""
    rng = random.Random(seed)
    return TrainBatch([Sample(prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                              response_ids=[rng.randrange(vocab) for _ in range(rng.randint(*response))],
                              advantage=rng.uniform(-1, 1), group=i) for i in range(n)])


class GcClock:
    """Python's garbage collector over the timed steps: collections per generation and their
    seconds (``gc.callbacks``). A full collection walks every tracked object, and a trainer
    process holds many (modules, compiled graphs), so collections land inside steps."""

    def __init__(self):
        self.seconds, self.collections, self._start = 0.0, [0, 0, 0], None

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        elif self._start is not None:
            self.seconds += time.perf_counter() - self._start
            self.collections[info["generation"]] += 1

    def start(self) -> None:
        gc.callbacks.append(self)

    def stop(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)


def run_trainer(name: str, model_config, options: ModelOptions, batch: TrainBatch, args, *, rank: int,
                world: int, device: torch.device, peak: float | None, micro_batch_size: int = 1,
                micro_batch_tokens: int = 0) -> dict:
    torch._dynamo.reset()
    trainer_config = TrainerConfig(lr=1e-5, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                                   kl_coef=0.0, entropy_coef=0.001, router_aux_loss_coef=0.001, model=options)
    worker = TrainerWorker(None, trainer_config, rank=rank, world_size=world, master_addr=os.environ["MASTER_ADDR"],
                           master_port=int(os.environ["MASTER_PORT"]), device=device, random_init_config=model_config)
    on_gpu = device.type == "cuda"
    times, first, clock = [], None, GcClock()
    for step in range(args.warmup + args.steps):
        if on_gpu:
            torch.cuda.synchronize()
            if step == args.warmup:
                torch.cuda.reset_peak_memory_stats()
        if step == args.warmup:
            clock.start()
        start = time.perf_counter()
        metrics = worker.train_step(batch)  # returns after the metric all-reduce and .item(): work is done
        elapsed = time.perf_counter() - start
        first = first if first is not None else elapsed
        if step >= args.warmup:
            times.append(elapsed)
    clock.stop()
    if getattr(args, "profile", 0) and on_gpu:
        profile_step(lambda: worker.train_step(batch), name, args)
    step_s = statistics.median(times)
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in batch.samples]
    scored = sum(len(s.response_ids) for s in batch.samples)
    flops = step_flops(model_config, lengths, scored)
    result = {
        "variant": name, "step_s": step_s, "step_s_min": min(times), "step_s_max": max(times),
        "first_step_s": first, "tokens_per_s": sum(lengths) / step_s,
        "tflops_per_gpu": flops / step_s / world / 1e12,
        "mfu": flops / step_s / world / (peak * 1e12) if peak else None,
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
        "tokens_per_step": sum(lengths), "loss": metrics["loss"], "skipped": metrics["skipped"],
        "gc_seconds": clock.seconds, "gc_collections": clock.collections,
    }
    del worker
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def profile_step(step, name: str, args) -> None:
    """Two more steps under ``torch.profiler``: the first for the kernel table and the GPU's idle
    time, the second with Python stacks for what the host ran in each gap (``bench/gpu_gaps.py``;
    the stacks slow the host, so the idle total is the first's). Printed on stdout; the traces
    are kept under ``--trace-dir`` when given."""
    import gzip
    import shutil
    import tempfile

    from torch.profiler import ProfilerActivity, profile, record_function

    from gpu_gaps import idle_report

    slug = "".join(c if c.isalnum() else "-" for c in name)
    for with_stack in (False, True):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=with_stack) as prof:
            with record_function("step"):  # the window opens with the step's first line, not its first operator
                step()
                torch.cuda.synchronize()
        if not with_stack:
            print(f"profile of {name}:\n" + prof.key_averages().table(
                sort_by="self_cuda_time_total", row_limit=args.profile, max_name_column_width=90), flush=True)
        with tempfile.TemporaryDirectory() as tmp:
            trace = os.path.join(tmp, "trace.json")
            prof.export_chrome_trace(trace)
            try:
                report = idle_report(trace, top=12, min_us=20.0)
            except Exception as exc:  # noqa: BLE001 - the analysis must not cost the run its numbers
                report = f"gap analysis failed: {exc!r}"
            print(f"GPU idle in {name} ({'with Python stacks' if with_stack else 'no stacks'}):\n{report}", flush=True)
            if getattr(args, "trace_dir", None):
                os.makedirs(args.trace_dir, exist_ok=True)
                dest = os.path.join(args.trace_dir, f"{slug}{'-stacks' if with_stack else ''}.json.gz")
                with open(trace, "rb") as src, gzip.open(dest, "wb") as out:
                    shutil.copyfileobj(src, out)


def logprob_memory(preset: dict, device: torch.device) -> list[dict]:
    """Peak memory of forward + backward of log-prob + entropy over ``memory_tokens`` rows."""
    n, h, v = preset["memory_tokens"], preset["hidden_size"], preset["vocab_size"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = []
    for name, fn, kw in (("chunked", chunked_logprobs_entropy, {}), ("unchunked", full_logprobs_entropy, {})):
        hidden = torch.randn(n, h, device=device, dtype=dtype, requires_grad=True)
        weight = (torch.randn(v, h, device=device, dtype=dtype) * 0.02).requires_grad_()
        targets = torch.randint(0, v, (n,), device=device)
        row = {"variant": f"logprob+entropy {name}", "tokens": n, "vocab": v}
        try:
            for attempt in range(2):  # the first compiles (chunked, on GPU)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()
                start = time.perf_counter()
                lp, ent = fn(hidden, weight, targets, **kw)
                (lp.sum() + ent.sum()).backward()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                row["seconds"] = time.perf_counter() - start
                hidden.grad = weight.grad = None
                del lp, ent
            if device.type == "cuda":
                row["peak_above_inputs_gib"] = (torch.cuda.max_memory_allocated() - base) / 2**30
        except torch.OutOfMemoryError as exc:
            row["error"] = f"out of memory: {str(exc)[:120]}"
        out.append(row)
        del hidden, weight, targets
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


def _init_single_process_env() -> None:
    if "RANK" in os.environ:
        return
    port = unclaimed_port()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


SECTIONS = ("memory", "dense", "packing", "moe")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h100")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--dense-variants", default="before,ckpt-all,ckpt-half,ckpt-quarter",
                        help="before = the path before issue 20; the others: activation checkpointing on every / "
                             "every other / every fourth layer, or none (no-ckpt: 4096-token micro-batches, no-ckpt-4: "
                             "16,384); sharded-flash-*: FSDP2 on one rank and FlashAttention-2 (before issue 36), "
                             "sharded-* / flash-*: one of the two")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (compilation happens here)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="profile two more steps of each variant: its top ROWS kernels and the GPU's idle gaps")
    parser.add_argument("--trace-dir", metavar="DIR", help="with --profile: keep each variant's Chrome traces here")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    if set(sections) - set(SECTIONS):
        parser.error(f"--sections: unknown {sorted(set(sections) - set(SECTIONS))}; choose from {SECTIONS}")
    _init_single_process_env()
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    on_gpu = torch.cuda.is_available()
    device = torch.device("cuda", local_rank) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    torch._dynamo.config.cache_size_limit = 64
    preset = PRESETS[args.preset]
    dtype = torch.bfloat16 if on_gpu else torch.float32
    peak = matmul_tflops(device) if on_gpu else None
    if rank == 0:
        print(f"bf16 matmul 8192^3, measured: {peak} TFLOP/s", flush=True)
    results: list[dict] = []

    def record(fn, *a, **kw):
        try:
            r = fn(*a, **kw)
        except Exception as exc:  # noqa: BLE001 - report the variant as failed and go on
            name = a[0] if a and isinstance(a[0], str) else getattr(fn, "__name__", "?")
            print(f"rank {rank}: {name} failed: {exc!r}", file=sys.stderr, flush=True)
            gc.collect()
            if on_gpu:
                torch.cuda.empty_cache()
            return
        for row in (r if isinstance(r, list) else [r]):
            row["section"] = current
            results.append(row)
            if rank == 0:
                print(f"done {row}", flush=True)

    kw = dict(rank=rank, world=world, device=device, peak=peak)
    seq = preset["seq_len"]
    if "memory" in sections:
        current = "memory"
        record(logprob_memory, preset, device)
    if "dense" in sections:
        current = "dense"
        config = make_config(preset, moe=False)
        batch = uniform_batch(world * preset["samples"], seq, config.vocab_size, seed=1)
        new = dict(param_dtype=dtype)
        # Before issue 36: FSDP2 on the one-rank mesh and FlashAttention-2 for packed rows.
        sharded_flash = dict(new, shard_single_rank=True, uniform_sdpa=False)
        variants = {
            # The path before issue 20, but for its foreach AdamW: the trainer's skip of a
            # non-finite update takes the fused optimizer (issue 36).
            "before": (ModelOptions(param_dtype=dtype, attn_implementation="sdpa", logprob_chunk_tokens=0,
                                    compile_layers=False, reshard_after_forward=True), dict(micro_batch_size=1)),
            "ckpt-all": (ModelOptions(**new), dict(micro_batch_tokens=4 * seq)),
            "ckpt-half": (ModelOptions(**new, checkpoint_every=2), dict(micro_batch_tokens=4 * seq)),
            "ckpt-quarter": (ModelOptions(**new, checkpoint_every=4), dict(micro_batch_tokens=4 * seq)),
            "ckpt-op": (ModelOptions(**new, checkpoint_per_op=True), dict(micro_batch_tokens=4 * seq)),
            "no-ckpt": (ModelOptions(**new, gradient_checkpointing=False), dict(micro_batch_tokens=seq)),
            "no-ckpt-4": (ModelOptions(**new, gradient_checkpointing=False), dict(micro_batch_tokens=4 * seq)),
            "sharded-flash-ckpt-all": (ModelOptions(**sharded_flash), dict(micro_batch_tokens=4 * seq)),
            "sharded-flash-ckpt-quarter": (ModelOptions(**sharded_flash, checkpoint_every=4),
                                           dict(micro_batch_tokens=4 * seq)),
            # One lever each, against sharded-flash-ckpt-quarter.
            "sharded-ckpt-quarter": (ModelOptions(**new, shard_single_rank=True, checkpoint_every=4),
                                     dict(micro_batch_tokens=4 * seq)),
            "flash-ckpt-quarter": (ModelOptions(**new, uniform_sdpa=False, checkpoint_every=4),
                                   dict(micro_batch_tokens=4 * seq)),
        }
        for name in args.dense_variants.split(","):
            options, extra = variants[name]
            record(run_trainer, f"dense {name}", config, options, batch, args, **kw, **extra)
    if "packing" in sections:
        current = "packing"
        config = make_config(preset, moe=False)
        batch = rl_batch(world * preset["pack_samples"], preset["pack_prompt"], preset["pack_response"],
                         config.vocab_size, seed=2)
        budget = 4 * seq
        record(run_trainer, "padded", config, ModelOptions(param_dtype=dtype), batch, args, **kw,
               micro_batch_size=4)
        record(run_trainer, "packed", config, ModelOptions(param_dtype=dtype), batch, args, **kw,
               micro_batch_tokens=budget)
    if "moe" in sections:
        current = "moe"
        config = make_config(preset, moe=True)
        batch = uniform_batch(world * preset["samples"], seq, config.vocab_size, seed=3)
        record(run_trainer, "moe grouped", config, ModelOptions(param_dtype=dtype), batch, args, **kw,
               micro_batch_tokens=2 * seq)
        record(run_trainer, "moe grouped ckpt-half", config, ModelOptions(param_dtype=dtype, checkpoint_every=2), batch,
               args, **kw, micro_batch_tokens=2 * seq)
        record(run_trainer, "moe grouped ckpt-quarter", config, ModelOptions(param_dtype=dtype, checkpoint_every=4),
               batch, args, **kw, micro_batch_tokens=2 * seq)
        # 16,384-token micro-batches: half the kernel launches per token (the 8,192-token step is
        # launch-bound: 606 ms of host time for 557 ms of kernels on an H200); needs more than 80 GB.
        record(run_trainer, "moe grouped ckpt-quarter 16k", config,
               ModelOptions(param_dtype=dtype, checkpoint_every=4), batch, args, **kw, micro_batch_tokens=4 * seq)
        record(run_trainer, "moe stock", config, ModelOptions(param_dtype=dtype, moe_experts="stock",
                                                              compile_layers=False), batch, args, **kw,
               micro_batch_tokens=2 * seq)
    if rank == 0:
        name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
        print(f"\n{world} x {name}, torch {torch.__version__}, preset {args.preset}, bf16 matmul {peak} TFLOP/s")
        print(f"{'section':<8} {'variant':<28} {'step s':>7} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'mem GiB':>8}")
        for r in results:
            if "step_s" in r:
                mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
                print(f"{r['section']:<8} {r['variant']:<28} {r['step_s']:>7.3f} {r['tokens_per_s']:>9.0f} "
                      f"{r['tflops_per_gpu']:>8.1f} {mfu:>6} {r['peak_mem_gib']:>8.1f}")
            else:
                print(f"{r['section']:<8} {r['variant']:<28} {r.get('seconds', 0):>7.3f} peak "
                      f"{r.get('peak_above_inputs_gib', 0):.2f} GiB {r.get('error', '')}")
        by = {r["variant"]: r for r in results}
        if "packed" in by and "padded" in by:
            print(f"packing: packed / padded tokens/s = {by['packed']['tokens_per_s'] / by['padded']['tokens_per_s']:.2f}x")
        if "moe grouped" in by and "moe stock" in by:
            print(f"moe: grouped / stock tokens/s = {by['moe grouped']['tokens_per_s'] / by['moe stock']['tokens_per_s']:.2f}x")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": name, "world_size": world, "preset": args.preset, "torch": torch.__version__,
                           "matmul_tflops": peak, "results": results}, f, indent=2)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
