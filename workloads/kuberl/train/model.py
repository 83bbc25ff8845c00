"""A Hugging Face causal LM as an FSDP2 module (on one rank a plain one under autocast, unless offloaded):
meta-device build on every rank, real weights read once on rank 0 and broadcast in coalesced
buckets, ``fully_shard`` per decoder layer then the root, optional non-reentrant activation
checkpointing (every layer or every n-th, or per op), each decoder layer's forward compiled on GPU,
packed-sequence attention, the chunked log-prob head and the every-expert MoE path."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from kuberl.train.logprobs import DEFAULT_CHUNK_TOKENS, use_logprob_head
from kuberl.train.lora import LoraOptions, apply_lora
from kuberl.train.moe import GroupedExperts, freeze_routers, is_moe_config, use_grouped_experts
from kuberl.train.packing import PACKED_ATTENTION, UNIFORM_SDPA_ATTR, register_packed_attention
from kuberl.train.recompute import checkpoint_per_op, checkpoint_whole

BROADCAST_BUCKET_BYTES = 256 << 20


@dataclass
class ModelOptions:
    trust_remote_code: bool = False
    gradient_checkpointing: bool = True
    # With checkpointing on: recompute every n-th decoder layer only (1 = all; 2 = half the
    # recompute, more activation memory).
    checkpoint_every: int = 1
    # With checkpointing on: every layer per op instead (kuberl.train.recompute: attention and
    # every other matmul saved, the rest recomputed; torchtitan's default). checkpoint_every is
    # then unused.
    checkpoint_per_op: bool = False
    # Compute dtype (FSDP2 mixed precision, or autocast on one unsharded rank); master weights,
    # gradients and their reduction stay fp32.
    param_dtype: torch.dtype = torch.float32
    # At world size 1: False keeps a plain module (fp32 weights, forward under autocast to
    # param_dtype), as torchtitan trains on one GPU: FSDP2 on a one-rank mesh only adds its
    # all-gather and reduce-scatter copies (0.8% of tokens/s on an H200, docs/benchmarks.md).
    # True wraps it in FSDP2 anyway.
    # Checkpoints are the same DCP state (same names, global shapes) either way.
    shard_single_rank: bool = False
    # Packed rows whose documents all have one length run as a batch of causal rows through SDPA
    # (cuDNN's flash kernels on Hopper, 1.6x FlashAttention-2 varlen; kuberl.train.packing);
    # False: every packed row through the varlen kernel.
    uniform_sdpa: bool = True
    # "grouped" | "loop": our every-expert path; "stock": the library's own experts (benchmarks
    # and the failure-mode test only).
    moe_experts: str = "grouped"
    # Ours handles packed rows (document-masked varlen) and plain causal rows; "sdpa" is the
    # library's own (padding masks built per forward).
    attn_implementation: str = PACKED_ATTENTION
    # Log-prob/entropy head: rows per chunk; 0 materialises [tokens x vocab] logits (reference).
    logprob_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # torch.compile each decoder layer's forward; None: on when the model is on a GPU.
    compile_layers: bool | None = None
    # FSDP2 frees each layer's gathered parameters after forward; None: only when sharded over
    # more than one rank (one rank holds every parameter anyway, freeing only adds a gather).
    reshard_after_forward: bool | None = None
    broadcast_bucket_bytes: int = BROADCAST_BUCKET_BYTES
    # spec.trainer.cpuOffload: FSDP2's CPUOffloadPolicy keeps the sharded parameters, their
    # gradients and so the optimizer state in host memory; each layer's gathered weights visit
    # the device for its forward and backward only. Shards even at world size 1 (is_sharded).
    cpu_offload: bool = False
    # spec.trainer.parallelism.expert: ranks per expert-parallel group (kuberl.train.moe); 1: every
    # rank FSDP2-shards every expert.
    expert_parallel: int = 1
    # spec.trainer.lora: adapters on the targeted linear layers (kuberl.train.lora), added before
    # fully_shard; the base frozen. None trains every parameter.
    lora: LoraOptions | None = None
    # spec.trainer.moe.freezeRouter: the MoE routers get no gradient and no optimizer state
    # (kuberl.train.moe.freeze_routers), frozen before fully_shard.
    freeze_router: bool = False


def trainer_meshes(device_type: str, world_size: int, expert_parallel: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """The dense mesh (every rank: FSDP2 of the dense weights) and, with expert parallelism, the
    2-D ``("dp_shard", "ep")`` mesh of the experts: ``ep`` consecutive ranks split the experts
    (on GPU nodes, the all-to-all stays within a node), the ``dp_shard`` ranks holding the same
    experts FSDP2-shard them. The plan's trainer mesh (kuberl.job.plan.TrainerMesh) names both
    sizes; this only builds them."""
    dense = init_device_mesh(device_type, (world_size,))
    if expert_parallel == 1:
        return dense, None
    return dense, init_device_mesh(device_type, (world_size // expert_parallel, expert_parallel),
                                   mesh_dim_names=("dp_shard", "ep"))


def load_config(model_path: str, options: ModelOptions):
    from transformers import AutoConfig

    return prepare_config(AutoConfig.from_pretrained(model_path, trust_remote_code=options.trust_remote_code),
                          options)


def prepare_config(config, options: ModelOptions):
    if options.attn_implementation == PACKED_ATTENTION:
        register_packed_attention()
        setattr(config, UNIFORM_SDPA_ATTR, options.uniform_sdpa)
    config._attn_implementation = options.attn_implementation
    if options.moe_experts == "stock":
        # The library's per-expert Python loop, i.e. what a plain from_pretrained trains with
        # when no fused kernel is selected.
        config._experts_implementation = "eager"
    return config


def _build(config, options: ModelOptions) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config, trust_remote_code=options.trust_remote_code,
                                             dtype=torch.float32)
    if options.moe_experts != "stock":
        use_grouped_experts(model, options.moe_experts)
    use_logprob_head(model, options.logprob_chunk_tokens)
    return model


# Compiled variants of the decoder layer's forward dynamo may keep. One process compiles one per
# grad mode (update, recompute / log-prob forwards), per optional input present or None, and per
# range of packed lengths inductor's kernels guard on: 8 after 4 steps at Qwen2.5-1.5B's shape on
# an H200 (TORCH_LOGS=recompiles), which is dynamo's default limit.
LAYER_COMPILE_VARIANTS = 64


def allow_layer_variants() -> None:
    """Room for every variant of a compiled decoder layer, and a limit hit is an error. Past the
    limit dynamo would run the layer eagerly instead; a checkpointed layer whose forward ran
    compiled and whose recomputation ran eagerly saves different tensors, and its backward fails
    with ``CheckpointError: Recomputed values ... have different metadata`` (seen on an H200)."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, LAYER_COMPILE_VARIANTS)
    torch._dynamo.config.fail_on_recompile_limit_hit = True


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks (the modules named in ``_no_split_modules``)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise NotImplementedError(f"{type(model).__name__} names no decoder layer class in "
                                  f"_no_split_modules; cannot shard it layer by layer")
    return layers


