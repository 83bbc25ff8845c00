"""What kuberl asks of vLLM on CPU (engine.engine_kwargs), without vLLM; the engines themselves run
in tests/engine/rollout/test_engine.py."""

from __future__ import annotations


def test_cpu_engines_prefill_whole_prompts_because_seeded_requests_cannot_be_chunked(tmp_path):
    """vLLM rewinds a seeded request's generator after a chunked prefill step with set_offset,
    which a CPU generator refuses; every kuberl request is seeded."""
    from kuberl.driver.__main__ import embedded_job
    from kuberl.rollout.engine import engine_kwargs

    spec = embedded_job(tmp_path / "tiny").spec
    args = engine_kwargs(spec, str(tmp_path / "tiny" / "model"), "tiny", engine_index=0, on_cpu=True)
    assert args["enable_chunked_prefill"] is False
    assert args["max_num_batched_tokens"] >= spec.rollout.context_length()
    assert args["enforce_eager"] is True


def test_cpu_engines_fork_their_workers_and_gpu_engines_keep_vllms_executor(tmp_path):
    """On CPU the workers are forked from vLLM's engine core (one import of torch and vLLM fewer
    per engine start; tests/engine/rollout/test_engine.py checks the processes); on a GPU vLLM
    chooses."""
    import importlib.util

    from kuberl.driver.__main__ import embedded_job
    from kuberl.rollout.engine import CPU_EXECUTOR, engine_kwargs

    spec = embedded_job(tmp_path / "tiny").spec
    assert engine_kwargs(spec, "m", "tiny", engine_index=0, on_cpu=True)["distributed_executor_backend"] == CPU_EXECUTOR
    assert "distributed_executor_backend" not in engine_kwargs(spec, "m", "tiny", engine_index=0, on_cpu=False)
    module, _, name = CPU_EXECUTOR.rpartition(".")
    assert importlib.util.find_spec(module) is not None, CPU_EXECUTOR
    assert f"class {name}(" in open(importlib.util.find_spec(module).origin).read()


def test_the_token_budget_is_the_engines_context_and_each_responses_share(tmp_path):
    from kuberl.api.types import RolloutSpec
    from kuberl.driver.__main__ import embedded_job
    from kuberl.rollout.engine import engine_kwargs

    split = RolloutSpec(maxPromptLength=1024, maxResponseLength=3072)
    assert (split.context_length(), split.response_limit(100), split.response_limit(1024)) == (4096, 3072, 3072)
    # NeMo-RL's max_total_sequence_length 4096: a response takes what its prompt leaves.
    budget = RolloutSpec(maxPromptLength=1024, maxResponseLength=4095, maxTotalLength=4096)
    assert (budget.context_length(), budget.response_limit(100), budget.response_limit(1024)) == (4096, 3996, 3072)
    spec = embedded_job(tmp_path / "tiny").spec
    spec.rollout = budget
    args = engine_kwargs(spec, str(tmp_path / "tiny" / "model"), "tiny", engine_index=0, on_cpu=True)
    assert args["max_model_len"] == 4096


def test_lora_engines_serve_one_adapter_of_a_rank_vllm_allows(tmp_path):
    """vLLM's max_lora_rank takes a few values only; the trainer's rank may be any up to it."""
    from kuberl.api.types import LoraSpec
    from kuberl.driver.__main__ import embedded_job
    from kuberl.rollout.engine import engine_kwargs

    spec = embedded_job(tmp_path / "tiny").spec
    assert "enable_lora" not in engine_kwargs(spec, "m", "tiny", engine_index=0, on_cpu=True)
    spec.trainer.lora = LoraSpec(rank=12)
    args = engine_kwargs(spec, "m", "tiny", engine_index=0, on_cpu=True)
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 1, 16)
    spec.trainer.lora = LoraSpec(rank=256)
    assert engine_kwargs(spec, "m", "tiny", engine_index=0, on_cpu=True)["max_lora_rank"] == 256
