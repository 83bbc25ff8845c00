"""A step's agent episodes, each an Anthropic Messages conversation with the rollout endpoint.

For each prompt, ``groupSize`` episodes; each makes a fresh environment (``spec.agent.environment``),
opens an episode key in the endpoint's ``EpisodeLog`` and uses it as its API key, then loops: the
model's reply comes from ``POST /v1/messages``, the environment's ``step`` turns it into an
observation (a tool's output) that goes back as the next user message, until the environment says
done, ``maxTurns`` replies were made or the context is full. The endpoint recorded every turn in
tokens; ``episode_to_sample`` makes them one sample whose loss mask is 1 on the model's tokens
only, with the sum of the step rewards as its reward.

The loop is an ordinary HTTP client of the endpoint, as any agent harness would be: what trains
is exactly what an external agent talking to the same endpoint would produce.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence

import httpx

from kuberl.agents.environment import AgentError, Task, as_step, first_chat, load_environment
from kuberl.rollout.server import NO_ROOM
from kuberl.rollout.transitions import EpisodeLog, episode_to_sample
from kuberl.samples import Sample
from kuberl.train.data import Prompt

ANTHROPIC_VERSION = "2023-06-01"
# A CPU engine under a full step's episodes answers slowly; a turn that takes longer is a fault.
TURN_TIMEOUT_S = 600.0


def turn_seed(seed: int, group: int, member: int, turn: int) -> int:
    """A pure function of (step seed, episode, turn): a resumed run samples the same turns."""
    return random.Random(f"agent/{seed}/{group}/{member}/{turn}").randrange(2**31)


class AgentRollout:
    """Runs episodes against the endpoint at ``base_url``, which records them in ``episodes``."""

    def __init__(self, spec: Any, *, base_url: str, model: str, episodes: EpisodeLog):
        self.agent = spec.agent
        self.algorithm = spec.algorithm
        self.max_tokens = self.agent.max_tokens_per_turn or spec.rollout.max_response_length
        self.environment = load_environment(self.agent.environment)
        self.model = model
        self.episodes = episodes
        self.client = httpx.Client(base_url=base_url, timeout=TURN_TIMEOUT_S)

    def generate(self, prompts: Sequence[Prompt], group_size: int, seed: int) -> list[list[Sample]]:
        """``group_size`` episode samples per prompt, in prompt order; ``Sample.group`` is the
        prompt's index and ``Sample.reward`` the episode's reward."""
        jobs = [(prompt, group, member) for group, prompt in enumerate(prompts) for member in range(group_size)]
        with ThreadPoolExecutor(max_workers=min(self.agent.concurrency, len(jobs))) as pool:
            samples = list(pool.map(lambda job: self.episode(*job, seed=seed), jobs))
        return [samples[i:i + group_size] for i in range(0, len(samples), group_size)]

    def episode(self, prompt: Prompt, group: int, member: int, *, seed: int) -> Sample:
        where = f"{self.agent.environment} (prompt {prompt.index}, episode {member})"
        env = self.environment()
        chat = first_chat(env.reset(Task(prompt.messages, prompt.answer, prompt.data_source, prompt.extra_info,
                                         seed=turn_seed(seed, group, member, -1))), where)
        key = self.episodes.open()
        reward, replies, truncated = 0.0, 0, False
        try:
            while True:
                reply = self._reply(key, chat, turn_seed(seed, group, member, replies), where)
                if reply is None:
                    truncated = True  # the context is full
                    break
                replies += 1
                step = as_step(env.step(reply), where)
                reward += step.reward
                if step.done:
                    break
                if replies == self.agent.max_turns:
                    truncated = True
                    break
                chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": step.observation}]
        finally:
            turns = self.episodes.close(key)
        sample = episode_to_sample(turns, group=group, reward=reward,
                                   weight_version=turns[0].metadata["weight_version"])
        if sample is None:
            raise AgentError(f"{where}: the model produced no tokens in any turn")
        sample.prompt_text = prompt.text
        sample.metadata.update(answer=prompt.answer, replies=replies, truncated=truncated)
        return sample

    def _reply(self, key: str, chat: list[dict[str, str]], seed: int, where: str) -> str | None:
        """The model's next reply, or None when the episode has no room left in the context."""
        system = [m["content"] for m in chat if m["role"] == "system"]
        body = {"model": self.model, "max_tokens": self.max_tokens, "seed": seed,
                "messages": [m for m in chat if m["role"] != "system"],
                "temperature": self.algorithm.temperature, "top_p": self.algorithm.top_p,
                "top_k": self.algorithm.top_k, "stop_sequences": list(self.algorithm.stop)}
        if system:
            body["system"] = "\n\n".join(system)
        response = self.client.post("/v1/messages", json=body,
                                    headers={"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION})
        payload = response.json()
        if response.status_code == 400 and NO_ROOM in payload["error"]["message"]:
            return None
        if response.status_code != 200:
            raise AgentError(f"{where}: the rollout endpoint answered {response.status_code}: "
                             f"{payload.get('error', {}).get('message', payload)}")
        return "".join(block["text"] for block in payload["content"] if block["type"] == "text")

    def close(self) -> None:
        self.client.close()
