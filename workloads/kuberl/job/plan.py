"""The run plan: every decision about how a job runs, made once, from the spec.

``for_cluster(job, attempt)`` is what the renderer writes into the job's ConfigMap beside the
accepted spec (``plan.yaml``); ``local(job, work_dir)`` is the same plan for ``kuberl train`` on a
machine without Kubernetes. The driver, the trainer ranks, the engines and the operator's status
computation all take a ``RunPlan`` and re-derive nothing: counts of ranks, engines and pods, the
GPUs each Ray actor asks for, the Ray resource names, the paths inside a pod, where checkpoints
go and which checkpoint a run restores.

A plan is data, not code: pydantic, strict, loaded with ``read`` from the YAML the renderer wrote.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import AliasChoices, BaseModel, ConfigDict, Field, model_validator

from kuberl.api import uri as uris
from kuberl.api import types as t
from kuberl.api.contract import (AGENT_CODE_DIR, DATA_DIR, MODEL_DIR, PLAN_FILE, REWARD_CODE_DIR, ROLLOUT_GROUP,
                                 ROLLOUT_RESOURCE, SCRATCH_DIR, TRAINER_GROUP, TRAINER_RESOURCE,
                                 VALIDATION_DATA_DIR)

EXPORT_DIR = "hf"
# libyaml's safe loader when PyYAML has it (its wheels do): 15x faster than the pure-Python one,
# and the operator reads every job's ConfigMap (spec and plan) on every reconcile.
YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# Likewise libyaml's dumper: the operator writes a new job's spec and plan into its ConfigMap, and
# the pure-Python emitter was the largest CPU item of rendering a job (bench/operator_scale.py).
YAML_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class TrainerMesh(Frozen):
    """The trainer ranks' device mesh: ``dp_shard`` x ``ep`` = world size. Dense weights are FSDP2-
    sharded over all ranks; each group of ``ep`` consecutive ranks splits the experts (expert
    parallelism, spec.trainer.parallelism.expert), and the ``dp_shard`` ranks holding the same
    experts FSDP2-shard them between them."""

    dp_shard: int
    ep: int = 1


class ProcessLayout(Frozen):
    """How many processes of each kind run where (pods, trainer ranks, engines), and what each asks
    Ray for; the machine's own topology (NUMA nodes, GPUs, CPUs) is ``kuberl.numa.topology``'s.
    Colocated engines ask for no GPU of their own: the trainer ranks hold every GPU of a pod, and
    each engine runs on the GPUs of trainer ranks of its node (sleeping while they train), so the
    pod's GPUs are counted exactly once."""

    trainer_pods: int
    ranks_per_pod: int
    world_size: int
    # None only in plans written before expert parallelism: read as (world_size, 1).
    trainer_mesh: TrainerMesh | None = None
    gpus_per_rank: int                  # 1 on GPU, 0 on CPU (gloo)
    rollout_pods: int                   # 0 when colocated
    engines_per_pod: int
    engines: int
    gpus_per_engine: int                # what the engine actor asks Ray for
    tensor_parallel_size: int
    # Each engine's expert-parallel size (spec.rollout.expertParallel): its tensor-parallel GPUs
    # split the experts; 1: no expert parallelism (vLLM's enable_expert_parallel off).
    engine_expert_parallel: int = 1
    colocated: bool
    expected_pods: int                  # head + trainer pods + rollout pods
    trainer_resource: str = TRAINER_RESOURCE
    rollout_resource: str = ROLLOUT_RESOURCE
    # Per worker group: the custom Ray resources its pods advertise (rayStartParams.resources).
    group_resources: dict[str, dict[str, int]]
    # In a RayJob each rank and engine reserves its group's slot resource; on a local Ray (no pods
    # advertise slots) a logical CPU. Decided by the plan, never by what the cluster shows at the
    # moment: while a trainer pod is being replaced its slots are missing, and a rank asking for a
    # CPU instead would start on another group's pod. True for plans written before this field.
    slots: bool = True

    @model_validator(mode="after")
    def _plain_fsdp_mesh(self) -> "ProcessLayout":
        if self.trainer_mesh is None:
            object.__setattr__(self, "trainer_mesh", TrainerMesh(dp_shard=self.world_size))
        if self.trainer_mesh.dp_shard * self.trainer_mesh.ep != self.world_size:
            raise ValueError(f"trainer_mesh {self.trainer_mesh} does not cover the {self.world_size} trainer ranks")
        return self

    def slot_reservation(self, resource: str) -> dict[str, Any]:
        """What one trainer rank or engine asks Ray for, besides GPUs.

        In a RayJob its group's pods advertise ``resource`` (one unit per process slot), and the
        slot is the whole reservation: the pod's CPUs are Kubernetes' to account (its requests),
        and Ray's CPUs there (``num-cpus``, the request's whole CPUs) are left to reward workers.
        Reserving a CPU per rank as well would leave a pod that requests fewer CPUs than it runs
        processes with ranks that never start. On a local Ray there are no slots: one logical CPU
        each (``kuberl train`` gives Ray enough of them)."""
        if self.slots:
            return {"num_cpus": 0, "resources": {resource: 1}}
        return {"num_cpus": 1}


