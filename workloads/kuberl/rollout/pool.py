"""The driver's handle on all rollout engines: creation, batched generation, HTTP serving."""

from __future__ import annotations

import logging

import ray

from kuberl.samples import Sample

logger = logging.getLogger(__name__)

# Nodes that may host engines advertise this Ray custom resource (set by the RayJob render).
ROLLOUT_RESOURCE = "kuberl_rollout"


def default_num_engines(spec) -> int:
    rollout = spec.rollout
    if rollout.colocate:
        gpus = spec.trainer.replicas * spec.trainer.gpus_per_replica
    elif rollout.gpus_per_replica == 0:
        return rollout.replicas  # CPU engines: one per rollout pod
    else:
        gpus = rollout.replicas * rollout.gpus_per_replica
    return max(1, gpus // rollout.tensor_parallel_size)


class EnginePool:
    def __init__(self, spec, model_path: str, served_model_name: str, *, num_engines: int | None = None):
        from kuberl.rollout.engine import RolloutEngine

        self.spec = spec
        self.served_model_name = served_model_name
        count = num_engines if num_engines is not None else default_num_engines(spec)
        if count < 1:
            raise ValueError(f"num_engines must be at least 1, got {count}")
        rollout = spec.rollout
        gpus = 0 if rollout.gpus_per_replica == 0 and not rollout.colocate else rollout.tensor_parallel_size
        options = {"num_cpus": 1, "num_gpus": gpus, "max_concurrency": 1000}
        if rollout.env:
            options["runtime_env"] = {"env_vars": dict(rollout.env)}
        if ray.cluster_resources().get(ROLLOUT_RESOURCE, 0) > 0:
            options["resources"] = {ROLLOUT_RESOURCE: 1}
        actor_cls = ray.remote(RolloutEngine)
        self.engines = [actor_cls.options(**options).remote(spec, model_path, served_model_name,
                                                            engine_index=i)
                        for i in range(count)]
        # Surface start-up failures (bad model path, vLLM errors) here, not at the first request.
        ray.get([engine.weight_version.remote() for engine in self.engines])
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

    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start the OpenAI/Anthropic endpoint in a background thread; returns its base URL."""
        from kuberl.rollout.server import BackgroundServer, make_app

        if self._server is None:
            self._server = BackgroundServer(make_app(self), host, port)
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
