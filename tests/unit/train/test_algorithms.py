"""Each algorithm's advantages and policy loss against numbers worked out by hand from its
paper's equations (the expected values are written out, never computed by the code under test)."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from kuberl.api.types import AlgorithmName
from kuberl.train.algorithms import registry
from kuberl.train.algorithms.base import UpdateTotals
from kuberl.train.algorithms.dapo import overlong_shaping

GRPO, DR_GRPO, DAPO, RLOO, GSPO = (registry.get(n) for n in ("grpo", "dr-grpo", "dapo", "rloo", "gspo"))

# Two prompts: group 0 with rewards 1, 0, 0, 1; group 1 with rewards 2, 4.
REWARDS = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0], dtype=torch.float64)
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1])


def test_registry_holds_every_api_name_and_names_the_field_for_others():
    assert set(registry.ALGORITHMS) == set(typing.get_args(AlgorithmName))
    with pytest.raises(ValueError, match=r"spec.algorithm.name: unknown algorithm 'ppo'; choose one of dapo, "):
        registry.get("ppo")


# --- advantages ------------------------------------------------------------------------------

def test_grpo_dapo_gspo_advantages_are_group_normalised():
    # group 0: mean 0.5, unbiased std sqrt((4 * 0.25) / 3) = sqrt(1/3): A = +-0.5 * sqrt(3) = +-0.8660254
    # group 1: mean 3, std sqrt((1 + 1) / 1) = sqrt(2): A = -+1 / sqrt(2) = -+0.7071068
    want = [0.8660254, -0.8660254, -0.8660254, 0.8660254, -0.7071068, 0.7071068]
    for algorithm in (GRPO, DAPO, GSPO):
        assert algorithm.advantages(REWARDS, GROUPS).tolist() == pytest.approx(want, rel=1e-5), algorithm.name


def test_dr_grpo_advantages_are_not_divided_by_the_std():
    # A_i = r_i - mean(group): group 0 mean 0.5, group 1 mean 3.
    assert DR_GRPO.advantages(REWARDS, GROUPS).tolist() == pytest.approx([0.5, -0.5, -0.5, 0.5, -1.0, 1.0])


def test_rloo_advantages_use_the_leave_one_out_baseline():
    # A_i = r_i - mean of the others: 1 - (0 + 0 + 1)/3 = 2/3; 0 - (1 + 0 + 1)/3 = -2/3;
    # group 1: 2 - 4 = -2, 4 - 2 = 2; a group of one (reward 5) has no baseline: 0.
    got = RLOO.advantages(torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 5.0]), torch.tensor([0, 0, 0, 0, 1, 1, 2]))
    assert got.tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3, -2.0, 2.0, 0.0])


# --- policy losses ----------------------------------------------------------------------------
# Two sequences. Sequence 0: two trained tokens with ratios 1.5 and 1.0, A = +1. Sequence 1: one
# trained token with ratio 0.5, A = -2, then a masked-out token with ratio 3.0.

LOGPROBS = torch.log(torch.tensor([[1.5, 1.0], [0.5, 3.0]]))
OLD = torch.zeros(2, 2)
ADV = torch.tensor([1.0, -2.0])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
INDEX = torch.tensor([[0, 0], [1, 1]])
TOTALS = UpdateTotals(tokens=torch.tensor(3.0), sequences=torch.tensor(2.0), max_response_tokens=4)


def _loss(algorithm, clip_low, clip_high, logprobs=LOGPROBS, totals=TOTALS):
    return algorithm.policy_loss(logprobs, OLD, ADV, MASK, INDEX, totals, clip_low=clip_low, clip_high=clip_high)


def test_grpo_and_rloo_token_mean_of_the_clipped_surrogate():
    # per token max(-A r, -A clip(r, 0.8, 1.2)): (0,0) max(-1.5, -1.2) = -1.2; (0,1) -1.0;
    # (1,0) max(-2 * -0.5, 2 * 0.8) = 1.6; divided by the 3 trained tokens.
    for algorithm in (GRPO, RLOO):
        loss, metrics = _loss(algorithm, 0.2, 0.2)
        assert loss.item() == pytest.approx((-1.2 - 1.0 + 1.6) / 3), algorithm.name
        assert metrics["clipped_tokens"].item() == 2


def test_dapo_clip_higher_with_a_token_level_loss():
    # clip(r, 1 - 0.2, 1 + 0.28): (0,0) max(-1.5, -1.28) = -1.28; (0,1) -1.0; (1,0) max(1.0, 1.6) = 1.6.
    loss, _ = _loss(DAPO, 0.2, 0.28)
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 1.6) / 3)


def test_dr_grpo_sums_tokens_and_divides_by_a_constant():
    # token sum -1.2 - 1.0 + 1.6 = -0.6, over G * L_max = 2 sequences * 4 tokens.
    loss, _ = _loss(DR_GRPO, 0.2, 0.2)
    assert loss.item() == pytest.approx(-0.6 / 8)
    with pytest.raises(ValueError, match="maxResponseLength"):
        _loss(DR_GRPO, 0.2, 0.2, totals=UpdateTotals(torch.tensor(3.0), torch.tensor(2.0)))


def test_gspo_sequence_ratio_clipped_per_sequence_and_sequence_mean():
    # s_0 = exp((ln 1.5 + ln 1) / 2) = sqrt(1.5) = 1.2247 -> clipped to 1.2: max(-1.2247, -1.2) = -1.2.
    # s_1 = exp(ln 0.5 / 1) = 0.5 (the masked token is not in it): max(2 * 0.5, 2 * 0.8) = 1.6.
    # Mean over the 2 sequences: (-1.2 + 1.6) / 2 = 0.2. Both sequences clipped: 2 + 1 tokens.
    loss, metrics = _loss(GSPO, 0.2, 0.2)
    assert loss.item() == pytest.approx(0.2)
    assert metrics["clipped_tokens"].item() == 3
    # With the range wide open nothing clips: (-1.2247 + 1.0) / 2.
    loss, metrics = _loss(GSPO, 0.9, 9.0)
    assert loss.item() == pytest.approx((-math.sqrt(1.5) + 1.0) / 2)
    assert metrics["clipped_tokens"].item() == 0


def test_truncated_importance_weights_per_token_and_per_sequence():
    from kuberl.train.loss import TruncatedIS

    # pi_old / mu per token: (0,0) 4 -> cap 2, (0,1) 1, (1,0) 0.5; the masked (1,1) is out.
    tis = TruncatedIS(torch.log(torch.tensor([[4.0, 1.0], [0.5, 1.0]])), cap=2.0)
    # Token level (grpo): the terms above times their weights, -1.2 * 2 - 1.0 * 1 + 1.6 * 0.5, over 3.
    for algorithm in (GRPO, DAPO, RLOO):
        loss, _ = algorithm.policy_loss(LOGPROBS, OLD, ADV, MASK, INDEX, TOTALS, clip_low=0.2, clip_high=0.2,
                                        tis=tis)
        assert loss.item() == pytest.approx((-2.4 - 1.0 + 0.8) / 3), algorithm.name
    # Sequence level (gspo): sequence 0's weight sqrt(4 * 1) = 2 (not above the cap), sequence 1's 0.5:
    # (-1.2 * 2 + 1.6 * 0.5) / 2.
    loss, _ = GSPO.policy_loss(LOGPROBS, OLD, ADV, MASK, INDEX, TOTALS, clip_low=0.2, clip_high=0.2, tis=tis)
    assert loss.item() == pytest.approx((-2.4 + 0.8) / 2)


def test_gspo_gradient_flows_through_the_sequence_ratio():
    # At pi = pi_old every s_i = 1 and d loss / d log pi_t = -A_i * s_i / |y_i| / G:
    # sequence 0 (2 tokens, A = 1): -1/2/2 = -0.25 per token; sequence 1 (1 token, A = -2): 2/1/2 = 1.0;
    # the masked token: 0.
    lp = torch.zeros(2, 2, requires_grad=True)
    loss, _ = _loss(GSPO, 3e-4, 4e-4, logprobs=lp)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-0.25, -0.25, 1.0, 0.0])


def test_gspo_packed_row_matches_the_padded_grid():
    # Both sequences in one packed row: [seq 0 tok, seq 0 tok, seq 1 tok, seq 1 masked tok].
    lp = LOGPROBS.reshape(1, 4)
    loss, _ = GSPO.policy_loss(lp, torch.zeros(1, 4), torch.tensor([[1.0, 1.0, -2.0, -2.0]]), MASK.reshape(1, 4),
                               torch.tensor([[0, 0, 1, 1]]), TOTALS, clip_low=0.2, clip_high=0.2)
    assert loss.item() == pytest.approx(0.2)


@pytest.mark.parametrize("name", sorted(registry.ALGORITHMS))
def test_micro_batch_shares_add_up_to_the_update_loss(name):
    """Each micro-batch's loss is its share of the update's: row by row, the shares sum to the whole."""
    algorithm = registry.get(name)
    whole, _ = _loss(algorithm, 0.2, 0.2)
    shares = sum(algorithm.policy_loss(LOGPROBS[i:i + 1], OLD[i:i + 1], ADV[i:i + 1], MASK[i:i + 1],
                                       torch.zeros(1, 2, dtype=torch.long), TOTALS, clip_low=0.2, clip_high=0.2)[0]
                 for i in range(2))
    assert shares.item() == pytest.approx(whole.item())


# --- what the driver asks of an algorithm ---------------------------------------------------

def test_log_probs_each_algorithm_needs():
    for algorithm in registry.ALGORITHMS.values():
        assert algorithm.logprobs(0.0) == ("old",)
        assert algorithm.logprobs(0.001) == ("old", "ref")


def test_dapo_overlong_shaping_values():
    # L_max 20, L_cache 5: no penalty up to 15 tokens, then (L_max - L_cache - |y|) / L_cache.
    assert overlong_shaping(15, 20, 5, 1.0) == 0.0
    assert overlong_shaping(16, 20, 5, 1.0) == pytest.approx(-0.2)
    assert overlong_shaping(18, 20, 5, 1.0) == pytest.approx(-0.6)
    assert overlong_shaping(20, 20, 5, 1.0) == pytest.approx(-1.0)
    assert overlong_shaping(25, 20, 5, 1.0) == pytest.approx(-1.0)
    assert overlong_shaping(18, 20, 5, 0.5) == pytest.approx(-0.3)
    assert overlong_shaping(20, 20, 0, 1.0) == 0.0  # buffer 0: off
    shaped = DAPO.shape_rewards([1.0, 0.0], [18, 10], response_limits=[20, 20], overlong_buffer=5, overlong_penalty=1.0)
    assert shaped == pytest.approx([0.4, 0.0])
    # With a maxTotalLength budget each sample's L_max is what its prompt left: 10 tokens of 12 are
    # 3 into the last 5.
    shaped = DAPO.shape_rewards([1.0, 0.0], [18, 10], response_limits=[20, 12], overlong_buffer=5, overlong_penalty=1.0)
    assert shaped == pytest.approx([0.4, -0.6])
    # The other algorithms train on the reward function's values.
    assert GRPO.shape_rewards([1.0], [20], response_limits=[20], overlong_buffer=5, overlong_penalty=1.0) == [1.0]


def test_only_dapo_filters_groups_whose_rewards_are_all_equal():
    assert not DAPO.keep_group([1.0, 1.0, 1.0]) and not DAPO.keep_group([0.0, 0.0])
    assert DAPO.keep_group([1.0, 0.0]) and DAPO.keep_group([0.4, 1.0])
    for algorithm in (GRPO, DR_GRPO, RLOO, GSPO):
        assert algorithm.keep_group([1.0, 1.0])
