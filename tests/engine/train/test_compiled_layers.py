"""Compiled decoder layers (the trainer's default on a GPU) under activation checkpointing, here
on CPU: inductor compiles for the host the same way."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def test_compiled_layers_train_and_a_variant_past_the_limit_is_an_error_not_an_eager_layer(tmp_path):
    """Past dynamo's limit a layer would run eagerly, and a checkpointed layer whose forward ran
    compiled and whose recomputation ran eagerly fails its backward with ``CheckpointError``
    (seen on an H200). The trainer leaves room for every variant it makes and turns a limit hit
    into an error naming it."""
    import torch._dynamo
    from torch.distributed.device_mesh import init_device_mesh

    from kuberl.driver.tiny import make_model
    from kuberl.train.model import LAYER_COMPILE_VARIANTS, ModelOptions, _build, load_config, shard_model
    from kuberl.train.packing import attention_kwargs, position_ids

    config = torch._dynamo.config
    saved = config.recompile_limit, config.fail_on_recompile_limit_hit
    # A one-rank group an earlier test of this process left up serves as well.
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    assert dist.get_world_size() == 1
    try:
        options = ModelOptions(compile_layers=True)
        model = _build(load_config(str(make_model(tmp_path / "model")), options), options)
        model = shard_model(model, init_device_mesh("cpu", (1,)), options)
        assert config.recompile_limit >= LAYER_COMPILE_VARIANTS and config.fail_on_recompile_limit_hit

        def step(lengths: list[int], grad: bool, packed: bool = True) -> None:
            ids = torch.randint(4, 100, (1, sum(lengths)))
            kwargs = dict(position_ids=position_ids(lengths, ids.device), **attention_kwargs(lengths, ids.device))
            with torch.set_grad_enabled(grad):
                # No KV cache, as the trainer calls it (TrainerWorker._forward).
                logits = model(input_ids=ids, use_cache=False, **(kwargs if packed else {})).logits
            if grad:
                logits.float().mean().backward()  # recomputes each checkpointed, compiled layer

        for lengths in ([5, 9], [12, 3, 7], [20]):  # the log-prob forward, then an update
            step(lengths, grad=False)
            step(lengths, grad=True)
        config.recompile_limit = 1  # as if the variants had run out
        with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
            step([6, 4], grad=True, packed=False)  # a variant not compiled yet
    finally:
        config.recompile_limit, config.fail_on_recompile_limit_hit = saved
        torch._dynamo.reset()
        if created:
            dist.destroy_process_group()
