"""The job's own code (``spec.reward.function``, ``spec.agent.environment``), loaded the way a run
will before anything expensive starts, so that a missing module or name is reported first: in the
head pod's check-data init container (the worker image, before Ray) and at the start of
``kuberl train`` (before Ray, engines or trainers).
"""

from __future__ import annotations

from kuberl.api.types import RLTrainingJobSpec
from kuberl.driver.rewards import load_reward
from kuberl.rollout.agents.environment import load_environment


def check_user_code(spec: RLTrainingJobSpec, reward_code: str | None = None, agent_code: str | None = None) -> None:
    """Load the code the job names as a run will; raise ``RewardError`` or ``AgentError`` naming
    the field and the fix. Only what a run uses: with ``spec.agent`` the episodes' rewards
    replace ``spec.reward``, and a harness is a program, not an import path. ``reward_code`` and
    ``agent_code``: the directories of spec.reward.source and spec.agent.source here."""
    if spec.agent is None:
        load_reward(spec.reward, reward_code)
    elif spec.agent.environment is not None:
        load_environment(spec.agent.environment, spec.agent.source, agent_code)
