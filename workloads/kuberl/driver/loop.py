"""The RL loop: the single controller that owns the run; Ray actors do the work.

Each step: the step's prompts (a pure function of seed and step) -> ``groupSize`` samples per
prompt from the rollout engines (with ``spec.agent``, episodes through the endpoint:
``kuberl.rollout.agents.episodes``) -> rewards, shaped by the algorithm -> the groups it trains on
(dynamic sampling refills dropped ones) -> its advantages -> the log-probs it needs from the
trainer -> policy updates over mini-batches (``kuberl.driver.updates``; the trainer's loss is the
algorithm's too) -> weight sync to the engines -> validation when due -> metrics, trackers, progress
and, every ``intervalSteps``, a checkpoint. The algorithm is ``spec.algorithm.name`` looked up once
in ``kuberl.train.algorithms.registry``, here and in ``TrainerConfig.from_spec``. With
``spec.algorithm.maxStaleness`` (``asyncRollout`` is 1) later steps' rollouts are generated in a
background thread while the trainer trains, up to that many weight versions behind it
(``kuberl.driver.schedule`` orders generation, training and weight sync). Everything a resumed
run needs is in the checkpoint (trainer state, step, weight version, and the rollouts generated
but not yet trained on), so a resumed run continues exactly where it stopped.
A rollout engine lost mid-step costs no step: the pool regenerates its share on the engines left,
and a replacement joins at a step boundary with the current weights (``_replenish_engines``). One
lost during a weight sync costs none either: the sync drops it, rebuilds its group for the engines
left and sends them the whole version again (``kuberl.sync.base.WeightSync.sync``).
A trainer rank lost mid-run costs the steps since the newest checkpoint, not the attempt: a new
trainer group restores that checkpoint and the engines, still up, get its weights
(``_recover_trainer``). A change of spec.rollout.replicas (``kubectl patch``) resizes the engine
pool at the next step boundary (``_resize_engines``); each recovery and resize is counted in
status.recoveries. A head or trainer pod that is going with its grace period gives notice first
(``kuberl.driver.notices``): the step in flight is checkpointed at its boundary, so the recovery
loses no step; when the head itself goes (the whole cluster, e.g. a Kueue preemption) no step
begins after that commit, so the next attempt runs none again.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import signal
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kuberl.api.types import RLTrainingJob
from kuberl.common import metrics as pod_metrics
from kuberl.common.prompts import Prompt
from kuberl.common.samples import Sample, TrainBatch
from kuberl.driver import schedule
from kuberl.driver.checkpoints import CheckpointManager
from kuberl.driver.data import PromptStream, check_prompt_lengths, load_for_spec, steps_for_epochs
from kuberl.driver.report import StatusReporter, gpu_busy
from kuberl.driver.rewards import RewardInput, RewardWorkers
from kuberl.driver.sampling import fill_groups
from kuberl.driver.tracking import Trackers
from kuberl.driver.updates import policy_updates
from kuberl.driver.validation import Validator
from kuberl.job.plan import RunPlan
from kuberl.train.algorithms import registry
from kuberl.train.group import TrainerCapacityError, TrainerLost

log = logging.getLogger("kuberl.train")

# Exit codes the operator reads from the RayJob: preempted (SIGTERM) after a checkpoint was written.
EXIT_OK = 0
EXIT_PREEMPTED = 75
# How often a driver held for a suspend asks whether the suspend still stands.
SUSPEND_POLL_SECONDS = 2.0
# How often a driver whose head is going looks for the SIGTERM that ends it.
HEAD_GOING_POLL_SECONDS = 0.5
# How long a lost trainer rank's replacement may take to get its resources: in a cluster KubeRay
# recreates the pod, which is scheduled, pulls the image and joins Ray; locally it is at once.
TRAINER_REPLACEMENT_TIMEOUT_S = 600


@dataclass
class StepResult:
    step: int
    reward_mean: float
    metrics: dict[str, float]
    rewards: list[float] = field(default_factory=list)


# Which trainer method computes each log-prob an algorithm asks for (Algorithm.logprobs).
LOGPROB_METHODS = {"old": "log_probs", "ref": "ref_log_probs"}

# A step's rollout: its batch, its prompts' task rewards, the rollout's metrics (Driver.rollout).
Rollout = tuple[list[Sample], list[float], dict[str, float]]


def rollout_state(rollout: Rollout) -> dict[str, Any]:
    """A rollout as JSON for the checkpoint's driver state (floats round-trip exactly)."""
    samples, task_rewards, metrics = rollout
    return {"samples": [asdict(s) for s in samples], "task_rewards": task_rewards, "metrics": metrics}


def rollout_from_state(state: dict[str, Any]) -> Rollout:
    return [Sample(**s) for s in state["samples"]], state["task_rewards"], state["metrics"]


