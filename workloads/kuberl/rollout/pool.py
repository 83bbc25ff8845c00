"""The driver's handle on all rollout engines: creation, batched generation, HTTP serving.

How many engines and what each asks Ray for come from the run plan. Colocated engines ask for no
GPU: each runs on the GPUs of ``tensorParallelSize`` trainer ranks of one node (which Ray gave
those ranks), pinned to that node, and sleeps while the trainer steps."""

from __future__ import annotations

import logging

import ray

from kuberl.common.samples import Sample
from kuberl.job.plan import RunPlan

logger = logging.getLogger(__name__)


def colocated_devices(gpu_slots: list[tuple[str, str]], tensor_parallel_size: int) -> list[tuple[str, list[str]]]:
    """(node, GPU ids) of each colocated engine: the trainer ranks' GPUs (``gpu_slots``: node id
    and Ray GPU id per rank) grouped by node, cut into tensor-parallel groups."""
    by_node: dict[str, list[str]] = {}
    for node, gpu in gpu_slots:
        by_node.setdefault(node, []).append(gpu)
    out = []
    for node, gpus in by_node.items():
        if len(gpus) % tensor_parallel_size:
            raise ValueError(f"node {node} has {len(gpus)} trainer GPUs, not a multiple of "
                             f"rollout.tensorParallelSize {tensor_parallel_size}")
        out += [(node, gpus[i:i + tensor_parallel_size]) for i in range(0, len(gpus), tensor_parallel_size)]
    return out


class EnginePool:
    def __init__(self, spec, plan: RunPlan, served_model_name: str, *, num_engines: int | None = None,
                 gpu_slots: list[tuple[str, str]] | None = None):
        """``gpu_slots``: the trainer ranks' (node, GPU id), required when colocated on GPUs."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        from kuberl.rollout.engine import RolloutEngine

        self.spec = spec
        self.served_model_name = served_model_name
        layout = plan.layout
        self.colocated = layout.colocated
        count = num_engines if num_engines is not None else layout.engines
        if count < 1:
            raise ValueError(f"num_engines must be at least 1, got {count}")
        options = {"num_gpus": layout.gpus_per_engine, "max_concurrency": 1000,
                   **layout.slot_reservation(layout.rollout_resource, ray.cluster_resources())}
        if spec.rollout.env:
            options["runtime_env"] = {"env_vars": dict(spec.rollout.env)}
        placements: list[tuple[str | None, list[str] | None]] = [(None, None)] * count
        if layout.colocated and layout.gpus_per_rank:
            placements = colocated_devices(gpu_slots or [], layout.tensor_parallel_size)[:count]
            if len(placements) < count:
                raise ValueError(f"{count} colocated engines need {count * layout.tensor_parallel_size} "
                                 f"trainer GPUs; the trainer ranks hold {len(gpu_slots or [])}")
        actor_cls = ray.remote(RolloutEngine)
        self.engines = []
        for i, (node, devices) in enumerate(placements):
            where = ({"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}
                     if node is not None else {})
            self.engines.append(actor_cls.options(**options, **where).remote(
                spec, plan.paths, served_model_name, engine_index=i, devices=devices))
        # Surface start-up failures (bad model path, vLLM errors) here, not at the first request.
        # The vocabulary (one model, so every engine's is the same) bounds the endpoint's token ids.
        self.vocab_size = ray.get([engine.vocab_size.remote() for engine in self.engines])[0]
        self._server = None

    def generate(self, prompts: list[list[int]], n: int, temperature: float, max_tokens: int,
                 seed: int | None = None, **sampling) -> list[list[Sample]]:
        """Contiguous shares of ``prompts`` per engine; results in prompt order. ``sampling``:
        ``top_p``, ``top_k``, ``stop`` (``RolloutEngine.generate``)."""
        if not prompts:
            return []
        per = -(-len(prompts) // len(self.engines))
        refs = [engine.generate.remote(prompts[lo:lo + per], n, temperature=temperature,
                                       max_tokens=max_tokens, seed=seed, group_offset=lo, **sampling)
                for engine, lo in zip(self.engines, range(0, len(prompts), per))]
        return [group for share in ray.get(refs) for group in share]

    def weight_versions(self) -> list[int]:
        return ray.get([engine.weight_version.remote() for engine in self.engines])

    def sleep(self) -> None:
        ray.get([engine.sleep.remote() for engine in self.engines])

    def wake_up(self) -> None:
        ray.get([engine.wake_up.remote() for engine in self.engines])

    def serve(self, tokenizer, host: str = "127.0.0.1", port: int = 0, episodes=None) -> str:
        """Start the OpenAI/Anthropic endpoint in a background thread; returns its base URL.
        ``tokenizer``: the model's (the driver's), which renders chats into prompt ids here so
        the engines only generate; ``episodes``: the ``EpisodeLog`` that records agent episodes
        (the driver's)."""
        from kuberl.rollout.server import BackgroundServer, make_app

        if self._server is None:
            self._server = BackgroundServer(make_app(self, tokenizer, episodes), host, port)
            self._server.start()
        return self._server.url

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
        for engine in self.engines:
            try:
                ray.get(engine.shutdown.remote())
            except ray.exceptions.RayError as err:
                logger.warning("engine shutdown failed: %s", err)
            ray.kill(engine)
        self.engines = []
