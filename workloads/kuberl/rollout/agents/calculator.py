"""The embedded two-turn tool-use task: ask the calculator, then answer.

Rows (``kuberl.driver.tiny.make_calculator_data``) ask for the value of a small sum whose result is one
digit. Turn 1 is the tool call: a reply containing ``=`` calls the calculator on the question's
expression, and its output (``calculator: 3``) comes back as the next user message; a reply
without it gets a hint instead. Turn 2 is the answer. The reward is 0 without a tool call, and
otherwise 0.2 plus 0.8 x the share of the answer's characters equal to the result digit, so the
answer must come from the tool's output (the digit is not in the prompt, except as an operand of
``0+n`` or ``n+0``) and the reward rises by steps
a random-weight character model can take on a CPU: first calling the tool, then copying its digit.

The tool-call syntax is a single character because the tiny model writes characters at random;
an environment for a real model parses real tool calls (JSON, XML tags) from ``action`` the same way.

The same task is also a harness (``spec.agent.harness``), ``python -m kuberl.rollout.agents.calculator``:
an agent program that drives ``Calculator`` with the Anthropic SDK, as any external agent would.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys

from kuberl.rollout.agents.environment import AgentError, Step, Task

CALL = "="
CALL_BONUS = 0.2
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def evaluate(expression: str) -> int:
    """The value of an integer expression of + - * (no names, no calls: never ``eval``)."""

    def value(node: ast.AST) -> int:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        raise ValueError(f"calculator: {expression!r} is not an integer expression of + - *")

    return value(ast.parse(expression, mode="eval").body)


class Calculator:
    def reset(self, task: Task) -> list[dict[str, str]]:
        if "expression" not in task.extra_info:
            raise AgentError("Calculator: the data row's extra_info (spec.data.extraInfoField) has no "
                             "'expression'; use the rows python -m kuberl.driver.tiny writes (data/calculator.jsonl)")
        self.expression = task.extra_info["expression"]
        self.answer = str(task.answer)
        self.called = False
        self.replies = 0
        return list(task.messages)

    def step(self, action: str) -> Step:
        self.replies += 1
        if self.replies == 1:
            if CALL in action:
                self.called = True
                return Step(observation=f"calculator: {evaluate(self.expression)}")
            return Step(observation=f"no tool call (write {CALL})")
        letters = action.strip()
        share = sum(c == self.answer for c in letters) / len(letters) if letters else 0.0
        return Step(reward=CALL_BONUS + (1 - CALL_BONUS) * share if self.called else 0.0, done=True)


def main() -> int:
    """The harness: the task on stdin, the endpoint and the episode key in the environment
    (``ANTHROPIC_BASE_URL``, ``ANTHROPIC_API_KEY``, which the SDK reads), the reward on stdout."""
    import anthropic

    from kuberl.rollout.server import NO_ROOM

    task = json.load(sys.stdin)
    env = Calculator()
    chat = env.reset(Task(tuple(task["messages"]), task["answer"], task["data_source"], task["extra_info"],
                          seed=task["seed"]))
    system = "\n\n".join(m["content"] for m in chat if m["role"] == "system")
    messages = [m for m in chat if m["role"] != "system"]
    client = anthropic.Anthropic(max_retries=0)
    reward = 0.0
    while True:
        try:
            reply = client.messages.create(model=os.environ["KUBERL_MODEL"], max_tokens=task["max_tokens"],
                                           messages=messages, **({"system": system} if system else {}))
        except anthropic.BadRequestError as err:
            if NO_ROOM in str(err):  # the episode filled the context
                break
            raise
        text = "".join(block.text for block in reply.content if block.type == "text")
        step = env.step(text)
        reward += step.reward
        if step.done:
            break
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": step.observation}]
    print(json.dumps({"reward": reward}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
