"""Per-op selective checkpointing recomputes every second matmul and none of the attention, and
its gradients are those of no checkpointing."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from kuberl.train.recompute import checkpoint_per_op


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.mm = self.attention = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func == torch.ops.aten.mm.default:
            self.mm += 1
        if "scaled_dot_product" in str(func) and "backward" not in str(func):
            self.attention += 1
        return func(*args, **(kwargs or {}))


def block(x, weights):
    for w in weights:  # four matmuls, then attention, then a cheap op
        x = torch.relu(x @ w)
    q = x.view(1, 1, *x.shape)
    return F.scaled_dot_product_attention(q, q, q, is_causal=True).squeeze(0).squeeze(0).sin().sum()


def test_every_second_matmul_and_no_attention_is_recomputed_and_gradients_match():
    torch.manual_seed(0)
    x = torch.randn(8, 16, dtype=torch.float64)
    weights = [torch.randn(16, 16, dtype=torch.float64, requires_grad=True) for _ in range(4)]
    expected = torch.autograd.grad(block(x, weights), weights)

    loss = checkpoint_per_op(block)(x, weights)
    with CountMatmuls() as backward:
        got = torch.autograd.grad(loss, weights)
    # Backward's own matmuls: two per layer (input and weight gradients; the first layer's input
    # needs none) = 7; recomputed: the 2nd and 4th forward matmuls; attention: none.
    assert (backward.mm, backward.attention) == (7 + 2, 0)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
