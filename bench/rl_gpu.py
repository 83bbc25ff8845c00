"""The whole GRPO step on one GPU at a real model's shape, against TRL and against the hardware.

One run measures, on the same random-weight model (Qwen2.5-1.5B's shape, bench/rl_shapes.py),
the same prompts (exactly ``--prompt-tokens`` chat tokens each) and the same lengths:

1. the GPU: bf16 matmul rate (8192^3, median of 20) and HBM bandwidth (a 4 GiB device copy);
2. generation alone, raw ``vllm.LLM.generate`` three times: with TRL's colocate-mode settings
   (``gpu_memory_utilization`` 0.3, ``max_num_batched_tokens`` 4096, one request per sample,
   detokenized), and with kuberl's own engine arguments and sampling parameters
   (``kuberl.rollout.engine.engine_kwargs`` / ``rollout_sampling_params``);
3. ``kuberl train`` on a colocated one-GPU manifest (trainer and engine share the GPU, ``ipc``
   weight sync, a checkpoint), its per-phase seconds from the driver's metrics file;
4. TRL's ``GRPOTrainer`` in vLLM colocate mode on the same model, data, group size, batch,
   lengths and learning rate, its phases from TRL's own profiling contexts.

Each piece runs in a subprocess of its own (a fresh CUDA context, all memory back between
them); the parent prints the tables and the ratios and writes ``--json``. Steps after the first
are measured (the first compiles and captures graphs), as the median of the rest; both sides save
the weights and the optimizer state every ``--checkpoint-interval`` steps, and a step's cost
includes its share of that: kuberl's stall when a save starts (its wait inside the next update
is in the update), TRL's save, which runs outside its step clock. Generation is also put against its
roofline: per decode step, the weights plus the KV cache read at the measured HBM bandwidth, or
the FLOPs at the measured matmul rate, whichever is longer.

    PYTHONPATH=workloads python bench/rl_gpu.py --json rl_gpu.json                # everything
    PYTHONPATH=workloads python bench/rl_gpu.py --only generate                   # 1 and 2
    PYTHONPATH=workloads python bench/rl_gpu.py --preset small --prompts 8 --response-tokens 32 \\
        --only kuberl                                                            # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import rl_shapes  # noqa: E402

PIECES = ("hardware", "generate", "kuberl", "trl")
GENERATE_ENGINES = ("trl", "kuberl")
# vLLM's own start-up log lines worth keeping (where an engine's start goes).
STARTUP_LINES = re.compile(r"(took|takes|Loading weights|Graph capturing|torch.compile|Compil|Memory profiling|"
                           r"KV cache|init engine|Available|cudagraph|flashinfer|FlashInfer|JIT|backend)", re.I)


# --- the workload -----------------------------------------------------------------------------

def manifest(args, work: Path) -> dict:
    """The colocated one-GPU RLTrainingJob that kuberl runs (and whose engine settings the raw
    comparison uses)."""
    gpu = args.device == "cuda"
    return {
        "apiVersion": "kuberl.dev/v1alpha1", "kind": "RLTrainingJob", "metadata": {"name": "bench-rl-gpu"},
        "spec": {
            "image": "local",
            "model": {"uri": str(work / "model")},
            "data": {"uri": str(work / "data.jsonl")},
            "reward": {"builtin": "repeat_letter"},
            "algorithm": {"groupSize": args.group_size, "promptsPerStep": args.prompts,
                          "microBatchSize": args.micro_batch, "totalSteps": args.steps,
                          "learningRate": args.lr, "klCoef": 0.0, "seed": 1},
            "trainer": {"gpusPerReplica": 1 if gpu else 0, "gradientCheckpointing": True,
                        "microBatchTokens": args.micro_batch_tokens if gpu else 0,
                        **({} if gpu else {"paramDtype": "float32"})},
            "rollout": {"colocate": gpu, "gpusPerReplica": 1 if gpu else 0,
                        "maxPromptLength": args.prompt_tokens, "maxResponseLength": args.response_tokens,
                        "gpuMemoryUtilization": args.gpu_memory_utilization},
            "weightSync": {"method": "ipc" if gpu else "nccl"},
            "checkpoint": {"uri": str(work / "checkpoints"), "intervalSteps": args.checkpoint_interval,
                           "keep": 1, "resume": "never"},
            "numa": {"policy": "none"},
        },
    }


def prepare(args, work: Path) -> None:
    from transformers import AutoTokenizer

    started = time.perf_counter()
    rl_shapes.make_model(work / "model", args.preset)
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    if not (work / "data.jsonl").exists():
        rl_shapes.make_data(work / "data.jsonl", tokenizer, args.prompts * args.steps, args.prompt_tokens)
    print(f"prepared {work} in {time.perf_counter() - started:.1f} s", flush=True)


def prompt_ids(work: Path, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    rows = [json.loads(line) for line in (work / "data.jsonl").read_text().splitlines()[:count]]
    out = []
    for row in rows:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], add_generation_prompt=True,
                                            tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


# --- 1. the hardware --------------------------------------------------------------------------

def run_hardware(args, work: Path) -> dict:
    import torch

    from train_speed import matmul_tflops

    device = torch.device("cuda")
    data = torch.empty(4 << 30, dtype=torch.uint8, device=device)
    out = torch.empty_like(data)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out.copy_(data)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    hbm = 2 * data.numel() / statistics.median(times[2:]) / 1e9  # bytes read + written
    del data, out
    return {"gpu": torch.cuda.get_device_name(), "matmul_tflops": matmul_tflops(device), "hbm_gb_s": hbm}


def decode_roofline(config: dict, prompts: int, n: int, prompt_tokens: int, response_tokens: int,
                    hbm_gb_s: float, tflops: float) -> dict:
    """Seconds that generating ``prompts`` x ``n`` responses of ``response_tokens`` tokens cannot
    beat: at each decode step, every weight (bf16) and the KV cache of every sequence are read
    once (at ``hbm_gb_s``) and the matmuls and attention run at ``tflops``; the step takes the
    longer of the two. The prompts' prefill (shared by a group: prefix caching) adds its FLOPs."""
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or h // heads
    q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
    layer_params = h * q_dim * 2 + h * kv_dim * 2 + 3 * h * config["intermediate_size"]
    matmul_params = layers * layer_params + vocab * h  # the LM head reads the (tied) embedding
    weight_bytes = 2 * matmul_params
    kv_bytes_per_token = layers * 2 * kv_dim * 2
    batch = prompts * n
    seconds = memory_bound = 0.0
    for step in range(response_tokens):
        context = prompt_tokens + step
        bytes_read = weight_bytes + batch * context * kv_bytes_per_token
        flops = 2 * matmul_params * batch + 4 * layers * q_dim * batch * context
        memory, compute = bytes_read / (hbm_gb_s * 1e9), flops / (tflops * 1e12)
        seconds += max(memory, compute)
        memory_bound += memory >= compute
    prefill = (2 * matmul_params * prompts * prompt_tokens
               + 2 * layers * q_dim * prompts * prompt_tokens ** 2) / (tflops * 1e12)
    return {"seconds": seconds + prefill, "decode_steps_memory_bound": int(memory_bound),
            "weight_bytes": weight_bytes, "kv_bytes_per_token": kv_bytes_per_token}


