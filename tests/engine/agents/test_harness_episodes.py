"""``spec.agent.harness``: a program of its own per episode, through the real rollout endpoint
(in process, over the scripted stand-in engine of tests/unit/agents). Each episode starts a
process, so these live in the engine tier."""

from __future__ import annotations

import re

import pytest

from kuberl.api.types import AgentHarnessSpec
from tests.unit.agents.conftest import serve, tokenizer  # noqa: F401  (the endpoint and its tokenizer)
from tests.unit.agents.stand_in import MODEL, make_spec
from tests.unit.agents.test_endpoint_episodes import prompts


def test_the_calculator_harness_plays_episodes_with_the_anthropic_sdk(serve, tokenizer):
    """``spec.agent.harness``: a program of its own per episode (``python -m kuberl.rollout.agents.calculator``)."""
    import sys

    from kuberl.rollout.agents.episodes import AgentRollout

    spec = make_spec().model_copy(deep=True)
    spec.agent.environment = None
    spec.agent.harness = AgentHarnessSpec(command=[sys.executable, "-m", "kuberl.rollout.agents.calculator"])
    base_url, episodes, engine = serve(spec)
    rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
    (group,) = rollout.generate(prompts()[:1], group_size=2, seed=5)
    for sample in group:
        assert sample.reward == pytest.approx(1.0) and sample.metadata["turns"] == 2
        untrained = [t for t, m in zip(sample.response_ids, sample.loss_mask) if not m]
        assert "calculator: " in tokenizer.decode(untrained)
    assert {r["temperature"] for r in engine.requests} == {0.7}


def test_a_harness_that_fails_or_prints_no_reward_names_the_field(serve):
    import sys

    from kuberl.rollout.agents.environment import AgentError
    from kuberl.rollout.agents.episodes import AgentRollout

    base_url, episodes, _ = serve(make_spec())
    for command, message in [(["no-such-agent-program"], "spec.agent.harness.command: 'no-such-agent-program'"),
                             ([sys.executable, "-c", "import sys; sys.exit('boom')"], "exited 1; its stderr ends:\nboom"),
                             ([sys.executable, "-c", "print('done')"], 'must print {"reward": <number>}'),
                             # A number as text is not read as one, nor a bool as 1.
                             ([sys.executable, "-c", "print('{\"reward\": \"1e3\"}')"],
                              "the harness's reward is '1e3' (str), not a number"),
                             ([sys.executable, "-c", "print('{\"reward\": true}')"],
                              "the harness's reward is True (bool), not a number"),
                             ([sys.executable, "-c", "print('{\"reward\": 1e308}')"],
                              "the harness's reward is 1e+308, beyond the bound |reward| <= 1e+06")]:
        spec = make_spec().model_copy(deep=True)
        spec.agent.environment = None
        spec.agent.harness = AgentHarnessSpec(command=command)
        rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
        with pytest.raises(AgentError, match=re.escape(message)):
            rollout.episode(prompts()[0], 0, 0, seed=0)


def _leaky_harness_spec(pid_file, mode: str, timeout_seconds: int):
    import sys
    from pathlib import Path

    spec = make_spec().model_copy(deep=True)
    spec.agent.environment = None
    spec.agent.harness = AgentHarnessSpec(command=[sys.executable, str(Path(__file__).with_name("leaky_harness.py")),
                                                   str(pid_file), mode], timeout_seconds=timeout_seconds)
    return spec


def test_a_harness_that_exits_has_what_it_left_running_killed(serve, tmp_path):
    """The harness leaves `sleep 600` holding its stdout. The episode ends when the harness does
    (reading a pipe to its end would wait for the sleeper), and the sleeper is killed with it."""
    import time

    from kuberl.rollout.agents.episodes import AgentRollout
    from tests.processes import running

    spec = _leaky_harness_spec(tmp_path / "pid", "exit", timeout_seconds=60)
    base_url, episodes, _ = serve(spec)
    rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
    started = time.monotonic()
    sample = rollout.episode(prompts()[0], 0, 0, seed=0)
    assert sample.reward == 0.5 and sample.metadata["turns"] == 1
    assert time.monotonic() - started < 30
    assert running([int((tmp_path / "pid").read_text())]) == []


def test_a_harness_that_times_out_is_killed_with_its_process_group(serve, tmp_path):
    import time

    from kuberl.rollout.agents.environment import AgentError
    from kuberl.rollout.agents.episodes import AgentRollout
    from tests.processes import running

    spec = _leaky_harness_spec(tmp_path / "pid", "hang", timeout_seconds=5)
    base_url, episodes, _ = serve(spec)
    rollout = AgentRollout(spec, base_url=base_url, model=MODEL, episodes=episodes)
    started = time.monotonic()
    with pytest.raises(AgentError, match=re.escape("(prompt 0, episode 0): the harness ran past "
                                                   "spec.agent.harness.timeoutSeconds (5); it and every process it "
                                                   "started were killed")):
        rollout.episode(prompts()[0], 0, 0, seed=0)
    assert time.monotonic() - started < 15
    assert running([int((tmp_path / "pid").read_text())]) == []
