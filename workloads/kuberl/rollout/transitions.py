"""Agent transitions -> training ``Sample``s.

An agent episode is a sequence of model calls (turns). Each turn has the tokens the model saw
(``prompt_ids``), the tokens it produced (``response_ids``) and usually their log-probs. In a
multi-turn episode each prompt extends the previous prompt + response with new observation
tokens (tool output, user messages): those are spliced into the response with loss mask 0, so
one sample carries the whole episode and only the model's own tokens are trained on.

Robustness rules (each decision is recorded in ``Sample.metadata["repairs"]``):
- a turn with no response tokens is dropped, and an episode with none at all yields no sample;
- log-probs that are missing, or whose count does not match the response, are discarded for the
  whole episode (``response_logprobs=None``: the trainer recomputes them) rather than misaligned;
- malformed input (no prompt, non-integer tokens, a mask of the wrong length, a turn whose
  prompt does not extend the conversation so far) raises ``SampleError`` naming the turn.
"""

from __future__ import annotations

import math
import secrets
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kuberl.common.samples import Sample, SampleError


@dataclass
class Transition:
    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float] | None = None
    # Per response token: 1 to train on it, 0 not (e.g. tokens the environment forced).
    loss_mask: list[int] | None = None
    metadata: dict = field(default_factory=dict)


def _tokens(value, where: str) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise SampleError(f"{where}: expected a list of token ids, got {type(value).__name__}")
    out = []
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise SampleError(f"{where}[{i}]: token ids are non-negative integers, got {tok!r}")
        out.append(tok)
    return out


def _as_transition(raw, where: str) -> Transition:
    if isinstance(raw, Transition):
        return raw
    if not isinstance(raw, Mapping):
        raise SampleError(f"{where}: expected a Transition or a mapping, got {type(raw).__name__}")
    unknown = set(raw) - {"prompt_ids", "response_ids", "response_logprobs", "loss_mask", "metadata"}
    if unknown:
        raise SampleError(f"{where}: unknown fields {sorted(unknown)}")
    return Transition(prompt_ids=raw.get("prompt_ids"), response_ids=raw.get("response_ids"),
                      response_logprobs=raw.get("response_logprobs"), loss_mask=raw.get("loss_mask"),
                      metadata=dict(raw.get("metadata") or {}))


def _logprobs(values, n: int) -> list[float] | None:
    """Valid log-probs for ``n`` tokens, or None when missing, mismatched or not finite."""
    if values is None or len(values) != n:
        return None
    try:
        floats = [float(v) for v in values]
    except (TypeError, ValueError):
        return None
    return floats if all(math.isfinite(v) and v <= 0 for v in floats) else None


def episode_to_sample(turns: Sequence, *, group: int = 0, reward: float = 0.0,
                      weight_version: int = 0) -> Sample | None:
    """One sample for a whole episode, or None when the model produced no tokens at all."""
    if not turns:
        raise SampleError(f"episode of group {group}: no transitions")
    repairs: list[str] = []
    prompt: list[int] | None = None
    context: list[int] = []  # everything the conversation holds so far
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] | None = []
    for t, raw in enumerate(turns):
        where = f"group {group} turn {t}"
        turn = _as_transition(raw, where)
        prompt_ids = _tokens(turn.prompt_ids, f"{where}: prompt_ids")
        response_ids = _tokens(turn.response_ids, f"{where}: response_ids")
        if not prompt_ids:
            raise SampleError(f"{where}: empty prompt_ids")
        turn_mask = [1] * len(response_ids)
        if turn.loss_mask is not None:
            turn_mask = _tokens(turn.loss_mask, f"{where}: loss_mask")
            if len(turn_mask) != len(response_ids) or any(m not in (0, 1) for m in turn_mask):
                raise SampleError(f"{where}: loss_mask needs one 0/1 per response token "
                                  f"({len(turn_mask)} entries for {len(response_ids)} tokens)")
        if prompt is None:
            prompt, context = prompt_ids, list(prompt_ids)
        else:
            if prompt_ids[:len(context)] != context:
                raise SampleError(f"{where}: prompt_ids do not start with the previous turns' prompt "
                                  f"and response; the episode cannot be one training sample")
            observation = prompt_ids[len(context):]
            response += observation
            mask += [0] * len(observation)
            if logprobs is not None:
                logprobs += [0.0] * len(observation)
            context = list(prompt_ids)
        if not response_ids:
            repairs.append(f"turn {t}: empty response dropped")
            continue
        turn_logprobs = _logprobs(turn.response_logprobs, len(response_ids))
        if turn_logprobs is None and logprobs is not None:
            got = "missing" if turn.response_logprobs is None else f"{len(turn.response_logprobs)} values"
            repairs.append(f"turn {t}: log-probs unusable ({got} for {len(response_ids)} tokens); "
                           f"the episode's log-probs are dropped")
            logprobs = None
        response += response_ids
        mask += turn_mask
        if logprobs is not None:
            logprobs += turn_logprobs
        context += response_ids
    # Observation tokens after the last model turn are not part of any response.
    if not any(mask):
        return None
    last = max(i for i, m in enumerate(mask) if m) + 1
    response, mask = response[:last], mask[:last]
    if logprobs is not None:
        logprobs = logprobs[:last]
    sample = Sample(prompt_ids=prompt, response_ids=response, response_logprobs=logprobs,
                    weight_version=weight_version, group=group, reward=reward, loss_mask=mask,
                    metadata={"repairs": repairs, "turns": len(turns)})
    sample.validate()
    return sample


