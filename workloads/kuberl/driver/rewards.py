"""Reward functions: built-ins, or any importable ``module:function`` the job names, run in
parallel Ray tasks.

The batch reward interface (docs/rewards.md)::

    def my_reward(batch: list[RewardInput]) -> list[float]: ...

One call gets a contiguous share of the step's samples (``spec.reward.workers`` shares, each in
its own Ray task reserving ``spec.reward.cpusPerWorker`` CPUs) and returns one number per input,
in order: a real number (not a string, not a bool), finite, at most ``MAX_ABS_REWARD`` in
magnitude (``kuberl.common.reward_values.as_reward``). Each ``RewardInput`` carries the prompt, the response, the reference
answer, the row's ``data_source`` and ``extra_info``, and the prompt/response token lengths
(overlong shaping), so a function can score per sample, batch calls to a verifier, or shape by
length. The step's calls have ``spec.reward.timeoutSeconds`` together (a verifier that hangs must
end the step); past it their worker processes are
killed and the step fails, naming the function.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kuberl.api.types import RewardSpec
from kuberl.common.reward_values import RewardError, as_reward
from kuberl.common.usercode import resolve


@dataclass(frozen=True)
class RewardInput:
    prompt: str              # the prompt as the model saw it (chat template applied)
    response: str            # the decoded response, special tokens removed
    answer: Any              # the row's reference answer (spec.data.answerField), None if absent
    data_source: str = ""    # the row's spec.data.dataSourceField
    extra_info: dict = field(default_factory=dict)  # the row's spec.data.extraInfoField
    prompt_tokens: int = 0
    response_tokens: int = 0
    max_response_tokens: int = 0  # rollout.maxResponseLength: the budget the response had
    finish_reason: str = ""  # "stop" or "length" (truncated at max_response_tokens)
    group: int = 0           # samples of the same prompt share a group


RewardFn = Callable[[Sequence[RewardInput]], Sequence[float]]

# GSM8K conventions (lm-evaluation-harness's gsm8k filters; verl's gsm8k reward): "strict" reads the
# number after the last "####"; "flexible" reads the last number anywhere in the response.
_STRICT = re.compile(r"#### (-?[0-9.,]+)")
_NUMBER = re.compile(r"-?[0-9.,]+")


def _gsm8k_number(text: str) -> str:
    return text.replace(",", "").replace("$", "").rstrip(".")


def _reference(answer: Any) -> str:
    """A GSM8K reference: the number after "####" in a full solution, or the answer itself."""
    text = str(answer).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    return _gsm8k_number(text)


def gsm8k_strict_answer(response: str) -> str | None:
    found = _STRICT.findall(response)
    return _gsm8k_number(found[-1]) if found else None


def gsm8k_flexible_answer(response: str) -> str | None:
    numbers = [n for n in _NUMBER.findall(response) if n not in ("", ".", ",") and any(c.isdigit() for c in n)]
    return _gsm8k_number(numbers[-1]) if numbers else None


def _equal(got: str | None, answer: Any) -> float:
    if got is None:
        return 0.0
    reference = _reference(answer)
    if got == reference:
        return 1.0
    try:
        return 1.0 if float(got) == float(reference) else 0.0
    except ValueError:
        return 0.0


def gsm8k_strict(batch: Sequence[RewardInput]) -> list[float]:
    """1.0 when the number after the response's last ``#### `` equals the answer."""
    return [_equal(gsm8k_strict_answer(x.response), x.answer) for x in batch]


def gsm8k_flexible(batch: Sequence[RewardInput]) -> list[float]:
    """1.0 when the last number in the response equals the answer."""
    return [_equal(gsm8k_flexible_answer(x.response), x.answer) for x in batch]


def repeat_letter(batch: Sequence[RewardInput]) -> list[float]:
    """The share of the response's characters that equal the answer letter (0 for an empty response)."""
    out = []
    for x in batch:
        letters = x.response.strip()
        out.append(sum(c == x.answer for c in letters) / len(letters) if letters else 0.0)
    return out


BUILTINS: dict[str, RewardFn] = {"gsm8k_strict": gsm8k_strict, "gsm8k_flexible": gsm8k_flexible,
                                 "repeat_letter": repeat_letter}


def reward_name(spec: RewardSpec) -> str:
    """The reward function as the job names it, for errors."""
    return f"spec.reward.builtin {spec.builtin}" if spec.builtin else f"spec.reward.function {spec.function}"


