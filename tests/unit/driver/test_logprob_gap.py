"""The engine log-prob gap the driver reports each synchronous step (pure)."""

from __future__ import annotations

import pytest

from kuberl.common.samples import Sample
from kuberl.driver.loop import engine_logprob_gap


def sample(logprobs, mask=None):
    return Sample(prompt_ids=[1, 2], response_ids=[5] * len(logprobs), response_logprobs=logprobs, loss_mask=mask)


def test_gap_is_mean_and_max_over_trained_tokens_only():
    samples = [sample([-1.0, -2.0, -0.5]), sample([-3.0, -1.0], mask=[1, 0])]
    trainer = [[-1.1, -2.0, -0.2], [-3.05, -9.0]]  # the masked (tool) token's 8.0 is not policy output
    gap = engine_logprob_gap(samples, trainer)
    assert gap["engine_logprob_gap_mean"] == pytest.approx((0.1 + 0.0 + 0.3 + 0.05) / 4)
    assert gap["engine_logprob_gap_max"] == pytest.approx(0.3)


def test_no_gap_without_engine_logprobs():
    assert engine_logprob_gap([Sample(prompt_ids=[1], response_ids=[2])], [[-1.0]]) == {}


def test_lengths_that_disagree_are_an_error_not_a_truncation():
    with pytest.raises(ValueError):
        engine_logprob_gap([sample([-1.0, -2.0])], [[-1.0]])
