"""Which exceptions of vLLM's the endpoint answers as a client's error (a 400): it needs vLLM
itself; what kuberl asks of vLLM needs none (tests/unit/rollout/test_engine_args.py)."""

from __future__ import annotations

import pytest


def test_client_errors_are_vllms_base_where_it_has_one_and_value_errors_on_0_26(monkeypatch):
    """vLLM 0.26 (the GPU image's) has no ``VLLMClientError``: the endpoint's every request failed
    there with an ImportError (a 500) until the engine looked it up like this."""
    exceptions = pytest.importorskip("vllm.exceptions")
    from kuberl.rollout.engine import vllm_client_errors

    assert vllm_client_errors() == (exceptions.VLLMClientError,)
    assert issubclass(exceptions.VLLMValidationError, vllm_client_errors())
    monkeypatch.delattr(exceptions, "VLLMClientError")
    assert vllm_client_errors() == (ValueError, TypeError)
