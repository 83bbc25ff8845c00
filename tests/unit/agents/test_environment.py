"""The environment form of spec.agent: loading by import path, what reset/step may return, and
the embedded calculator task."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kuberl.driver.tiny import calculator_rows
from kuberl.rollout.agents.calculator import Calculator, evaluate
from kuberl.rollout.agents.environment import AgentError, Step, Task, as_step, first_chat, load_environment


def task(row: dict) -> Task:
    return Task(({"role": "user", "content": row["prompt"]},), row["answer"], extra_info=row["extra_info"])


def test_the_calculator_rewards_an_answer_taken_from_the_tool():
    env = Calculator()
    chat = env.reset(task({"prompt": "1+2? Use the calculator (=).", "answer": "3",
                           "extra_info": {"expression": "1+2"}}))
    assert chat == [{"role": "user", "content": "1+2? Use the calculator (=)."}]
    assert env.step("x=") == Step(observation="calculator: 3")
    final = env.step(" 33 ")
    assert final.done and final.reward == pytest.approx(1.0)


def test_the_calculator_gives_nothing_without_a_tool_call_and_partial_credit_with_one():
    row = {"prompt": "q", "answer": "4", "extra_info": {"expression": "4+0"}}
    env = Calculator()
    env.reset(task(row))
    assert env.step("abc").observation == "no tool call (write =)"
    assert env.step("4").reward == 0.0
    env.reset(task(row))
    env.step("=")
    assert env.step("4a").reward == pytest.approx(0.2 + 0.8 * 0.5)
    env.reset(task(row))
    env.step("=")
    assert env.step("").reward == pytest.approx(0.2)


def test_the_calculator_names_the_data_field_it_needs():
    with pytest.raises(AgentError, match=r"extra_info \(spec.data.extraInfoField\) has no 'expression'"):
        Calculator().reset(Task(({"role": "user", "content": "q"},), "3"))


def test_the_calculator_never_evaluates_anything_but_arithmetic():
    assert evaluate("2+3*4-1") == 13
    for bad in ("__import__('os')", "2**99999", "1/0", "x+1", "1.5+1"):
        with pytest.raises((ValueError, SyntaxError)):
            evaluate(bad)


def test_the_embedded_rows_have_one_digit_answers_their_expressions_give():
    rows = calculator_rows(64, seed=3)
    assert {row["answer"] for row in rows} == set("1234")
    assert all(str(evaluate(row["extra_info"]["expression"])) == row["answer"] for row in rows)


def test_load_environment_names_the_field_and_the_fix():
    assert load_environment("kuberl.rollout.agents.calculator:Calculator") is Calculator
    with pytest.raises(AgentError, match=r"spec.agent.environment: cannot import 'no_such_module'"):
        load_environment("no_such_module:Env")
    with pytest.raises(AgentError, match=r"spec.agent.environment: 'kuberl.rollout.agents.calculator' has no class 'Nope'"):
        load_environment("kuberl.rollout.agents.calculator:Nope")
    with pytest.raises(AgentError, match=r"spec.agent.environment: .* has no reset or step method"):
        load_environment("kuberl.rollout.agents.environment:Task")


def test_reset_may_return_a_chat_a_string_or_gymnasium_pair():
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert first_chat(chat, "env") == chat
    assert first_chat("hi", "env") == [{"role": "user", "content": "hi"}]
    assert first_chat(("hi", {"info": 1}), "env") == [{"role": "user", "content": "hi"}]
    with pytest.raises(AgentError, match="env: reset\\(\\): the last message must be the user's"):
        first_chat([{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}], "env")
    with pytest.raises(AgentError, match=r"env: reset\(\)\[0\] must be"):
        first_chat([{"role": "tool", "content": "u"}], "env")
    with pytest.raises(AgentError, match="env: reset\\(\\) must return a chat"):
        first_chat([], "env")


def test_step_may_return_a_step_or_gymnasium_five_tuple():
    assert as_step(("obs", 1, False, False, {}), "env") == Step("obs", 1.0, False)
    assert as_step((None, 0.5, False, True, {}), "env") == Step(None, 0.5, True)  # truncated ends it
    assert as_step(("obs", np.float32(0.5), False, False, {}), "env").reward == 0.5  # numpy's scalars are numbers
    with pytest.raises(AgentError, match=r"env: step\(\)'s reward is 'high' \(str\), not a number"):
        as_step(Step("o", "high"), "env")
    with pytest.raises(AgentError, match=r"env: step\(\)'s reward is '1e3' \(str\), not a number"):
        as_step(Step("o", "1e3"), "env")
    with pytest.raises(AgentError, match=r"env: step\(\)'s reward is True \(bool\), not a number"):
        as_step(("obs", True, False, False, {}), "env")
    with pytest.raises(AgentError, match="not finite"):
        as_step(Step("o", math.nan), "env")
    with pytest.raises(AgentError, match=r"reward is 1e\+19, beyond the bound \|reward\| <= 1e\+06"):
        as_step(Step("o", 1e19), "env")
    with pytest.raises(AgentError, match="done=False without a string observation"):
        as_step(Step(None, 0.0, False), "env")
    with pytest.raises(AgentError, match="must return a Step"):
        as_step({"reward": 1}, "env")


def test_an_agent_failure_goes_to_the_job_status_as_agent_failed():
    """A hung or failing environment or harness is the job's own input: status.workloadError says
    so (the operator then fails the job instead of restarting it into the same episodes)."""
    from kuberl.driver.report import StatusReporter, user_errors_reported

    class Recording(StatusReporter):
        patches: list[dict] = []

        def _patch(self, status):
            self.patches.append(status)

    reporter = Recording()
    message = "spec.agent.environment (prompt 0, episode 1): step() of turn 1 did not return within 300 s"
    with pytest.raises(AgentError), user_errors_reported(reporter, attempt=2):
        raise AgentError(message)
    (patch,) = reporter.patches
    assert patch["workloadError"] | {"time": None} == {"attempt": 2, "reason": "AgentFailed", "message": message,
                                                       "time": None}


def test_an_environment_loads_from_its_source_directory_and_errors_name_the_source(tmp_path, monkeypatch):
    import sys

    from kuberl.api.types import CodeSource

    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "staged_envs", raising=False)
    code = tmp_path / "agent"
    (code / "staged_envs").mkdir(parents=True)
    (code / "staged_envs" / "__init__.py").write_text(
        "class Echo:\n    def reset(self, task):\n        return 'say hi'\n"
        "    def step(self, action):\n        return None\n")
    source = CodeSource(uri="s3://code/envs.tar", sha256="0" * 64)
    assert load_environment("staged_envs:Echo", source, str(code)).__name__ == "Echo"
    with pytest.raises(AgentError, match=r"^spec.agent.environment: cannot import 'other_envs' from spec.agent.source "
                                         r"\(s3://code/envs.tar \(sha256 0{64}\), at .*agent\)"):
        load_environment("other_envs:Echo", source, str(code))
