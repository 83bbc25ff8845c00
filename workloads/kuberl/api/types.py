"""The RLTrainingJob API: the one definition the CRD, the renderer, the operator and the workloads share.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python.
Cross-field rules are written once, as CEL (``x-kubernetes-validations``), so that the API server
itself rejects a bad manifest; ``kuberl.api.cel`` evaluates the same rules locally for
``kuberl render`` and the driver, so a manifest means the same thing with and without Kubernetes.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

from kuberl.uri import (CHECKPOINT_URI_PATTERN, DOT_SEGMENT_VIOLATION, MAX_REVISION_LENGTH,
                        REVISION_IN_URI_VIOLATION, REVISION_RULES_TEXT, REVISION_VIOLATION, URI_PATTERN)

GROUP = "kuberl.dev"
VERSION = "v1alpha1"
KIND = "RLTrainingJob"
PLURAL = "rltrainingjobs"
SINGULAR = "rltrainingjob"
SHORT_NAMES = ["rltj"]
API_VERSION = f"{GROUP}/{VERSION}"

# Names derived from the job name (RayJob, RayCluster "<job>-xxxxx", pods, Services) must stay within
# the 63-character label limit; KubeRay appends its own suffixes.
MAX_NAME_LENGTH = 40

QUANTITY_PATTERN = r"^([0-9]+(\.[0-9]+)?|\.[0-9]+)(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
INTEGER_CPU_PATTERN = r"^[0-9]+$"


def rule(expr: str, message: str, field_path: str | None = None, reason: str | None = None) -> dict:
    """One CEL validation rule as the CRD carries it. The API server evaluates every rule even when
    a minimum already failed, so a rule guards its own divisors: a modulus by zero would surface as
    an evaluation error instead of the field's message."""
    out: dict[str, Any] = {"rule": expr, "message": message}
    if field_path:
        out["fieldPath"] = field_path
    if reason:
        out["reason"] = reason
    return out


def _rules(*rules: dict) -> dict:
    return {"x-kubernetes-validations": list(rules)}


class APIModel(BaseModel):
    """Base for every API object: camelCase aliases, unknown fields rejected (like the pruning
    API server would drop them silently, but with an error that names them)."""

    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", validate_default=True
    )


def uri_field(description: str, **kw: Any) -> Any:
    return Field(pattern=URI_PATTERN, max_length=2048, description=description, **kw)


def dot_segment_rule(field: str, optional: bool = False) -> dict:
    """No '.' or '..' segments in a URI: the stager and the renderer refuse them, so the API server
    must too, or a job it accepted would wedge afterwards."""
    guard = f"!has(self.{field}) || " if optional else ""
    return rule(f"{guard}!self.{field}.matches(r'{DOT_SEGMENT_VIOLATION}')",
                "'.' and '..' path segments are not allowed in a URI; write the path plainly", f".{field}")


def revision_in_uri_rule(field: str) -> dict:
    """A Hugging Face revision after '@' that git would accept (it reaches huggingface_hub's paths)."""
    return rule(f"!self.{field}.matches(r'{REVISION_IN_URI_VIOLATION}')",
                f"the revision after '@' must be {REVISION_RULES_TEXT}", f".{field}")


# Bounds on every list and map: far above what a real job uses, far below what would carry an
# object toward etcd's size limit (each entry is copied into every pod template of the RayJob).
MAX_LIST_ITEMS = 64
MAX_LABEL_KEY = 317     # a DNS-1123 prefix (253), '/', a name (63)
MAX_LABEL_VALUE = 63


class SecretRef(APIModel):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                      description="Name of a Secret in the job's namespace.")


# What ``trustRemoteCode: false`` keeps out of every pod: the repository's Python files are never
# staged, so code nobody vouched for never lands beside the weights (stager, resolve(), export).
REMOTE_CODE_GLOBS = ("*.py",)


class ModelSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        dot_segment_rule("uri"),
        revision_in_uri_rule("uri"),
        rule(f"!has(self.revision) || !self.revision.matches(r'{REVISION_VIOLATION}')",
             f"model.revision must be {REVISION_RULES_TEXT}", ".revision"),
    ))
    uri: str = uri_field("Where the model is: s3://bucket/prefix, gs://bucket/prefix, hf://org/name, "
                         "a Hugging Face id (org/name), pvc://claim/path, or an absolute path in the image.")
    revision: str | None = Field(None, min_length=1, max_length=MAX_REVISION_LENGTH,
                                 description="Hugging Face revision (branch, tag or commit) for hf:// and Hub "
                                             "ids, as git allows it (no '..', spaces, ~ ^ : ? * [ \\ and so on).")
    trust_remote_code: bool = Field(False, description="Run the model repository's own Python code "
                                    "(modeling_*.py). Only for sources you trust.")
    credentials: SecretRef | None = Field(None, description="Secret with AWS_*, "
                                          "GOOGLE_APPLICATION_CREDENTIALS or HF_TOKEN keys; given only "
                                          "to the init containers that stage the model.")


class DataSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(dot_segment_rule("uri"), revision_in_uri_rule("uri")))
    uri: str = uri_field("Training prompts: a .jsonl or .parquet file (or a prefix of them), local or cloud.")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="File format; auto uses the extension.")
    prompt_field: str = Field("prompt", min_length=1, max_length=256, description="Field holding the prompt text.")
    answer_field: str = Field("answer", min_length=1, max_length=256, description="Field holding the reference answer "
                              "passed to the reward function.")
    credentials: SecretRef | None = Field(None, description="Secret for reading the data (init containers only).")


class RewardSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("has(self.builtin) != has(self.function)",
             "reward: set exactly one of builtin or function"),
    ))
    builtin: Literal["math_exact_match", "repeat_letter"] | None = Field(
        None, description="A built-in reward: math_exact_match (\\boxed{} or last number equals the "
                          "answer) or repeat_letter (a toy verifiable task: the share of response "
                          "characters equal to the answer letter).")
    function: str | None = Field(
        None, max_length=512, pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$",
        description="An importable reward function, module.path:function, called with "
                    "(prompts, responses, answers) and returning one float per response.")


class AlgorithmSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("self.clipRatioHigh >= self.clipRatioLow",
             "algorithm.clipRatioHigh must be >= algorithm.clipRatioLow", ".clipRatioHigh"),
        rule("self.microBatchSize < 1 || (self.promptsPerStep * self.groupSize) % self.microBatchSize == 0",
             "algorithm.microBatchSize must divide promptsPerStep * groupSize (samples per step)",
             ".microBatchSize"),
    ))
    name: Literal["grpo"] = Field("grpo", description="The RL algorithm.")
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt; advantages are normalised within a group.")
    prompts_per_step: int = Field(32, ge=1, le=65536, description="Prompts per training step.")
    micro_batch_size: int = Field(4, ge=1, le=4096, description="Samples per forward/backward on one rank.")
    total_steps: int = Field(100, ge=1, le=10_000_000, description="Training steps to run.")
    learning_rate: float = Field(1e-6, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay.")
    warmup_steps: int = Field(0, ge=0, description="Linear learning-rate warm-up steps.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    kl_coef: float = Field(0.001, ge=0, description="Weight of the KL penalty to the reference policy; 0 disables it.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    clip_ratio_low: float = Field(0.2, ge=0, le=1, description="PPO clip: ratio lower bound is 1 - clipRatioLow.")
    clip_ratio_high: float = Field(0.28, ge=0, le=10, description="PPO clip: ratio upper bound is 1 + clipRatioHigh.")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature for rollouts.")
    seed: int = Field(42, ge=0, le=2**31 - 1, description="Seed for data order, sampling and initialisation.")


class Resources(APIModel):
    cpu: str = Field("8", pattern=QUANTITY_PATTERN, description="CPU request and limit per pod.")
    memory: str = Field("64Gi", pattern=QUANTITY_PATTERN, description="Memory request and limit per pod.")


class MoESpec(APIModel):
    expert_implementation: Literal["grouped", "loop"] = Field(
        "grouped", description="grouped: all experts in batched GEMMs (fast); loop: one expert at a time.")
    router_aux_loss_coef: float = Field(0.001, ge=0, description="Load-balancing loss weight.")


class TrainerSpec(APIModel):
    strategy: Literal["fsdp2"] = Field("fsdp2", description="Data-parallel sharding strategy.")
    replicas: int = Field(1, ge=1, le=1024, description="Trainer pods (nodes).")
    gpus_per_replica: int = Field(1, ge=0, le=16, description="GPUs per trainer pod; 0 trains on CPU (gloo).")
    processes_per_replica: int = Field(1, ge=1, le=64, description="Trainer processes per pod when "
                                       "gpusPerReplica is 0 (one per GPU otherwise).")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward (non-reentrant).")
    param_dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="Compute dtype on GPU; CPU always uses float32.")
    moe: MoESpec = Field(default_factory=MoESpec, description="Mixture-of-Experts options.")
    resources: Resources = Field(default_factory=Resources, description="Per-pod CPU and memory.")


class HeadSpec(APIModel):
    resources: Resources = Field(default_factory=lambda: Resources(cpu="2", memory="8Gi"),
                                 description="CPU and memory of the Ray head pod, where the driver runs.")


class RolloutSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("self.colocate || self.gpusPerReplica == 0 || self.tensorParallelSize < 1 || "
             "self.gpusPerReplica % self.tensorParallelSize == 0",
             "rollout.tensorParallelSize must divide rollout.gpusPerReplica", ".tensorParallelSize"),
    ))
    engine: Literal["vllm"] = Field("vllm", description="Inference engine.")
    replicas: int = Field(1, ge=1, le=1024, description="Rollout pods (nodes); ignored when colocated.")
    gpus_per_replica: int = Field(1, ge=0, le=16, description="GPUs per rollout pod; each pod runs "
                                  "gpusPerReplica / tensorParallelSize engines. 0 runs on CPU.")
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="GPUs per engine.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Fraction of GPU memory vLLM may use.")
    max_prompt_length: int = Field(1024, ge=1, le=1_048_576, description="Longest prompt in tokens.")
    max_response_length: int = Field(1024, ge=1, le=1_048_576, description="Longest response in tokens.")
    colocate: bool = Field(False, description="Run engines on the trainer's GPUs (sleeping while training).")
    resources: Resources = Field(default_factory=Resources, description="Per-pod CPU and memory.")


