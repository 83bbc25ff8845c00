"""A step's agent episodes, each a conversation with the rollout endpoint under an episode key.

For each prompt, ``groupSize`` episodes. Each opens an episode key in the endpoint's
``EpisodeLog``, with the run's sampling (``algorithm.temperature``, ``topP``, ``topK``, ``stop``,
a seed per episode, ``agent.maxTokensPerTurn``), and plays one of the two forms of ``spec.agent``:

- ``environment``: a Python class with ``reset``/``step`` (``kuberl.rollout.agents.environment``). The loop
  here is an Anthropic Messages client: the model's reply comes from ``POST /v1/messages``, ``step``
  turns it into an observation (a tool's output) that goes back as the next user message, until the
  environment says done, ``maxTurns`` replies were made or the context is full. The reward is the
  sum of the steps' rewards. Each call of the environment's code (the class, ``reset``, ``step``)
  has ``spec.agent.stepTimeoutSeconds`` (default 300: a tool that runs code or a test suite takes
  seconds to minutes; one that takes longer is hung; with the turn's bound and ``maxTurns`` this
  bounds a whole episode); one that runs past it fails the step (``bounded_call``).
- ``harness``: any program, run once per episode with the endpoint's address and the episode key
  as its Anthropic and OpenAI API settings and the task as JSON on stdin; it talks to the endpoint
  as it likes and prints ``{"reward": ...}`` as its last line of output. It runs in a process group
  of its own, killed whole when it exits or times out (``wait_then_kill_group``).

Either way the endpoint recorded every turn in tokens, and ``episode_to_sample`` makes them one
sample whose loss mask is 1 on the model's tokens only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence

import httpx

from kuberl.common.prompts import Prompt
from kuberl.common.reward_values import as_reward
from kuberl.common.samples import Sample
from kuberl.rollout.agents.environment import AgentError, Task, as_step, first_chat, load_environment
from kuberl.rollout.server import NO_ROOM
from kuberl.rollout.transitions import EpisodeLog, EpisodeSampling, episode_to_sample

ANTHROPIC_VERSION = "2023-06-01"
# A CPU engine under a full step's episodes answers slowly; a turn that takes longer is a fault.
TURN_TIMEOUT_S = 600.0
# How often a harness is checked for having exited.
HARNESS_POLL_S = 0.05
# What a harness inherits from the driver's environment: enough to run a program, none of the
# job's credentials (checkpoint storage, trackers).
HARNESS_INHERITS = ("PATH", "HOME", "LANG", "LC_ALL", "PYTHONPATH", "VIRTUAL_ENV", "TMPDIR")


def episode_seed(seed: int, group: int, member: int) -> int:
    """A pure function of (step seed, episode): a resumed run samples the same episodes."""
    return random.Random(f"agent/{seed}/{group}/{member}").randrange(2**31)


def bounded_call(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str) -> Any:
    """``fn(*args)``, or an ``AgentError`` naming ``what`` once it has run ``timeout_s`` seconds.

    The environment is Python in the driver's process, and a thread cannot be killed: the call
    runs in a daemon thread of its own, and past the bound the episode stops waiting for it. The
    step fails and the run with it, and the process exits: a daemon thread holds no one up (a
    ``ThreadPoolExecutor``'s threads are joined at exit, so a hung call there would hang that).
    """
    outcome: list[Any] = []

    def call() -> None:
        try:
            outcome.append((True, fn(*args)))
        except BaseException as exc:  # re-raised in the episode's thread, as if called there
            outcome.append((False, exc))

    thread = threading.Thread(target=call, name=f"kuberl-env {what}"[:60], daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise AgentError(f"{what} did not return within {timeout_s:g} s (spec.agent.stepTimeoutSeconds, the "
                         f"bound on each call of the environment's code); the step fails, not to hang the run")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def wait_then_kill_group(process: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``process`` (started with ``start_new_session=True``, so it leads a process group
    of its own) to exit, ``timeout_s`` at most; then kill the whole group, whatever the process
    started and left running, and reap it. True if it exited in time.

    The group is killed before the leader is reaped: an exited but unreaped leader keeps its
    pid, the group's id, from being reused, so the kill reaches the harness's processes only. A
    process that left the group on purpose (``setsid``) is not followed."""
    def has_exited() -> bool:  # WNOWAIT: seen, not reaped
        return os.waitid(os.P_PID, process.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    deadline = time.monotonic() + timeout_s
    exited = has_exited()
    while not exited and time.monotonic() < deadline:
        time.sleep(HARNESS_POLL_S)
        exited = has_exited()
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the group is gone already
        pass
    process.wait()
    return exited


def task_json(prompt: Prompt, seed: int, max_tokens: int) -> str:
    """What a harness reads on stdin."""
    return json.dumps({"messages": list(prompt.messages), "answer": prompt.answer,
                       "data_source": prompt.data_source, "extra_info": prompt.extra_info,
                       "seed": seed, "max_tokens": max_tokens})


class AgentRollout:
    """Runs episodes against the endpoint at ``base_url``, which records them in ``episodes``."""

    def __init__(self, spec: Any, *, base_url: str, model: str, episodes: EpisodeLog, code_dir: str | None = None):
        self.agent = spec.agent
        algorithm = spec.algorithm
        self.max_tokens = self.agent.max_tokens_per_turn or spec.rollout.max_response_length
        self.sampling = EpisodeSampling(temperature=algorithm.temperature, top_p=algorithm.top_p,
                                        top_k=algorithm.top_k, stop=tuple(algorithm.stop), max_tokens=self.max_tokens)
        self.environment = load_environment(self.agent.environment, self.agent.source, code_dir) if self.agent.environment else None
        self.step_timeout_s = float(self.agent.step_timeout_seconds)
        self.base_url, self.model, self.episodes = base_url, model, episodes

    def generate(self, prompts: Sequence[Prompt], group_size: int, seed: int,
                 sampling: EpisodeSampling | None = None) -> list[list[Sample]]:
        """``group_size`` episode samples per prompt, in prompt order; ``Sample.group`` is the
        prompt's index and ``Sample.reward`` the episode's reward. ``sampling`` replaces the
        training's (``spec.algorithm``'s) for validation episodes."""
        jobs = [(prompt, group, member) for group, prompt in enumerate(prompts) for member in range(group_size)]
        pool = ThreadPoolExecutor(max_workers=min(self.agent.concurrency, len(jobs)))
        try:
            samples = list(pool.map(lambda job: self.episode(*job, seed=seed, sampling=sampling), jobs))
        finally:
            # After a failed episode the step fails: the episodes not started yet never start.
            pool.shutdown(wait=True, cancel_futures=True)
        return [samples[i:i + group_size] for i in range(0, len(samples), group_size)]

    def episode(self, prompt: Prompt, group: int, member: int, *, seed: int,
                sampling: EpisodeSampling | None = None) -> Sample:
        form = self.agent.environment or "spec.agent.harness"
        where = f"{form} (prompt {prompt.index}, episode {member})"
        seed = episode_seed(seed, group, member)
        key = self.episodes.open(dataclasses.replace(sampling or self.sampling, seed=seed))
        try:
            if self.environment is not None:
                # A client per episode, used by its thread alone: httpx's sync connection pool,
                # shared by threads, can close a connection that another thread was just given
                # (encode/httpcore#1110), and that thread's read then fails with "Bad file
                # descriptor". It failed one CI run here (tests/engine/driver/test_agent_e2e.py).
                with httpx.Client(base_url=self.base_url, timeout=TURN_TIMEOUT_S) as client:
                    reward, info = self._play(client, prompt, key, seed, where)
            else:
                reward, info = self._harness(prompt, key, seed, where)
        finally:
            turns = self.episodes.close(key)
        if not turns:
            raise AgentError(f"{where}: the agent made no model call with its episode key (its Anthropic "
                             f"or OpenAI API key)")
        sample = episode_to_sample(turns, group=group, reward=reward, weight_version=turns[0].metadata["weight_version"])
        if sample is None:
            raise AgentError(f"{where}: the model produced no tokens in any turn")
        sample.prompt_text = prompt.text
        sample.metadata.update(answer=prompt.answer, **info)
        return sample

    # --- the environment form ----------------------------------------------------------------

    def _play(self, client: httpx.Client, prompt: Prompt, key: str, seed: int, where: str) -> tuple[float, dict]:
        def bounded(fn: Callable[..., Any], *args: Any, what: str) -> Any:
            return bounded_call(fn, *args, timeout_s=self.step_timeout_s, what=f"{where}: {what}")

        env = bounded(self.environment, what=f"{self.environment.__name__}()")
        task = Task(prompt.messages, prompt.answer, prompt.data_source, prompt.extra_info, seed=seed)
        chat = first_chat(bounded(env.reset, task, what="reset()"), where)
        reward, replies, truncated = 0.0, 0, False
        while True:
            reply = self._reply(client, key, chat, where)
            if reply is None:  # the context is full
                truncated = True
                break
            replies += 1
            step = as_step(bounded(env.step, reply, what=f"step() of turn {replies}"), where)
            reward += step.reward
            if step.done:
                break
            if replies == self.agent.max_turns:
                truncated = True
                break
            chat += [{"role": "assistant", "content": reply}, {"role": "user", "content": step.observation}]
        return as_reward(reward, f"{where}: the episode's reward (the sum of its steps')", AgentError), {
            "replies": replies, "truncated": truncated}

    def _reply(self, client: httpx.Client, key: str, chat: list[dict[str, str]], where: str) -> str | None:
        """The model's next reply, or None when the episode has no room left in the context. The
        episode key makes the endpoint sample as the run says; the body carries only the chat."""
        system = [m["content"] for m in chat if m["role"] == "system"]
        body = {"model": self.model, "max_tokens": self.max_tokens,
                "messages": [m for m in chat if m["role"] != "system"]}
        if system:
            body["system"] = "\n\n".join(system)
        response = client.post("/v1/messages", json=body,
                               headers={"x-api-key": key, "anthropic-version": ANTHROPIC_VERSION})
        if response.status_code != 200:
            try:
                message = response.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):  # not the API's error shape (a crashed handler)
                message = response.text[:2000]
            if response.status_code == 400 and NO_ROOM in message:
                return None
            raise AgentError(f"{where}: the rollout endpoint answered {response.status_code}: {message}")
        return "".join(block["text"] for block in response.json()["content"] if block["type"] == "text")

    # --- the harness form --------------------------------------------------------------------

    def _harness(self, prompt: Prompt, key: str, seed: int, where: str) -> tuple[float, dict]:
        harness = self.agent.harness
        env = {name: os.environ[name] for name in HARNESS_INHERITS if name in os.environ}
        env.update(ANTHROPIC_BASE_URL=self.base_url, ANTHROPIC_API_KEY=key, OPENAI_BASE_URL=f"{self.base_url}/v1",
                   OPENAI_API_KEY=key, KUBERL_MODEL=self.model)
        # Files, not pipes: a process the harness leaves running may hold its stdout open, and
        # reading a pipe to its end would wait for that process, not for the harness.
        with tempfile.TemporaryFile() as stdin, tempfile.TemporaryFile() as stdout, \
                tempfile.TemporaryFile() as stderr:
            stdin.write(task_json(prompt, seed, self.max_tokens).encode())
            stdin.seek(0)
            try:
                process = subprocess.Popen(harness.command, stdin=stdin, stdout=stdout, stderr=stderr, env=env,
                                           start_new_session=True)
            except FileNotFoundError:
                raise AgentError(f"spec.agent.harness.command: {harness.command[0]!r} is not in the image "
                                 f"(PATH={env.get('PATH', '')})") from None
            except OSError as exc:  # not executable, a directory
                raise AgentError(f"spec.agent.harness.command: cannot run {harness.command[0]!r}: "
                                 f"{exc.strerror}") from None
            exited = wait_then_kill_group(process, harness.timeout_seconds)
            stdout.seek(0)
            stderr.seek(0)
            out, err = (f.read().decode(errors="replace") for f in (stdout, stderr))
        if not exited:
            raise AgentError(f"{where}: the harness ran past spec.agent.harness.timeoutSeconds "
                             f"({harness.timeout_seconds}); it and every process it started were killed")
        if process.returncode != 0:
            raise AgentError(f"{where}: the harness exited {process.returncode}; its stderr ends:\n{err[-2000:]}")
        return _harness_reward(out, where), {}


def _harness_reward(stdout: str, where: str) -> float:
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        reward = json.loads(lines[-1])["reward"]
    except (IndexError, ValueError, TypeError, KeyError):
        raise AgentError(f'{where}: the harness must print {{"reward": <number>}} as its last line of '
                         f"output; it ended with {lines[-1][:200] if lines else 'nothing'!r}") from None
    return as_reward(reward, f"{where}: the harness's reward", AgentError)
