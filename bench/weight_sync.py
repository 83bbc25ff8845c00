"""Weight-sync transport throughput: kuberl's nccl method vs a raw NCCL broadcast of the same bytes.

Two processes, one GPU each. The sender plays trainer rank 0 and runs kuberl's real sending code
(``kuberl.sync.nccl.broadcast_weights``: per-bucket gather, cast, pack, broadcast over a
``SyncGroup``). The receiver runs kuberl's real receiving code (``WeightReceiver.kuberl_receive``:
receive each bucket, cut it into views, ``reload_weights``) inside a stand-in for a vLLM worker,
whose model copies each tensor into a parameter of the same name and shape: vLLM and Ray are not
installed on the GPU machine, so the engine's own ``load_weights`` (fusing q/k/v etc.) is not
measured. The reference, in the same run and processes, broadcasts the same number of bytes as
one flat buffer with plain ``torch.distributed.broadcast``.

    PYTHONPATH=workloads python bench/weight_sync.py [--model qwen2.5-7b] [--bucket-mb 512] [--json out.json]

The last line is the headline: our GB/s as a percentage of the raw broadcast's (goal >= 80%).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

# Qwen2-family shapes (hidden, layers, heads, kv heads, intermediate, vocab, tied embeddings).
MODELS = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864, 151936, True),
    "qwen2.5-7b": (3584, 28, 28, 4, 18944, 152064, False),
}


def qwen2_shapes(name: str) -> list[tuple[str, tuple[int, ...]]]:
    hidden, layers, heads, kv_heads, inter, vocab, tied = MODELS[name]
    head_dim = hidden // heads
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "self_attn.q_proj.weight", (heads * head_dim, hidden)), (p + "self_attn.q_proj.bias", (heads * head_dim,)),
            (p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden)), (p + "self_attn.k_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden)), (p + "self_attn.v_proj.bias", (kv_heads * head_dim,)),
            (p + "self_attn.o_proj.weight", (hidden, heads * head_dim)),
            (p + "mlp.gate_proj.weight", (inter, hidden)), (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
            (p + "input_layernorm.weight", (hidden,)), (p + "post_attention_layernorm.weight", (hidden,)),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not tied:
        shapes.append(("lm_head.weight", (vocab, hidden)))
    return shapes


def build_model(shapes, dtype, device, fill: float | None):
    """A module whose named parameters have exactly these names and shapes."""
    import torch

    class Params(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self._names = {}
            for i, (name, shape) in enumerate(shapes):
                tensor = torch.empty(shape, dtype=dtype, device=device)
                if fill is None:
                    tensor.normal_()
                else:
                    tensor.fill_(fill)
                self.register_parameter(f"p{i}", torch.nn.Parameter(tensor, requires_grad=False))
                self._names[name] = f"p{i}"

        def named_parameters(self, *args, **kwargs):
            for name, attr in self._names.items():
                yield name, getattr(self, attr)

        def load_weights(self, weights):
            """Stand-in for vLLM's ``model.load_weights``: copy each tensor by name."""
            for name, tensor in weights:
                getattr(self, self._names[name]).data.copy_(tensor)

    return Params()


class TrainerStandIn:
    def __init__(self, model, device):
        self.model, self.rank, self.world_size, self.device = model, 0, 1, device


class RunnerStandIn:
    """vLLM's model runner stand-in: ``reload_weights`` consumes the stream into the model."""

    def __init__(self, model):
        self.model = model

    def reload_weights(self, weights_iterator, is_checkpoint_format=True):
        self.model.load_weights(weights_iterator)

    def get_model(self):
        return self.model