class WeightSyncSpec(APIModel):
    method: Literal["nccl", "ipc", "checkpoint"] = Field(
        "nccl", description="nccl: broadcast trainer -> engines; ipc: CUDA IPC when colocated; "
                            "checkpoint: engines load a weight snapshot the trainer writes.")
    bucket_size_mb: int = Field(512, alias="bucketSizeMB", ge=1, le=65536, description="Bytes per broadcast bucket, in MiB.")


class CheckpointSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule(f"self.resume in ['auto', 'never'] || self.resume.matches(r'{CHECKPOINT_URI_PATTERN}')",
             "checkpoint.resume must be auto, never, or the URI of a checkpoint "
             "(s3://, gs://, pvc:// or an absolute path)", ".resume"),
        dot_segment_rule("uri", optional=True),
        dot_segment_rule("resume"),
        rule("!self.exportHuggingFace || has(self.uri)",
             "checkpoint.exportHuggingFace needs checkpoint.uri (where to write the export)",
             ".exportHuggingFace"),
    ))
    uri: str | None = Field(None, pattern=CHECKPOINT_URI_PATTERN, max_length=2048,
                            description="Where checkpoints go: s3://, gs://, pvc://claim/path or an absolute path.")
    interval_steps: int = Field(50, ge=1, description="Save every this many steps.")
    keep: int = Field(3, ge=1, le=1000, description="Newest complete checkpoints to keep.")
    resume: str = Field("auto", min_length=1, max_length=2048,
                        description="auto: newest complete checkpoint under uri if any; never: start "
                                    "fresh; or the URI of one checkpoint.")
    export_hugging_face: bool = Field(False, description="Also export a Hugging Face model "
                                      "(safetensors + config + tokenizer + remote-code files) at the end.")
    format: Literal["dcp", "tar"] = Field("dcp", description="dcp: torch.distributed.checkpoint files; "
                                          "tar: the same packed in one uncompressed tar per rank.")
    credentials: SecretRef | None = Field(None, description="Secret for writing checkpoints; given to "
                                          "the Ray containers that upload and to the init container that restores.")


class NumaSpec(APIModel):
    policy: Literal["gpu-local", "none"] = Field(
        "gpu-local", description="gpu-local: pin each GPU process's CPUs and memory to its GPU's NUMA node.")


class Toleration(APIModel):
    key: str | None = Field(None, max_length=MAX_LABEL_KEY)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=MAX_LABEL_VALUE)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = None


class SchedulingSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule(f"self.nodeSelector.all(k, size(k) <= {MAX_LABEL_KEY})",
             f"scheduling.nodeSelector keys are label keys: at most {MAX_LABEL_KEY} characters", ".nodeSelector"),
    ))
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE)]] = Field(
        default_factory=dict, max_length=MAX_LIST_ITEMS, description="Node labels every pod must match.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_LIST_ITEMS,
                                          description="Tolerations for every pod.")
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass for every pod.")
    queue_name: str | None = Field(None, max_length=MAX_LABEL_VALUE,
                                   description="Kueue LocalQueue; sets kueue.x-k8s.io/queue-name on the RayJob.")


class RLTrainingJobSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("!self.rollout.colocate || self.weightSync.method in ['ipc', 'nccl']",
             "rollout.colocate needs weightSync.method ipc or nccl", ".weightSync.method"),
        rule("self.weightSync.method != 'ipc' || self.rollout.colocate",
             "weightSync.method ipc needs rollout.colocate: true (CUDA IPC works only on the same GPUs)",
             ".weightSync.method"),
        rule("!self.rollout.colocate || self.trainer.gpusPerReplica > 0",
             "rollout.colocate needs trainer.gpusPerReplica > 0", ".rollout.colocate"),
        rule("!self.rollout.colocate || self.rollout.tensorParallelSize < 1 || "
             "self.trainer.gpusPerReplica % self.rollout.tensorParallelSize == 0",
             "rollout.tensorParallelSize must divide trainer.gpusPerReplica when colocated",
             ".rollout.tensorParallelSize"),
        rule("self.trainer.gpusPerReplica == 0 || self.numa.policy != 'gpu-local' || "
             "self.trainer.resources.cpu.matches('^[0-9]+$')",
             "numa.policy gpu-local needs an integer trainer.resources.cpu (Guaranteed QoS lets the "
             "kubelet pin whole CPUs)", ".trainer.resources.cpu"),
        rule("self.rollout.colocate || self.rollout.gpusPerReplica == 0 || self.numa.policy != 'gpu-local' || "
             "self.rollout.resources.cpu.matches('^[0-9]+$')",
             "numa.policy gpu-local needs an integer rollout.resources.cpu (Guaranteed QoS lets the "
             "kubelet pin whole CPUs)", ".rollout.resources.cpu"),
        rule("self.checkpoint.resume in ['auto', 'never'] || !has(self.checkpoint.uri) || "
             "self.checkpoint.resume != self.checkpoint.uri",
             "checkpoint.resume names the checkpoint root itself; use auto to resume from the newest "
             "checkpoint under checkpoint.uri", ".checkpoint.resume"),
        rule("self.trainer.replicas < 1 || self.trainer.processesPerReplica < 1 || "
             "(self.algorithm.promptsPerStep * self.algorithm.groupSize) % "
             "(self.trainer.replicas * (self.trainer.gpusPerReplica > 0 ? self.trainer.gpusPerReplica "
             ": self.trainer.processesPerReplica)) == 0",
             "algorithm.promptsPerStep * algorithm.groupSize must be divisible by the number of trainer "
             "processes (trainer.replicas x GPUs or processes per replica)", ".algorithm.promptsPerStep"),
    ))
    model: ModelSpec
    data: DataSpec
    image: str = Field(min_length=1, max_length=1024, pattern=r"^\S+$",
                       description="Worker image: Ray + torch + vLLM + kuberl (see images/worker).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy for every container.")
    reward: RewardSpec = Field(default_factory=lambda: RewardSpec(builtin="math_exact_match"),
                               description="How responses are scored.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL algorithm and its hyper-parameters.")
    head: HeadSpec = Field(default_factory=HeadSpec, description="The Ray head pod (runs the driver).")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Training workers.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout engines.")
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, description="Trainer -> engine weight transfer.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing and resume.")
    numa: NumaSpec = Field(default_factory=NumaSpec, description="CPU/memory placement of GPU processes.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Where pods may run.")
    suspend: bool = Field(False, description="true: checkpoint and tear the cluster down; false resumes.")
    backoff_limit: int = Field(3, ge=0, le=100, description="Restarts from the last checkpoint before the job is Failed.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, description="Delete the job this long after it Succeeded or Failed.")


Phase = Literal["Pending", "Staging", "Starting", "Running", "Suspended", "Succeeded", "Failed"]


class Condition(APIModel):
    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = None


class Progress(APIModel):
    step: int = 0
    total_steps: int = 0
    reward: float | None = None
    tokens_per_second: float | None = None
    updated_time: datetime | None = None


class CheckpointRef(APIModel):
    uri: str = Field(max_length=2048)
    step: int
    time: datetime


class RLTrainingJobStatus(APIModel):
    phase: Phase | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    observed_generation: int | None = None
    ray_job_name: str | None = Field(None, max_length=253)
    ray_cluster_name: str | None = Field(None, max_length=253)
    dashboard_url: str | None = Field(None, alias="dashboardURL", max_length=2048)
    progress: Progress | None = None
    last_checkpoint: CheckpointRef | None = None
    restarts: int = 0
    message: str | None = Field(None, max_length=32768)
    start_time: datetime | None = None
    completion_time: datetime | None = None


class ObjectMeta(BaseModel):
    """The part of metadata kuberl reads; the API server owns the rest."""

    model_config = ConfigDict(extra="allow")
    # The length limit is a CEL rule on the root (ROOT_RULES), so both paths say the same thing.
    name: str = Field(min_length=1, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
    namespace: str = "default"
    uid: str | None = None
    generation: int | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)


class RLTrainingJob(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")
    api_version: Literal["kuberl.dev/v1alpha1"] = Field(API_VERSION, alias="apiVersion")
    kind: Literal["RLTrainingJob"] = KIND
    metadata: ObjectMeta
    spec: RLTrainingJobSpec
    status: RLTrainingJobStatus | None = None
