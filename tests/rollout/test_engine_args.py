"""What kuberl asks of vLLM on CPU (engine.engine_args); the engines themselves run in test_engine.py."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm")


def test_cpu_engines_prefill_whole_prompts_because_seeded_requests_cannot_be_chunked(tmp_path):
    """vLLM rewinds a seeded request's generator after a chunked prefill step with set_offset,
    which a CPU generator refuses; every kuberl request is seeded."""
    from vllm.platforms import current_platform

    from kuberl.driver.__main__ import embedded_job
    from kuberl.rollout.engine import engine_args

    if not current_platform.is_cpu():
        pytest.skip("vLLM's platform here is not CPU")
    spec = embedded_job(tmp_path / "tiny").spec
    args = engine_args(spec, str(tmp_path / "tiny" / "model"), "tiny", engine_index=0)
    assert args.enable_chunked_prefill is False
    assert args.max_num_batched_tokens >= spec.rollout.max_prompt_length + spec.rollout.max_response_length
    assert args.enforce_eager is True


def test_client_errors_are_vllms_base_where_it_has_one_and_value_errors_on_0_26(monkeypatch):
    """vLLM 0.26 (the GPU image's) has no ``VLLMClientError``: the endpoint's every request failed
    there with an ImportError (a 500) until the engine looked it up like this."""
    exceptions = pytest.importorskip("vllm.exceptions")
    from kuberl.rollout.engine import vllm_client_errors

    assert vllm_client_errors() == (exceptions.VLLMClientError,)
    assert issubclass(exceptions.VLLMValidationError, vllm_client_errors())
    monkeypatch.delattr(exceptions, "VLLMClientError")
    assert vllm_client_errors() == (ValueError, TypeError)
