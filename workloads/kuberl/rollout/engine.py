"""One vLLM engine (one tensor-parallel group) as a Ray actor.

The engine is vLLM's ``AsyncLLM``: concurrent ``generate`` calls (the driver's batches and the
HTTP endpoint's requests) are batched together by vLLM's scheduler. Weight updates pause the
scheduler (waiting for in-flight requests, so every sample comes from exactly one weight
version), load through the workers' ``WeightReceiver`` extension, reset the prefix cache (cached
KV was computed with the old weights) and resume with ``weight_version`` incremented. With
``trainer.lora`` the engine serves the frozen base plus the policy's adapter: each sync loads the
new version's adapter (vLLM's LoRA support, from a directory in peft's format) and every request
carries it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import uuid

from kuberl.common.samples import Sample
from kuberl.job.plan import Paths

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "kuberl.sync.receiver.WeightReceiver"
# CPU engines' executor (vLLM resolves the name in its engine core process): workers forked from
# the engine core instead of spawned, one import of torch and vLLM fewer per engine start.
CPU_EXECUTOR = "kuberl.rollout.cpu_executor.ForkedWorkersExecutor"
# The ranks vLLM's max_lora_rank takes (vllm.config.lora.MaxLoRARanks); an adapter's rank may be
# any up to it, so an engine takes the smallest that holds trainer.lora.rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ADAPTER_NAME = "kuberl-policy"


def lora_kwargs(lora) -> dict:
    """vLLM's LoRA engine arguments for ``spec.trainer.lora``: one adapter, the policy's."""
    if lora is None:
        return {}
    return {"enable_lora": True, "max_loras": 1, "max_cpu_loras": 1,
            "max_lora_rank": next(r for r in VLLM_LORA_RANKS if r >= lora.rank)}


def batch_usage_context():
    """The usage context kuberl's engines start under: vLLM's offline ``LLM`` class's. vLLM sizes
    its batch limits by it: for ``LLM`` on a GPU of 70 GB or more, 1024 sequences and 16384
    tokens a step (256 and 8192 below that); for the ``AsyncLLM`` default (``ENGINE_CONTEXT``)
    only its generic 128 sequences and 2048 tokens, which would cut a step's 512 samples into
    four decode waves. Rollouts are batch work, so they take the batch defaults.
    ``spec.rollout.engineArgs`` still overrides both limits."""
    from vllm.usage.usage_lib import UsageContext

    return UsageContext.LLM_CLASS


def vllm_client_errors() -> tuple[type[Exception], ...]:
    """The exceptions vLLM raises for a request's own faults (a token id out of vocabulary, bad
    sampling parameters). Newer vLLM (0.32 here) gathers them under ``VLLMClientError``; 0.26, the
    GPU image's, has no such base and raises plain ``ValueError`` or ``TypeError`` (its own OpenAI
    server answers every ``ValueError`` with a 400 likewise)."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError, TypeError)
    return (VLLMClientError,)


class RequestRefused(ValueError):
    """A request's input refused by the engine's own checks (or vLLM's): the client's fault, which
    the HTTP endpoint answers with a 400 naming ``field``. Any other error of the engine is its own
    failure (a 500)."""

    def __init__(self, field: str, message: str):
        super().__init__(field, message)
        self.field, self.message = field, message

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


def engine_args(spec, local_model_path: str, served_model_name: str, *, engine_index: int,
                expert_parallel: int = 1):
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(**engine_kwargs(spec, local_model_path, served_model_name, engine_index=engine_index,
                                           expert_parallel=expert_parallel))


