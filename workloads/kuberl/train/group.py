"""``TrainerGroup``: the trainer ranks as Ray actors forming one torch.distributed group.

The driver holds a plain ``TrainerGroup``; each method fans out to every actor and blocks until
all ranks return (every ``TrainerWorker`` method is collective). Rank 0 picks the rendezvous
address and a free port and hands them to the others, so nothing depends on RANK, MASTER_ADDR or
RAY_LOCAL_WORLD_SIZE being set in the environment. How many ranks, the GPUs and Ray resources
each asks for, where the model is and where each rank may write: all from the run plan.

A rank that dies (its process crashes, its pod or node goes) surfaces as ``TrainerLost`` from the
call under way, at once: the driver does not wait for its peers, which may sit in a collective
with the dead rank until the process group's timeout. ``replace`` then ends every rank and starts
a new group of the next epoch (``kuberl.storage.claim_epoch``) once Ray has the resources for it.
"""

from __future__ import annotations

import logging
import os
import tempfile
from contextlib import ExitStack
from typing import Any, Callable

import ray

from kuberl.common.ports import unclaimed_port
from kuberl.common.samples import TrainBatch
from kuberl.job.plan import Resume, RunPlan
from kuberl.train.checkpoint import CONCURRENCY_GROUP, find_checkpoint

log = logging.getLogger("kuberl.train")

CLOSE_TIMEOUT_S = 30
# After one rank's call failed, how long to wait for the others' results before that failure is
# taken as the run's own: a collective on a rank that died fails on its peers (gloo: the socket
# closes) slightly before Ray reports the death itself.
PEER_DEATH_GRACE_S = 30


class TrainerLost(RuntimeError):
    """A trainer rank's actor died: its process, pod or node is gone."""

    def __init__(self, rank: int, cause: BaseException):
        super().__init__(f"trainer rank {rank} lost ({type(cause).__name__}: {str(cause).splitlines()[0]})")
        self.rank = rank


class TrainerCapacityError(RuntimeError):
    """No resources for a replacement trainer group appeared within the wait."""


