"""Dynamic sampling (``kuberl.driver.sampling``): filter, refill rounds, and what
happens when the rounds run out. Groups here are lists of rewards; generation is a stand-in
callable that records what it was asked for (the pure function under test takes any)."""

from __future__ import annotations

import pytest

from kuberl.driver.sampling import fill_groups, refill_request
from kuberl.train.algorithms import registry

KEEP = registry.get("dapo").keep_group


class Rounds:
    def __init__(self, *rounds):
        self.rounds = list(rounds)
        self.asked: list[tuple[int, int]] = []

    def __call__(self, round_, count):
        self.asked.append((round_, count))
        return self.rounds.pop(0)[:count]


def test_refill_request_scales_by_the_keep_rate_and_is_bounded():
    assert refill_request(want=4, kept=2, generated=4) == 4      # 2 missing at 1/2 kept
    assert refill_request(want=4, kept=3, generated=8) == 3      # ceil(1 / (3/8)) = 3
    assert refill_request(want=4, kept=0, generated=4) == 4      # none kept: a full batch, not 16
    assert refill_request(want=8, kept=7, generated=8) == 2      # ceil(1 / (7/8)) = 2


def test_dropped_groups_are_refilled_in_generation_order():
    first = [[1, 1], [0, 1], [0, 0], [1, 0]]
    more = Rounds([[1, 1], [1, 0.5], [0, 0], [0, 0]], [[0, 1], [1, 0], [0, 1]])
    filled = fill_groups(first, more, KEEP, want=4, max_rounds=3)
    assert more.asked == [(1, 4), (2, 3)]
    assert filled.groups == [[0, 1], [1, 0], [1, 0.5], [0, 1]]
    assert (filled.rounds, filled.generated, filled.dropped, filled.padded) == (2, 11, 5, 0)


def test_rounds_that_run_out_fill_the_gaps_with_dropped_groups():
    first = [[1, 1], [0, 1], [0, 0], [1, 0]]
    more = Rounds([[1, 1]] * 4)
    filled = fill_groups(first, more, KEEP, want=4, max_rounds=1)
    assert more.asked == [(1, 4)]
    assert filled.groups == [[0, 1], [1, 0], [1, 1], [0, 0]]  # kept, then the first dropped
    assert (filled.rounds, filled.dropped, filled.padded) == (1, 6, 2)


@pytest.mark.parametrize("keep", [KEEP, registry.get("grpo").keep_group])
def test_no_round_when_nothing_is_missing_or_none_allowed(keep):
    def never(round_, count):
        raise AssertionError("no refill expected")

    first = [[0, 1], [1, 0]]
    assert fill_groups(first, never, keep, want=2, max_rounds=3).groups == first
    # grpo keeps every group; with 0 rounds, a filtering algorithm trains as it got them.
    filled = fill_groups([[1, 1], [0, 1]], never, keep, want=2, max_rounds=0)
    assert sorted(filled.groups) == [[0, 1], [1, 1]]