def held_rollouts(state: dict[str, Any]) -> dict[int, Rollout]:
    """The rollouts a checkpoint's driver state holds, by step: ``rollouts`` (maxStaleness), or
    ``rollout``, the one step's that checkpoints written before maxStaleness hold."""
    if "rollout" in state:
        return {state["step"]: rollout_from_state(state["rollout"])}
    return {int(step): rollout_from_state(rollout) for step, rollout in state.get("rollouts", {}).items()}


def staleness_metrics(trainer_version: int, samples: Sequence[Sample]) -> dict[str, float]:
    """How many weight versions the trainer is ahead of the weights that generated the step's
    samples (each records its own: ``Sample.weight_version``): the oldest sample's and the mean.
    0 synchronous; at most ``maxStaleness`` asynchronous."""
    ages = [trainer_version - s.weight_version for s in samples]
    return {"rollout_staleness": float(max(ages)), "rollout_staleness_mean": sum(ages) / len(ages)}


def engine_logprobs(samples: Sequence[Sample], field: str) -> list[list[float]]:
    """The behaviour policy's log-probs as the engines returned them with the samples; ``field``
    names the setting that needs them, for the error when some samples came without (an agent
    harness that returns none: docs/agents.md)."""
    missing = [i for i, s in enumerate(samples) if s.response_logprobs is None]
    if missing:
        raise ValueError(f"{field}: samples {missing[:8]} came without the engines' log-probs, which "
                         f"the importance ratio needs; a harness must return them with each turn, or "
                         f"remove {field}")
    return [list(s.response_logprobs) for s in samples]


def engine_logprob_gap(samples: Sequence[Sample], trainer_logprobs: Sequence[Sequence[float]]) -> dict[str, float]:
    """How far the engines' log-probs of the sampled tokens are from the trainer's own for the
    same weights: the mean and the largest |trainer - engine| over the trained response tokens.
    Both should compute one policy; the gap is numerics (bf16 kernels, vLLM's fused ops against
    the trainer's), and a large one (a weight sync that loaded the wrong tensors, a sampler
    setting the trainer does not apply) biases every importance ratio. Empty where the samples
    came without the engines' log-probs (agents' tool tokens carry none)."""
    gaps = []
    for sample, trainer in zip(samples, trainer_logprobs, strict=True):
        if sample.response_logprobs is None:
            continue
        mask = sample.loss_mask or [1] * len(sample.response_ids)
        gaps += [abs(t - e) for t, e, m in zip(trainer, sample.response_logprobs, mask, strict=True) if m]
    if not gaps:
        return {}
    return {"engine_logprob_gap_mean": sum(gaps) / len(gaps), "engine_logprob_gap_max": max(gaps)}


def check_advantages(step: int, algorithm: str, samples: Sequence[Sample], advantages: Sequence[float]) -> None:
    """Refuse a non-finite advantage before any update: one NaN or inf makes the step's loss and
    every weight it touches NaN, and the run trains on garbage from then on. Rewards are checked
    where they are made (finite, bounded: ``kuberl.common.reward_values.as_reward``), so this is the
    algorithm's fault, named with the group and its rewards."""
    for sample, advantage in zip(samples, advantages, strict=True):
        if not math.isfinite(advantage):
            group = [s for s in samples if s.group == sample.group]
            raise FloatingPointError(
                f"step {step}: the {algorithm} advantage of a sample of group {sample.group} is {advantage} "
                f"(prompt {sample.prompt_text[:80]!r}, the group's rewards {[s.reward for s in group]}); "
                f"no update was made")


def _done(rollout: Rollout) -> Future:
    future: Future = Future()
    future.set_result(rollout)
    return future


def refill_seed(seed: int, step: int, round_: int) -> int:
    """The sampling seed of dynamic sampling's extra round ``round_`` (the step's own round uses
    ``seed * 1_000_003 + step``): a pure function of (seed, step, round), so a resume regenerates it."""
    return random.Random(f"refill/{seed}/{step}/{round_}").randrange(2**31)


class Preemption:
    """Turns SIGTERM (pod eviction, `kubectl delete`, RayJob suspend) into a flag the loop checks
    between steps, so a step is never torn in half."""

    def __init__(self) -> None:
        self.requested = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM: finishing the current step, then checkpointing and exiting")
        self.requested = True