# --- 2. generation alone ----------------------------------------------------------------------

def trl_engine_settings(args) -> tuple[dict, dict]:
    """TRL 1.16's colocate mode (trl/generation/vllm_generation.py): its LLM(...) and the
    SamplingParams of GRPOTrainer's defaults, one request per sample (n=1, prompts repeated)."""
    llm = dict(gpu_memory_utilization=0.3, max_num_seqs=args.prompts * args.group_size,
               max_num_batched_tokens=4096, logprobs_mode="processed_logprobs", seed=0)
    sampling = dict(n=1, repetition_penalty=1.0, temperature=1.0, top_p=1.0, top_k=-1, min_p=0.0,
                    max_tokens=args.response_tokens, logprobs=0)
    return llm, sampling


def run_generate(args, work: Path) -> dict:
    """Raw ``LLM.generate`` of one step's batch, three times (the median of the last two is reported), with
    ``args.engine``'s settings; also where the engine's start went."""
    # The parent process asked torch about CUDA: vLLM's engine core must not be forked from it.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    started = time.perf_counter()
    import vllm
    from vllm import LLM, SamplingParams

    imported = time.perf_counter()
    from kuberl.api.validate import validate_manifest
    from kuberl.rollout.engine import engine_kwargs, rollout_sampling_params

    ids = prompt_ids(work, args.prompts)
    if args.engine == "trl":
        llm_kwargs, sampling = trl_engine_settings(args)
        llm_kwargs["model"] = str(work / "model")
        requests = [{"prompt_token_ids": p} for p in ids for _ in range(args.group_size)]
        params = [SamplingParams(**sampling)] * len(requests)
    else:
        job = validate_manifest(manifest(args, work))
        llm_kwargs = engine_kwargs(job.spec, str(work / "model"), "bench", engine_index=0)
        requests = [{"prompt_token_ids": p} for p in ids]
        # kuberl seeds every request (a resumed step regenerates the same samples); the unseeded
        # round on the same engine measures what that costs in vLLM's sampler.
        params = [rollout_sampling_params(n=args.group_size, temperature=1.0, max_tokens=args.response_tokens,
                                          seed=1000 + i) for i in range(len(ids))]
        unseeded = [rollout_sampling_params(n=args.group_size, temperature=1.0, max_tokens=args.response_tokens)
                    for _ in ids]
    llm = LLM(**llm_kwargs)
    ready = time.perf_counter()

    def timed(batch_params) -> dict:
        begin = time.perf_counter()
        outputs = llm.generate(requests, batch_params, use_tqdm=False)
        seconds = time.perf_counter() - begin
        return {"seconds": seconds, "response_tokens": sum(len(c.token_ids) for o in outputs for c in o.outputs)}

    rounds = [timed(params) for _ in range(3)]  # the first pays one-time costs; the median of the rest is reported
    extra = {"unseeded_round": timed(unseeded)} if args.engine == "kuberl" else {}
    config = llm.llm_engine.vllm_config
    result = {"engine": args.engine, "vllm": vllm.__version__, "import_seconds": imported - started,
              "start_seconds": ready - imported, "rounds": rounds,
              "max_num_seqs": config.scheduler_config.max_num_seqs,
              "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
              "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
              "async_scheduling": config.scheduler_config.async_scheduling,
              "enforce_eager": config.model_config.enforce_eager, **extra}
    llm.llm_engine.engine_core.shutdown()
    return result


