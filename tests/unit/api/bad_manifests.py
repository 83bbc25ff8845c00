"""The table of bad RLTrainingJob manifests: each must be rejected with a message naming the field.

Shared by the unit tests (local validation: schema + CEL through cel-python, then the renderer) and
the cluster tests (the real API server). ``server`` says whether the API server itself must reject
the case (schema or CEL); the rest are caught by the renderer's deeper checks.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable


def minimal_manifest(name: str = "bad-case") -> dict[str, Any]:
    return {
        "apiVersion": "kuberl.dev/v1alpha1",
        "kind": "RLTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "image": "ghcr.io/kuberl/worker:0.1.0",
            "model": {"uri": "s3://models/tiny"},
            "data": {"uri": "s3://datasets/train.jsonl"},
        },
    }


@dataclass(frozen=True)
class BadManifest:
    id: str
    edit: Callable[[dict[str, Any]], None]
    message: str  # a substring the error must contain (the field, or the rule's message)
    server: bool = True

    @property
    def manifest(self) -> dict[str, Any]:
        m = minimal_manifest(self.id.replace("_", "-"))
        self.edit(m)
        return m


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        node = m
        *parents, last = path.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = copy.deepcopy(value)
    return edit


def _delete(path: str) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        node = m
        *parents, last = path.split(".")
        for p in parents:
            node = node[p]
        del node[last]
    return edit


def _all(*edits: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def edit(m: dict[str, Any]) -> None:
        for e in edits:
            e(m)
    return edit


BAD_MANIFESTS: list[BadManifest] = [
    BadManifest("missing_model", _delete("spec.model"), "spec.model"),
    BadManifest("missing_data", _delete("spec.data"), "spec.data"),
    BadManifest("missing_image", _delete("spec.image"), "spec.image"),
    BadManifest("missing_model_uri", _set("spec.model", {"revision": "main"}), "spec.model.uri"),
    BadManifest("model_uri_unknown_scheme", _set("spec.model.uri", "ftp://host/model"), "spec.model.uri"),
    BadManifest("model_uri_relative_path", _set("spec.model.uri", "./models/tiny"), "spec.model.uri"),
    BadManifest("model_uri_bad_bucket", _set("spec.model.uri", "s3://My_Bucket/model"), "spec.model.uri"),
    BadManifest("data_uri_http", _set("spec.data.uri", "https://example.com/train.jsonl"), "spec.data.uri"),
    BadManifest("model_uri_dot_segments", _set("spec.model.uri", "s3://models/a/../../etc"), "spec.model.uri"),
    BadManifest("data_uri_dot_segments", _set("spec.data.uri", "pvc://datasets/./train.jsonl"), "spec.data.uri"),
    BadManifest("checkpoint_uri_dot_segments", _set("spec.checkpoint", {"uri": "s3://ckpt/run/.."}),
                "spec.checkpoint.uri"),
    BadManifest("validation_uri_dot_segments", _set("spec.validation", {"uri": "s3://datasets/val/../train.jsonl"}),
                "spec.validation.uri"),
    BadManifest("validation_uri_dot_segment_alone", _set("spec.validation", {"uri": "/data/./val.jsonl"}),
                "'.' and '..' path segments are not allowed"),
    BadManifest("resume_dot_segments",
                _set("spec.checkpoint", {"uri": "s3://ckpt/run", "resume": "s3://ckpt/run/../other/step-000000001"}),
                "spec.checkpoint.resume"),
    BadManifest("revision_dot_dot", _set("spec.model", {"uri": "hf://org/m", "revision": "../../../x"}),
                "spec.model.revision"),
    BadManifest("revision_lock", _set("spec.model", {"uri": "hf://org/m", "revision": "main.lock"}),
                "spec.model.revision"),
    BadManifest("revision_space", _set("spec.model", {"uri": "hf://org/m", "revision": "a b"}),
                "spec.model.revision"),
    BadManifest("revision_empty", _set("spec.model", {"uri": "hf://org/m", "revision": ""}),
                "spec.model.revision"),
    BadManifest("uri_revision_dot_dot", _set("spec.model.uri", "hf://org/m@a..b"), "spec.model.uri"),
    BadManifest("bare_id_revision_reflog", _set("spec.model.uri", "org/m@main@{1}"), "spec.model.uri"),
    BadManifest("data_uri_revision_control", _set("spec.data.uri", "hf://org/d@x\x7f"), "spec.data.uri"),
    BadManifest("tolerations_unbounded",
                _set("spec.scheduling", {"tolerations": [{"key": f"k{i}", "operator": "Exists"} for i in range(65)]}),
                "spec.scheduling.tolerations"),
    BadManifest("node_selector_unbounded", _set("spec.scheduling", {"nodeSelector": {f"k{i}": "v" for i in range(65)}}),
                "spec.scheduling.nodeSelector"),
    BadManifest("node_selector_key_too_long", _set("spec.scheduling", {"nodeSelector": {"k" * 400: "v"}}),
                "scheduling.nodeSelector keys are label keys"),
    BadManifest("node_selector_value_too_long", _set("spec.scheduling", {"nodeSelector": {"k": "v" * 64}}),
                "spec.scheduling.nodeSelector"),
    BadManifest("prompt_field_too_long", _set("spec.data.promptField", "p" * 257), "spec.data.promptField"),
    BadManifest("checkpoint_uri_hf", _set("spec.checkpoint", {"uri": "hf://org/ckpt"}), "spec.checkpoint.uri"),
    BadManifest("colocate_with_checkpoint_sync",
                _all(_set("spec.rollout", {"colocate": True}), _set("spec.weightSync", {"method": "checkpoint"})),
                "rollout.colocate needs weightSync.method ipc or nccl"),
    BadManifest("ipc_without_colocate", _set("spec.weightSync", {"method": "ipc"}),
                "weightSync.method ipc needs rollout.colocate"),
    BadManifest("tp_does_not_divide_rollout_gpus",
                _set("spec.rollout", {"gpusPerReplica": 3, "tensorParallelSize": 2}),
                "rollout.tensorParallelSize must divide rollout.gpusPerReplica"),
    BadManifest("tp_not_dividing_colocated_gpus",
                _all(_set("spec.trainer", {"gpusPerReplica": 6}),
                     _set("spec.rollout", {"colocate": True, "tensorParallelSize": 4})),
                "rollout.tensorParallelSize must divide trainer.gpusPerReplica"),
    BadManifest("colocate_on_cpu",
                _all(_set("spec.trainer", {"gpusPerReplica": 0, "processesPerReplica": 2}),
                     _set("spec.rollout", {"colocate": True})),
                "rollout.colocate needs trainer.gpusPerReplica > 0"),
    BadManifest("cpu_offload_on_cpu",
                _set("spec.trainer", {"gpusPerReplica": 0, "cpuOffload": True}),
                "trainer.cpuOffload needs trainer.gpusPerReplica > 0"),
    BadManifest("expert_parallel_not_dividing_gpus",
                _set("spec.trainer", {"replicas": 3, "gpusPerReplica": 2, "parallelism": {"expert": 4}}),
                "trainer.parallelism.expert must divide the trainer's processes"),
    BadManifest("expert_parallel_not_dividing_cpu_processes",
                _set("spec.trainer", {"gpusPerReplica": 0, "processesPerReplica": 3, "parallelism": {"expert": 2}}),
                "trainer.parallelism.expert must divide the trainer's processes"),
    BadManifest("expert_parallel_zero", _set("spec.trainer", {"parallelism": {"expert": 0}}),
                "spec.trainer.parallelism.expert"),
    BadManifest("rollout_expert_parallel_on_one_gpu",
                _set("spec.rollout", {"gpusPerReplica": 8, "tensorParallelSize": 1, "expertParallel": True}),
                "rollout.expertParallel needs rollout.tensorParallelSize > 1"),
    BadManifest("rollout_expert_parallel_on_cpu",
                _set("spec.rollout", {"gpusPerReplica": 0, "tensorParallelSize": 2, "expertParallel": True}),
                "rollout.expertParallel needs GPU engines"),
    BadManifest("lora_rank_zero", _set("spec.trainer.lora", {"rank": 0}), "spec.trainer.lora.rank"),
    BadManifest("lora_rank_too_large", _set("spec.trainer.lora", {"rank": 512}), "spec.trainer.lora.rank"),
    BadManifest("lora_dropout_one", _set("spec.trainer.lora", {"dropout": 1.0}), "spec.trainer.lora.dropout"),
    BadManifest("lora_target_lm_head", _set("spec.trainer.lora", {"targetModules": ["q_proj", "lm_head"]}),
                "trainer.lora.targetModules: each must be one of q_proj"),
    BadManifest("lora_target_twice", _set("spec.trainer.lora", {"targetModules": ["q_proj", "q_proj"]}),
                "trainer.lora.targetModules: list each module once"),
    BadManifest("lora_no_targets", _set("spec.trainer.lora", {"targetModules": []}),
                "spec.trainer.lora.targetModules"),
    BadManifest("lora_with_ipc_sync",
                _all(_set("spec.trainer.lora", {}), _set("spec.rollout", {"colocate": True}),
                     _set("spec.weightSync", {"method": "ipc"})),
                "trainer.lora syncs only the adapter"),
    BadManifest("lora_merge_without_export", _set("spec.trainer.lora", {"mergeOnExport": True}),
                "trainer.lora.mergeOnExport needs checkpoint.exportHuggingFace"),
    BadManifest("resume_keyword_unknown", _set("spec.checkpoint", {"resume": "latest"}),
                "checkpoint.resume must be auto, never, or the URI"),
    BadManifest("resume_equals_root",
                _set("spec.checkpoint", {"uri": "s3://ckpt/run1", "resume": "s3://ckpt/run1"}),
                "checkpoint.resume names the checkpoint root itself"),
    BadManifest("export_without_uri", _set("spec.checkpoint", {"exportHuggingFace": True}),
                "checkpoint.exportHuggingFace needs checkpoint.uri"),
    BadManifest("reward_both", _set("spec.reward", {"builtin": "gsm8k_strict", "function": "my.mod:fn"}),
                "reward: set exactly one of builtin or function"),
    BadManifest("reward_neither", _set("spec.reward", {}), "reward: set exactly one of builtin or function"),
    BadManifest("reward_function_malformed", _set("spec.reward", {"function": "my reward"}),
                "is not an import path: write module.path:function as Python imports it"),
    BadManifest("reward_function_file_name", _set("spec.reward", {"function": "rewards/math.py:score"}),
                "is not an import path: write module.path:function as Python imports it"),
    BadManifest("reward_builtin_unknown", _set("spec.reward", {"builtin": "bleu"}), "spec.reward.builtin"),
    BadManifest("reward_source_uri_without_digest",
                _set("spec.reward", {"function": "my_rewards:score", "source": {"uri": "s3://code/my_rewards.py"}}),
                "source.uri needs source.sha256"),
    BadManifest("reward_source_digest_malformed",
                _set("spec.reward", {"function": "my_rewards:score",
                                     "source": {"uri": "s3://code/my_rewards.py", "sha256": "ABC123"}}),
                "spec.reward.source.sha256"),
    BadManifest("reward_source_uri_not_one_file",
                _set("spec.reward", {"function": "my_rewards:score",
                                     "source": {"uri": "s3://code/rewards", "sha256": "0" * 64}}),
                "source.uri must name one .py module or one uncompressed .tar"),
    BadManifest("reward_source_uri_from_the_hub",
                _set("spec.reward", {"function": "my_rewards:score",
                                     "source": {"uri": "hf://org/code/my_rewards.py", "sha256": "0" * 64}}),
                "spec.reward.source.uri"),
    BadManifest("reward_source_config_map_and_uri",
                _set("spec.reward", {"function": "my_rewards:score",
                                     "source": {"configMap": {"name": "rewards"}, "uri": "s3://code/my_rewards.py",
                                                "sha256": "0" * 64}}),
                "source: set exactly one of configMap or uri"),
    BadManifest("reward_source_digest_without_uri",
                _set("spec.reward", {"function": "my_rewards:score",
                                     "source": {"configMap": {"name": "rewards"}, "sha256": "0" * 64}}),
                "source.sha256 pins a source.uri"),
    BadManifest("reward_source_config_map_key_with_a_slash",
                _set("spec.reward", {"function": "my_rewards:score",
                                     "source": {"configMap": {"name": "rewards", "key": "../my_rewards.py"}}}),
                "spec.reward.source.configMap.key"),
    BadManifest("reward_source_for_a_builtin",
                _set("spec.reward", {"builtin": "gsm8k_strict", "source": {"configMap": {"name": "rewards"}}}),
                "reward.source holds the module of reward.function"),
    BadManifest("clip_high_below_low", _set("spec.algorithm", {"clipRatioLow": 0.3, "clipRatioHigh": 0.1}),
                "algorithm.clipRatioHigh must be >= algorithm.clipRatioLow"),
    BadManifest("algorithm_unknown", _set("spec.algorithm", {"name": "ppo"}), "spec.algorithm.name"),
    BadManifest("gspo_clip_high_below_its_default_low", _set("spec.algorithm", {"name": "gspo", "clipRatioHigh": 1e-4}),
                "algorithm.clipRatioHigh must be >= algorithm.clipRatioLow"),
    BadManifest("async_rollout_colocated",
                _all(_set("spec.algorithm", {"asyncRollout": True}), _set("spec.rollout", {"colocate": True})),
                "algorithm.asyncRollout and maxStaleness need rollout.colocate: false"),
    BadManifest("async_rollout_top_p", _set("spec.algorithm", {"asyncRollout": True, "topP": 0.9}),
                "leave topP: 1 and topK: -1, or set asyncRollout: false and maxStaleness: 0"),
    BadManifest("async_rollout_top_k", _set("spec.algorithm", {"asyncRollout": True, "topK": 50}),
                "leave topP: 1 and topK: -1, or set asyncRollout: false and maxStaleness: 0"),
    BadManifest("max_staleness_colocated",
                _all(_set("spec.algorithm", {"maxStaleness": 2}), _set("spec.rollout", {"colocate": True})),
                "algorithm.asyncRollout and maxStaleness need rollout.colocate: false"),
    BadManifest("max_staleness_top_p", _set("spec.algorithm", {"maxStaleness": 2, "topP": 0.9}),
                "leave topP: 1 and topK: -1, or set asyncRollout: false and maxStaleness: 0"),
    BadManifest("max_staleness_top_k", _set("spec.algorithm", {"maxStaleness": 1, "topK": 50}),
                "leave topP: 1 and topK: -1, or set asyncRollout: false and maxStaleness: 0"),
    BadManifest("max_staleness_with_async_rollout", _set("spec.algorithm", {"maxStaleness": 3, "asyncRollout": True}),
                "algorithm.asyncRollout: true is maxStaleness: 1; set maxStaleness alone"),
    BadManifest("max_staleness_zero_with_async_rollout",
                _set("spec.algorithm", {"maxStaleness": 0, "asyncRollout": True}),
                "algorithm.asyncRollout: true is maxStaleness: 1; set maxStaleness alone"),
    BadManifest("max_staleness_not_an_integer", _set("spec.algorithm", {"maxStaleness": 1.5}), "maxStaleness"),
    BadManifest("max_staleness_negative", _set("spec.algorithm", {"maxStaleness": -1}), "maxStaleness"),
    BadManifest("max_staleness_too_large", _set("spec.algorithm", {"maxStaleness": 65}), "maxStaleness"),
    BadManifest("tis_top_p", _set("spec.algorithm", {"tis": {}, "topP": 0.95}),
                "leave topP: 1 and topK: -1, or remove algorithm.tis"),
    BadManifest("tracking_run_name_is_a_path", _set("spec.tracking", {"runName": "../../etc"}), "runName"),
    BadManifest("total_length_not_above_the_prompt", _set("spec.rollout", {"maxPromptLength": 1024,
                                                                          "maxTotalLength": 1024}),
                "rollout.maxTotalLength must be above maxPromptLength"),
    BadManifest("total_length_changes_nothing", _set("spec.rollout", {"maxTotalLength": 2048}),
                "raise maxResponseLength up to maxTotalLength - 1"),
    BadManifest("tis_cap_below_one", _set("spec.algorithm", {"tis": {"cap": 0.5}}), "cap"),
    BadManifest("overlong_buffer_without_dapo", _set("spec.algorithm", {"name": "grpo", "overlongBuffer": 64}),
                "apply to name: dapo only"),
    BadManifest("overlong_penalty_without_dapo", _set("spec.algorithm", {"name": "rloo", "overlongPenalty": 0.5}),
                "apply to name: dapo only"),
    BadManifest("refill_rounds_without_dapo", _set("spec.algorithm", {"name": "gspo", "maxRefillRounds": 2}),
                "apply to name: dapo only"),
    BadManifest("overlong_buffer_not_below_max_response",
                _all(_set("spec.algorithm", {"name": "dapo", "overlongBuffer": 512}),
                     _set("spec.rollout", {"maxResponseLength": 512})),
                "algorithm.overlongBuffer must be below rollout.maxResponseLength"),
    BadManifest("micro_batch_does_not_divide",
                _set("spec.algorithm", {"promptsPerStep": 3, "groupSize": 3, "microBatchSize": 2}),
                "algorithm.microBatchSize must divide"),
    BadManifest("samples_not_divisible_by_ranks",
                _all(_set("spec.algorithm", {"promptsPerStep": 3, "groupSize": 3, "microBatchSize": 1}),
                     _set("spec.trainer", {"gpusPerReplica": 2})),
                "must be divisible by the number of trainer processes"),
    BadManifest("group_size_one", _set("spec.algorithm", {"groupSize": 1}), "spec.algorithm.groupSize"),
    BadManifest("learning_rate_zero", _set("spec.algorithm", {"learningRate": 0}), "spec.algorithm.learningRate"),
    BadManifest("gpu_memory_utilization_over_one", _set("spec.rollout", {"gpuMemoryUtilization": 1.5}),
                "spec.rollout.gpuMemoryUtilization"),
    BadManifest("numa_fractional_cpu",
                _set("spec.trainer", {"gpusPerReplica": 8, "resources": {"cpu": "7500m", "memory": "64Gi"}}),
                "numa.policy gpu-local needs an integer trainer.resources.cpu"),
    BadManifest("numa_fractional_rollout_cpu",
                _set("spec.rollout", {"gpusPerReplica": 8, "resources": {"cpu": "0.5", "memory": "64Gi"}}),
                "numa.policy gpu-local needs an integer rollout.resources.cpu"),
    BadManifest("memory_not_a_quantity", _set("spec.trainer", {"resources": {"cpu": "8", "memory": "lots"}}),
                "spec.trainer.resources.memory"),
    BadManifest("unknown_field", _set("spec.trainr", {"replicas": 2}), "spec.trainr"),
    BadManifest("name_too_long", _set("metadata.name", "a" * 41), "metadata.name must be at most 40 characters"),
    BadManifest("strategy_unknown", _set("spec.trainer", {"strategy": "ddp"}), "spec.trainer.strategy"),
    BadManifest("sync_method_unknown", _set("spec.weightSync", {"method": "rdma"}), "spec.weightSync.method"),
    BadManifest("secret_name_invalid", _set("spec.model.credentials", {"name": "My_Secret"}),
                "spec.model.credentials.name"),
    BadManifest("backoff_limit_negative", _set("spec.backoffLimit", -1), "spec.backoffLimit"),
    BadManifest("ttl_negative", _set("spec.ttlSecondsAfterFinished", -5), "spec.ttlSecondsAfterFinished"),
    BadManifest("toleration_operator_unknown",
                _set("spec.scheduling", {"tolerations": [{"key": "gpu", "operator": "Maybe"}]}),
                "spec.scheduling.tolerations[0].operator"),
    BadManifest("trainer_replicas_zero", _set("spec.trainer", {"replicas": 0}), "spec.trainer.replicas"),
    BadManifest("mini_batch_not_dividing", _set("spec.algorithm", {"promptsPerStep": 32, "miniBatchSize": 5}),
                "algorithm.miniBatchSize must divide algorithm.promptsPerStep"),
    BadManifest("engine_arg_not_allowed", _set("spec.rollout.engineArgs", {"model": "other"}),
                "spec.rollout.engineArgs.model"),
    BadManifest("env_name_not_allowed", _set("spec.rollout.env", {"RAY_ADDRESS": "x"}),
                "rollout.env: variable names must match"),
    BadManifest("prompt_template_without_placeholder", _set("spec.data.promptTemplate", "Answer:"),
                "data.promptTemplate must contain {prompt}"),
    BadManifest("export_interval_without_export", _set("spec.checkpoint", {"uri": "s3://bucket/c", "exportIntervalSteps": 5}),
                "checkpoint.exportIntervalSteps needs checkpoint.exportHuggingFace: true"),
    BadManifest("reward_workers_zero", _set("spec.reward", {"builtin": "gsm8k_strict", "workers": 0}), "spec.reward.workers"),
    BadManifest("wandb_online_without_credentials", _set("spec.tracking", {"wandb": {"project": "p"}}),
                "spec.tracking.wandb.credentials: mode online needs a Secret with WANDB_API_KEY", server=False),
    BadManifest("mlflow_uri_relative", _set("spec.tracking", {"mlflow": {"trackingUri": "mlruns"}}),
                "spec.tracking.mlflow.trackingUri"),
    BadManifest("agent_without_environment_or_harness", _set("spec.agent", {"maxTurns": 2}),
                "agent: set exactly one of environment or harness"),
    BadManifest("agent_with_environment_and_harness",
                _set("spec.agent", {"environment": "my.envs:Env", "harness": {"command": ["my-agent"]}}),
                "agent: set exactly one of environment or harness"),
    BadManifest("agent_harness_without_command", _set("spec.agent", {"harness": {"command": []}}),
                "spec.agent.harness.command"),
    BadManifest("agent_environment_not_an_import_path", _set("spec.agent", {"environment": "calculator.py"}),
                "is not an import path: write module.path:Class as Python imports it"),
    BadManifest("agent_source_for_a_harness",
                _set("spec.agent", {"harness": {"command": ["my-agent"]}, "source": {"configMap": {"name": "envs"}}}),
                "agent.source holds the module of agent.environment"),
    BadManifest("agent_max_turns_zero", _set("spec.agent", {"environment": "my.envs:Env", "maxTurns": 0}),
                "spec.agent.maxTurns"),
    BadManifest("agent_turn_longer_than_responses",
                _all(_set("spec.agent", {"environment": "my.envs:Env", "maxTokensPerTurn": 2048}),
                     _set("spec.rollout.maxResponseLength", 1024)),
                "agent.maxTokensPerTurn must be at most rollout.maxResponseLength"),
]