def load_reward(spec: RewardSpec, code_dir: str | None = None) -> RewardFn:
    """``code_dir``: where ``spec.source``'s code is in this process's pod (the plan's
    ``paths.reward_code``, or the local copy ``kuberl train`` staged)."""
    if spec.builtin:
        return BUILTINS[spec.builtin]
    fn = resolve(spec.function or "", "spec.reward.function", "function", RewardError, source=spec.source,
                 source_dir=code_dir)
    if not callable(fn):
        raise RewardError(f"spec.reward.function: {spec.function} is a {type(fn).__name__}, not a function; "
                          f"name the reward function after ':'")
    return fn


def score(fn: RewardFn, batch: Sequence[RewardInput], offset: int = 0, *, name: str = "the reward function"
          ) -> list[float]:
    """Call ``fn`` (``name`` in errors) and check what it returned: one reward per input
    (``as_reward``). ``offset`` is the share's position in the step, so errors name the sample
    as the whole step numbers it."""
    rewards = list(fn(list(batch)))
    if len(rewards) != len(batch):
        raise RewardError(f"{name} returned {len(rewards)} rewards for {len(batch)} inputs "
                          f"(samples {offset}-{offset + len(batch) - 1})")
    return [as_reward(r, f"{name}: reward {offset + i}") for i, r in enumerate(rewards)]


def _score_share(spec: RewardSpec, code_dir: str | None, batch: list[RewardInput], offset: int) -> list[float]:
    """One reward worker: loads the function in its own process (by name: nothing unpicklable
    crosses Ray) and scores its share."""
    return score(load_reward(spec, code_dir), batch, offset, name=reward_name(spec))


RETRIES_ON_WORKER_LOSS = 2


class RewardWorkers:
    """Scores a step's samples in ``spec.workers`` parallel Ray tasks, contiguous shares, results
    in input order. The function is loaded once here as well, so a bad ``reward.function`` fails
    when the driver starts, not at the first step.

    The step's shares have ``timeout_s`` together. A thread running a hung function could not be
    stopped; a Ray task can: past the bound, or once one share failed, every share still running
    is cancelled with ``force``, which kills its worker process, and the step fails naming the
    function, the bound and the samples."""

    def __init__(self, spec: RewardSpec, code_dir: str | None = None):
        import ray

        load_reward(spec, code_dir)
        self.spec, self.code_dir = spec, code_dir
        self.name = reward_name(spec)
        self.timeout_s = float(spec.timeout_seconds)
        # A share whose worker or node went (its pod deleted or preempted: Ray runs reward tasks
        # wherever a CPU is free, the trainer pods' too) runs again elsewhere, within the same
        # deadline; an exception the function raised is never retried (retry_exceptions is off),
        # and a share cancelled past the deadline is not either. In pods, a trainer pod's
        # preemption ended a job as RewardFunctionFailed when it held a share.
        self._task = ray.remote(_score_share).options(num_cpus=spec.cpus_per_worker, max_retries=RETRIES_ON_WORKER_LOSS)

    def __call__(self, batch: Sequence[RewardInput]) -> list[float]:
        import ray

        batch = list(batch)
        if not batch:
            return []
        per = -(-len(batch) // self.spec.workers)
        shares = {self._task.remote(self.spec, self.code_dir, batch[lo:lo + per], lo): (lo, min(lo + per, len(batch)) - 1)
                  for lo in range(0, len(batch), per)}
        deadline = time.monotonic() + self.timeout_s
        pending = list(shares)
        try:
            while pending:
                done, pending = ray.wait(pending, timeout=max(0.0, deadline - time.monotonic()))
                if not done:
                    first, last = min(shares[ref] for ref in pending)
                    raise RewardError(f"{self.name} did not return within {self.timeout_s:g} s "
                                      f"(spec.reward.timeoutSeconds, the bound on a step's reward calls) for "
                                      f"samples {first}-{last}; its workers were killed")
                ray.get(done)  # a share that failed fails the step now, not after the slow ones
        except ray.exceptions.RayTaskError as exc:
            # exc.cause is the worker's own exception; its str() has no Ray traceback around it.
            if isinstance(exc.cause, RewardError):
                raise RewardError(str(exc.cause)) from None
            raise RewardError(f"{self.name} failed: {exc.cause!r}") from None
        except ray.exceptions.RayError as exc:  # its worker died again on every retry (out of memory, killed)
            raise RewardError(f"{self.name}: a reward worker died: {exc}") from None
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
        return [reward for ref in shares for reward in ray.get(ref)]