def transitions_to_samples(episodes: Sequence[Sequence], *, groups: Sequence[int] | None = None,
                           rewards: Sequence[float] | None = None) -> tuple[list[Sample], list[int]]:
    """Samples for the episodes that produced tokens, and the indices of those that did not."""
    if groups is not None and len(groups) != len(episodes):
        raise SampleError(f"{len(groups)} groups for {len(episodes)} episodes")
    if rewards is not None and len(rewards) != len(episodes):
        raise SampleError(f"{len(rewards)} rewards for {len(episodes)} episodes")
    samples, skipped = [], []
    for i, turns in enumerate(episodes):
        sample = episode_to_sample(turns, group=groups[i] if groups is not None else i,
                                   reward=rewards[i] if rewards is not None else 0.0)
        if sample is None:
            skipped.append(i)
        else:
            samples.append(sample)
    return samples, skipped


EPISODE_KEY_PREFIX = "kuberl-episode-"


@dataclass(frozen=True)
class EpisodeSampling:
    """How every turn of an episode samples, whatever the client asks: the trained policy is the
    one at the run's temperature, and a resumed run must repeat its turns."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None  # a cap on the client's max_tokens
    seed: int | None = None        # turn t samples with seed + t

    def turn_seed(self, turn: int) -> int | None:
        return None if self.seed is None else (self.seed + turn) % 2**31


@dataclass
class _Episode:
    sampling: EpisodeSampling
    turns: list[Transition] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the chat up to the last reply, included
    context: list[int] = field(default_factory=list)  # the last turn's prompt and response ids


class EpisodeLog:
    """The endpoint's record of agent episodes, by the per-episode key the driver hands out.

    A client (an environment loop, an agent harness) sends the key as its API key; every turn made
    with it samples as the episode's ``EpisodeSampling`` says and is recorded as a ``Transition``
    (the ids the model saw and produced, their log-probs and weight version). A turn whose chat
    extends the previous one (the reply as returned, then new messages) continues from the
    previous turn's ids (``kuberl.rollout.continuation``), so the recorded turns always chain into
    one training sample."""

    def __init__(self) -> None:
        self._episodes: dict[str, _Episode] = {}
        self._lock = threading.Lock()

    def open(self, sampling: EpisodeSampling | None = None) -> str:
        key = EPISODE_KEY_PREFIX + secrets.token_hex(16)
        with self._lock:
            self._episodes[key] = _Episode(sampling or EpisodeSampling())
        return key

    def close(self, key: str) -> list[Transition]:
        """The episode's turns, in order; the key is no longer recorded."""
        with self._lock:
            return self._episodes.pop(key).turns

    def sampling(self, key: str | None) -> tuple[EpisodeSampling, int] | None:
        """(the episode's sampling, the number of its next turn), or None when ``key`` is no open episode's."""
        with self._lock:
            episode = self._episodes.get(key) if key is not None else None
            return None if episode is None else (episode.sampling, len(episode.turns))

    def continuation(self, key: str, chat: list[dict]) -> tuple[list[int], list[dict]] | None:
        """(the previous turn's prompt and response ids, the messages after its reply) when ``chat``
        extends the episode's last exchange; None for a first turn or a chat that does not."""
        with self._lock:
            episode = self._episodes[key]
        done = len(episode.messages)
        if not done or len(chat) <= done or chat[:done] != episode.messages:
            return None
        return list(episode.context), chat[done:]

    def record(self, key: str, chat: list[dict], turn: Transition, reply: dict) -> None:
        """``reply``: the model's reply as a chat message, as a request sending it back renders it."""
        with self._lock:
            episode = self._episodes.get(key)
            if episode is None:  # closed while the turn ran: the driver gave up on it
                return
            episode.turns.append(turn)
            episode.messages = [*chat, reply]
            episode.context = turn.prompt_ids + turn.response_ids