class Paths(Frozen):
    """Where a process finds its inputs. In a pod these are the staged copies or mounted claims;
    on a laptop the URIs themselves, fetched by ``kuberl.storage.resolve``."""

    model: str
    # A Hugging Face revision, only while ``model`` is still a Hub id to fetch (never for a
    # staged directory: the stager already took the revision).
    model_revision: str | None = None
    data: str
    validation_data: str | None = None  # spec.validation.uri's copy; None without validation
    scratch: str
    # The directories of spec.reward.source and spec.agent.source, where the run uses them (in a
    # pod the mounted ConfigMap or the stager's verified copy; locally source.uri, fetched by
    # kuberl.storage.code.code_dir); None: the code is in the image.
    reward_code: str | None = None
    agent_code: str | None = None


class Checkpoints(Frozen):
    root: str | None                    # spec.checkpoint.uri
    interval_steps: int
    keep: int
    format: Literal["dcp", "tar"]
    export_hugging_face: bool
    export_uri: str | None              # <root>/hf

    def export_uri_at(self, step: int) -> str:
        """Where a periodic export (checkpoint.exportIntervalSteps) of ``step`` goes."""
        if self.root is None:
            raise ValueError("a Hugging Face export needs spec.checkpoint.uri")
        return uris.parse(self.root, "spec.checkpoint.uri").join(f"hf-step-{step}")


class Resume(Frozen):
    """Which checkpoint this attempt restores, decided from the spec alone (never from the job's
    status, which the workload itself may write): the newest complete ``step-<n>`` below
    ``newest_under`` if there is one, else ``explicit`` (a checkpoint the spec names; it must be
    complete), else nothing."""

    newest_under: str | None = None
    explicit: str | None = None


class RunPlan(Frozen):
    job: str
    namespace: str
    attempt: int
    # plan.yaml of a job rendered before the rename says ``topology``: still read.
    layout: ProcessLayout = Field(validation_alias=AliasChoices("layout", "topology"))
    paths: Paths
    checkpoints: Checkpoints
    resume: Resume

    def rank_scratch(self, rank: int) -> Path:
        return Path(self.paths.scratch) / f"rank-{rank}"

    def dump(self) -> str:
        return yaml.dump(self.model_dump(mode="json"), Dumper=YAML_DUMPER, sort_keys=False)