# --- 3. kuberl train --------------------------------------------------------------------------

def run_kuberl(args, work: Path) -> dict:
    import yaml

    config = work / "kuberl.yaml"
    config.write_text(yaml.safe_dump(manifest(args, work)))
    metrics = work / "kuberl-metrics.jsonl"
    metrics.unlink(missing_ok=True)
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "kuberl.driver", "--config", str(config), "--work-dir",
                           str(work / "kuberl-work"), "--metrics-file", str(metrics)],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.perf_counter() - started
    (work / "kuberl.log").write_text(proc.stdout)
    if proc.returncode:
        raise RuntimeError(f"kuberl train exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    shutil.rmtree(work / "checkpoints", ignore_errors=True)  # the disk TRL's saves need next
    return {"wall_seconds": wall, "steps": rows}


# --- 4. TRL -----------------------------------------------------------------------------------

def run_trl(args, work: Path) -> dict:
    """TRL's GRPOTrainer, colocate mode, its defaults except what the workload fixes. Phases come
    from TRL's own ``profiling_context`` timers (which it sends only to W&B, MLflow or trackio):
    the bench records them as they close."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer
    from trl.extras import profiling

    phases: list[tuple[str, float]] = []
    original = profiling.ProfilingContext._log_metrics  # fails loudly if TRL renames its timer

    def record(self, duration: float) -> None:
        phases.append((self.name, duration))
        original(self, duration)

    profiling.ProfilingContext._log_metrics = record

    rows = [json.loads(line) for line in (work / "data.jsonl").read_text().splitlines()]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
                                 for r in rows])

    def repeat_letter(completions, answer, **_):
        out = []
        for completion, letter in zip(completions, answer):
            text = completion[0]["content"].strip()
            out.append(sum(c == letter for c in text) / len(text) if text else 0.0)
        return out

    step_times: list[float] = []
    save_times: list[float] = []

    class StepClock(TrainerCallback):
        """TRL's step on its own clock, and its checkpoint saves apart: the Trainer saves after
        ``on_step_end`` and calls ``on_save`` when the save is done."""

        def on_step_begin(self, *_, **__):
            torch.cuda.synchronize()
            self.begin = time.perf_counter()

        def on_step_end(self, *_, **__):
            torch.cuda.synchronize()
            self.end = time.perf_counter()
            step_times.append(self.end - self.begin)

        def on_save(self, *_, **__):
            save_times.append(time.perf_counter() - self.end)

    per_device = args.micro_batch
    config = GRPOConfig(
        output_dir=str(work / "trl-out"), max_steps=args.steps, learning_rate=args.lr, beta=0.0,
        num_generations=args.group_size, per_device_train_batch_size=per_device,
        gradient_accumulation_steps=args.prompts * args.group_size // per_device,
        max_completion_length=args.response_tokens, temperature=1.0, bf16=True, gradient_checkpointing=True,
        use_vllm=True, vllm_mode="colocate", logging_steps=1, report_to="none",
        save_strategy="steps", save_steps=args.checkpoint_interval, save_only_model=False, seed=1,
        dataloader_num_workers=0, shuffle_dataset=False)
    started = time.perf_counter()
    trainer = GRPOTrainer(model=str(work / "model"), reward_funcs=repeat_letter, args=config, train_dataset=dataset,
                          callbacks=[StepClock()])
    ready = time.perf_counter()
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry or "reward" in entry]
    return {"trl": trl.__version__, "start_seconds": ready - started, "wall_seconds": time.perf_counter() - started,
            "step_seconds": step_times, "save_seconds": save_times, "phases": phases, "logs": logs,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}


# --- the parent -------------------------------------------------------------------------------

def child(piece: str, args, work: Path, extra: list[str] = ()) -> dict:
    out = work / f"{piece}{'-' + extra[-1] if extra else ''}.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", piece, "--work", str(work), *extra,
           *[a for a in sys.argv[1:] if a not in ("--child",)]]
    print(f"--- {piece} {' '.join(extra)}", flush=True)
    log = work / f"{piece}{'-' + extra[-1] if extra else ''}.log"
    started = time.perf_counter()
    with log.open("w") as f:
        code = subprocess.run(cmd + ["--out", str(out)], stdout=f, stderr=subprocess.STDOUT).returncode
    print(f"    {time.perf_counter() - started:.0f} s, exit {code}, log {log}", flush=True)
    text = log.read_text()
    startup = [line for line in text.splitlines() if STARTUP_LINES.search(line) and ("INFO" in line or "WARN" in line)]
    if code:
        print(text[-3000:], flush=True)
        return {"error": f"exit {code}", "startup_log": startup[-40:]}
    result = json.loads(out.read_text())
    result["startup_log"] = startup[-40:]
    return result


def ratio(numerator, denominator):
    """numerator / denominator, or None where either is missing (a piece that failed or did not run)."""
    return numerator / denominator if numerator and denominator else None


def measured(steps: list[dict], key: str) -> float:
    values = [s[key] for s in steps if key in s]
    return statistics.median(values) if values else 0.0


def summarize(results: dict, args) -> dict:
    hw = results.get("hardware", {})
    config = rl_shapes.PRESETS[args.preset]  # the model's shape (rl_shapes.make_model), all the roofline reads
    summary: dict = {}
    if hw and "error" not in hw:
        summary["roofline"] = decode_roofline(config, args.prompts, args.group_size, args.prompt_tokens,
                                              args.response_tokens, hw["hbm_gb_s"], hw["matmul_tflops"])
    for engine in GENERATE_ENGINES:
        gen = results.get(f"generate-{engine}", {})
        if gen.get("rounds"):
            warm = gen["rounds"][1:] or gen["rounds"]
            seconds = statistics.median(r["seconds"] for r in warm)
            tokens = statistics.median(r["response_tokens"] for r in warm)
            row = {"seconds": seconds, "tokens_per_second": ratio(tokens, seconds)}
            if "roofline" in summary:
                row["share_of_roofline"] = ratio(summary["roofline"]["seconds"], seconds)
            summary[f"raw_generate_{engine}_settings"] = row
        if gen.get("unseeded_round"):
            last = gen["unseeded_round"]
            summary[f"raw_generate_{engine}_settings_unseeded"] = {
                "seconds": last["seconds"], "tokens_per_second": ratio(last["response_tokens"], last["seconds"]),
                "seeded_over_unseeded_seconds": ratio(summary[f"raw_generate_{engine}_settings"]["seconds"],
                                                      last["seconds"])}
    ku = results.get("kuberl", {})
    if ku.get("steps"):
        steps = [s for s in ku["steps"] if s.get("step", 0) >= 2 and "step_seconds" in s]
        tokens = args.prompts * args.group_size * (args.prompt_tokens + args.response_tokens)
        phases = {phase: measured(steps, f"{phase}_seconds") for phase in
                  ("generate", "reward", "logprobs", "update", "checkpoint_wait", "weight_sync", "sleep", "wake",
                   "checkpoint_stall")}
        step = measured(steps, "step_seconds") + phases["checkpoint_stall"] / max(1, args.checkpoint_interval)
        summary["kuberl"] = {"step_seconds": step, "tokens_per_second": ratio(tokens, step), "phases": phases,
                             "reward_first": ku["steps"][0].get("reward_mean"),
                             "reward_last": ku["steps"][-1].get("reward_mean")}
        raw = summary.get("raw_generate_kuberl_settings")
        if raw:
            summary["kuberl"]["generate_vs_raw"] = ratio(raw["seconds"], phases["generate"])
        if "roofline" in summary:
            summary["kuberl"]["generate_share_of_roofline"] = ratio(summary["roofline"]["seconds"], phases["generate"])
    tr = results.get("trl", {})
    if tr.get("step_seconds"):
        steps = tr["step_seconds"][1:] or tr["step_seconds"]
        tokens = args.prompts * args.group_size * (args.prompt_tokens + args.response_tokens)
        by_name: dict[str, list[float]] = {}
        for name, seconds in tr["phases"]:
            by_name.setdefault(name, []).append(seconds)
        # Per step: TRL generates once per step (steps_per_generation = gradient_accumulation_steps).
        per_step = {name: sum(v) / len(tr["step_seconds"]) for name, v in by_name.items()}
        # Its saves run outside its step clock; like kuberl's checkpoint stall, one per interval
        # is part of a step's cost (both save the weights and the optimizer state as often).
        save = statistics.median(tr["save_seconds"]) if tr.get("save_seconds") else 0.0
        step_clock = statistics.median(steps)
        step = step_clock + save / max(1, args.checkpoint_interval)
        # TRL names its timers after the method: "GRPOTrainer.vLLM.generate" in 1.16.
        generate = next((v for name, v in per_step.items() if name.endswith("vLLM.generate")), None)
        summary["trl"] = {"step_seconds": step, "step_clock_seconds": step_clock, "save_seconds": save,
                          "tokens_per_second": ratio(tokens, step), "phases_per_step": per_step,
                          "generate_seconds": generate}
        if "roofline" in summary:
            summary["trl"]["generate_share_of_roofline"] = ratio(summary["roofline"]["seconds"], generate)
    if "kuberl" in summary and "trl" in summary:
        summary["step_speedup_vs_trl"] = ratio(summary["kuberl"]["tokens_per_second"],
                                               summary["trl"]["tokens_per_second"])
        summary["generate_speedup_vs_trl"] = ratio(summary["trl"]["generate_seconds"],
                                                   summary["kuberl"]["phases"]["generate"])
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="qwen2.5-1.5b", choices=sorted(rl_shapes.PRESETS))
    parser.add_argument("--prompts", type=int, default=64, help="prompts per step")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--response-tokens", type=int, default=1024)
    # Three steps: one checkpoint (step 2, 18 GB at the default shape, written then copied to its
    # root) fits a 64 GB disk beside TRL's; a second one at step 4 did not.
    parser.add_argument("--steps", type=int, default=3, help="step 1 warms up; the median of the rest is reported")
    parser.add_argument("--checkpoint-interval", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=8, help="samples per forward/backward")
    parser.add_argument("--micro-batch-tokens", type=int, default=16384, help="kuberl's packed micro-batches")
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.5, help="kuberl's engine")
    parser.add_argument("--work", default="/tmp/kuberl-rl-gpu")
    parser.add_argument("--only", default=",".join(PIECES), help=f"comma-separated subset of {PIECES}")
    parser.add_argument("--engines", default=",".join(GENERATE_ENGINES),
                        help=f"the raw generation runs: comma-separated subset of {GENERATE_ENGINES}")
    parser.add_argument("--json", help="write every figure here")
    parser.add_argument("--child", choices=PIECES, help=argparse.SUPPRESS)
    parser.add_argument("--engine", choices=GENERATE_ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--summarize", metavar="JSON", help="print the summary of a saved --json run again")
    args = parser.parse_args(argv)
    if args.summarize:
        saved = json.loads(Path(args.summarize).read_text())
        print(json.dumps(summarize(saved["results"], argparse.Namespace(**saved["args"])), indent=2))
        return 0
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    work = Path(args.work)
    if args.child:
        run = {"hardware": run_hardware, "generate": run_generate, "kuberl": run_kuberl, "trl": run_trl}[args.child]
        Path(args.out).write_text(json.dumps(run(args, work), default=str))
        return 0

    work.mkdir(parents=True, exist_ok=True)
    prepare(args, work)
    wanted = args.only.split(",")
    results: dict = {}
    report = {"args": vars(args), "results": results}

    def save() -> None:  # after every piece: a run cut short, or a summary that fails, loses nothing measured
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))

    if "hardware" in wanted and args.device == "cuda":
        results["hardware"] = child("hardware", args, work)
        save()
    if "generate" in wanted:
        for engine in args.engines.split(","):
            results[f"generate-{engine}"] = child("generate", args, work, ["--engine", engine])
            save()
    if "kuberl" in wanted:
        results["kuberl"] = child("kuberl", args, work)
        save()
    if "trl" in wanted:
        results["trl"] = child("trl", args, work)
        save()
    report["summary"] = summarize(results, args)
    print(json.dumps(report["summary"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
