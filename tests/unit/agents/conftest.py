"""The tiny model's real tokenizer (made locally in a moment, no model weights), and the rollout
endpoint in process on loopback over a scripted engine."""

from __future__ import annotations

import pytest

from kuberl.rollout.server import BackgroundServer, make_app
from kuberl.rollout.transitions import EpisodeLog
from tests.unit.agents.stand_in import Pool, ScriptedEngine


@pytest.fixture(scope="session")
def tokenizer(tmp_path_factory):
    from kuberl.driver.tiny import make_tokenizer

    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def serve(tokenizer):
    """Start the endpoint over a scripted engine for a spec; yields (base URL, log, engine)."""
    servers = []

    def start(spec, engine_cls=ScriptedEngine):
        engine, episodes = engine_cls(tokenizer), EpisodeLog()
        server = BackgroundServer(make_app(Pool(spec, engine), tokenizer, episodes), "127.0.0.1", 0)
        server.start()
        servers.append(server)
        return server.url, episodes, engine

    yield start
    for server in servers:
        server.stop()
