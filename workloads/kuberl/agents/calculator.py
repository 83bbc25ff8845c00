"""The embedded two-turn tool-use task: ask the calculator, then answer.

Rows (``kuberl.tiny.make_calculator_data``) ask for the value of a small sum whose result is one
digit. Turn 1 is the tool call: a reply containing ``=`` calls the calculator on the question's
expression, and its output (``calculator: 3``) comes back as the next user message; a reply
without it gets a hint instead. Turn 2 is the answer. The reward is 0 without a tool call, and
otherwise 0.2 plus 0.8 x the share of the answer's characters equal to the result digit, so the
answer must come from the tool's output (the digit is in no prompt) and the reward rises by steps
a random-weight character model can take on a CPU: first calling the tool, then copying its digit.

The tool-call syntax is a single character because the tiny model writes characters at random;
an environment for a real model parses real tool calls (JSON, XML tags) from ``action`` the same way.
"""

from __future__ import annotations

import ast
import operator

from kuberl.agents.environment import Step, Task

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
