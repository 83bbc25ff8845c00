"""The tiny model's real tokenizer (made locally in a moment, no model weights)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from kuberl.tiny import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))
