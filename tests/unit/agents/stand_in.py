"""A scripted stand-in for the ``RolloutEngine`` actor behind the real rollout endpoint.

Not vLLM: the agent tests check the recorded token ids exactly, which needs replies known in
advance (a random tiny model almost never calls the tool), including ones real engines produce
and text cannot carry (an unused token id that decodes to nothing). It only generates, as the
real one does: the endpoint renders chats into ids itself, with the tiny model's real tokenizer. The endpoint over the real vLLM
engine is tested in tests/engine/rollout/test_http.py, and the whole loop in tests/engine/driver/test_agent_e2e.py.
"""

from __future__ import annotations

import re

from kuberl.api import RLTrainingJobSpec
from kuberl.common.samples import Sample
from kuberl.driver.tiny import VOCAB_SIZE

MODEL = "kuberl-tiny"
UNUSED_TOKEN = 120  # beyond the tiny vocabulary's characters: decodes to no text at all


class _Method:
    """``actor.method.remote(...)``: awaitable, as a Ray ObjectRef is."""

    def __init__(self, fn):
        self._fn = fn

    def remote(self, *args, **kwargs):
        async def call():
            return self._fn(*args, **kwargs)
        return call()


class ScriptedEngine:
    """Stands in for the ``RolloutEngine`` actor. It plays a policy that already solved the
    calculator task: a first turn calls the tool (``=``, an unused token, then EOS); a later turn
    answers the digit the tool printed, twice, without closing its turn."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.requests: list[dict] = []
        self.complete = _Method(self._complete)

    def reply_ids(self, prompt_ids: list[int]) -> list[int]:
        # \s*: a tokenizer loaded from disk decodes the tiny vocabulary without its whitespace.
        tool = re.findall(r"calculator:\s*(\d)", self.tokenizer.decode(prompt_ids))
        if tool:
            return self.tokenizer.encode(tool[-1] * 2, add_special_tokens=False)
        return self.tokenizer.encode("=", add_special_tokens=False) + [UNUSED_TOKEN, self.tokenizer.eos_token_id]

    def _complete(self, prompt_ids, *, n=1, temperature=1.0, top_p=1.0, top_k=-1, max_tokens=16, stop=None,
                  seed=None, logprobs=False, detokenize=True):
        self.requests.append({"prompt_ids": prompt_ids, "max_tokens": max_tokens, "seed": seed,
                              "temperature": temperature, "top_k": top_k})
        ids = self.reply_ids(prompt_ids)[:max_tokens]
        return [Sample(prompt_ids=list(prompt_ids), response_ids=ids,
                       response_logprobs=[-0.25] * len(ids) if logprobs else None, weight_version=3,
                       finish_reason="stop" if ids[-1] == self.tokenizer.eos_token_id else "length",
                       # As the engine: no text when the endpoint decodes it.
                       response_text=self.tokenizer.decode(ids, skip_special_tokens=True) if detokenize else "",
                       metadata={"tokens": [self.tokenizer.decode([t]) for t in ids]} if detokenize else {})
                for _ in range(n)]


def make_spec(max_response_length: int = 64) -> RLTrainingJobSpec:
    return RLTrainingJobSpec.model_validate({
        "image": "kuberl/worker:test", "model": {"uri": "/models/tiny"}, "data": {"uri": "/data/calc.jsonl"},
        "rollout": {"gpusPerReplica": 0, "maxPromptLength": 48, "maxResponseLength": max_response_length},
        "agent": {"environment": "kuberl.rollout.agents.calculator:Calculator", "maxTurns": 4, "maxTokensPerTurn": 12},
        "algorithm": {"groupSize": 2, "temperature": 0.7},
    })


class Pool:
    def __init__(self, spec, engine):
        self.spec, self.engines, self.served_model_name = spec, [engine], MODEL
        self.vocab_size = VOCAB_SIZE


