"""``TrainerGroup``: the trainer ranks as Ray actors forming one torch.distributed group.

The driver holds a plain ``TrainerGroup``; each method fans out to every actor and blocks until
all ranks return (every ``TrainerWorker`` method is collective). Rank 0 picks the rendezvous
address and a free port and hands them to the others, so nothing depends on RANK, MASTER_ADDR or
RAY_LOCAL_WORLD_SIZE being set in the environment.
"""

from __future__ import annotations

import logging
import socket
from contextlib import ExitStack
from typing import Any, Callable

import ray

from kuberl.samples import TrainBatch

log = logging.getLogger("kuberl.train")

# The custom Ray resource that `kuberl render` puts on the trainer worker group's pods.
TRAINER_RESOURCE = "kuberl_trainer"
CLOSE_TIMEOUT_S = 30


class TrainerActor:
    """Hosts one ``TrainerWorker``; torch is imported only inside the actor process."""

    def __init__(self):
        self.worker = None
        # Holds the staged model directory (s3/gs: a temporary copy on this node) open while the
        # worker lives: export_hf reads the tokenizer from it.
        self._model_dir = ExitStack()

    def rendezvous(self) -> tuple[str, int]:
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", 0))
            return host, s.getsockname()[1]

    def setup(self, model_path: str, config, *, revision: str | None, rank: int, world_size: int,
              master_addr: str, master_port: int, use_gpu: bool, local_rank: int, numa_policy: str) -> None:
        import torch

        from kuberl.metrics import start_pod_exporter
        from kuberl.storage import resolve
        from kuberl.train.worker import TrainerWorker

        start_pod_exporter("trainer", rank)  # NUMA placement (kuberl_numa_*) of this pod

        # Every node stages on its own (no shared filesystem); local paths pass through.
        local_path = self._model_dir.enter_context(
            resolve(model_path, revision=revision, trust_remote_code=config.model.trust_remote_code))

        if use_gpu:
            from kuberl.numa import pin_current_process

            pin_current_process(local_rank, numa_policy)
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is device 0 here.
            device = torch.device("cuda", 0)
        else:
            device = torch.device("cpu")
        self.worker = TrainerWorker(local_path, config, rank=rank, world_size=world_size,
                                    master_addr=master_addr, master_port=master_port, device=device)

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def execute(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        return fn(self.worker, *args, **kwargs)

    def close(self) -> None:
        try:
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            self._model_dir.close()


class TrainerGroup:
    """``model_path``: a local directory or any model URI ``kuberl.storage.resolve`` accepts
    (s3://, gs://, hf://, pvc://): each rank resolves it on its own node."""

    def __init__(self, spec, model_path: str, *, world_size: int | None = None,
                 resources_per_worker: dict | None = None, num_cpus_per_worker: float = 1):
        from kuberl.train.worker import TrainerConfig

        trainer = spec.trainer
        per_replica = trainer.gpus_per_replica or trainer.processes_per_replica
        self.world_size = world_size or trainer.replicas * per_replica
        use_gpu = trainer.gpus_per_replica > 0
        if resources_per_worker is None:
            resources_per_worker = {TRAINER_RESOURCE: 1} if TRAINER_RESOURCE in ray.cluster_resources() else {}
        actor_cls = ray.remote(TrainerActor).options(
            num_cpus=num_cpus_per_worker, num_gpus=1 if use_gpu else 0, resources=resources_per_worker,
            **({"runtime_env": {"env_vars": dict(spec.rollout.env)}} if spec.rollout.env else {}))
        self.actors = [actor_cls.remote() for _ in range(self.world_size)]
        master_addr, master_port = ray.get(self.actors[0].rendezvous.remote())
        config = TrainerConfig.from_spec(spec, on_gpu=use_gpu)
        log.info("trainer group: %d ranks, rendezvous %s:%d, %s", self.world_size, master_addr, master_port,
                 "NCCL on GPU" if use_gpu else "gloo on CPU")
        try:
            ray.get([actor.setup.remote(model_path, config, revision=spec.model.revision, rank=rank, world_size=self.world_size,
                                        master_addr=master_addr, master_port=master_port, use_gpu=use_gpu,
                                        local_rank=rank % per_replica, numa_policy=spec.numa.policy)
                     for rank, actor in enumerate(self.actors)])
        except Exception:
            self.shutdown()
            raise

    def _all(self, method: str, *args, **kwargs) -> list[Any]:
        return ray.get([actor.call.remote(method, *args, **kwargs) for actor in self.actors])

    def log_probs(self, batch: TrainBatch) -> list[list[float]]:
        return self._all("log_probs", batch)[0]

    def ref_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        return self._all("ref_log_probs", batch)[0]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("train_step", batch)[0]

    def save_state(self, path: str) -> None:
        self._all("save_state", path)

    def load_state(self, path: str) -> None:
        self._all("load_state", path)

    def export_hf(self, path: str) -> None:
        self._all("export_hf", path)

    def execute(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        return ray.get([actor.execute.remote(fn, *args, **kwargs) for actor in self.actors])

    def shutdown(self) -> None:
        """Leave the process group and remove staged model copies, then end the actors (killed
        regardless after ``CLOSE_TIMEOUT_S``: a rank stuck in a collective must not block this)."""
        try:
            ray.get([actor.close.remote() for actor in self.actors], timeout=CLOSE_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("trainer group: closing ranks failed (%s); killing them", exc)
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