class TrainerActor:
    """Hosts one ``TrainerWorker``; torch is imported only inside the actor process."""

    def __init__(self):
        self.worker = None
        self.checkpointer = None
        self.scratch = None
        # Holds the staged model directory (s3/gs: a temporary copy on this node) open while the
        # worker lives: export_hf reads the tokenizer from it.
        self._model_dir = ExitStack()

    def rendezvous(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), unclaimed_port("")

    def setup(self, plan: RunPlan, config, *, rank: int, master_addr: str, master_port: int,
              numa_policy: str) -> tuple[str, str]:
        """Returns (node id, GPU id) of this rank: where colocated engines go."""
        import torch

        from kuberl.common.metrics import start_pod_exporter
        from kuberl.storage import resolve
        from kuberl.train.checkpoint import RankCheckpointer
        from kuberl.train.worker import TrainerWorker

        start_pod_exporter("trainer", rank)  # NUMA placement (kuberl_numa_*) of this pod
        layout = plan.layout
        use_gpu = layout.gpus_per_rank > 0
        local_rank = rank % layout.ranks_per_pod
        # This rank's own scratch, temp files included: nothing here is shared with another rank.
        scratch = self.scratch = plan.rank_scratch(rank)
        (scratch / "tmp").mkdir(parents=True, exist_ok=True)
        os.environ["TMPDIR"] = tempfile.tempdir = str(scratch / "tmp")

        # Every node stages on its own (no shared filesystem); local paths pass through.
        local_path = self._model_dir.enter_context(resolve(
            plan.paths.model, revision=plan.paths.model_revision,
            trust_remote_code=config.model.trust_remote_code))

        if use_gpu:
            from kuberl.numa import pin_current_process

            pin_current_process(local_rank, numa_policy)
            # Ray sets CUDA_VISIBLE_DEVICES to this actor's GPU: it is device 0 here.
            device = torch.device("cuda", 0)
        else:
            device = torch.device("cpu")
        self.worker = TrainerWorker(local_path, config, rank=rank, world_size=layout.world_size,
                                    master_addr=master_addr, master_port=master_port, device=device)
        if plan.checkpoints.root:
            self.checkpointer = RankCheckpointer(self.worker, plan.checkpoints, scratch / "checkpoints")
            self.worker.before_update = self.checkpointer.fence
        return ray.get_runtime_context().get_node_id(), (str(ray.get_gpu_ids()[0]) if use_gpu else "")

    def call(self, method: str, *args, **kwargs) -> Any:
        return getattr(self.worker, method)(*args, **kwargs)

    def execute(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        return fn(self.worker, *args, **kwargs)

    # Checkpoints: the rank's own shards, written and uploaded from its own node.
    def save_checkpoint(self, step: int) -> float:
        return self.checkpointer.save(step)

    @ray.method(concurrency_group=CONCURRENCY_GROUP)
    def checkpoint_uploaded(self, step: int) -> list[dict]:
        return self.checkpointer.uploaded(step)

    @ray.method(concurrency_group=CONCURRENCY_GROUP)
    def commit_checkpoint(self, step: int, files: list[dict], driver_state: dict) -> str:
        return self.checkpointer.commit(step, files, driver_state)

    def find_checkpoint(self, resume: Resume) -> str | None:
        return find_checkpoint(resume)

    def claim_epoch(self) -> int:
        return self.checkpointer.claim_epoch()

    def join_epoch(self, epoch: int) -> None:
        """Every rank carries its group's epoch; rank 0, which withdraws and commits, is fenced by it."""
        self.checkpointer.epoch = epoch

    def load_checkpoint(self, uri: str) -> dict:
        return self.checkpointer.load(uri)

    def export_hugging_face(self, target_uri: str) -> str:
        """Collective: the full model gathered to rank 0, written on rank 0's node with the
        model's remote-code files, and uploaded from there to ``target_uri``."""
        import shutil

        from kuberl.train.export import publish_export

        out = self.scratch / "hf-export"
        shutil.rmtree(out, ignore_errors=True)
        self.worker.export_hf(str(out))
        if self.worker.rank != 0:
            return target_uri
        try:
            return publish_export(out, self.worker.model_path, target_uri,
                                  trust_remote_code=self.worker.config.model.trust_remote_code)
        finally:
            shutil.rmtree(out, ignore_errors=True)

    def close(self) -> None:
        try:
            if self.checkpointer is not None:
                self.checkpointer.close()
            if self.worker is not None:
                self.worker.shutdown()
        finally:
            self._model_dir.close()


class TrainerGroup:
    """``plan.paths.model``: a local directory or any model URI ``kuberl.storage.resolve`` accepts
    (s3://, gs://, hf://, pvc://): each rank resolves it on its own node."""

    def __init__(self, spec, plan: RunPlan, *, ready_timeout: float | None = None):
        """``ready_timeout``: how long the ranks may wait for their resources; by default as long
        as it takes (the first group of a run: the cluster is just coming up)."""
        self.spec, self.plan = spec, plan
        self.world_size = plan.layout.world_size
        self.actors: list = []
        self.epoch = 0  # this group's generation: claimed under the checkpoint root when there is one
        self._start(ready_timeout)

    def _start(self, ready_timeout: float | None) -> None:
        from kuberl.train.worker import TrainerConfig

        spec, plan, layout = self.spec, self.plan, self.plan.layout
        use_gpu = layout.gpus_per_rank > 0
        actor_cls = ray.remote(concurrency_groups={CONCURRENCY_GROUP: 1})(TrainerActor).options(
            num_gpus=layout.gpus_per_rank, **layout.slot_reservation(layout.trainer_resource),
            **({"runtime_env": {"env_vars": dict(spec.rollout.env)}} if spec.rollout.env else {}))
        self.actors = [actor_cls.remote() for _ in range(self.world_size)]
        try:
            # Every rank placed (Ray starts an actor once its resources exist); rank 0 names the rendezvous.
            addresses = [actor.rendezvous.remote() for actor in self.actors]
            ready, _ = ray.wait(addresses, num_returns=self.world_size, timeout=ready_timeout)
            if len(ready) < self.world_size:
                raise TrainerCapacityError(
                    f"only {len(ready)} of {self.world_size} trainer ranks got their resources "
                    f"({layout.gpus_per_rank} GPUs each) within {ready_timeout:.0f} s")
            master_addr, master_port = self._gather(addresses)[0]
            config = TrainerConfig.from_spec(spec, on_gpu=use_gpu, expert_parallel=layout.trainer_mesh.ep)
            log.info("trainer group: %d ranks, rendezvous %s:%d, %s", self.world_size, master_addr, master_port,
                     "NCCL on GPU" if use_gpu else "gloo on CPU")
            # (node, GPU id) per rank: colocated engines run on these GPUs.
            self.gpu_slots = self._gather([actor.setup.remote(plan, config, rank=rank, master_addr=master_addr,
                                                              master_port=master_port, numa_policy=spec.numa.policy)
                                           for rank, actor in enumerate(self.actors)])
            if plan.checkpoints.root:  # fences out every older group's checkpoint writes
                self.epoch = self._gather([self.actors[0].claim_epoch.remote()])[0]
                self._gather([actor.join_epoch.remote(self.epoch) for actor in self.actors])
            else:
                self.epoch += 1
        except TrainerCapacityError:
            self.kill()  # ranks never placed have nothing to close
            raise
        except BaseException:
            self.shutdown()
            raise

    def replace(self, ready_timeout: float) -> None:
        """A rank was lost: end every rank now (the survivors may be stuck in a collective with it),
        then start a new group of the next epoch, waiting at most ``ready_timeout`` seconds for
        its resources (in a cluster: KubeRay's replacement pod joining)."""
        self.kill()
        self._start(ready_timeout)

    def _gather(self, refs: list) -> list[Any]:
        """The results of one call per rank, in rank order; ``TrainerLost`` as soon as a rank's
        actor is dead, whether the others have returned or not."""
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            try:
                results[ready[0]] = ray.get(ready[0])
            except ray.exceptions.RayActorError as exc:
                raise TrainerLost(rank_of[ready[0]], exc) from None
            except ray.exceptions.RayTaskError:
                lost = self._dead_peer(pending, rank_of)
                if lost is not None:
                    raise lost from None
                raise
        return [results[ref] for ref in refs]

    @staticmethod
    def _dead_peer(pending: list, rank_of: dict) -> TrainerLost | None:
        """After one rank's call raised: the first rank found dead among the rest, if any."""
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_DEATH_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                return TrainerLost(rank_of[ref], exc)
            except ray.exceptions.RayError:
                pass
        return None

    def _all(self, method: str, *args, **kwargs) -> list[Any]:
        return self._gather([actor.call.remote(method, *args, **kwargs) for actor in self.actors])

    def log_probs(self, batch: TrainBatch) -> list[list[float]]:
        return self._all("log_probs", batch)[0]

    def ref_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        return self._all("ref_log_probs", batch)[0]

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        return self._all("train_step", batch)[0]

    # --- checkpoints (kuberl.train.checkpoint) ---------------------------------------------

    def save_checkpoint(self, step: int) -> float:
        """Every rank starts writing its shards; returns the longest stall a rank saw."""
        return max(self._gather([actor.save_checkpoint.remote(step) for actor in self.actors]))

    def checkpoint_uploaded(self, step: int) -> list[dict]:
        """Every rank's files of checkpoint ``step``, once all are durable (runs beside training)."""
        return [f for files in self._gather([actor.checkpoint_uploaded.remote(step) for actor in self.actors])
                for f in files]

    def commit_checkpoint(self, step: int, files: list[dict], driver_state: dict) -> str:
        return self._gather([self.actors[0].commit_checkpoint.remote(step, files, driver_state)])[0]

    def find_checkpoint(self, resume: Resume) -> str | None:
        """Asked of rank 0: the trainers hold the checkpoint credentials, the driver none."""
        return self._gather([self.actors[0].find_checkpoint.remote(resume)])[0]

    def load_checkpoint(self, uri: str) -> dict:
        return self._gather([actor.load_checkpoint.remote(uri) for actor in self.actors])[0]

    def export_hugging_face(self, target_uri: str) -> str:
        """The trained model as a Hugging Face checkpoint at ``target_uri`` (the run plan's
        ``checkpoints.export_uri``), written from rank 0's node: nothing passes through the driver."""
        return self._gather([actor.export_hugging_face.remote(target_uri) for actor in self.actors])[0]

    def execute(self, fn: Callable[..., Any], *args, **kwargs) -> list[Any]:
        return self._gather([actor.execute.remote(fn, *args, **kwargs) for actor in self.actors])

    def shutdown(self) -> None:
        """Leave the process group and remove staged model copies, then end the actors (killed
        regardless after ``CLOSE_TIMEOUT_S``: a rank stuck in a collective must not block this)."""
        try:
            ray.get([actor.close.remote() for actor in self.actors], timeout=CLOSE_TIMEOUT_S)
        except (ray.exceptions.RayError, TimeoutError) as exc:
            log.warning("trainer group: closing ranks failed (%s); killing them", exc)
        self.kill()

    def kill(self) -> None:
        """End every rank at once, without closing anything (a lost group)."""
        for actor in self.actors:
            ray.kill(actor)
        self.actors = []