def is_sharded(mesh: DeviceMesh, options: ModelOptions) -> bool:
    """Whether ``shard_model`` wraps the model in FSDP2 on this mesh. Offload is FSDP2's own
    (its hooks copy each layer to the device and back), so it needs the wrapper at one rank too."""
    return mesh.size() > 1 or options.shard_single_rank or options.cpu_offload


def check_expert_parallel(config, options: ModelOptions, expert_parallel: int) -> None:
    """The part of spec.trainer.parallelism.expert only the model's config can judge (the API
    server checked that it divides the trainer's processes)."""
    if expert_parallel == 1:
        return
    field = f"spec.trainer.parallelism.expert ({expert_parallel})"
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    if not experts:
        raise ValueError(f"{field} needs a Mixture-of-Experts model; {type(config).__name__} has no experts: set it to 1")
    if options.moe_experts == "stock":
        raise ValueError(f"{field} needs kuberl's grouped experts, not the library's (moe_experts='stock')")
    if experts % expert_parallel:
        raise ValueError(f"{field} must divide the model's num_experts ({experts}): set it to a divisor of {experts}")


def _shard_experts(experts: GroupedExperts, expert_mesh: DeviceMesh, world_size: int, **fsdp) -> None:
    """Expert parallelism, as torchtitan composes it with FSDP2: the expert weights become
    DTensors ``Shard(0)`` over the ``ep`` dimension (whole experts per rank), then FSDP2 shards
    each rank's experts over ``dp_shard`` in their own group. Their gradients are summed over the
    EP group by the all-to-all's backward and over ``dp_shard`` by FSDP2, so they are divided by
    the whole world (as the dense gradients are), not by ``dp_shard``."""
    ep_mesh, dp_mesh = expert_mesh["ep"], expert_mesh["dp_shard"]
    for name, param in list(experts.named_parameters(recurse=False)):
        # src_data_rank=None: each rank keeps its own chunk (the weights are filled after sharding).
        experts.register_parameter(name, nn.Parameter(distribute_tensor(param, ep_mesh, [Shard(0)],
                                                                        src_data_rank=None)))
    # Fewer local experts than dp_shard ranks: FSDP2 would split dim 0 unevenly (padding);
    # shard the rows of each expert instead (torchtitan's choice).
    local = experts.num_experts // ep_mesh.size()
    placement = (lambda _param: Shard(1)) if dp_mesh.size() > local else None
    fully_shard(experts, mesh=dp_mesh, shard_placement_fn=placement, **fsdp)
    experts.set_gradient_divide_factor(float(world_size))
    if dp_mesh.device_type == "cpu" and dp_mesh.size() > 1:
        # gloo has no PREMUL_SUM (FSDP2's reduce-scatter with a divide factor): sum, then divide.
        # Not on a one-rank dp_shard (EP = world): there FSDP2 skips the reduce-scatter and divides
        # by the factor itself, and with forced sums would divide a second time (torch 2.13).
        experts.set_force_sum_reduction_for_comms(True)