def worker(rank: int, args, results) -> None:
    import torch
    import torch.distributed as dist

    from kuberl.sync import nccl
    from kuberl.sync.buckets import ParamMeta, dtype_name
    from kuberl.sync.group import SyncGroup, open_store
    from kuberl.sync.receiver import WeightReceiver

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dtype = getattr(torch, args.dtype)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{args.port}", rank=rank, world_size=2,
                            device_id=device)
    shapes = qwen2_shapes(args.model)
    model = build_model(shapes, dtype, device, fill=None if rank == 0 else 0.0)
    metas = [ParamMeta(name, shape, dtype_name(dtype)) for name, shape in shapes]
    total = sum(m.nbytes for m in metas)
    bucket_bytes = args.bucket_mb * 1024 * 1024

    # Sync group: rank 0 serves the store; its port travels over the default group.
    port = torch.zeros(1, dtype=torch.int64, device=device)
    store = None
    if rank == 0:
        store = open_store("127.0.0.1")
        port[0] = store.port
    dist.broadcast(port, 0)
    key = "bench"
    if rank == 0:
        nccl._GROUPS[key] = SyncGroup("127.0.0.1", int(port), 0, 2, "nccl", store=store)
        trainer = TrainerStandIn(model, device)
    else:
        receiver = WeightReceiver()
        receiver.model_runner = RunnerStandIn(model)
        receiver.device = device
        receiver.rank = 0
        receiver._kuberl_group = SyncGroup("127.0.0.1", int(port), 1, 2, "nccl")

    def ours() -> None:
        if rank == 0:
            nccl.broadcast_weights(trainer, key, metas, bucket_bytes)
        else:
            receiver.kuberl_receive(metas, bucket_bytes)

    flat = torch.empty(total, dtype=torch.uint8, device=device)

    def raw() -> None:
        dist.broadcast(flat, 0)

    def timed(fn) -> float:
        dist.barrier()
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dist.barrier()
        return time.perf_counter() - start

    times = {"ours": [], "raw": []}
    for _ in range(args.warmup):
        ours()
        raw()
    for _ in range(args.reps):  # interleaved, so drift hits both alike
        times["ours"].append(timed(ours))
        times["raw"].append(timed(raw))
    # Correctness: the receiver now holds the sender's weights (same checksum on both sides).
    checksum = torch.stack([p.float().sum() for _, p in model.named_parameters()]).sum()
    sums = [torch.zeros(1, device=device, dtype=torch.float64) for _ in range(2)]
    dist.all_gather(sums, checksum.double().reshape(1))
    if rank == 0:
        results.put({"bytes": total, "params": len(metas), "times": times,
                     "checksums": [float(s) for s in sums], "device": torch.cuda.get_device_name(0)})
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="qwen2.5-7b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--bucket-mb", type=int, nargs="+", default=[512, 128])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--port", type=int, default=29555)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)

    import torch
    import torch.multiprocessing as mp

    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs (nvidia-h200-x2)", file=sys.stderr)
        return 2
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    rows = []
    for bucket_mb in args.bucket_mb:
        run_args = argparse.Namespace(**{**vars(args), "bucket_mb": bucket_mb, "port": args.port + bucket_mb % 1000})
        ctx = mp.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=worker, args=(rank, run_args, results)) for rank in range(2)]
        for p in procs:
            p.start()
        result = results.get(timeout=600)
        for p in procs:
            p.join()
            if p.exitcode:
                raise SystemExit(f"bench worker exited with {p.exitcode}")
        ours = statistics.median(result["times"]["ours"])
        raw = statistics.median(result["times"]["raw"])
        rows.append({"model": args.model, "dtype": args.dtype, "bucket_mb": bucket_mb, "bytes": result["bytes"],
                     "params": result["params"], "ours_s": ours, "raw_s": raw,
                     "ours_gbps": result["bytes"] / ours / 1e9, "raw_gbps": result["bytes"] / raw / 1e9,
                     "ratio": raw / ours, "weights_match": result["checksums"][0] == result["checksums"][1],
                     "device": result["device"], "times": result["times"]})
    print(f"{'model':<14}{'bucket MiB':>11}{'GB':>8}{'ours s':>9}{'raw s':>9}{'ours GB/s':>11}{'raw GB/s':>10}"
          f"{'match':>7}")
    for r in rows:
        print(f"{r['model']:<14}{r['bucket_mb']:>11}{r['bytes'] / 1e9:>8.2f}{r['ours_s']:>9.3f}{r['raw_s']:>9.3f}"
              f"{r['ours_gbps']:>11.1f}{r['raw_gbps']:>10.1f}{str(r['weights_match']):>7}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": rows[0]["device"], "rows": rows}, f, indent=2)
    head = rows[0]
    print(f"headline: kuberl nccl sync = {100 * head['ratio']:.1f}% of raw NCCL broadcast GB/s "
          f"({head['bucket_mb']} MiB buckets, {head['model']} {head['dtype']}; goal >= 80%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
