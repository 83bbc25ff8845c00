"""FSDP2 training throughput: kuberl's every-expert MoE path vs the stock Hugging Face expert loop,
and a dense model of the same active size.

Runs the trainer ranks' own code (``kuberl.train.worker.TrainerWorker``: FSDP2, bf16 mixed
precision, non-reentrant activation checkpointing, the GRPO loss with entropy, AdamW) under
torchrun, with random weights built from configs (the GPU machine cannot download models):

    PYTHONPATH=workloads torchrun --nproc-per-node 2 bench/train_moe.py --json out.json
    PYTHONPATH=workloads torchrun --nproc-per-node 2 bench/train_moe.py --preset tiny   # CPU smoke run

MFU counts model FLOPs only (6 x active matmul parameters per token plus causal attention,
no recompute) over ``--peak-tflops`` per GPU (788: bf16 dense matmul as measured on an H200).
The last line is the headline: tokens/s of our MoE path over the stock loop, measured in the same run.
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

from kuberl.common.samples import Sample, TrainBatch
from kuberl.train.model import ModelOptions
from kuberl.train.worker import TrainerConfig, TrainerWorker

# Qwen3-30B-A3B's layer shape (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of 768,
# top-8) at half the depth and half the experts: ~8.3B parameters, ~1.7B active, sized so that
# fp32 master weights, gradients and AdamW moments fill most of two H200s' memory.
PRESETS = {
    "h200": dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=24, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=64, num_experts_per_tok=8,
                 moe_intermediate_size=768, dense_intermediate_size=6144, seq_len=4096, micro_batch=1,
                 micro_batches=4),
    "tiny": dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, dense_intermediate_size=64, seq_len=64, micro_batch=2,
                 micro_batches=2),
}
VARIANTS = ("moe-kuberl", "moe-stock", "dense")


def make_config(preset: dict, variant: str):
    from transformers import Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=preset["vocab_size"], hidden_size=preset["hidden_size"],
                  num_hidden_layers=preset["num_hidden_layers"], num_attention_heads=preset["num_attention_heads"],
                  num_key_value_heads=preset["num_key_value_heads"], head_dim=preset["head_dim"],
                  max_position_embeddings=preset["seq_len"], tie_word_embeddings=False, use_cache=False)
    if variant == "dense":
        return Qwen3Config(**common, intermediate_size=preset["dense_intermediate_size"])
    return Qwen3MoeConfig(**common, intermediate_size=preset["dense_intermediate_size"],
                          moe_intermediate_size=preset["moe_intermediate_size"],
                          num_experts=preset["num_experts"], num_experts_per_tok=preset["num_experts_per_tok"],
                          decoder_sparse_step=1, norm_topk_prob=True, output_router_logits=False)


def model_flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token: 6 x active matmul parameters + causal attention scores/values."""
    h, layers = config.hidden_size, config.num_hidden_layers
    q_dim = config.num_attention_heads * config.head_dim
    kv_dim = config.num_key_value_heads * config.head_dim
    attn_params = h * q_dim * 2 + h * kv_dim * 2
    if getattr(config, "num_experts", None):
        mlp_params = config.num_experts_per_tok * 3 * h * config.moe_intermediate_size + h * config.num_experts
    else:
        mlp_params = 3 * h * config.intermediate_size
    matmul_params = layers * (attn_params + mlp_params) + config.vocab_size * h
    # QK^T and AV: 2 matmuls x 2 FLOPs x q_dim per (query, key) pair, seq_len/2 keys on average.
    attention = layers * 2 * 2 * q_dim * (seq_len / 2)
    return 3 * (2 * matmul_params + attention)


def total_params(config) -> int:
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def make_batch(n: int, seq_len: int, vocab: int, seed: int) -> TrainBatch:
    rng = random.Random(seed)
    prompt = seq_len // 8
    return TrainBatch([Sample(prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
                              response_ids=[rng.randrange(vocab) for _ in range(seq_len - prompt)],
                              advantage=rng.uniform(-1, 1), group=i) for i in range(n)])


