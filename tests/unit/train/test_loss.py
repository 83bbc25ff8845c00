"""Loss terms against values computed by hand."""

import math

import pytest
import torch

from kuberl.train.loss import entropy_from_logits, group_advantages, kl_penalty, policy_loss


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
