"""Environments and a harness the agent tests name by import path, as a job's spec.agent would."""

from __future__ import annotations

import threading

from kuberl.rollout.agents.environment import Step

# Lets a hung call's thread end once its test is over (the episode stopped waiting for it long before).
RELEASE = threading.Event()


class HangsInReset:
    def reset(self, task):
        RELEASE.wait(60)
        return "never reached"

    def step(self, action):
        return Step(reward=1.0, done=True)


class HangsInStep:
    def reset(self, task):
        return list(task.messages)

    def step(self, action):
        RELEASE.wait(60)
        return Step(reward=1.0, done=True)


class LargeSum:
    """Two steps of 6e5, each within the bound on a reward, whose sum is not."""

    def reset(self, task):
        self.steps = 0
        return list(task.messages)

    def step(self, action):
        self.steps += 1
        return Step(observation="again", reward=6e5, done=self.steps == 2)
