"""One trainer rank: FSDP2 model, optimizer, log-probs, the policy update, state save/load, export.

Torch only (no Ray): ``group.TrainerGroup`` hosts one in each Ray actor; ``bench/train_moe.py``
runs the same class under torchrun on machines without Ray.
"""

from __future__ import annotations

import copy
import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)

from kuberl.common.samples import Sample, SampleError, TrainBatch
from kuberl.sync.adapter import ADAPTER_EXPORT_DIR, is_adapter_name, save_adapter, saved_adapter
from kuberl.train import loss as L
from kuberl.train import packing
from kuberl.train.algorithms import registry
from kuberl.train.algorithms.base import UpdateTotals
from kuberl.train.logprobs import score_tokens
from kuberl.train.lora import LoraOptions, adapters_disabled, merged_state_dict
from kuberl.train.model import (ModelOptions, clip_coefficient, init_random_sharded_model, load_config,
                                load_sharded_model, total_grad_norm, trainer_meshes)
from kuberl.train.moe import is_moe_config
from kuberl.train.optim import AdamW

log = logging.getLogger("kuberl.train")

METRIC_NAMES = ("loss", "pg_loss", "kl", "entropy", "aux_loss", "clipped_tokens", "tokens",
                "tis_ratio", "tis_truncated_tokens")


@dataclass
class TrainerConfig:
    """What a rank needs from ``spec.algorithm`` / ``spec.trainer``, as plain values."""

    algorithm: str = "grpo"  # spec.algorithm.name: its policy loss (kuberl.train.algorithms)
    lr: float = 1e-6
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    clip_low: float = 0.2
    clip_high: float = 0.28
    micro_batch_size: int = 4
    max_response_tokens: int | None = None  # rollout.maxResponseLength (dr-grpo's loss divisor)
    # > 0: packed micro-batches of up to this many tokens (kuberl.train.packing) instead of
    # micro_batch_size right-padded samples.
    micro_batch_tokens: int = 0
    log_prob_micro_batch_size: int | None = None  # default: micro_batch_size
    kl_clamp: float | None = None
    # algorithm.tis.cap: weight each token's loss by min(pi_old / mu, cap) against the engines'
    # log-probs ``mu`` that came with the samples; None: no truncated importance sampling.
    tis_cap: float | None = None
    temperature: float = 1.0
    seed: int = 42
    router_aux_loss_coef: float = 0.0
    model: ModelOptions = field(default_factory=ModelOptions)

    @classmethod
    def from_spec(cls, spec, *, on_gpu: bool, expert_parallel: int = 1) -> "TrainerConfig":
        """``expert_parallel``: the EP degree of the run plan's trainer mesh."""
        algo, trainer = spec.algorithm, spec.trainer
        dtype = getattr(torch, trainer.param_dtype) if on_gpu else torch.float32
        clip_low, clip_high = algo.clip_range()
        return cls(
            algorithm=algo.name, lr=algo.learning_rate, weight_decay=algo.weight_decay, warmup_steps=algo.warmup_steps,
            max_grad_norm=algo.max_grad_norm, kl_coef=algo.kl_coef, entropy_coef=algo.entropy_coef,
            clip_low=clip_low, clip_high=clip_high, max_response_tokens=spec.rollout.max_response_length,
            micro_batch_size=algo.micro_batch_size, micro_batch_tokens=trainer.micro_batch_tokens,
            temperature=algo.temperature, seed=algo.seed,
            log_prob_micro_batch_size=algo.log_prob_micro_batch_size, kl_clamp=algo.kl_clamp,
            tis_cap=algo.tis.cap if algo.tis is not None else None,
            router_aux_loss_coef=trainer.moe.router_aux_loss_coef,
            model=ModelOptions(trust_remote_code=spec.model.trust_remote_code,
                               gradient_checkpointing=trainer.gradient_checkpointing,
                               checkpoint_every=trainer.checkpoint_every,
                               param_dtype=dtype, moe_experts=trainer.moe.expert_implementation,
                               cpu_offload=trainer.cpu_offload, expert_parallel=expert_parallel,
                               freeze_router=trainer.moe.freeze_router,
                               lora=LoraOptions.from_spec(trainer.lora, algo.seed)),
        )