def shard_model(model: nn.Module, mesh: DeviceMesh, options: ModelOptions, *, trainable: bool = True,
                expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """``expert_mesh``: the ("dp_shard", "ep") mesh of ``trainer_meshes`` for expert parallelism."""
    layers = decoder_layers(model)
    if expert_mesh is not None:
        check_expert_parallel(model.config, options, expert_mesh["ep"].size())
    if options.freeze_router:
        # Before fully_shard, which keeps each parameter's requires_grad in its sharded one.
        freeze_routers(model)
    if options.gradient_checkpointing and trainable:
        if options.checkpoint_per_op:
            for layer in layers:
                layer.forward = checkpoint_per_op(layer.forward)
        else:
            if options.checkpoint_every < 1:
                raise ValueError(f"checkpoint_every must be >= 1, got {options.checkpoint_every}")
            checkpointed = layers[::options.checkpoint_every]
            if is_moe_config(model.config):
                # MoE: the library's eager checkpoint around the compiled layer. Inside it the MoE
                # preset's step was 1.50x slower with every layer checkpointed (0.957 s against
                # 0.636 s) and 1.15x at every 4th (two calls on H200s, docs/benchmarks.md); why
                # is not known yet.
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                for i, layer in enumerate(layers):
                    layer.gradient_checkpointing = i % options.checkpoint_every == 0
            else:
                for layer in checkpointed:
                    layer.forward = checkpoint_whole(layer.forward)
    compile_layers = options.compile_layers if options.compile_layers is not None else mesh.device_type == "cuda"
    if compile_layers:
        allow_layer_variants()
        # The layer's forward only: FSDP's unshard/reshard hooks and the checkpoint wrapper stay
        # eager around it; repeated layers share one compiled graph, with dynamic shapes from the
        # start (packed micro-batches differ in length every time).
        for layer in layers:
            layer.forward = torch.compile(layer.forward, dynamic=True)
    if not is_sharded(mesh, options):
        if options.param_dtype != torch.float32:
            model.forward = torch.autocast(mesh.device_type, dtype=options.param_dtype)(model.forward)
        if not trainable:
            model.requires_grad_(False)
        return model
    mp = MixedPrecisionPolicy(param_dtype=options.param_dtype, reduce_dtype=torch.float32)
    # Pinned host shards make the copies to and from a GPU asynchronous; a CPU mesh has none
    # (and pinning needs a GPU driver).
    offload = (CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if options.cpu_offload
               else OffloadPolicy())
    # Offloaded, a layer kept gathered after forward would hold its device copy until backward:
    # freeing it is the memory offload is for, even at one rank.
    reshard = (options.reshard_after_forward if options.reshard_after_forward is not None
               else mesh.size() > 1 or options.cpu_offload)
    fsdp = dict(mp_policy=mp, offload_policy=offload, reshard_after_forward=reshard)
    for layer in layers:
        if expert_mesh is not None:
            for experts in [m for m in layer.modules() if isinstance(m, GroupedExperts)]:
                _shard_experts(experts, expert_mesh, mesh.size(), **fsdp)
        fully_shard(layer, mesh=mesh, **fsdp)
    # The root group holds the embeddings, final norm and LM head: tied weights stay one parameter.
    fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=offload)
    if not trainable:
        model.requires_grad_(False)
    return model