def run_variant(variant: str, preset: dict, args, rank: int, world: int, device: torch.device) -> dict:
    config = make_config(preset, variant)
    on_gpu = device.type == "cuda"
    options = ModelOptions(gradient_checkpointing=not args.no_checkpointing,
                           param_dtype=torch.bfloat16 if on_gpu else torch.float32,
                           moe_experts="stock" if variant == "moe-stock" else "grouped")
    trainer_config = TrainerConfig(lr=1e-5, micro_batch_size=preset["micro_batch"], kl_coef=0.0,
                                   entropy_coef=0.001, router_aux_loss_coef=0.001, model=options)
    worker = TrainerWorker(None, trainer_config, rank=rank, world_size=world,
                           master_addr=os.environ["MASTER_ADDR"], master_port=int(os.environ["MASTER_PORT"]),
                           device=device, random_init_config=config)
    n = world * preset["micro_batch"] * preset["micro_batches"]
    batch = make_batch(n, preset["seq_len"], config.vocab_size, seed=1)
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    times, skipped = [], 0.0
    for step in range(args.warmup + args.steps):
        if on_gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        metrics = worker.train_step(batch)  # returns after the metric all-reduce: work is done
        elapsed = time.perf_counter() - start
        if step >= args.warmup:
            times.append(elapsed)
            skipped += metrics["skipped"]
    step_s = statistics.median(times)
    tokens = n * preset["seq_len"]
    flops = model_flops_per_token(config, preset["seq_len"]) * tokens
    result = {
        "variant": variant, "params_b": total_params(config) / 1e9,
        "step_s": step_s, "step_s_spread": (max(times) - min(times)) if len(times) > 1 else 0.0,
        "tokens_per_s": tokens / step_s, "tflops_per_gpu": flops / step_s / world / 1e12,
        "mfu": flops / step_s / world / (args.peak_tflops * 1e12),
        "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else 0.0,
        "skipped_steps": skipped, "tokens_per_step": tokens, "last_loss": metrics["loss"],
    }
    del worker
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="h200")
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {VARIANTS}")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per variant (median reported)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, help="samples per forward/backward (default: the preset's)")
    parser.add_argument("--no-checkpointing", action="store_true", help="disable activation checkpointing")
    parser.add_argument("--peak-tflops", type=float, default=788.0, help="bf16 dense peak per GPU (H200 measured)")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    unknown = set(variants) - set(VARIANTS)
    if unknown:
        parser.error(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    if "RANK" not in os.environ:
        parser.error("run under torchrun (it sets RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT)")
    rank, world, local_rank = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")
    preset = dict(PRESETS[args.preset])
    if args.micro_batch:
        preset["micro_batch"] = args.micro_batch
    results = []
    for variant in variants:
        try:
            results.append(run_variant(variant, preset, args, rank, world, device))
        except Exception as exc:  # noqa: BLE001 - every rank fails alike (same shapes); report and go on
            print(f"rank {rank}: {variant} failed: {exc!r}", file=sys.stderr, flush=True)
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        if rank == 0:
            print(f"done {variant}: {results[-1]}", flush=True)
    if not results:
        return 1
    if rank == 0:
        by = {r["variant"]: r for r in results}
        device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        print(f"\n{world} x {device_name}, torch {torch.__version__}, preset {args.preset}, "
              f"seq {preset['seq_len']}, {results[0]['tokens_per_step']} tokens/step, "
              f"checkpointing {'off' if args.no_checkpointing else 'on'}")
        print(f"{'variant':<12} {'params':>8} {'step s':>8} {'tokens/s':>10} {'TFLOP/s/GPU':>12} {'MFU':>6} {'mem GiB':>8}")
        for r in results:
            print(f"{r['variant']:<12} {r['params_b']:>7.2f}B {r['step_s']:>8.3f} {r['tokens_per_s']:>10.0f} "
                  f"{r['tflops_per_gpu']:>12.1f} {r['mfu']:>6.1%} {r['peak_mem_gib']:>8.1f}")
        headline = None
        if "moe-kuberl" in by and "moe-stock" in by:
            headline = by["moe-kuberl"]["tokens_per_s"] / by["moe-stock"]["tokens_per_s"]
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": device_name, "world_size": world, "preset": args.preset,
                           "torch": torch.__version__, "results": results,
                           "moe_kuberl_over_stock": headline}, f, indent=2)
        if headline is not None:
            print(f"headline: MoE tokens/s, kuberl every-expert grouped GEMM / stock HF expert loop = {headline:.2f}x")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
