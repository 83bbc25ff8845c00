"""The every-expert MoE path: same outputs and gradients as the stock Hugging Face experts, every
expert gets a gradient, and its saved tensors do not depend on routing."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3MoeConfig

from kuberl.train.moe import GroupedExperts, use_grouped_experts


def _config(**kw):
    return Qwen3MoeConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, head_dim=16, intermediate_size=64, moe_intermediate_size=16,
                          num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, **kw)


def _pair(implementation):
    torch.manual_seed(0)
    config = _config()
    config._experts_implementation = "eager"  # the library's per-expert loop
    stock = AutoModelForCausalLM.from_config(config)
    ours = AutoModelForCausalLM.from_config(config)
    ours.load_state_dict(stock.state_dict())
    assert use_grouped_experts(ours, implementation) == 2
    return stock, ours


@pytest.mark.parametrize("implementation", ["grouped", "loop"])
def test_same_outputs_and_grads_as_stock(implementation):
    stock, ours = _pair(implementation)
    # Route everything away from expert 3 in layer 0: an expert with zero tokens.
    with torch.no_grad():
        for model in (stock, ours):
            model.model.layers[0].mlp.gate.weight[3] = -100.0 * model.model.layers[0].mlp.gate.weight[0].sign()
    ids = torch.randint(0, 64, (3, 11))
    out_stock = stock(ids).logits
    out_ours = ours(ids).logits
    torch.testing.assert_close(out_ours, out_stock, rtol=1e-5, atol=1e-5)
    out_stock.square().mean().backward()
    out_ours.square().mean().backward()
    for (name, p_s), (_, p_o) in zip(stock.named_parameters(), ours.named_parameters()):
        torch.testing.assert_close(p_o.grad, p_s.grad, rtol=1e-4, atol=1e-6, msg=name)
    # Parameter names (state dict, HF export) are unchanged by the swap.
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in ours.named_parameters()]


def _saved_shapes(experts, hidden, index, weights):
    shapes = []

    def pack(t):
        shapes.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        experts(hidden, index, weights)
    return shapes


def test_saved_tensors_do_not_depend_on_routing():
    """Non-reentrant checkpointing requires the recompute to save the same tensors as the forward;
    ours saves the same shapes whatever the routing (the stock loop does not)."""
    stock, ours = _pair("grouped")
    hidden = torch.randn(10, 32, requires_grad=True)
    weights = torch.full((10, 2), 0.5)
    spread = torch.tensor([[0, 1], [2, 3]] * 5)
    narrow = torch.tensor([[0, 1]] * 10)
    ours_experts = ours.model.layers[0].mlp.experts
    stock_experts = stock.model.layers[0].mlp.experts
    assert isinstance(ours_experts, GroupedExperts)
    assert _saved_shapes(ours_experts, hidden, spread, weights) == _saved_shapes(ours_experts, hidden, narrow, weights)
    assert _saved_shapes(stock_experts, hidden, spread, weights) != _saved_shapes(stock_experts, hidden, narrow, weights)


def test_every_expert_gets_a_gradient_even_without_tokens():
    _, ours = _pair("grouped")
    experts = ours.model.layers[0].mlp.experts
    hidden = torch.randn(6, 32)
    out = experts(hidden, torch.tensor([[0, 1]] * 6), torch.full((6, 2), 0.5))
    out.sum().backward()
    assert experts.gate_up_proj.grad is not None
    assert experts.gate_up_proj.grad[2:].abs().sum() == 0  # experts 2, 3: zero, but present
    assert experts.gate_up_proj.grad[:2].abs().sum() > 0


def test_unknown_implementation_names_the_field():
    _, ours = _pair("grouped")
    with pytest.raises(ValueError, match="expertImplementation"):
        use_grouped_experts(ours, "fast")


def test_grouped_layer_compiles_as_one_graph():
    """Routing has shapes independent of the data, so a compiled decoder layer is one graph:
    a graph break (bincount did this) would leave the routing eager between two graphs."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeRotaryEmbedding

    config = _config()
    config._attn_implementation = "sdpa"
    layer = Qwen3MoeDecoderLayer(config, 0).to(torch.bfloat16)  # _grouped_mm computes in bf16
    assert use_grouped_experts(layer) == 1
    hidden = torch.randn(1, 16, config.hidden_size, dtype=torch.bfloat16)
    positions = torch.arange(16)[None]
    cos, sin = Qwen3MoeRotaryEmbedding(config)(hidden, positions)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer.forward)(
        hidden, position_embeddings=(cos.to(torch.bfloat16), sin.to(torch.bfloat16)), attention_mask=None,
        position_ids=positions)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def test_expert_parallel_degree_is_checked_against_the_model_naming_the_field():
    """The API server checks that spec.trainer.parallelism.expert divides the trainer's processes;
    the model's expert count is judged when the trainer builds the model, before any collective."""
    from transformers import Qwen3Config, Qwen3MoeConfig

    from kuberl.train.model import ModelOptions, check_expert_parallel

    moe = Qwen3MoeConfig(num_experts=8)
    check_expert_parallel(moe, ModelOptions(), 4)
    with pytest.raises(ValueError, match=r"spec.trainer.parallelism.expert \(3\) must divide the model's "
                                         r"num_experts \(8\): set it to a divisor of 8"):
        check_expert_parallel(moe, ModelOptions(), 3)
    with pytest.raises(ValueError, match=r"spec.trainer.parallelism.expert \(2\) needs a Mixture-of-Experts model"):
        check_expert_parallel(Qwen3Config(), ModelOptions(), 2)
    with pytest.raises(ValueError, match="needs kuberl's grouped experts"):
        check_expert_parallel(moe, ModelOptions(moe_experts="stock"), 2)
    check_expert_parallel(Qwen3Config(), ModelOptions(), 1)


def test_freeze_routers_freezes_the_gates_only():
    from kuberl.train.moe import freeze_routers

    model = AutoModelForCausalLM.from_config(_config())
    assert freeze_routers(model) == 2
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    assert frozen == {f"model.layers.{i}.mlp.gate.weight" for i in range(2)}


def test_freeze_routers_refuses_a_dense_model():
    from transformers import Qwen3Config

    from kuberl.train.moe import freeze_routers

    dense = AutoModelForCausalLM.from_config(Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                                                         num_attention_heads=2, num_key_value_heads=1,
                                                         head_dim=16, intermediate_size=64))
    with pytest.raises(ValueError, match=r"spec.trainer.moe.freezeRouter needs a Mixture-of-Experts model; "
                                         r"Qwen3Config has no experts: remove freezeRouter"):
        freeze_routers(dense)