def total_grad_norm(params: list[nn.Parameter]) -> torch.Tensor:
    """The gradients' global 2-norm, a plain tensor equal on every rank (zero without gradients).
    Sharded gradients are DTensors of up to two meshes (dense, and the experts' ("dp_shard",
    "ep")); torch's ``get_total_norm`` over all of them would stack per-tensor norms of different
    meshes, so each mesh's norm is reduced to a full tensor first (as torchtitan's
    ``_clip_grad_norm_with_ep``)."""
    by_mesh: dict[DeviceMesh | None, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p.grad)
    norms = []
    for grads in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(grads)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.zeros(())
    # One mesh: its norm as it is (bit for bit what clip_grad_norm_ gives).
    return norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """What ``torch.nn.utils.clip_grads_with_norm_`` multiplies every gradient by to clip them to
    a global norm of ``max_norm``, as a tensor (no host sync): ``kuberl.train.optim.AdamW`` takes
    it into its update instead of a pass over the gradients of its own."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)


def _materialize(model: nn.Module, mesh: DeviceMesh, device: torch.device, options: ModelOptions) -> None:
    """Allocate the meta-device model on ``device`` (contents undefined); offloaded, on the host,
    where FSDP2's CPUOffloadPolicy requires the shards to be."""
    model.to_empty(device="cpu" if options.cpu_offload else device)
    if options.cpu_offload:
        # FSDP2 offloads only the parameters it shards: buffers (rotary inv_freq) serve the
        # forward on the device, as torchtitan places them.
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
    if not is_sharded(mesh, options):
        # to_empty gives each module its own new parameter: tie the LM head to the embeddings
        # again (FSDP2 keeps a tied parameter one, in the root group).
        model.tie_weights()


