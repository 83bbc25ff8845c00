"""Reward functions: built-ins, or any importable ``module:function`` the job names.

A reward function takes ``(prompts, responses, answers)`` (lists of equal length) and returns one
float per response.
"""

from __future__ import annotations

import importlib
import math
import re
from typing import Any, Callable, Sequence

from kuberl.api.types import RewardSpec

RewardFn = Callable[[Sequence[str], Sequence[str], Sequence[Any]], Sequence[float]]

_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def _final_answer(text: str) -> str | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _normalise(answer: Any) -> str:
    text = str(answer).strip()
    # GSM8K answers end with "#### 42".
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip()
    text = text.replace(",", "").rstrip(".")
    try:
        value = float(text)
        return str(int(value)) if value.is_integer() else str(value)
    except ValueError:
        return text


def math_exact_match(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any]) -> list[float]:
    """1.0 when the response's final answer (the last \\boxed{}, else the last number) equals the answer."""
    out = []
    for response, answer in zip(responses, answers, strict=True):
        got = _final_answer(response)
        out.append(1.0 if got is not None and _normalise(got) == _normalise(answer) else 0.0)
    return out


def repeat_letter(prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any]) -> list[float]:
    """The share of the response's characters that equal the answer letter (0 for an empty response)."""
    out = []
    for response, answer in zip(responses, answers, strict=True):
        letters = response.strip()
        out.append(sum(c == answer for c in letters) / len(letters) if letters else 0.0)
    return out


BUILTINS: dict[str, RewardFn] = {"math_exact_match": math_exact_match, "repeat_letter": repeat_letter}


class RewardError(ValueError):
    """The reward function cannot be loaded or returned something unusable."""


def load_reward(spec: RewardSpec) -> RewardFn:
    if spec.builtin:
        return BUILTINS[spec.builtin]
    module_name, _, attr = (spec.function or "").partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"spec.reward.function: cannot import {module_name!r}: {exc}") from exc
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RewardError(f"spec.reward.function: {module_name!r} has no function {attr!r}")
    return fn


def score(fn: RewardFn, prompts: Sequence[str], responses: Sequence[str], answers: Sequence[Any]) -> list[float]:
    """Call ``fn`` and check what it returned: one finite float per response."""
    rewards = list(fn(prompts, responses, answers))
    if len(rewards) != len(responses):
        raise RewardError(f"reward function returned {len(rewards)} rewards for {len(responses)} responses")
    out = []
    for i, r in enumerate(rewards):
        try:
            value = float(r)
        except (TypeError, ValueError):
            raise RewardError(f"reward {i} is {r!r}, not a number") from None
        if not math.isfinite(value):
            raise RewardError(f"reward {i} is {value}, not finite")
        out.append(value)
    return out
