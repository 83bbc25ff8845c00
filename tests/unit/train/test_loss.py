"""Loss terms against values computed by hand."""

import math

import pytest
import torch

from kuberl.train.loss import TruncatedIS, entropy_from_logits, group_advantages, kl_penalty, policy_loss


def test_policy_loss_clips_and_averages_over_tokens():
    # Sample 0: 2 tokens, A=+1. Sample 1: 1 trained token (second is masked out), A=-2.
    logprobs = torch.log(torch.tensor([[1.5, 1.0], [0.5, 3.0]]))
    old = torch.zeros(2, 2)  # ratio = exp(lp - 0) = [[1.5, 1.0], [0.5, 3.0]]
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    loss, metrics = policy_loss(logprobs, old, adv, mask, clip_low=0.2, clip_high=0.28)
    # token (0,0): r=1.5, A=1: max(-1.5, -1.28) = -1.28 (clipped)
    # token (0,1): r=1.0, A=1: -1.0
    # token (1,0): r=0.5, A=-2: max(1.0, 2*0.8=1.6) = 1.6 (clipped)
    assert loss.item() == pytest.approx((-1.28 - 1.0 + 1.6) / 3)
    assert metrics["clipped_tokens"].item() == 2


def test_policy_loss_total_tokens_divisor_and_per_token_advantages():
    lp = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, 2.0, 3.0]])
    loss, _ = policy_loss(lp, lp, adv, torch.ones(1, 3), 0.2, 0.2, total_tokens=12)
    assert loss.item() == pytest.approx(-(1 + 2 + 3) / 12)


def test_policy_loss_gradient_is_zero_where_clipped():
    lp = torch.log(torch.tensor([[2.0]])).requires_grad_()
    loss, _ = policy_loss(lp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1), 0.2, 0.2)
    loss.backward()
    assert lp.grad.item() == 0.0


def test_truncated_importance_weights_bound_each_tokens_correction_at_the_cap():
    # pi_old / mu per token: 0.5, 1.0, 4.0 (the engine found token 2 four times less likely than
    # the trainer does); cap 2. The PPO ratio is 1 (pi = pi_old), so each token's term is -A * w.
    old = torch.log(torch.tensor([[0.4, 0.3, 0.8]]))
    mu = torch.log(torch.tensor([[0.8, 0.3, 0.2]]))
    tis = TruncatedIS(old - mu, cap=2.0)
    assert tis.token_weights()[0].tolist() == pytest.approx([0.5, 1.0, 2.0])
    lp = old.clone().requires_grad_()
    loss, metrics = policy_loss(lp, old, torch.tensor([1.0]), torch.ones(1, 3), 0.2, 0.2, tis=tis)
    assert loss.item() == pytest.approx(-(0.5 + 1.0 + 2.0) / 3)  # 4.0 truncated to 2.0
    assert metrics["clipped_tokens"].item() == 0
    loss.backward()
    # d/d lp of -A * exp(lp - old) * w at lp = old: -A * w / tokens; the weight is a constant.
    assert lp.grad[0].tolist() == pytest.approx([-0.5 / 3, -1.0 / 3, -2.0 / 3])
    # Without TIS the same tokens weigh the same: the correction is the only difference.
    plain, _ = policy_loss(old, old, torch.tensor([1.0]), torch.ones(1, 3), 0.2, 0.2)
    assert plain.item() == pytest.approx(-1.0)


def test_truncated_importance_weight_multiplies_the_clipped_term_too():
    # r = 1.5 is clipped at 1.28 for A = +1; w = pi_old / mu = 3 truncated to 2.
    old = torch.zeros(1, 1)
    loss, metrics = policy_loss(torch.log(torch.tensor([[1.5]])), old, torch.tensor([1.0]), torch.ones(1, 1),
                                0.2, 0.28, tis=TruncatedIS(torch.log(torch.tensor([[3.0]])), cap=2.0))
    assert loss.item() == pytest.approx(-1.28 * 2.0)
    assert metrics["clipped_tokens"].item() == 1


def test_sequence_truncated_importance_weight_is_the_geometric_mean_truncated():
    # One sequence of 2 trained tokens (the third is masked): ratios 2 and 8 -> sqrt(16) = 4 -> cap 3;
    # a second sequence with ratios 0.25 and 1 -> 0.5.
    log_ratio = torch.log(torch.tensor([[2.0, 8.0, 100.0, 0.25, 1.0]]))
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0]])
    index = torch.tensor([[0, 0, 0, 1, 1]])
    weights = TruncatedIS(log_ratio * mask, cap=3.0).sequence_weights(mask, index, 2)
    assert weights.tolist() == pytest.approx([3.0, 0.5])


def test_kl_k3_estimator():
    lp = torch.tensor([[math.log(0.5), math.log(0.25)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.25)]])
    # k3 = exp(ref - lp) - (ref - lp) - 1: token 0: 0.5 - ln 0.5 - 1 = ln 2 - 0.5; token 1: 0
    got = kl_penalty(lp, ref, torch.ones(1, 2))
    assert got.item() == pytest.approx((math.log(2) - 0.5) / 2)
    assert kl_penalty(lp, lp, torch.ones(1, 2)).item() == 0.0


def test_entropy_from_logits():
    uniform = torch.zeros(3, 4)
    assert torch.allclose(entropy_from_logits(uniform), torch.full((3,), math.log(4)))
    p = torch.tensor([0.7, 0.2, 0.1])
    want = -(p * p.log()).sum()
    assert entropy_from_logits(p.log()[None]).item() == pytest.approx(want.item(), rel=1e-6)


def test_group_advantages():
    rewards = [1.0, 0.0, 0.5, 0.5, 2.0]
    groups = [7, 7, 3, 3, 9]
    adv = group_advantages(rewards, groups, eps=0.0)
    # group 7: mean 0.5, unbiased std sqrt(0.5) -> +-0.5/0.7071; group 3: std 0 -> 0/0 guarded by eps
    assert adv[0].item() == pytest.approx(0.5 / math.sqrt(0.5))
    assert adv[1].item() == pytest.approx(-0.5 / math.sqrt(0.5))
    adv = group_advantages(rewards, groups)
    assert adv[2].item() == 0.0 and adv[3].item() == 0.0
    assert adv[4].item() == 0.0  # a group of one carries no signal


def test_group_advantages_rejects_mismatched_lengths():
    with pytest.raises(ValueError, match="same length"):
        group_advantages([1.0, 2.0], [0])


def test_group_advantages_accumulate_in_float64():
    """In float32 the squares of the variance overflowed from |r| of about 1e19: the std became inf
    and every advantage of the group silently 0. Rewards are bounded far below (MAX_ABS_REWARD), and
    the arithmetic keeps its range and its digits wherever they come from."""
    from kuberl.train.loss import group_centred

    adv = group_advantages([0.0, 4e19, 1e6 + 1.0, 1e6 - 1.0], [0, 0, 1, 1])
    assert adv.dtype == torch.float64
    assert adv.tolist() == pytest.approx([-math.sqrt(0.5), math.sqrt(0.5), math.sqrt(0.5), -math.sqrt(0.5)])
    centred, size = group_centred([1e6 + 0.25, 1e6 - 0.25], [0, 0])
    assert centred.tolist() == [0.25, -0.25] and size.dtype == torch.float64  # float32 rounds both to 0