def process_layout(spec: t.RLTrainingJobSpec, *, slots: bool) -> ProcessLayout:
    trainer, rollout = spec.trainer, spec.rollout
    ranks_per_pod = trainer.gpus_per_replica or trainer.processes_per_replica
    gpus_per_rank = 1 if trainer.gpus_per_replica else 0
    world_size = trainer.replicas * ranks_per_pod
    ep = trainer.parallelism.expert
    tp = rollout.tensor_parallel_size
    if rollout.colocate:
        rollout_pods = 0
        engines_per_pod = trainer.gpus_per_replica // tp
        engines = trainer.replicas * engines_per_pod
        gpus_per_engine = 0
        groups = {TRAINER_GROUP: {TRAINER_RESOURCE: ranks_per_pod, ROLLOUT_RESOURCE: engines_per_pod}}
    else:
        rollout_pods = rollout.replicas
        # CPU engines: one per rollout pod.
        engines_per_pod = max(1, rollout.gpus_per_replica // tp)
        engines = rollout_pods * engines_per_pod
        gpus_per_engine = tp if rollout.gpus_per_replica else 0
        groups = {TRAINER_GROUP: {TRAINER_RESOURCE: ranks_per_pod},
                  ROLLOUT_GROUP: {ROLLOUT_RESOURCE: engines_per_pod}}
    return ProcessLayout(
        trainer_pods=trainer.replicas, ranks_per_pod=ranks_per_pod,
        world_size=world_size, gpus_per_rank=gpus_per_rank,
        trainer_mesh=TrainerMesh(dp_shard=world_size // ep, ep=ep),
        rollout_pods=rollout_pods, engines_per_pod=engines_per_pod, engines=engines,
        gpus_per_engine=gpus_per_engine, tensor_parallel_size=tp,
        engine_expert_parallel=tp if rollout.expert_parallel else 1, colocated=rollout.colocate,
        expected_pods=1 + trainer.replicas + rollout_pods, group_resources=groups, slots=slots)


def checkpoints(spec: t.RLTrainingJobSpec) -> Checkpoints:
    ck = spec.checkpoint
    export = ck.uri.parsed.join(EXPORT_DIR) if ck.uri else None
    return Checkpoints(root=ck.uri, interval_steps=ck.interval_steps, keep=ck.keep, format=ck.format,
                       export_hugging_face=ck.export_hugging_face, export_uri=export)


def resume(spec: t.RLTrainingJobSpec, attempt: int) -> Resume:
    """attempt 0 does what spec.checkpoint.resume says; every restart continues from the job's own
    newest checkpoint under spec.checkpoint.uri, or where attempt 0 started if it saved none."""
    ck = spec.checkpoint
    explicit = None if ck.resume in ("auto", "never") else ck.resume
    if explicit is not None:
        explicit.parsed  # a bad URI stops the plan here, naming spec.checkpoint.resume
    if attempt == 0 and ck.resume == "never":
        return Resume()
    newest_under = ck.uri if (ck.resume == "auto" or attempt > 0) else None
    return Resume(newest_under=newest_under, explicit=explicit)


def reward_source(spec: t.RLTrainingJobSpec) -> t.CodeSource | None:
    """spec.reward.source where the run loads the reward function (with spec.agent, the episodes'
    rewards replace spec.reward)."""
    return spec.reward.source if spec.agent is None else None


def agent_source(spec: t.RLTrainingJobSpec) -> t.CodeSource | None:
    return spec.agent.source if spec.agent is not None else None


def in_pod_path(uri: uris.SpecURI, staged_dir: str) -> str:
    """The path a container reads the spec's ``uri`` from: the staged copy, a mounted claim, or
    the path."""
    return uris.in_pod_path(uri.parsed, staged_dir)


def for_cluster(job: t.RLTrainingJob, attempt: int = 0) -> RunPlan:
    spec = job.spec
    return RunPlan(
        job=job.metadata.name, namespace=job.metadata.namespace, attempt=attempt,
        layout=process_layout(spec, slots=True),
        paths=Paths(model=in_pod_path(spec.model.uri, MODEL_DIR),
                    data=in_pod_path(spec.data.uri, DATA_DIR),
                    validation_data=(in_pod_path(spec.validation.uri, VALIDATION_DATA_DIR)
                                     if spec.validation is not None else None),
                    scratch=SCRATCH_DIR,
                    reward_code=REWARD_CODE_DIR if reward_source(spec) else None,
                    agent_code=AGENT_CODE_DIR if agent_source(spec) else None),
        checkpoints=checkpoints(spec), resume=resume(spec, attempt))


def local(job: t.RLTrainingJob, work_dir: Path, attempt: int = 0) -> RunPlan:
    """``kuberl train`` outside Kubernetes: every process fetches its inputs itself."""
    spec = job.spec
    model = spec.model.uri.parsed
    revision = spec.model.revision if model.info.hub else None
    return RunPlan(
        job=job.metadata.name, namespace=job.metadata.namespace, attempt=attempt,
        layout=process_layout(spec, slots=False),
        paths=Paths(model=spec.model.uri, model_revision=revision, data=spec.data.uri,
                    validation_data=spec.validation.uri if spec.validation is not None else None,
                    scratch=str(Path(work_dir) / "scratch"),
                    reward_code=_local_code(reward_source(spec)), agent_code=_local_code(agent_source(spec))),
        checkpoints=checkpoints(spec), resume=resume(spec, attempt))


def _local_code(source: t.CodeSource | None) -> str | None:
    """Outside Kubernetes a source is its URI (a ConfigMap has no meaning there: None, and loading
    the code says so)."""
    return str(source.uri) if source is not None and source.uri is not None else None


def read(text: str) -> RunPlan:
    return RunPlan.model_validate(yaml.load(text, Loader=YAML_LOADER))


def load(job: t.RLTrainingJob, config_path: Path | None, work_dir: Path) -> RunPlan:
    """The one way a process gets its plan: the one the renderer wrote beside the job's config
    (``plan.yaml`` in the same ConfigMap), else a local one for a run without Kubernetes."""
    if config_path is not None:
        written = Path(config_path).parent / PLAN_FILE
        if written.is_file():
            return read(written.read_text())
    return local(job, work_dir)
