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
    assert args["max_num_batched_tokens"] >= spec.rollout.max_prompt_length + spec.rollout.max_response_length
    assert args["enforce_eager"] is True
