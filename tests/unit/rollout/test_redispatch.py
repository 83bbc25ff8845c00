"""The pool's re-dispatch bookkeeping (``kuberl.rollout.pool.Redispatch``), pure: a lost engine's
share goes back out over the engines left, with the same prompt indices (and so the same seeds),
and the batch comes back whole and in prompt order."""

from __future__ import annotations

import pytest

from kuberl.rollout.pool import EnginesLost, Redispatch, shares


def test_shares_are_contiguous_and_cover_every_prompt_once():
    assert shares(0, 8, 3) == [(0, 3), (3, 6), (6, 8)]
    assert shares(4, 6, 3) == [(4, 5), (5, 6)]  # fewer prompts than engines: fewer shares
    with pytest.raises(ValueError, match="no engine"):
        shares(0, 4, 0)


def test_a_lost_share_is_resent_to_the_engines_left_with_its_own_prompt_indices():
    batch = Redispatch(8)
    for ticket, (engine, start, end) in enumerate(batch.plan(0, 8, ["a", "b"])):
        batch.sent(ticket, engine, start, end)
    assert batch.out == {0: ("a", 0, 4), 1: ("b", 4, 8)}

    batch.finished(0, [f"g{i}" for i in range(0, 4)])
    engine, start, end = batch.lost(1)  # "b" died with prompts 4..8 out
    assert (engine, start, end) == ("b", 4, 8)
    again = batch.plan(start, end, ["a"])
    assert again == [("a", 4, 8)]
    for ticket, (engine, lo, hi) in enumerate(again, start=2):
        batch.sent(ticket, engine, lo, hi)
    with pytest.raises(RuntimeError, match="4 of 8 groups done, 1 requests out"):
        batch.result()
    batch.finished(2, [f"g{i}" for i in range(4, 8)])
    assert batch.result() == [f"g{i}" for i in range(8)]


def test_an_answer_with_the_wrong_number_of_groups_is_refused():
    batch = Redispatch(2)
    batch.sent("t", "a", 0, 2)
    with pytest.raises(RuntimeError, match="1 groups for prompts 0..2"):
        batch.finished("t", ["g0"])


def test_with_no_engine_left_the_batch_fails_naming_the_cause():
    with pytest.raises(EnginesLost, match=r"every rollout engine is lost: prompts 4..8"):
        Redispatch(8).plan(4, 8, [])
