"""Multi-turn agent rollouts (``spec.agent``): episodes through the rollout endpoint (docs/agents.md)."""