def engine_kwargs(spec, local_model_path: str, served_model_name: str, *, engine_index: int,
                  on_cpu: bool | None = None, expert_parallel: int = 1) -> dict:
    """vLLM engine arguments of engine ``engine_index`` (also what bench/rl_gpu.py gives a raw
    ``LLM`` to compare against kuberl's engine with the same settings). ``on_cpu`` None asks vLLM's
    platform; a bool leaves vLLM unimported (the unit tests run without it). ``expert_parallel``:
    the run plan's ``layout.engine_expert_parallel``; vLLM derives the EP size from the tensor-
    parallel size itself, so the plan's value must be that size (or 1, off)."""
    if on_cpu is None:
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
    rollout = spec.rollout
    if expert_parallel not in (1, rollout.tensor_parallel_size):
        raise ValueError(f"an engine's expert-parallel size is its tensor-parallel size "
                         f"({rollout.tensor_parallel_size}) or 1, got {expert_parallel}")
    # CPU engines only serve tests and laptops: full precision, so trainer and engine agree.
    dtype = "float32" if on_cpu or spec.trainer.param_dtype == "float32" else "bfloat16"
    # vLLM's CPU linear layers call kernels prepacked from the weights through per-layer
    # closures; a traced graph would keep the closures it saw, so weight sync could never reach
    # generation. No graph capture on CPU: the closures the reload rebuilds are the ones called.
    max_model_len = rollout.context_length()
    cpu_only = {
        "enforce_eager": True, "compilation_config": {"mode": 0},
        # After a partial (chunked) prefill step vLLM rewinds a seeded request's generator with
        # set_offset, which CPU generators refuse ("CPU Generator does not use offset"): the
        # engine dies. Every request here is seeded (exact resume), so CPU engines prefill whole
        # prompts; the batch budget must then hold the longest. tests/engine/driver/test_agent_e2e.py's
        # multi-turn prompts hit it.
        "enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 2048),
        "distributed_executor_backend": CPU_EXECUTOR,
    } if on_cpu else {}
    kwargs = dict(
        model=local_model_path,
        tokenizer=local_model_path,
        served_model_name=served_model_name,
        trust_remote_code=spec.model.trust_remote_code,
        dtype=dtype,
        tensor_parallel_size=rollout.tensor_parallel_size,
        enable_expert_parallel=expert_parallel > 1,
        gpu_memory_utilization=rollout.gpu_memory_utilization,
        max_model_len=max_model_len,
        seed=spec.algorithm.seed + engine_index,
        enable_prefix_caching=True,
        # The sampling policy's log-probs: after temperature, as the token was actually drawn.
        logprobs_mode="processed_logprobs",
        enable_sleep_mode=rollout.colocate and not on_cpu,
        worker_extension_cls=WORKER_EXTENSION,
        **lora_kwargs(spec.trainer.lora),
    )
    # spec.rollout.engineArgs (an allow-list) may override the tunable ones, e.g. prefix caching;
    # CPU engines keep their eager mode whatever the spec says.
    kwargs.update(rollout.engine_args.model_dump(exclude_none=True))
    kwargs.update(cpu_only)
    return kwargs


def rollout_sampling_params(*, n: int, temperature: float, max_tokens: int, top_p: float = 1.0, top_k: int = -1,
                            stop: list[str] | None = None, seed: int | None = None):
    """vLLM sampling parameters of one prompt's group in a rollout batch (``RolloutEngine.generate``).

    The driver decodes the responses it scores itself, so vLLM detokenizes only to find stop
    strings: incremental detokenization of every sequence at every step is host work the GPU
    waits on. Flat log-probs: a few lists per request instead of a dict and a ``Logprob`` per
    token, whose count grows with batch x length."""
    from vllm import SamplingParams

    return SamplingParams(n=n, temperature=temperature, max_tokens=max_tokens, logprobs=0, top_p=top_p,
                          top_k=top_k, stop=stop or None, seed=seed, detokenize=bool(stop), flat_logprobs=True)


def sampled_logprobs(token_ids: list[int], logprobs) -> list[float] | None:
    """The log-prob of each sampled token, from vLLM's per-position log-probs (``logprobs=0``:
    the sampled token alone at each position), flat or as one dict per position."""
    if logprobs is None:
        return None
    from vllm.logprobs import FlatLogprobs

    if isinstance(logprobs, FlatLogprobs) and len(logprobs.logprobs) == len(token_ids):
        if logprobs.token_ids != token_ids:
            raise RuntimeError("vLLM returned log-probs of tokens other than the sampled ones")
        return list(logprobs.logprobs)
    return [entry[tok].logprob for tok, entry in zip(token_ids, logprobs)]


