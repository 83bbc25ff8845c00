"""Reward functions: built-ins, or any importable ``module:function`` the job names, run in
parallel Ray tasks.

The batch reward interface (docs/rewards.md)::

    def my_reward(batch: list[RewardInput]) -> list[float]: ...

One call gets a contiguous share of the step's samples (``spec.reward.workers`` shares, each in
its own Ray task reserving ``spec.reward.cpusPerWorker`` CPUs) and returns one finite float per
input, in order. Each ``RewardInput`` carries the prompt, the response, the reference answer, the
row's ``data_source`` and ``extra_info``, and the prompt/response token lengths (overlong
shaping), so a function can score per sample, batch calls to a verifier, or shape by length.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from kuberl.api.types import RewardSpec
from kuberl.usercode import resolve


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


class RewardError(ValueError):
    """The reward function cannot be loaded or returned something unusable."""


def load_reward(spec: RewardSpec) -> RewardFn:
    if spec.builtin:
        return BUILTINS[spec.builtin]
    fn = resolve(spec.function or "", "spec.reward.function", "function", RewardError)
    if not callable(fn):
        raise RewardError(f"spec.reward.function: {spec.function} is a {type(fn).__name__}, not a function; "
                          f"name the reward function after ':'")
    return fn


def score(fn: RewardFn, batch: Sequence[RewardInput], offset: int = 0) -> list[float]:
    """Call ``fn`` and check what it returned: one finite float per input. ``offset`` is the
    share's position in the step, so errors name the sample as the whole step numbers it."""
    rewards = list(fn(list(batch)))
    if len(rewards) != len(batch):
        raise RewardError(f"reward function returned {len(rewards)} rewards for {len(batch)} inputs "
                          f"(samples {offset}-{offset + len(batch) - 1})")
    out = []
    for i, r in enumerate(rewards):
        try:
            value = float(r)
        except (TypeError, ValueError):
            raise RewardError(f"reward {offset + i} is {r!r}, not a number") from None
        if not math.isfinite(value):
            raise RewardError(f"reward {offset + i} is {value}, not finite")
        out.append(value)
    return out


def _score_share(spec: RewardSpec, batch: list[RewardInput], offset: int) -> list[float]:
    """One reward worker: loads the function in its own process (by name: nothing unpicklable
    crosses Ray) and scores its share."""
    return score(load_reward(spec), batch, offset)


class RewardWorkers:
    """Scores a step's samples in ``spec.workers`` parallel Ray tasks, contiguous shares, results
    in input order. The function is loaded once here as well, so a bad ``reward.function`` fails
    when the driver starts, not at the first step."""

    def __init__(self, spec: RewardSpec):
        import ray

        load_reward(spec)
        self.spec = spec
        self._task = ray.remote(_score_share).options(num_cpus=spec.cpus_per_worker, max_retries=0)

    def __call__(self, batch: Sequence[RewardInput]) -> list[float]:
        import ray

        batch = list(batch)
        if not batch:
            return []
        per = -(-len(batch) // self.spec.workers)
        refs = [self._task.remote(self.spec, batch[lo:lo + per], lo) for lo in range(0, len(batch), per)]
        rewards: list[float] = []
        for ref in refs:  # in order, so an error names the first bad share
            try:
                rewards += ray.get(ref)
            except ray.exceptions.RayTaskError as exc:
                # exc.cause is the worker's own exception; its str() has no Ray traceback around it.
                if isinstance(exc.cause, RewardError):
                    raise RewardError(str(exc.cause)) from None
                raise RewardError(f"spec.reward.function failed: {exc.cause!r}") from None
        return rewards
