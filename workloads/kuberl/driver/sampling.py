"""Dynamic sampling: the step's batch keeps only the groups its algorithm trains on
(``Algorithm.keep_group``) and is refilled with groups of new prompts, at most ``max_rounds``
extra generation rounds (DAPO, arXiv 2503.14476, section 3.2). Pure: generation is a callable."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar

G = TypeVar("G")


@dataclass
class Filled(Generic[G]):
    groups: list[G]      # exactly ``want``: the kept groups, then dropped ones where kept fell short
    rounds: int          # extra generation rounds run
    generated: int       # groups generated, first round included
    dropped: int         # groups the filter dropped
    padded: int          # dropped groups put back because the rounds ran out


def refill_request(want: int, kept: int, generated: int) -> int:
    """Prompts for the next round: the missing groups divided by the keep rate seen so far (at
    least one group in ``want``), at most ``want``."""
    missing = want - kept
    rate = max(kept / generated if generated else 1.0, 1.0 / want)
    return min(want, math.ceil(missing / rate))


def fill_groups(first: Sequence[G], generate: Callable[[int, int], Sequence[G]], keep: Callable[[G], bool],
                want: int, max_rounds: int) -> Filled[G]:
    """``first``: the step's own groups. ``generate(round, count)`` makes ``count`` more (round
    1, 2, ...). Keeps the groups ``keep`` accepts, in generation order, until there are ``want``;
    if ``max_rounds`` rounds leave the batch short, the gaps are filled with dropped groups (all
    their rewards are equal, so their advantages are zero or carry only reward shaping) and the
    batch keeps its size, which the mini-batch and rank splits depend on."""
    kept: list[G] = []
    dropped: list[G] = []
    generated = 0
    rounds = 0
    batch = list(first)
    while True:
        generated += len(batch)
        for group in batch:
            (kept if keep(group) else dropped).append(group)
        if len(kept) >= want or rounds >= max_rounds:
            break
        rounds += 1
        batch = list(generate(rounds, refill_request(want, len(kept), generated)))
    padded = max(0, want - len(kept))
    return Filled(groups=kept[:want] + dropped[:padded], rounds=rounds, generated=generated,
                  dropped=len(dropped), padded=padded)
