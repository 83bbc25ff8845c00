"""The optimizer's share of a training step on one GPU (issue 36): gradient clipping and AdamW over
the dense preset's parameters (``bench/train_speed.py``'s 1.98B Qwen3 shape, fp32 weights,
gradients and moments), torch's way against ``kuberl.train.optim.AdamW``.

    PYTHONPATH=workloads python bench/adamw_speed.py --json adamw.json

Rows: the device-to-device copy rate (the bandwidth ceiling, bytes read plus written); torch's
path as the trainer ran it (``get_total_norm``, ``clip_grads_with_norm_``, fused AdamW), each of
its three parts, and fused AdamW taking the clipping through its ``grad_scale`` hook; kuberl's (the norm, then one launch of the update with the clipping's
coefficient), and its step at other block sizes. Each time is the median of ``--repeat`` runs of
the whole call between CUDA events: the host's time inside the call (torch's grouping of the
tensors, kuberl's small kernels for the step counts and the address table) counts where the GPU
waits for it, so a kernel alone runs shorter (kuberl's: 13.6 ms in a profiled training step against
15.6 ms here). Bytes: the norm reads every gradient (4 B an element), the
clipping reads and writes it (8 B), AdamW reads parameter, gradient and both moments and writes
parameter and moments (28 B). Then both optimizers take three steps from the same state and the
largest relative difference of their parameters is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from head_stats import timed  # noqa: E402
from train_speed import PRESETS  # noqa: E402

from kuberl.train import optim  # noqa: E402
from kuberl.train.model import clip_coefficient, total_grad_norm  # noqa: E402


def preset_shapes(preset: dict) -> list[tuple[int, ...]]:
    """Qwen3's parameters at the preset, in the model's order (untied embeddings and LM head)."""
    h, q, kv = preset["hidden_size"], preset["num_attention_heads"] * preset["head_dim"], \
        preset["num_key_value_heads"] * preset["head_dim"]
    mlp, d = preset["dense_intermediate_size"], preset["head_dim"]
    layer = [(q, h), (kv, h), (kv, h), (h, q), (d,), (d,), (mlp, h), (mlp, h), (h, mlp), (h,), (h,)]
    return [(preset["vocab_size"], h), *layer * preset["num_hidden_layers"], (h,), (preset["vocab_size"], h)]


def copy_rate(device: torch.device, repeat: int) -> float:
    """TB/s of a 4 GiB device-to-device copy, bytes read plus written."""
    src = torch.randn(1 << 30, device=device)
    dst = torch.empty_like(src)
    ms = timed(lambda: dst.copy_(src), repeat)
    return 2 * src.numel() * 4 / ms / 1e9


def make_params(shapes, device, seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
    return params


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--blocks", default="1024:4,2048:4,2048:8,4096:8,4096:16,8192:16",
                        help="kernel-only rows: BLOCK:num_warps pairs")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    device = torch.device("cuda")
    rows: list[dict] = []

    def row(name: str, ms: float, gbytes: float | None) -> None:
        r = {"row": name, "ms": ms, "gb": gbytes, "tb_s": gbytes / ms if gbytes else None}
        rows.append(r)
        print(f"{name:<52} {ms:8.2f} ms" + (f"  {gbytes:6.1f} GB  {gbytes / ms:5.2f} TB/s" if gbytes else ""),
              flush=True)

    rate = copy_rate(device, args.repeat)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; copy {rate:.2f} TB/s", flush=True)
    shapes = preset_shapes(PRESETS["h100"])
    params = make_params(shapes, device, 0)
    n = sum(p.numel() for p in params)
    gb = n * 4 / 1e9
    print(f"{len(params)} tensors, {n / 1e9:.3f}B parameters", flush=True)
    max_norm = 1e-3  # below the random gradients' norm: the coefficient clips
    theirs = torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, fused=True)
    grads = [p.grad for p in params]

    def torch_path():
        norm = torch.nn.utils.get_total_norm(grads)
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        theirs.step()

    row("torch: norm + clip + fused AdamW", timed(torch_path, args.repeat), gb * (4 + 8 + 28) / 4)
    row("torch: get_total_norm", timed(lambda: torch.nn.utils.get_total_norm(grads), args.repeat), gb)
    norm = torch.nn.utils.get_total_norm(grads)
    row("torch: clip_grads_with_norm_", timed(lambda: torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm),
                                              args.repeat), gb * 2)
    row("torch: fused AdamW step", timed(theirs.step, args.repeat), gb * 7)
    # The clipping through the GradScaler hook instead: the kernel divides by grad_scale, and then
    # writes the gradients back (the unscaled gradients GradScaler's callers expect).
    theirs.grad_scale = 1.0 / clip_coefficient(norm, max_norm)
    row("torch: fused AdamW step, grad_scale", timed(theirs.step, args.repeat), gb * 8)
    del theirs, grads
    for p in params:  # its moments and the old gradients freed; the parameters stay
        p.grad = torch.randn_like(p) * 1e-3
    ours = optim.AdamW(params, lr=1e-5, weight_decay=0.01)

    def kuberl_path():
        norm = total_grad_norm(params)
        ours.step(found_inf=(~torch.isfinite(norm)).float(), grad_mul=clip_coefficient(norm, max_norm))

    coefficient = clip_coefficient(total_grad_norm(params), max_norm)
    found_inf = torch.zeros((), device=device)
    sweep = {}
    for spec in args.blocks.split(","):
        block, warps = (int(x) for x in spec.split(":"))
        optim.BLOCK, optim.NUM_WARPS = block, warps
        sweep[spec] = timed(lambda: ours.step(found_inf=found_inf, grad_mul=coefficient), args.repeat)
        row(f"kuberl: AdamW step, BLOCK {block}, {warps} warps", sweep[spec], gb * 7)
    best = min(sweep, key=sweep.get)
    print(f"fastest BLOCK:num_warps {best}", flush=True)
    optim.BLOCK, optim.NUM_WARPS = (int(x) for x in best.split(":"))
    row("kuberl: norm + AdamW with the clipping folded in", timed(kuberl_path, args.repeat), gb * (4 + 28) / 4)
    del ours, params
    # Both from one state, three steps each: the parameters' largest relative difference.
    results = []
    for kind in ("torch", "kuberl"):
        ps = make_params(shapes, device, 1)
        opt = (torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01, fused=True) if kind == "torch"
               else optim.AdamW(ps, lr=1e-3, weight_decay=0.01))
        for step in range(3):
            g = torch.Generator(device=device).manual_seed(10 + step)
            for p in ps:
                p.grad = torch.randn(p.shape, device=device, generator=g) * 1e-3
            norm = total_grad_norm(ps)
            if kind == "torch":
                torch.nn.utils.clip_grads_with_norm_(ps, max_norm, norm)
                opt.step()
            else:
                opt.step(grad_mul=clip_coefficient(norm, max_norm))
        results.append([p.detach().clone() for p in ps])
        del ps, opt
    worst = max(((a - b).norm() / b.norm()).item() for a, b in zip(*results))
    print(f"kuberl against torch after 3 steps: largest relative difference of a parameter {worst:.2e}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device), "torch": torch.__version__, "copy_tb_s": rate,
                       "parameters": n, "rows": rows, "fastest": best, "max_rel_diff": worst}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