@dataclass
class MicroBatch:
    input_ids: torch.Tensor       # (B, L)
    attention_mask: torch.Tensor  # (B, L)
    targets: torch.Tensor         # (B, L-1): input_ids shifted left
    mask: torch.Tensor            # (B, L-1): 1 on trained response tokens
    response_lengths: list[int]
    response_starts: list[int]    # index into the (B, L-1) grid of each sample's first response token
    advantages: torch.Tensor      # (B,)
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    # The engines' log-probs of the sampled tokens (Sample.response_logprobs), for algorithm.tis.
    behaviour_logprobs: torch.Tensor | None = None
    response_rows: list[int] = field(default_factory=list)  # grid row of each sample
    position_ids: torch.Tensor | None = None
    attention_kwargs: dict = field(default_factory=dict)    # packed: document boundaries


def _grid(rows: list[list[float]], starts: list[int], width: int, device) -> torch.Tensor:
    out = torch.zeros(len(rows), width, dtype=torch.float32)
    for i, (row, start) in enumerate(zip(rows, starts)):
        out[i, start:start + len(row)] = torch.tensor(row, dtype=torch.float32)
    return packing.to_device(out, device)


def make_micro_batch(batch: TrainBatch, device: torch.device, pad_id: int = 0,
                     weights: list[float] | None = None, behaviour: bool = False) -> MicroBatch:
    """Right-padded tensors; position t of the ``(B, L-1)`` grids predicts token t+1.
    ``weights`` multiplies each sample's loss mask (0 drops padding samples); ``behaviour`` adds
    the engines' log-probs grid (``behaviour_logprobs``)."""
    seqs = [s.prompt_ids + s.response_ids for s in batch.samples]
    width = max(len(x) for x in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(seqs), width), dtype=torch.long)
    masks, starts = [], []
    for i, (s, seq) in enumerate(zip(batch.samples, seqs)):
        ids[i, :len(seq)] = torch.tensor(seq)
        attn[i, :len(seq)] = 1
        starts.append(len(s.prompt_ids) - 1)
        mask = s.loss_mask if s.loss_mask is not None else [1] * len(s.response_ids)
        w = 1.0 if weights is None else weights[i]
        masks.append([m * w for m in mask])
    ids = packing.to_device(ids, device)
    return MicroBatch(
        input_ids=ids, attention_mask=packing.to_device(attn, device), targets=ids[:, 1:],
        mask=_grid(masks, starts, width - 1, device), response_lengths=[len(s.response_ids) for s in batch.samples],
        response_starts=starts, response_rows=list(range(len(seqs))),
        advantages=packing.to_device(torch.tensor([s.advantage for s in batch.samples], dtype=torch.float32), device),
        old_logprobs=_grid(batch.old_logprobs, starts, width - 1, device) if batch.old_logprobs is not None else None,
        ref_logprobs=_grid(batch.ref_logprobs, starts, width - 1, device) if batch.ref_logprobs is not None else None,
        behaviour_logprobs=(_grid(behaviour_rows(batch.samples), starts, width - 1, device) if behaviour else None),
    )


def behaviour_rows(samples: list[Sample]) -> list[list[float]]:
    """The engines' log-probs of each sample's response tokens, which algorithm.tis weighs against."""
    missing = [i for i, s in enumerate(samples) if s.response_logprobs is None]
    if missing:
        raise SampleError(f"algorithm.tis: samples {missing[:8]} of this micro-batch came without the "
                          f"engines' log-probs, which the truncated importance weights need")
    return [s.response_logprobs for s in samples]


def tis_metric_sums(tis: L.TruncatedIS, mask: torch.Tensor) -> torch.Tensor:
    """Over the trained tokens: the sum of pi_old / mu before truncation, and the count truncated."""
    ratio = torch.exp(tis.log_ratio.detach())
    return torch.stack([(ratio * mask).sum(), ((ratio > tis.cap).to(mask.dtype) * mask).sum()])