class Driver:
    """The loop of one run, for whichever algorithm ``spec.algorithm.name`` names."""

    def __init__(self, job: RLTrainingJob, plan: RunPlan, *, trainer: Any, engines: Any, weight_sync: Any,
                 tokenizer: Any, data_path: str, checkpoints: CheckpointManager, reporter: StatusReporter,
                 preemption: Preemption | None = None, metrics_file: Path | None = None,
                 validation_path: str | None = None, trackers: Trackers | None = None,
                 exporter: Callable[[int], Any] | None = None, notices: Any = None,
                 reward_code: str | None = None, agent_code: str | None = None):
        self.job = job
        self.spec = job.spec
        self.plan = plan
        self.trainer = trainer
        self.engines = engines
        self.weight_sync = weight_sync
        self.tokenizer = tokenizer
        self.checkpoints = checkpoints
        self.reporter = reporter
        self.preemption = preemption or Preemption()
        self.notices = notices  # kuberl.driver.notices.Notices: pods of the job that are going
        algo = self.spec.algorithm
        self.algorithm = registry.get(algo.name)
        prompts = self._fitting(load_for_spec(data_path, self.spec), "spec.data")
        self.stream = PromptStream(prompts, algo.seed)
        self.total_steps = (steps_for_epochs(algo.epochs, len(prompts), algo.prompts_per_step)
                            if algo.epochs else algo.total_steps)
        # With spec.agent the episodes' rewards replace spec.reward, which is then not loaded.
        self.reward_fn = RewardWorkers(self.spec.reward, reward_code) if self.spec.agent is None else None
        self.agent = None
        if self.spec.agent is not None:  # episodes through the endpoint, which records their tokens
            from kuberl.rollout.agents.episodes import AgentRollout
            from kuberl.rollout.transitions import EpisodeLog

            episodes = EpisodeLog()
            self.agent = AgentRollout(self.spec, base_url=engines.serve(tokenizer, episodes=episodes),
                                      model=engines.served_model_name, episodes=episodes, code_dir=agent_code)
        self.validator = None
        if self.spec.validation is not None:
            held_out = load_for_spec(validation_path or self.spec.validation.uri, self.spec,
                                     spec_field="spec.validation")
            self.validator = Validator(self.spec.validation, self._fitting(held_out, "spec.validation"),
                                       engines=engines, tokenizer=tokenizer, reward_fn=self.reward_fn,
                                       prompt_ids=self._chat_ids,
                                       rollout=self.spec.rollout, seed=algo.seed, agent=self.agent)
        self.trackers = trackers or Trackers([])
        self.exporter = exporter
        self.metrics_file = metrics_file
        self.step = 0
        self.weight_version = 0  # the trainer's
        self.engine_version = 0  # the engines': older between sync points (maxStaleness >= 2)
        # Rollouts generated, or being generated, and not yet trained on, by step
        # (kuberl.driver.schedule: the current step's and, asynchronous, up to maxStaleness later ones).
        self._rollouts: dict[int, Future] = {}
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout")
        self._timing = threading.local()  # .phases: what _phase adds to, per thread
        self._checkpoint_stall: float | None = None
        self._trainer_lost_at: int | None = None  # steps completed when a trainer rank was last lost
        self._trainer_recovery: float | None = None  # its recovery's seconds, reported with the next step
        self._resize_started: float | None = None  # when a resize began that the pool has not reached yet

    def _hold_for_suspend(self) -> None:
        """spec.suspend is true: the step is checkpointed; wait (no next step) while the operator
        sees the checkpoint in status and has KubeRay delete the cluster, which ends this process.
        KubeRay itself stops no Ray job before it deletes the cluster. If suspend is withdrawn
        first, training goes on."""
        log.info("suspend requested after step %d: %s; waiting for the Ray cluster to go", self.step,
                 "checkpointed" if self.checkpoints.enabled else "no checkpoint.uri, so nothing saved")
        self.reporter.held_for_suspend(True)
        if self.notices is not None:  # the cluster's pods go with nothing in flight to wait for
            self.notices.take(self.step, in_flight=False)
        while self.reporter.suspend_requested():
            time.sleep(SUSPEND_POLL_SECONDS)
        self.reporter.held_for_suspend(False)
        log.info("suspend withdrawn: training on from step %d", self.step)

    def _hold_while_the_head_goes(self) -> int | None:
        """The head, this driver's own pod, gave notice and the step in flight is committed: a
        step begun now would be lost with the head (KubeRay deleting the whole cluster, for a
        Kueue preemption say), so none begins. Waits for the SIGTERM that ends the attempt (the
        head gets it once its hook has seen the commit), at most the pod's grace period; past it
        (a notice with no deletion behind it) training goes on."""
        grace = self.spec.scheduling.termination_grace_period_seconds
        log.warning("the head pod is going: step %d is committed and no next step begins (it would be lost "
                    "with the head); waiting for the Ray cluster to go", self.step)
        if self.notices is not None:  # pods going from now on have nothing in flight to wait for
            self.notices.take(self.step, in_flight=False)
        deadline = time.monotonic() + grace
        while not self.preemption.requested and time.monotonic() < deadline:
            time.sleep(HEAD_GOING_POLL_SECONDS)
        if self.preemption.requested:
            return EXIT_PREEMPTED
        log.warning("the head pod is still here %d s after its notice: training on from step %d", grace, self.step)
        return None

    # --- one step ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _phase(self, name: str):
        """Adds the block's wall time to this step's ``<name>_seconds`` metric (generate, reward,
        logprobs, update, sleep, wake): where a step's time goes, per step, in the metrics file,
        the trackers and bench/rl_gpu.py. Generate and reward are timed into the rollout's own
        metrics (``rollout``), so with asyncRollout, where they run in the rollout thread beside
        the other phases, they count in the step that trains on that rollout."""
        phases = self._timing.phases
        started = time.perf_counter()
        try:
            yield
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - started

    @contextlib.contextmanager
    def _doing(self, activity: str):
        """The block is what the driver does (status.progress.activity, once it has lasted a few
        seconds: ``StatusReporter.activity``). The main thread's view: with asyncRollout the
        engines generate in the background during ``train``, and ``generate`` is the wait for them."""
        self.reporter.activity(activity)
        try:
            yield
        finally:
            self.reporter.activity(None)

    def _generated(self, rollout: Future) -> Rollout:
        """A rollout once generated; waiting for one still generating in the background
        (asynchronous) is the driver's ``generate``."""
        if rollout.done():
            return rollout.result()
        with self._doing("generate"):
            return rollout.result()

    def _chat_ids(self, messages: Sequence[dict]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        return list(ids)

    def _fitting(self, prompts: list[Prompt], spec_field: str) -> list[Prompt]:
        """``data.overlongPrompts`` applied: never a silently truncated prompt."""
        return check_prompt_lengths(prompts, [len(self._chat_ids(p.messages)) for p in prompts],
                                    self.spec.rollout.max_prompt_length, self.spec.data.overlong_prompts, spec_field)

    def _scored_groups(self, prompts: list[Prompt], seed: int) -> list[list[Sample]]:
        """``groupSize`` scored samples per prompt: ``sample.reward`` is what the algorithm trains
        on (the reward function's, or with ``spec.agent`` the episode's, shaped: dapo's overlong
        penalty), ``metadata['task_reward']`` the unshaped one."""
        algo = self.spec.algorithm
        max_tokens = self.spec.rollout.max_response_length
        started = time.perf_counter()
        if self.agent is not None:
            with self._phase("generate"):  # episodes: generation and the environment's rewards
                groups = self.agent.generate(prompts, algo.group_size, seed)
            samples = [sample for group in groups for sample in group]
            rewards = [sample.reward for sample in samples]  # the environment's, summed over the episode
        else:
            groups, samples, rewards = self._generated_groups(prompts, seed)
        buffer, penalty = algo.overlong(max_tokens)
        shaped = self.algorithm.shape_rewards(
            rewards, [len(s.response_ids) for s in samples],
            response_limits=[self.spec.rollout.response_limit(len(s.prompt_ids)) for s in samples],
            overlong_buffer=buffer, overlong_penalty=penalty)
        for sample, reward, value in zip(samples, rewards, shaped, strict=True):
            sample.metadata["task_reward"] = reward
            sample.reward = value
        pod_metrics.record_rollout(sum(len(s.response_ids) for s in samples), time.perf_counter() - started)
        return [list(group) for group in groups]

    def _generated_groups(self, prompts: list[Prompt], seed: int) -> tuple[list[list[Sample]], list[Sample], list[float]]:
        """Single responses from the engines, scored by ``spec.reward``: the groups, their samples
        in order and the reward function's rewards."""
        algo = self.spec.algorithm
        max_tokens = self.spec.rollout.max_response_length
        with self._phase("generate"):
            groups = self.engines.generate([self._chat_ids(p.messages) for p in prompts], algo.group_size,
                                           temperature=algo.temperature, max_tokens=max_tokens, seed=seed,
                                           top_p=algo.top_p, top_k=algo.top_k, stop=algo.stop or None)
        samples, inputs = [], []
        for index, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
            for sample in group:
                sample.group = index
                sample.prompt_text = prompt.text
                sample.response_text = self.tokenizer.decode(sample.response_ids, skip_special_tokens=True)
                sample.metadata["answer"] = prompt.answer
                samples.append(sample)
                inputs.append(RewardInput(
                    prompt=prompt.text, response=sample.response_text, answer=prompt.answer,
                    data_source=prompt.data_source, extra_info=prompt.extra_info,
                    prompt_tokens=len(sample.prompt_ids), response_tokens=len(sample.response_ids),
                    max_response_tokens=self.spec.rollout.response_limit(len(sample.prompt_ids)),
                    finish_reason=sample.finish_reason, group=index))
        with self._phase("reward"):
            return groups, samples, self.reward_fn(inputs)

    def rollout(self, step: int) -> Rollout:
        """The step's batch, its prompts' task rewards and the rollout's metrics. The batch holds
        the groups the algorithm keeps (``keep_group``), refilled from extra rounds of prompts
        (dynamic sampling, ``maxRefillRounds``), numbered in batch order. The task rewards are
        those of the step's own prompts, before any filter: what ``reward_mean`` reports."""
        outer, self._timing.phases = getattr(self._timing, "phases", None), {}
        try:
            return self._rollout(step)
        finally:
            self._timing.phases = outer

    def _rollout(self, step: int) -> Rollout:
        algo = self.spec.algorithm
        first = self._scored_groups(self.stream.batch(step, algo.prompts_per_step), algo.seed * 1_000_003 + step)
        filled = fill_groups(
            first, lambda round_, count: self._scored_groups(self.stream.refill(step, round_, count),
                                                             refill_seed(algo.seed, step, round_)),
            keep=lambda group: self.algorithm.keep_group([s.metadata["task_reward"] for s in group]),
            want=algo.prompts_per_step, max_rounds=algo.refill_rounds())
        if filled.padded:
            log.warning("step %d: %d of %d groups have rewards that are all equal after %d refill rounds; "
                        "training with them in the gaps (raise algorithm.maxRefillRounds)",
                        step, filled.padded, algo.prompts_per_step, filled.rounds)
        samples = []
        for index, group in enumerate(filled.groups):
            for sample in group:
                sample.group = index
                samples.append(sample)
        task_rewards = [s.metadata["task_reward"] for group in first for s in group]
        metrics = {"groups_dropped": float(filled.dropped), "groups_padded": float(filled.padded),
                   "refill_rounds": float(filled.rounds), "groups_generated": float(filled.generated),
                   "reward_shaping": sum(s.reward - s.metadata["task_reward"] for s in samples) / len(samples)}
        if self.agent is not None:  # the batch's model tokens (trained) and tool/environment tokens (not)
            model_tokens = sum(sum(s.loss_mask) for s in samples)
            metrics.update(agent_model_tokens=float(model_tokens),
                           agent_tool_tokens=float(sum(len(s.response_ids) for s in samples) - model_tokens),
                           agent_turns=sum(s.metadata["turns"] for s in samples) / len(samples))
        metrics.update({f"{phase}_seconds": seconds for phase, seconds in self._timing.phases.items()})
        return samples, task_rewards, metrics

    def _fresh(self, version: int) -> bool:
        """Whether the engines must hold the trainer's weights after step ``version``: validation
        then generates with them (a sync point: ``kuberl.driver.schedule.syncs_at``)."""
        return self.validator is not None and self.validator.due(version, self.total_steps)

    def train_step(self, step: int) -> StepResult:
        """Step ``step`` as ``kuberl.driver.schedule.step_actions`` lays it out: its rollout (unless
        generated already), asynchronous the later steps' generated in the background beside the
        updates, then at a sync point the weight sync."""
        import torch

        started = time.perf_counter()
        self._timing.phases = {}
        self._resize_engines()
        if self.engine_version == self.weight_version:  # nothing out: the engines may change
            self._replenish_engines()
        resized = self._resize_done()
        actions = schedule.step_actions(step, self.total_steps, max_staleness=self.spec.algorithm.staleness(),
                                        held=set(self._rollouts), engines=self.engine_version, fresh=self._fresh)
        synced = False
        for action in actions:
            if isinstance(action, schedule.Generate) and action.overlap:
                self._rollouts[action.step] = self._background.submit(self.rollout, action.step)
            elif isinstance(action, schedule.Generate):
                with self._doing("generate"):
                    self._rollouts[action.step] = _done(self.rollout(action.step))
            elif isinstance(action, schedule.Train):
                samples, task_rewards, rollout_metrics = self._generated(self._rollouts.pop(action.step))
                with self._doing("train"):
                    metrics = self._update(action.step, samples)
                staleness = staleness_metrics(self.weight_version, samples)
                self.weight_version = action.step + 1
            elif isinstance(action, schedule.Wait):
                self._generated(self._rollouts[action.step])
            else:
                self.engine_version, synced = action.version, True
                with self._doing("sync"):
                    sync = self._sync_weights(action.version)
        elapsed = time.perf_counter() - started
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        rewards = torch.tensor(task_rewards, dtype=torch.float64)
        metrics.update(rollout_metrics)
        metrics.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()) if len(rewards) > 1 else 0.0,
                       response_length=sum(len(s.response_ids) for s in samples) / len(samples),
                       step_seconds=elapsed, tokens_per_second=tokens / elapsed, **staleness)
        if synced:  # not between sync points (maxStaleness >= 2): no 0 s sync to average in
            metrics.update(weight_sync_seconds=getattr(sync, "seconds", 0.0), weight_sync_bytes=getattr(sync, "bytes", 0))
        metrics.update({f"{phase}_seconds": seconds for phase, seconds in self._timing.phases.items()})
        metrics.update(self.engines.take_counts())
        if resized is not None:
            metrics.update(rollout_resizes=1.0, rollout_resize_seconds=resized)
        self._report_recoveries(metrics)
        if self._checkpoint_stall is not None:  # the checkpoint after the step before
            metrics["checkpoint_stall_seconds"], self._checkpoint_stall = self._checkpoint_stall, None
        if self._trainer_recovery is not None:  # the first step of a recovered trainer group
            metrics.update(trainer_recoveries=1.0, trainer_recovery_seconds=self._trainer_recovery)
            self._trainer_recovery = None
        return StepResult(step, metrics["reward_mean"], metrics, rewards.tolist())

    def _resize_engines(self) -> None:
        """At the step boundary: the pool resized to spec.rollout.replicas as the job has it now
        (the reporter reads it; ``kubectl patch`` changes it while the job runs). Fewer engines
        retire at once, after any rollout still generating (maxStaleness) has finished, and the
        pods the engines left run in go to status (the operator deletes only other rollout pods);
        more start now and join through
        ``replenish`` once KubeRay's new pods give Ray their resources. Colocated engines live on
        the trainer pods: those never resize."""
        replicas = self.reporter.rollout_replicas()
        layout = self.plan.layout
        if replicas is None or layout.colocated or replicas * layout.engines_per_pod == self.engines.wanted:
            return
        wanted = replicas * layout.engines_per_pod
        log.warning("spec.rollout.replicas is now %d: resizing the rollout pool from %d to %d engines",
                    replicas, self.engines.wanted, wanted)
        if wanted < len(self.engines.engines):
            for rollout in self._rollouts.values():  # no engine retires with a share of a batch out
                rollout.exception()
        self.engines.resize(wanted)
        self.reporter.rollout(self.plan.attempt, replicas, self.engines.pods())
        self._resize_started = time.perf_counter()

    def _resize_done(self) -> float | None:
        """The seconds the last resize took, once the pool has reached its size (a scale-down at
        once, a scale-up when the last new engine joined)."""
        if self._resize_started is None or len(self.engines.engines) < self.engines.wanted:
            return None
        seconds, self._resize_started = time.perf_counter() - self._resize_started, None
        return seconds

    def _report_recoveries(self, metrics: dict[str, float]) -> None:
        """This step's recoveries to status.recoveries (the operator posts an Event for each)."""
        if metrics.get("engines_lost"):
            self.reporter.recovered("engine_lost", None, int(metrics["engines_lost"]))
        if metrics.get("engine_replacements"):
            self.reporter.recovered("engine_replaced", metrics["engine_replacement_seconds"],
                                    int(metrics["engine_replacements"]))
        if metrics.get("trainer_recoveries"):
            self.reporter.recovered("trainer", metrics["trainer_recovery_seconds"])
        if metrics.get("rollout_resizes"):
            self.reporter.recovered("resize", metrics["rollout_resize_seconds"])

    def _replenish_engines(self) -> None:
        """At a step boundary where nothing is generating (every one but with maxStaleness >= 2,
        where the engines hold older weights between sync points: at those only): engines lost
        earlier are replaced as their replacements come up (``EnginePool.replenish``, never waiting
        for one); those that joined get the current weights before they serve, so their samples
        carry this weight version."""
        if self.engines.replenish():
            with self._doing("sync"):
                self._sync_weights(self.weight_version)

    def _sync_weights(self, version: int):
        """The weights of ``version`` to every live engine, the sync's group first rebuilt if an
        engine was lost or joined since it was set up; an engine lost during the sync is dropped
        and the rest get the version again (``WeightSync.sync``)."""
        if self.weight_sync.rebuild():
            log.info("weight sync rebuilt for %d live rollout engines", len(self.engines.engines))
        return self.weight_sync.sync(version)

    def _update(self, step: int, samples: list[Sample]) -> dict[str, float]:
        """Advantages, the log-probs the algorithm needs, and the policy updates on one rollout."""
        import torch

        advantages = self.algorithm.advantages(torch.tensor([s.reward for s in samples], dtype=torch.float64),
                                               torch.tensor([s.group for s in samples]))
        check_advantages(step, self.algorithm.name, samples, advantages.tolist())
        colocated = self.plan.layout.colocated
        if colocated:
            with self._phase("sleep"):
                self.engines.sleep()  # the trainer ranks get the GPUs' memory while they step
        for sample, advantage in zip(samples, advantages.tolist(), strict=True):
            sample.advantage = advantage
        if self.spec.algorithm.tis is not None:
            engine_logprobs(samples, "algorithm.tis")  # every trainer rank weighs against them
        batch = TrainBatch(samples)
        for name in self.algorithm.logprobs(self.spec.algorithm.kl_coef):
            with self._phase("logprobs"):
                setattr(batch, f"{name}_logprobs", self._logprobs(name, batch))
        with self._phase("update"):
            metrics = policy_updates(self.trainer, batch, self.spec.algorithm)
        if batch.old_logprobs is not None and not self.spec.algorithm.staleness():
            metrics.update(engine_logprob_gap(samples, batch.old_logprobs))  # the trainer's own: comparable
        if colocated:
            with self._phase("wake"):
                self.engines.wake_up()
        return metrics

    def _logprobs(self, name: str, batch: TrainBatch) -> list[list[float]]:
        """The behaviour policy's ("old") log-probs, before the first update: the ratio of every
        update is measured against them (kuberl.driver.updates). Synchronous, the trainer
        recomputes them with its own numerics: it still holds the weights that generated the
        rollout. Asynchronous (maxStaleness, asyncRollout) it is up to maxStaleness versions ahead
        of those weights, so they are the engines' (vLLM's, after temperature, as the tokens were
        drawn), unless algorithm.tis: then the ratio is against the trainer's own log-probs (its
        weights now, the proximal policy) and the truncated importance weight corrects from the
        engines' to those."""
        if name == "old" and self.spec.algorithm.staleness() and self.spec.algorithm.tis is None:
            algo = self.spec.algorithm
            return engine_logprobs(batch.samples, "algorithm.maxStaleness" if algo.max_staleness is not None
                                   else "algorithm.asyncRollout")
        return getattr(self.trainer, LOGPROB_METHODS[name])(batch)

    # --- the run -----------------------------------------------------------------------------

    def restore(self) -> bool:
        """Restore what the run plan says (``plan.resume``), if there is a checkpoint to restore;
        True if there was."""
        state = self.checkpoints.restore()
        if state is None:
            return False
        self.step = state["step"]
        self.weight_version = self.engine_version = state["weight_version"]
        # Generated by weights older than these (asynchronous): not to regenerate.
        self._rollouts.update({step: _done(rollout) for step, rollout in held_rollouts(state).items()})
        # The engines hold other weights (the initial ones, or a lost trainer group's): push these.
        self.weight_sync.sync(self.weight_version)
        return True

    def run(self, max_steps: int | None = None) -> tuple[int, list[StepResult]]:
        total = self.total_steps
        last = total if max_steps is None else min(total, self.step + max_steps)
        results = []
        if self.step > 0:
            # Resumed: the attempt before may have held for a suspend and left heldForSuspend true.
            # From here on a step can be in flight, so a suspend must wait for this driver's hold.
            self.reporter.held_for_suspend(False)
        try:
            if self.step == 0 and self.validator is not None and self.validator.due(0, total):
                self._emit(0, self._validate(0))
            while self.step < last:
                try:
                    if self._run_step(results) == EXIT_PREEMPTED:
                        return EXIT_PREEMPTED, results
                except TrainerLost as lost:
                    with self._doing("recover"):
                        self._recover_trainer(lost)
        finally:
            self._background.shutdown(wait=False, cancel_futures=True)
            self.checkpoints.close()
            self.trackers.close()
        return EXIT_OK, results

    def _run_step(self, results: list[StepResult]) -> int | None:
        """One step and what follows it (validation, reports, export, checkpoint, a suspend's
        hold); ``EXIT_PREEMPTED`` once a SIGTERM's checkpoint is written."""
        total = self.total_steps
        result = self.train_step(self.step)
        self.step += 1
        results.append(result)
        if self.validator is not None and self.validator.due(self.step, total):
            result.metrics.update(self._validate(self.step))
        log.info("step %d/%d %s", self.step, total,
                 " ".join(f"{k}={v:.4g}" for k, v in sorted(result.metrics.items())))
        self.reporter.progress(self.step, total, result.reward_mean, result.metrics["tokens_per_second"],
                               gpu_busy(result.metrics))
        pod_metrics.record_step({"step": self.step, **result.metrics})
        self._emit(self.step, result.metrics)
        interval = self.spec.checkpoint.export_interval_steps
        if self.exporter is not None and interval and self.step % interval == 0 and self.step < total:
            self.exporter(self.step)
        suspend = self.step < total and self.reporter.suspend_requested()
        # The pods that gave notice since the last boundary, and whether the head is among them.
        going, head_going = self.notices.take(self.step) if self.notices is not None else ([], False)
        if going:  # their preStop hooks hold them until this checkpoint is committed
            log.warning("preemption notice from %s: checkpointing step %d, the step in flight at the notice",
                        ", ".join(going), self.step)
        if self.checkpoints.enabled and (self.checkpoints.due(self.step) or self.preemption.requested or suspend
                                         or going):
            with self._doing("checkpoint"):  # the stall; the shards upload in the background
                self.save()
                if going:
                    # The commit first, not in the background: a step begun now runs on a pod about
                    # to go and would only run again after the recovery (in pods, two steps ran
                    # during the upload). The hooks let their pods go once it is committed.
                    waited = time.perf_counter()
                    self.checkpoints.wait()
                    log.warning("checkpoint step %d committed %.1f s after the notice's boundary: %s may go",
                                self.step, time.perf_counter() - waited, ", ".join(going))
        if self.preemption.requested:
            return EXIT_PREEMPTED
        if head_going and self.checkpoints.enabled:
            return self._hold_while_the_head_goes()
        if suspend:
            self._hold_for_suspend()
        return None

    def _recover_trainer(self, lost: TrainerLost) -> None:
        """A trainer rank died: end its group, start a new one (the next epoch, which fences the
        old one out of the checkpoint root) once Ray has the resources, restore the newest
        checkpoint into it and push those weights to the engines, which stay up. The steps since
        that checkpoint run again. Ends the run instead (the operator's new attempt takes over)
        with colocated engines (the lost pod held engines too), when a rank is lost again before
        the run got past the step of the last loss, or when no resources come back in time."""
        if self.plan.layout.colocated:
            raise RuntimeError(f"{lost} during step {self.step + 1}: with rollout.colocate its pod held rollout "
                               f"engines too; a new attempt restores the newest checkpoint") from lost
        if self._trainer_lost_at is not None and self.step <= self._trainer_lost_at:
            raise RuntimeError(f"{lost} during step {self.step + 1}, again before the run got past step "
                               f"{self._trainer_lost_at + 1}, where a rank was lost last: not a passing failure, "
                               f"so this attempt ends") from lost
        self._trainer_lost_at = self.step  # steps completed when it was lost
        started = time.perf_counter()
        log.warning("%s during step %d: ending its group and starting a new one (waiting up to %d s for its "
                    "resources), then restoring the newest checkpoint", lost, self.step + 1,
                    TRAINER_REPLACEMENT_TIMEOUT_S)
        if self.notices is not None:  # no group to checkpoint with: going pods need not wait
            self.notices.recovering(True)
        for rollout in self._rollouts.values():  # asynchronous: the engines finish before new weights come
            rollout.exception()
        self._rollouts.clear()
        # The commit under way first: one whose every rank has uploaded its shards completes (a
        # checkpoint like any other, and less to run again); one that waits on the lost rank fails
        # at once. Either way before the new group claims the root, so no old commit lands after.
        self.checkpoints.settle()
        try:
            self.trainer.replace(TRAINER_REPLACEMENT_TIMEOUT_S)  # ends the lost group first
        except TrainerCapacityError as exc:
            raise TrainerCapacityError(f"{lost} during step {self.step + 1}, and {exc}: a new attempt takes "
                                       f"over") from lost
        self.weight_sync.replace_trainers()
        lost_step, self.step, self.weight_version, self.engine_version = self.step, 0, 0, 0
        if not self.restore():  # no checkpoint: the model's initial weights, from step 0
            self.weight_sync.sync(self.weight_version)
        if self.notices is not None:
            self.notices.recovering(False)
        self._trainer_recovery = time.perf_counter() - started
        log.warning("trainer group recovered in %.1f s (epoch %d): restored step %d, so steps %d-%d run again",
                    self._trainer_recovery, self.trainer.epoch, self.step, self.step + 1, lost_step + 1)

    def _validate(self, step: int) -> dict[str, float]:
        with self._doing("validate"):
            metrics = self.validator.run(step)
        self.reporter.validation(step, metrics["val/reward"])
        pod_metrics.record_validation(metrics)
        return metrics

    def _emit(self, step: int, metrics: dict[str, float]) -> None:
        """One step's metrics to the metrics file and the experiment trackers."""
        self.trackers.log(step, metrics)
        if self.metrics_file:
            with self.metrics_file.open("a") as f:
                f.write(json.dumps({"step": step, **metrics}) + "\n")

    def save(self) -> None:
        state: dict[str, Any] = {"weight_version": self.weight_version, "job": self.job.metadata.name}
        # Asynchronous: the later steps' rollouts, from weights this checkpoint no longer has; the
        # ones still generating (maxStaleness >= 2, between sync points) first complete.
        waited = time.perf_counter()
        if self._rollouts:
            state["rollouts"] = {str(step): rollout_state(rollout.result())
                                 for step, rollout in sorted(self._rollouts.items())}
        waited = time.perf_counter() - waited
        stall = self.checkpoints.save(self.step, state)
        log.info("checkpoint step %d started: training stalled %.3f s (%.3f s of it waiting for %d held rollouts); "
                 "shards upload in the background", self.step, stall + waited, waited, len(self._rollouts))
        # Reported with the next step, the time between the two being when training stalled.
        self._checkpoint_stall = stall