def _named_state(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    # named_parameters() lists a tied parameter once; buffers include the non-persistent ones
    # (rotary inv_freq), which a meta-device build leaves uninitialised.
    return [*model.named_parameters(), *model.named_buffers()]


@torch.no_grad()
def broadcast_full_state(model: nn.Module, source: nn.Module | None, device: torch.device,
                         bucket_bytes: int = BROADCAST_BUCKET_BYTES) -> None:
    """Fill the sharded ``model`` from rank 0's unsharded ``source`` (None on other ranks).

    Tensors are packed into flat buckets of up to ``bucket_bytes`` per dtype and broadcast one
    bucket at a time (a broadcast per tensor costs a round trip each: minutes for large MoE
    checkpoints); every rank then keeps its own shard.
    """
    targets = _named_state(model)
    src = dict(_named_state(source)) if source is not None else None
    if src is not None:
        missing = [name for name, _ in targets if name not in src]
        if missing:
            raise RuntimeError(f"checkpoint lacks {len(missing)} tensors the model needs, e.g. {missing[:3]}")
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current, size, dtype = [], 0, None
    for name, tensor in targets:
        nbytes = tensor.numel() * tensor.element_size()
        if current and (size + nbytes > bucket_bytes or tensor.dtype != dtype):
            buckets.append(current)
            current, size = [], 0
        current.append((name, tensor))
        size += nbytes
        dtype = tensor.dtype
    if current:
        buckets.append(current)
    for bucket in buckets:
        numels = [t.numel() for _, t in bucket]
        flat = torch.empty(sum(numels), dtype=bucket[0][1].dtype, device=device)
        if src is not None:
            # Packed on the host (where rank 0 read the checkpoint), then one copy to the device.
            flat.copy_(torch.cat([src[name].detach().reshape(-1).to(flat.dtype) for name, _ in bucket]))
        dist.broadcast(flat, src=0)
        for (name, target), full in zip(bucket, flat.split(numels)):
            full = full.view(target.shape)
            if isinstance(target, DTensor):
                # src_data_rank=None: every rank holds the full tensor; each just keeps its shard.
                # Copied shard to shard: an offloaded target's shard is on the host, ``full`` on
                # the mesh's device.
                shard = distribute_tensor(full, target.device_mesh, target.placements, src_data_rank=None)
                target.to_local().copy_(shard.to_local())
            else:
                target.copy_(full)


def load_sharded_model(model_path: str, mesh: DeviceMesh, device: torch.device, options: ModelOptions,
                       *, trainable: bool = True, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Build on the meta device, shard, allocate on ``device``, then broadcast rank 0's weights."""
    from transformers import AutoModelForCausalLM

    config = load_config(model_path, options)
    lora = options.lora if trainable else None
    with torch.device("meta"):
        model = _build(config, options)
        if lora is not None:
            apply_lora(model, lora)
    model = shard_model(model, mesh, options, trainable=trainable, expert_mesh=expert_mesh)
    _materialize(model, mesh, device, options)
    source = None
    if dist.get_rank() == 0:
        source = AutoModelForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32,
                                                      trust_remote_code=options.trust_remote_code)
        if options.moe_experts != "stock":
            use_grouped_experts(source, options.moe_experts)
        if lora is not None:
            # Rank 0 draws the adapters' initial values; the broadcast gives every rank the same.
            apply_lora(source, lora, seed=lora.seed)
    broadcast_full_state(model, source, device, options.broadcast_bucket_bytes)
    del source
    return model


def init_random_sharded_model(config, mesh: DeviceMesh, device: torch.device, options: ModelOptions,
                              seed: int = 0, expert_mesh: DeviceMesh | None = None) -> nn.Module:
    """Benchmarks: a model from a config with random weights, built directly on ``device`` per
    layer shard (no checkpoint exists; same sharding and wrappers as ``load_sharded_model``)."""
    config = prepare_config(config, options)
    with torch.device("meta"):
        model = _build(config, options)
        if options.lora is not None:
            apply_lora(model, options.lora)
    model = shard_model(model, mesh, options, expert_mesh=expert_mesh)
    _materialize(model, mesh, device, options)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            elif ".lora_B." in name:
                param.zero_()  # an adapter starts as the identity, as apply_lora's
            else:
                param.normal_(0.0, config.initializer_range)
        # Non-persistent buffers (rotary inv_freq) are garbage after to_empty: rebuild them.
        for module in model.modules():
            if isinstance(getattr(module, "inv_freq", None), torch.Tensor):
                fresh = type(module)(module.config)
                for name, buffer in fresh.named_buffers(recurse=False):
                    getattr(module, name).copy_(buffer)
    return model