def sequence_index(mb: MicroBatch) -> torch.Tensor:
    """Each grid position's sample within the micro-batch (a packed row holds several); positions
    outside every response get 0 and are out of the mask."""
    index = torch.zeros(mb.mask.shape, dtype=torch.long)
    for j, (row, start, n) in enumerate(zip(mb.response_rows, mb.response_starts, mb.response_lengths)):
        index[row, start:start + n] = j
    return packing.to_device(index, mb.mask.device)


def scored_positions(mb: MicroBatch, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The grid's ``(row, column)`` of every response token, sample after sample (one tensor op
    per sample: a Python list per token, or CPU ``repeat_interleave``, took milliseconds of host
    time the GPU waited through)."""
    spans = list(zip(mb.response_rows, mb.response_starts, mb.response_lengths))
    rows = torch.cat([torch.full((n,), row, dtype=torch.long) for row, _, n in spans])
    cols = torch.cat([torch.arange(start, start + n) for _, start, n in spans])
    return packing.to_device(rows, device), packing.to_device(cols, device)


def _rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].copy()), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy(), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"]:
        torch.cuda.set_rng_state_all(state["cuda"])


class TrainerWorker:
    """One rank. Every public method is collective: all ranks call it with the same arguments."""

    def __init__(self, model_path: str | None, config: TrainerConfig, *, rank: int, world_size: int,
                 master_addr: str, master_port: int, device: torch.device, random_init_config=None):
        """Loads ``model_path``; or, given ``random_init_config`` (a transformers config: benchmarks
        on machines that cannot download a model), builds that model with random weights."""
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        self.config = config
        self.algorithm = registry.get(config.algorithm)
        self.model_path = model_path
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        on_gpu = self.device.type == "cuda"
        # Offloaded, gradient clipping (the norm over the host's gradient shards) and the export
        # (gathering the host's weight shards) are collectives over CPU tensors: gloo beside NCCL.
        backend = ("cuda:nccl,cpu:gloo" if config.model.cpu_offload else "nccl") if on_gpu else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=rank, world_size=world_size, device_id=self.device if on_gpu else None)
        self.mesh, self.expert_mesh = trainer_meshes(self.device.type, world_size, config.model.expert_parallel)
        random.seed(config.seed + rank)
        np.random.seed(config.seed + rank)
        torch.manual_seed(config.seed + rank)
        if random_init_config is not None:
            if config.kl_coef > 0:
                raise ValueError("a randomly initialised model has no reference policy; use klCoef 0")
            self.hf_config = random_init_config
            self.model = init_random_sharded_model(random_init_config, self.mesh, self.device, config.model,
                                                   seed=config.seed, expert_mesh=self.expert_mesh)
            self.ref_model = None
        else:
            self.hf_config = load_config(model_path, config.model)
            self.model = load_sharded_model(model_path, self.mesh, self.device, config.model,
                                            expert_mesh=self.expert_mesh)
            # The reference policy is the initial weights, frozen; kept only when the KL term is used.
            # With LoRA it is the base model itself, the adapters switched off (ref_log_probs).
            self.ref_model = (load_sharded_model(model_path, self.mesh, self.device, config.model, trainable=False,
                                                 expert_mesh=self.expert_mesh)
                              if config.kl_coef > 0 and config.model.lora is None else None)
        self.is_moe = is_moe_config(self.hf_config)
        # torch's fused AdamW (its state and checkpoints), on the GPU one Triton launch per step with
        # the gradient clipping folded in (kuberl.train.optim), on the host (offload) torch's own
        # fused kernels: both take ``found_inf``, which lets train_step skip a non-finite update
        # without a host sync. With LoRA only the adapters train: neither gradients nor moments
        # exist for the base.
        self.optimizer = AdamW([p for p in self.model.parameters() if p.requires_grad], lr=config.lr,
                               weight_decay=config.weight_decay)
        warmup = config.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        # Called before anything changes the model or optimizer state: a checkpoint being written
        # from the live state in the background (kuberl.train.checkpoint) waits there; returns
        # the seconds it waited.
        self.before_update: Callable[[], float] = lambda: 0.0
        self.pad_id = self.hf_config.pad_token_id if self.hf_config.pad_token_id is not None else 0

    # ---- batching -------------------------------------------------------------------------

    def _rank_micro_batches(self, batch: TrainBatch, mbs: int | None = None) -> list[tuple[TrainBatch, list[float]]]:
        """This rank's share, padded so every rank runs the same number of micro-batches (FSDP2
        collectives must match); padding samples repeat the last one with weight 0."""
        n = len(batch.samples)
        if n == 0:
            raise SampleError("empty TrainBatch")
        for i, s in enumerate(batch.samples):
            s.validate(i)
        per_rank = -(-n // self.world_size)
        extra = per_rank * self.world_size - n
        weights = [1.0] * n + [0.0] * extra
        padded = TrainBatch(
            samples=batch.samples + [batch.samples[-1]] * extra,
            old_logprobs=batch.old_logprobs + [batch.old_logprobs[-1]] * extra if batch.old_logprobs is not None else None,
            ref_logprobs=batch.ref_logprobs + [batch.ref_logprobs[-1]] * extra if batch.ref_logprobs is not None else None,
        )
        mine = padded.shard(self.rank, self.world_size)
        my_weights = weights[self.rank * per_rank:(self.rank + 1) * per_rank]
        mbs = mbs or self.config.micro_batch_size
        extra_micro = 0
        if self.config.micro_batch_tokens:
            ranges = packing.split_by_tokens([len(s.prompt_ids) + len(s.response_ids) for s in mine.samples],
                                             self.config.micro_batch_tokens)
            # Every rank runs as many micro-batches as the rank that needs the most (FSDP2
            # collectives must match); the extra ones repeat the last sample with weight 0. A host
            # sync, so only where there are other ranks.
            if self.world_size > 1:
                count = torch.tensor([len(ranges)], device=self.device)
                dist.all_reduce(count, op=dist.ReduceOp.MAX)
                extra_micro = int(count.item()) - len(ranges)
        else:
            ranges = [(lo, lo + mbs) for lo in range(0, per_rank, mbs)]
        out = []
        for lo, hi in ranges:
            out.append((TrainBatch(mine.samples[lo:hi],
                                   mine.old_logprobs[lo:hi] if mine.old_logprobs is not None else None,
                                   mine.ref_logprobs[lo:hi] if mine.ref_logprobs is not None else None),
                        my_weights[lo:hi]))
        out += [(TrainBatch(mine.samples[-1:], mine.old_logprobs[-1:] if mine.old_logprobs is not None else None,
                            mine.ref_logprobs[-1:] if mine.ref_logprobs is not None else None), [0.0])] * extra_micro
        return out

    def _micro_batch(self, part: TrainBatch, weights: list[float]) -> MicroBatch:
        if self.config.micro_batch_tokens:
            behaviour = behaviour_rows(part.samples) if self.config.tis_cap is not None else None
            return MicroBatch(**packing.packed_fields(part.samples, part.old_logprobs, part.ref_logprobs,
                                                      self.device, weights, behaviour_logprobs=behaviour))
        return make_micro_batch(part, self.device, self.pad_id, weights, behaviour=self.config.tis_cap is not None)

    def _forward(self, model, mb: MicroBatch, *, with_entropy: bool):
        """Log-probs and entropy as ``mb.targets``-shaped grids, scored only at response positions
        (kuberl.train.logprobs: no ``[tokens x vocab]`` logits unless chunking is off)."""
        want_router = self.is_moe and self.config.router_aux_loss_coef > 0 and model is self.model and model.training
        inputs = dict(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False,
                      **({"position_ids": mb.position_ids} if mb.position_ids is not None else {}),
                      **mb.attention_kwargs, **({"output_router_logits": True} if want_router else {}))
        rows, cols = scored_positions(mb, self.device)
        logprobs, entropy, out = score_tokens(model, inputs, rows, cols, mb.targets[rows, cols], tuple(mb.targets.shape),
                                              temperature=self.config.temperature, with_entropy=with_entropy)
        aux = getattr(out, "aux_loss", None) if want_router else None
        return logprobs, entropy, aux

    # ---- log-probs ------------------------------------------------------------------------

    @torch.no_grad()
    def _log_probs(self, model, batch: TrainBatch) -> list[list[float]]:
        model.eval()
        mine: list[list[float]] = []
        for part, weights in self._rank_micro_batches(batch, self.config.log_prob_micro_batch_size):
            mb = self._micro_batch(part, weights)
            logprobs, _, _ = self._forward(model, mb, with_entropy=False)
            grid = logprobs.cpu()
            for w, row, start, n in zip(weights, mb.response_rows, mb.response_starts, mb.response_lengths):
                if w:
                    mine.append(grid[row, start:start + n].tolist())
        gathered: list[list[list[float]]] = [None] * self.world_size  # type: ignore[list-item]
        dist.all_gather_object(gathered, mine)
        return [row for part in gathered for row in part]

    def log_probs(self, batch: TrainBatch) -> list[list[float]]:
        """Per sample, log-probs of its response tokens under the current weights."""
        return self._log_probs(self.model, batch)

    def ref_log_probs(self, batch: TrainBatch) -> list[list[float]]:
        if self.config.kl_coef <= 0:
            raise RuntimeError("no reference policy: spec.algorithm.klCoef is 0, so none is kept; "
                               "set klCoef > 0 to use reference log-probs")
        if self.ref_model is None:  # trainer.lora: the frozen base is the reference
            with adapters_disabled(self.model):
                return self._log_probs(self.model, batch)
        return self._log_probs(self.ref_model, batch)

    # ---- the optimisation step ------------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum over the ranks in place; nothing to do (no kernel, no launch) on one rank."""
        if self.world_size > 1:
            dist.all_reduce(tensor)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        cfg = self.config
        if cfg.kl_coef > 0 and batch.ref_logprobs is None:
            raise SampleError("spec.algorithm.klCoef > 0 but the TrainBatch has no ref_logprobs "
                              "(call TrainerGroup.ref_log_probs first)")
        if not self.model.training:  # train() walks every module: milliseconds before the first kernel
            self.model.train()
        parts = self._rank_micro_batches(batch)
        # The first micro-batch's forward is queued before the others are packed, so the host
        # packs them while the GPU runs it instead of before it (the GPU's first idle milliseconds
        # of every step; the losses below still wait for the whole update's totals).
        micro = [self._micro_batch(*parts[0])]
        first = self._forward(self.model, micro[0], with_entropy=True)
        micro += [self._micro_batch(p, w) for p, w in parts[1:]]
        indexes = [sequence_index(mb) for mb in micro]
        # The update's trained tokens and sequences over all ranks: the algorithm's loss divisors.
        counts = torch.stack([sum(mb.mask.sum() for mb in micro),
                              sum((L.sequence_sums(mb.mask, index, len(mb.response_lengths)) > 0).sum()
                                  for mb, index in zip(micro, indexes)).to(torch.float32)])
        self._all_reduce(counts)
        global_tokens = counts[0]
        totals = UpdateTotals(tokens=global_tokens, sequences=counts[1], max_response_tokens=cfg.max_response_tokens)
        # FSDP2 averages gradients over ranks; each rank's loss is its share of the update's loss
        # (divided by the global totals), so scaling by world_size makes the averaged gradient
        # that of the whole update's loss.
        scale = float(self.world_size)
        sums = torch.zeros(len(METRIC_NAMES), dtype=torch.float32, device=self.device)
        for i, (mb, index) in enumerate(zip(micro, indexes)):
            logprobs, entropy, aux = first if i == 0 else self._forward(self.model, mb, with_entropy=True)
            # On-policy single update: without old log-probs the ratio is exactly 1.
            old = mb.old_logprobs if mb.old_logprobs is not None else logprobs.detach()
            tis = (L.TruncatedIS((old - mb.behaviour_logprobs) * (mb.mask > 0), cfg.tis_cap)
                   if cfg.tis_cap is not None else None)
            pg, extra = self.algorithm.policy_loss(logprobs, old, mb.advantages, mb.mask, index, totals,
                                                   clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis=tis)
            ent = L.masked_token_mean(entropy, mb.mask, global_tokens)
            kl = (L.kl_penalty(logprobs, mb.ref_logprobs, mb.mask, total_tokens=global_tokens, clamp=cfg.kl_clamp)
                  if cfg.kl_coef > 0 else torch.zeros((), device=self.device))
            total = pg + cfg.kl_coef * kl - cfg.entropy_coef * ent
            aux_term = (aux / len(micro)) if aux is not None else torch.zeros((), device=self.device)
            (total * scale + cfg.router_aux_loss_coef * aux_term).backward()
            with torch.no_grad():
                tis_sums = tis_metric_sums(tis, mb.mask) if tis is not None else torch.zeros(2, device=self.device)
                sums += torch.cat([torch.stack([total.detach(), pg.detach(), kl.detach(), ent.detach(),
                                                aux_term.detach() / self.world_size, extra["clipped_tokens"],
                                                mb.mask.sum()]).float(), tis_sums.float()])
        # The norm only: the clipping's multiply is the optimizer's (one pass over the gradients fewer).
        grad_norm = total_grad_norm(list(self.model.parameters()))
        nonfinite = (~torch.isfinite(grad_norm)).float().reshape(1).to(self.device)
        # One collective for every metric and the skip decision, after all micro-batches: every
        # rank sees the same sum, hence takes the same decision below.
        reduced = torch.cat([sums, nonfinite])
        self._all_reduce(reduced)
        lr = self.scheduler.get_last_lr()[0]
        # The skip decision and the clipping stay on the device, so the optimizer is queued behind
        # the backward instead of launched on an idle GPU after a sync: the update leaves
        # parameters and moments untouched where ``found_inf`` is 1 and takes the step count back
        # (the hook torch's GradScaler uses; tests/unit/train/test_skip_update.py fails if it
        # changes). The scheduler and counters follow below, once the metrics are read.
        checkpoint_wait = self.before_update()  # the step count moves and moves back even when skipped
        self.optimizer.step(found_inf=(reduced[-1] > 0).float(),
                            grad_mul=clip_coefficient(grad_norm, cfg.max_grad_norm))
        self.optimizer.zero_grad(set_to_none=True)
        # The step's one host sync, with the optimizer's kernels already queued.
        *metric_values, nonfinite_ranks, norm = torch.cat([reduced, grad_norm.reshape(1).to(reduced)]).tolist()
        skipped = nonfinite_ranks > 0
        if skipped:
            # AdamW with zero grads would still have decayed weights, moved the moments and
            # advanced its step count. Parameters, moments, step and LR stay as they are.
            self.skipped_steps += 1
            log.warning("rank %d: non-finite grad norm %s; update skipped (%d so far)",
                        self.rank, norm, self.skipped_steps)
        else:
            self.scheduler.step()
            self.optimizer_steps += 1
        values = dict(zip(METRIC_NAMES, metric_values))
        tokens = values["tokens"]
        return {
            "loss": values["loss"], "pg_loss": values["pg_loss"], "kl": values["kl"],
            "entropy": values["entropy"], "aux_loss": values["aux_loss"],
            "grad_norm": norm, "lr": float(lr),
            "clip_frac": values["clipped_tokens"] / tokens if tokens else 0.0,
            # algorithm.tis: the token mean of pi_old / mu before truncation, and the share truncated
            # (both 0 without it).
            "tis_ratio": values["tis_ratio"] / tokens if tokens else 0.0,
            "tis_truncated_frac": values["tis_truncated_tokens"] / tokens if tokens else 0.0,
            "tokens": tokens, "skipped": 1.0 if skipped else 0.0,
            "skipped_total": float(self.skipped_steps), "optimizer_steps": float(self.optimizer_steps),
            "checkpoint_wait": checkpoint_wait,
        }

    # ---- state ----------------------------------------------------------------------------

    def checkpoint_state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """What a checkpoint holds: the model and optimizer state for torch.distributed.checkpoint
        (the live tensors, not copies: ``before_update`` guards them until they are written) and
        this rank's own part, copied now: scheduler, step counters and every RNG state, so that a
        resume continues bit-exactly. With LoRA the model state is the adapters' alone: the base
        never changes, and a resume reads it from the model again."""
        model_sd, optim_sd = self._state()
        extra = {"scheduler": copy.deepcopy(self.scheduler.state_dict()), "optimizer_steps": self.optimizer_steps,
                 "skipped_steps": self.skipped_steps, "rng": _rng_state()}
        return {"model": model_sd, "optim": optim_sd}, extra

    def restore_state(self, load: Callable[[dict[str, Any]], None], extra: dict[str, Any]) -> None:
        """``load`` fills the model/optimizer state in place (dcp.load); ``extra`` is this rank's
        part as ``checkpoint_state`` returned it."""
        self.before_update()
        model_sd, optim_sd = self._state()
        state = {"model": model_sd, "optim": optim_sd}
        load(state)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self._state_options)
        self.scheduler.load_state_dict(extra["scheduler"])
        self.optimizer_steps = extra["optimizer_steps"]
        self.skipped_steps = extra["skipped_steps"]
        _set_rng_state(extra["rng"])
        dist.barrier()

    @property
    def _state_options(self) -> StateDictOptions:
        # LoRA: the frozen base is left out (strict=False: a state without it still loads).
        lora = self.config.model.lora is not None
        return StateDictOptions(ignore_frozen_params=lora, strict=not lora)

    def _state(self) -> tuple[dict[str, Any], dict[str, Any]]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self._state_options)
        return self._adapters_only(model_sd), optim_sd

    def _adapters_only(self, model_sd: dict[str, Any]) -> dict[str, Any]:
        if self.config.model.lora is None:
            return model_sd
        # ignore_frozen_params keeps a tied weight's second name (lm_head.weight, the whole
        # embedding): the adapters' own tensors alone.
        return {k: v for k, v in model_sd.items() if is_adapter_name(k)}

    def adapter_shapes(self) -> dict[str, tuple[int, ...]]:
        """The adapters' names in a checkpoint (``model.`` + state name) and global shapes; empty
        without LoRA. A resume checks a checkpoint against them (kuberl.train.checkpoint)."""
        if self.config.model.lora is None:
            return {}
        model_sd = self._adapters_only(get_model_state_dict(self.model, options=self._state_options))
        return {f"model.{k}": tuple(v.shape) for k, v in model_sd.items()}

    def export_hf(self, path: str) -> None:
        """The full model gathered to rank 0 and saved as a Hugging Face checkpoint (safetensors)
        with the tokenizer and, for trust_remote_code models, their code. With LoRA: the adapters
        in peft's format under ``adapter/``, and with ``mergeOnExport`` the merged model at
        ``path`` itself."""
        lora = self.config.model.lora
        if lora is not None and not lora.merge_on_export:
            adapters = get_model_state_dict(self.model, options=StateDictOptions(
                full_state_dict=True, cpu_offload=True, ignore_frozen_params=True))
            if self.rank == 0:
                save_adapter(Path(path) / ADAPTER_EXPORT_DIR, saved_adapter(self.model, adapters), lora.config())
            dist.barrier()
            return
        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            if lora is not None:
                save_adapter(Path(path) / ADAPTER_EXPORT_DIR, saved_adapter(self.model, full), lora.config())
                full = merged_state_dict(self.model, full, lora, self.hf_config)
            self._save_hf(path, full)
        dist.barrier()

    def _save_hf(self, path: str, state_dict: dict[str, torch.Tensor]) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        config = (load_config(self.model_path, ModelOptions(trust_remote_code=self.config.model.trust_remote_code))
                  if self.model_path is not None else self.hf_config)
        with torch.device("meta"):
            shell = AutoModelForCausalLM.from_config(config, trust_remote_code=self.config.model.trust_remote_code)
        shell.save_pretrained(path, state_dict=state_dict, safe_serialization=True)
        tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
        if self.model_path is not None and any((Path(self.model_path) / name).exists() for name in tokenizer_files):
            AutoTokenizer.from_pretrained(self.model_path, trust_remote_code=self.config.model.trust_remote_code
                                          ).save_pretrained(path)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