class RolloutEngine:
    """Ray actor around one ``vllm.AsyncLLM``; see ``kuberl.rollout.pool.EnginePool``."""

    def __init__(self, spec, paths: Paths, served_model_name: str, *, engine_index: int = 0,
                 devices: list[str] | None = None, expert_parallel: int = 1):
        """``devices``: colocated on GPUs, the GPU ids of the trainer ranks this engine shares;
        ``expert_parallel``: the run plan's ``layout.engine_expert_parallel``."""
        if devices is not None:
            # Before vLLM starts its workers, which inherit it.
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(devices)
        if not spec.rollout.gpus_per_replica:
            # vLLM's CPU worker pins itself (and its OpenMP threads) to the node's cores but one,
            # the same cores for every engine of the node: on a small node every engine ran on
            # core 0, and a second engine starting beside a busy one was starved for minutes
            # (tests/e2e/test_resize_in_pods.py's join, CI of 2026-11-26). The kernel schedules
            # them instead; rollout.env may still set a binding.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        from vllm.v1.engine.async_llm import AsyncLLM

        from kuberl.common.metrics import start_pod_exporter
        from kuberl.storage import resolve

        start_pod_exporter("rollout", engine_index)
        self.spec = spec
        self.engine_index = engine_index
        self.served_model_name = served_model_name
        self._version = 0
        self._asleep = False
        # trainer.lora: the adapter every request carries (vLLM's LoRARequest); None until the
        # first sync, which is the base model exactly (an adapter starts with B = 0).
        self._adapter = None
        self._resources = contextlib.ExitStack()
        try:
            local = self._resources.enter_context(resolve(
                paths.model, revision=paths.model_revision, trust_remote_code=spec.model.trust_remote_code))
            self.engine = AsyncLLM.from_engine_args(
                engine_args(spec, local, served_model_name, engine_index=engine_index,
                            expert_parallel=expert_parallel),
                usage_context=batch_usage_context())
            self._resources.callback(self.engine.shutdown)
        except BaseException:
            # A staged model's temp dir must not outlive an engine that failed to start.
            self._resources.close()
            raise
        self.rollout = spec.rollout
        self.max_model_len = spec.rollout.context_length()

    # --- generation ------------------------------------------------------------------------
    async def _one(self, prompt_ids: list[int], params, group: int, token_text: bool = False) -> list[Sample]:
        """``token_text``: also keep each sampled token's text (``metadata["tokens"]``), as vLLM's
        detokenizer already decoded it for the log-probs, for the HTTP APIs' logprobs objects."""
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY
        final = None
        async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(prompt_ids)), params,
                                              uuid.uuid4().hex, lora_request=self._adapter):
            final = out
        version = self._version  # read at completion: a pause drains requests before loading
        samples = []
        for choice in sorted(final.outputs, key=lambda c: c.index):
            ids = list(choice.token_ids)
            logprobs = sampled_logprobs(ids, choice.logprobs)
            metadata = {"stop_reason": choice.stop_reason, "engine": self.engine_index}
            if token_text and choice.logprobs is not None:
                metadata["tokens"] = [entry[tok].decoded_token for tok, entry in zip(ids, choice.logprobs)]
            samples.append(Sample(
                prompt_ids=list(prompt_ids), response_ids=ids, response_logprobs=logprobs,
                weight_version=version, group=group, finish_reason=choice.finish_reason or "",
                response_text=choice.text, metadata=metadata))
        return samples

    def _response_tokens(self, prompt_ids: list[int], max_tokens: int, where: str) -> int:
        """The request's ``max_tokens`` as the engine's context allows it: refused when the prompt
        and ``max_tokens`` exceed the context, or with ``rollout.maxTotalLength`` cut to what the
        prompt leaves of that budget."""
        if not prompt_ids:
            raise RequestRefused(where, "empty prompt")
        if self.rollout.max_total_length is not None and len(prompt_ids) >= self.max_model_len:
            raise RequestRefused(where, f"{len(prompt_ids)} prompt tokens leave nothing of the engine's "
                                        f"context of {self.max_model_len} (rollout.maxTotalLength)")
        if self.rollout.max_total_length is None and len(prompt_ids) + max_tokens > self.max_model_len:
            raise RequestRefused(where, f"{len(prompt_ids)} prompt tokens + max_tokens {max_tokens} exceed "
                                        f"the engine's context of {self.max_model_len} "
                                        f"(rollout.maxPromptLength + rollout.maxResponseLength)")
        return self.rollout.response_limit(len(prompt_ids), max_tokens)

    async def generate(self, prompts: list[list[int]], n: int, *, temperature: float, max_tokens: int,
                       seed: int | None = None, group_offset: int = 0, top_p: float = 1.0, top_k: int = -1,
                       stop: list[str] | None = None) -> list[list[Sample]]:
        """``n`` samples per prompt with the sampled tokens' log-probs; ``Sample.group`` is the
        prompt's index (plus ``group_offset``, for the pool's share of a larger batch)."""
        limits = [self._response_tokens(prompt, max_tokens, f"prompt {group_offset + i}")
                  for i, prompt in enumerate(prompts)]
        requests = []
        for i, (prompt, limit) in enumerate(zip(prompts, limits)):
            group = group_offset + i
            params = rollout_sampling_params(n=n, temperature=temperature, max_tokens=limit, top_p=top_p,
                                             top_k=top_k, stop=stop, seed=None if seed is None else seed + group)
            requests.append(self._one(prompt, params, group))
        return list(await asyncio.gather(*requests))

    async def complete(self, prompt_ids: list[int], *, n: int = 1, temperature: float = 1.0,
                       top_p: float = 1.0, top_k: int = -1, max_tokens: int = 16, stop: list[str] | None = None,
                       seed: int | None = None, logprobs: bool = False, detokenize: bool = True) -> list[Sample]:
        """One request of the HTTP endpoint (already tokenized and validated there). ``detokenize``
        false: vLLM does not decode text step by step, and the samples' ``response_text`` is empty
        for the endpoint to decode once (``kuberl.rollout.server.decode_samples``). What vLLM's
        own checks refuse all the same is raised as ``RequestRefused``: vLLM raises its client errors
        (``vllm_client_errors``), and ``SamplingParams`` also ``ValueError`` or ``TypeError``. Its
        other errors (``EngineGenerateError``, ``EngineDeadError``) are the
        engine's and pass through."""
        from vllm import SamplingParams

        max_tokens = self._response_tokens(prompt_ids, max_tokens, "prompt")
        try:
            params = SamplingParams(n=n, temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                    stop=stop or None, seed=seed, logprobs=0 if logprobs else None,
                                    detokenize=detokenize)
        except (ValueError, TypeError, *vllm_client_errors()) as err:
            raise RequestRefused("sampling parameters", str(err)) from None
        try:
            return await self._one(prompt_ids, params, 0, token_text=logprobs and detokenize)
        except vllm_client_errors() as err:  # the engine's input checks, e.g. a token id out of vocabulary
            raise RequestRefused("prompt", str(err)) from None

    async def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Log-prob of each token given the ones before it (token 1 onwards), current weights."""
        from vllm import SamplingParams

        async def one(seq: list[int]) -> list[float]:
            from vllm.inputs import TokensPrompt

            params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0)
            final = None
            async for out in self.engine.generate(TokensPrompt(prompt_token_ids=list(seq)), params,
                                                  uuid.uuid4().hex, lora_request=self._adapter):
                final = out
            return [entry[tok].logprob for tok, entry in zip(seq[1:], final.prompt_logprobs[1:])]

        return list(await asyncio.gather(*(one(seq) for seq in sequences)))

    def pod(self) -> str:
        """The pod (in a KubeRay cluster; else the machine) this engine runs in: its host name, which
        Kubernetes sets to the pod's name. A scale-down keeps the pods live engines run in."""
        import socket

        return socket.gethostname()

    def vocab_size(self) -> int:
        """The model's vocabulary: token ids from 0 below it (the HTTP endpoint checks prompts given
        as ids against it, as vLLM does)."""
        return self.engine.vllm_config.model_config.get_vocab_size()

    # --- weights ----------------------------------------------------------------------------
    def weight_version(self) -> int:
        return self._version

    async def sync_info(self) -> dict:
        dtypes = await self.engine.collective_rpc("kuberl_model_dtype")
        return {"dtype": dtypes[0], "tensor_parallel_size": self.spec.rollout.tensor_parallel_size}

    async def rpc(self, method: str, *args) -> list:
        """Run a ``WeightReceiver`` method on every worker of this engine."""
        return await self.engine.collective_rpc(method, args=args)

    async def pause(self) -> None:
        await self.engine.pause_generation(mode="wait", clear_cache=True)

    async def resume(self, version: int) -> None:
        await self.engine.reset_prefix_cache()
        self._version = version
        await self.engine.resume_generation()

    async def update_weights(self, method: str, args: tuple, version: int) -> list:
        """Pause (in-flight requests finish first), load, reset the prefix cache, resume."""
        await self.pause()
        try:
            result = await self.rpc(method, *args)
        except BaseException:
            # Keep the old version number: the samples must not claim weights that never arrived.
            await self.resume(self._version)
            raise
        await self.resume(version)
        return result

    async def update_adapter(self, method: str, args: tuple, version: int, directory: str | None = None) -> list:
        """trainer.lora's sync: pause (in-flight requests finish first), have the workers run
        ``method(*args, directory)``, load the adapter in ``directory`` (peft's format) as
        version ``version``'s, reset the prefix cache, resume; later requests carry it.

        ``directory`` None: one of this engine's own, where the workers write what they received
        (nccl), removed once loaded; else the trainer wrote it there (checkpoint). vLLM reads the
        files once, at ``add_lora``, and keeps the adapter in memory: one adapter slot
        (``lora_kwargs``), and the old version leaves it when the new one arrives."""
        from vllm.lora.request import LoRARequest

        own = directory is None
        if own:
            directory = tempfile.mkdtemp(prefix=f"v{version:08d}-", dir=self._adapter_root())
        await self.pause()
        try:
            result = await self.rpc(method, *args, directory)
            # A fresh id per version (ids must be > 0); in place: the same version sent again
            # (an engine lost mid-sync) replaces what part of it arrived.
            name, lora_id = f"{ADAPTER_NAME}-v{version}", version + 1
            if not await self.engine.add_lora(LoRARequest(name, lora_id, directory, load_inplace=True)):
                raise RuntimeError(f"engine {self.engine_index}: vLLM did not load the adapter of weight "
                                   f"version {version} from {directory}")
            old, self._adapter = self._adapter, LoRARequest(name, lora_id, directory)
            if old is not None and old.lora_int_id != lora_id:
                await self.engine.remove_lora(old.lora_int_id)
        except BaseException:
            # Keep the old version and adapter: the samples must not claim weights that never arrived.
            await self.resume(self._version)
            raise
        finally:
            if own:
                shutil.rmtree(directory, ignore_errors=True)
        await self.resume(version)
        return result

    def _adapter_root(self) -> str:
        """This engine's own directory for the adapters its workers receive (memory-backed like
        the weight snapshots), removed with the engine."""
        from kuberl.sync.snapshot import snapshot_root

        root = snapshot_root() / f"engine-{self.engine_index}-{os.getpid()}"
        if not root.is_dir():
            root.mkdir(parents=True)
            self._resources.callback(shutil.rmtree, root, True)
        return str(root)

    async def sleep(self) -> bool:
        """Free the KV cache (and offload weights) while the colocated trainer runs; False where
        vLLM has no sleep mode (CPU)."""
        if not self.engine.vllm_config.model_config.enable_sleep_mode:
            logger.info("engine %d: sleep mode unavailable here; staying awake", self.engine_index)
            return False
        await self.engine.sleep(level=1, mode="wait")
        self._asleep = True
        return True

    async def wake_up(self) -> bool:
        if not self._asleep:
            return False
        await self.engine.wake_up()
        self._asleep = False
        return True

    def shutdown(self) -> None:
        self._resources.close()
