"""What a reward is: a real number, finite and bounded (``as_reward``).

The driver's reward functions (``kuberl.driver.rewards``) and the agents' episode rewards
(``kuberl.rollout.agents``) are checked by the same rule, so both import it from here.
"""

from __future__ import annotations

import math
import numbers
from typing import Any


class RewardError(ValueError):
    """The reward function cannot be loaded, returned something unusable, failed or ran too long."""


# The largest reward magnitude a run trains on. Rewards are scores (0 or 1, [-1, 1], a few points);
# one past a million is a bug (a count, a timestamp, an overflow) that would swamp the advantages
# of the algorithms that do not divide by the group's spread (dr-grpo, rloo) and, near 1e154, overflow
# even the float64 squares of GRPO's variance. An error, not a clamp: a clamped bug trains silently.
MAX_ABS_REWARD = 1e6


def as_reward(value: Any, where: str, error: type[ValueError] = RewardError) -> float:
    """``value`` as a reward, or ``error`` naming ``where``: a real number (int, float, a numpy or
    torch scalar), finite, with ``|value| <= MAX_ABS_REWARD``. A string is refused, "1e3" too: a
    reward read from text is the function's job, where it knows the format. A bool is refused
    as well (although Python counts it an int): ``True`` is a predicate, where a score was meant,
    and numpy's ``bool_`` is no number at all, so ``float(ok)`` says which is meant, for both alike."""
    if callable(getattr(value, "item", None)) and getattr(value, "shape", None) == ():  # numpy, torch
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise error(f"{where} is {value!r:.100} ({type(value).__name__}), not a number: return an int or a "
                    f"float (a string is not parsed, and a bool needs float(...))")
    bound = f"the bound |reward| <= {MAX_ABS_REWARD:g} (kuberl.common.reward_values.MAX_ABS_REWARD); scale the reward into it"
    try:
        number = float(value)
    except OverflowError:
        raise error(f"{where} is an int past float's range, beyond {bound}") from None
    if not math.isfinite(number):
        raise error(f"{where} is {number}, not finite")
    if abs(number) > MAX_ABS_REWARD:
        raise error(f"{where} is {number:g}, beyond {bound}")
    return number
