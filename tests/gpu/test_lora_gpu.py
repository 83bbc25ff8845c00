"""trainer.lora colocated on one GPU with a real vLLM CUDA engine: ``kuberl train`` on the embedded
tiny task as tests/gpu/test_grpo_gpu.py runs it, the FSDP2 trainer training the adapters alone and
the engine serving the base plus the synced adapter (vLLM's LoRA support), the sync over the nccl
transport's gloo group (colocated: kuberl.sync.nccl.sync_backend). The reward must rise, the
engine's log-probs must agree with the trainer's after each sync (which they cannot if the engine
misses the adapter), and each sync must carry the adapters' bytes alone. Skipped without a GPU or
vLLM."""

from __future__ import annotations

import pytest

from tests.engine.driver.test_lora_e2e import LEARNING_RATE, LORA, peak_logits
from tests.gpu.test_grpo_gpu import MAX_GAP, MEAN_GAP, manifest, run_driver

pytest.importorskip("vllm")
pytest.importorskip("ray")


def test_colocated_lora_on_one_gpu_learns_the_tiny_task_and_syncs_the_adapters(tmp_path):
    from safetensors.torch import load_file

    from kuberl.driver import tiny

    model = tiny.make_model(tmp_path / "model")
    peak_logits(model)  # LoRA freezes the norms and embeddings: a flat base barely learns (test_lora_e2e.py)
    data = tiny.make_data(tmp_path / "data.jsonl")
    job = manifest(str(model), str(data), str(tmp_path / "checkpoints"))
    job["metadata"]["name"] = "lora-one-gpu-tiny"
    job["spec"]["trainer"]["lora"] = {k: v for k, v in LORA.items() if k != "mergeOnExport"}
    job["spec"]["weightSync"] = {"method": "nccl"}
    job["spec"]["algorithm"]["learningRate"] = LEARNING_RATE  # as on CPU (test_lora_e2e.py)
    steps = run_driver(tmp_path, job)

    rewards = [s["reward_mean"] for s in steps]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    gap_mean = max(s["engine_logprob_gap_mean"] for s in steps)
    gap_max = max(s["engine_logprob_gap_max"] for s in steps)
    full = sum(t.numel() * 2 for t in load_file(model / "model.safetensors").values())  # bf16 on the wire
    sent = steps[-1]["weight_sync_bytes"]
    print(f"MEASURED tiny LoRA GRPO on one GPU: reward {first:.3f} (first 5 steps) -> {last:.3f} (last 5); "
          f"log-prob gap mean <= {gap_mean:.4f}, max {gap_max:.4f}; {sent} bytes per sync against a full "
          f"sync's {full}")
    assert last > 0.08 and last > 2 * first, rewards
    assert gap_mean <= MEAN_GAP and gap_max <= MAX_GAP, (gap_mean, gap_max)
    assert all(0 < s["weight_sync_bytes"] == sent for s in steps) and sent * 4 < full
