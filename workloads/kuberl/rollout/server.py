"""OpenAI- and Anthropic-compatible HTTP endpoint over the engine pool, for agent rollouts.

- ``POST /v1/chat/completions``, ``POST /v1/completions`` (OpenAI), ``POST /v1/messages``
  (Anthropic: content blocks, tool use, system prompt, stop reasons, usage), ``GET /v1/models``;
- sticky routing: requests of one session (header ``x-session-id``, else the OpenAI ``user`` or
  Anthropic ``metadata.user_id`` field) go to the same engine, so its prefix cache holds the
  conversation so far;
- every error in the API's own error shape (OpenAI's ``{"error": {...}}``, Anthropic's
  ``{"type": "error", ...}``): a request's fault is a 4xx naming the field, checked here before
  any of it reaches an engine where it can be (token ids against the vocabulary, seeds, ``top_k``,
  lengths against the context); a body larger than the context could hold is a 413, refused
  before it is read; what an engine still refuses is a 400, and a failure that is not the
  request's (an engine's, or this endpoint's) a 500 whose traceback goes to the driver's log.

Responses also carry the token ids (``prompt_token_ids``, per-choice ``token_ids``) and the
``weight_version`` that produced them, which the trainer needs and the text alone cannot give.

Agent episodes: a request whose API key (Anthropic ``x-api-key``, OpenAI ``Authorization:
Bearer``) is an episode key from the ``EpisodeLog`` is recorded as one turn of that episode
(``kuberl.rollout.transitions``), with its log-probs. It samples as the episode says (the run's
temperature, top-p, top-k and stop strings, a seed per turn, ``max_tokens`` capped), whatever
the request's own fields: the driver, not the agent, decides how the policy samples. When its
chat extends the previous turn's (that reply, then new messages), its prompt is the previous
turn's ids plus the new messages' tokens (``kuberl.rollout.continuation``), not a re-tokenized
chat; such a turn is bounded by the context (``maxTotalLength``, else ``maxPromptLength +
maxResponseLength``), not by
``maxPromptLength``, and its ``max_tokens`` is capped at the room left. Episode turns are routed
to one engine, whose prefix cache holds the conversation.

Chats are rendered into prompt ids here, with the driver's copy of the model's tokenizer (the
same files the engines load): an engine only generates, and a request is one Ray call to it.
Rendering and tokenizing run in worker threads (at most ``TOKENIZER_THREADS`` at once), not on
the event loop: a chat of megabytes takes seconds to tokenize, and on the loop it would stall
every other client for as long.

The hot path is kept thin, since every microsecond here is taken from the engines on small
hosts: plain Starlette routes (no FastAPI dependency resolution per request), request bodies
parsed and validated in one step by pydantic's Rust JSON parser, responses encoded by msgspec
(vLLM's own serialiser), no access log.
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
import uuid
from collections import OrderedDict

import anyio
import anyio.to_thread
import msgspec
from jinja2 import TemplateError
from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from kuberl.rollout.continuation import continuation_ids
from kuberl.rollout.engine import RequestRefused
from kuberl.rollout.protocol import (ChatCompletionRequest, CompletionRequest, MessagesRequest, ToolUseBlock,
                                     assistant_message, reply_blocks)
from kuberl.rollout.transitions import EpisodeLog, Transition

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"

# The body cap is derived from the context: whatever a request holds must fit in
# ``max_model_len`` tokens once rendered, and JSON-escaped text takes far fewer bytes per token
# than BODY_BYTES_PER_TOKEN in any real chat (about 4 for English; 6-12 for CJK or emoji escaped
# as \uXXXX, as Python's json.dumps writes them; under 20 for a pretty-printed token id). Tool
# schemas and message wrappers are rendered into the prompt too, so they count as tokens; the
# overhead covers the rest (model name, options, ids of tool calls, indentation).
BODY_BYTES_PER_TOKEN = 128
BODY_OVERHEAD_BYTES = 1 << 20
# Chats rendered and tokenized at once: each holds its chat's text and ids in memory, and beyond
# a few the threads only take turns on the driver's cores. A fast tokenizer encodes in several
# threads at once; only changing its truncation or padding would conflict, which nothing here does.
TOKENIZER_THREADS = 4


def max_body_bytes(max_model_len: int) -> int:
    """The largest request body the endpoint reads for a context of ``max_model_len`` tokens."""
    return BODY_BYTES_PER_TOKEN * max_model_len + BODY_OVERHEAD_BYTES


class StickyRouter:
    """Session id -> engine index; new sessions and anonymous requests go round-robin."""

    def __init__(self, num_engines: int, max_sessions: int = 100_000):
        self.num_engines = num_engines
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._next = itertools.count()
        self._lock = threading.Lock()

    def route(self, session: str | None) -> int:
        with self._lock:
            if session is None:
                return next(self._next) % self.num_engines
            if session in self._sessions:
                self._sessions.move_to_end(session)
                return self._sessions[session]
            index = self._sessions[session] = next(self._next) % self.num_engines
            if len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
            return index


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _openai_error(err: APIError) -> dict:
    return {"error": {"message": err.message, "type": err.kind, "param": err.param,
                      "code": "model_not_found" if err.status == 404 else None}}


def _anthropic_error(err: APIError) -> dict:
    kind = {404: "not_found_error", 413: "request_too_large", 500: "api_error"}.get(err.status, err.kind)
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _cause(err: Exception) -> Exception:
    """The exception an engine actor raised, for one that came through Ray."""
    from ray.exceptions import RayTaskError

    return err.cause if isinstance(err, RayTaskError) else err


def _failure(err: Exception) -> APIError:
    """A 500 for an error that is not the request's (an engine's, or the endpoint's own)."""
    logger.error("rollout endpoint: request failed", exc_info=err)
    cause = _cause(err)
    detail = str(cause).strip().splitlines()
    return APIError(500, f"the rollout endpoint failed: {type(cause).__name__}"
                         f"{': ' + detail[0] if detail else ''} (the driver's log has the traceback)",
                    kind="server_error")


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    """A prompt given as token ids holds ids of the model's vocabulary only."""
    for i, token in enumerate(ids):
        if not 0 <= token < vocab_size:
            raise APIError(400, f"{field}.{i}: token id {token} is not in the model's vocabulary; ids run from 0 "
                                f"to {vocab_size - 1}", param=field)


def check_top_k(top_k: int, vocab_size: int) -> None:
    if top_k > vocab_size:
        raise APIError(400, f"top_k: {top_k} is more than the model's {vocab_size} tokens; use at most "
                            f"{vocab_size}, or -1 (or leave it out) for no top-k", param="top_k")


def _field(loc: tuple) -> str:
    return ".".join(str(part) for part in loc if part != "body")


def _too_large(max_model_len: int, size: int | None = None) -> APIError:
    """The 413; ``size``: the declared length, unknown for a chunked body."""
    what = f"{size} bytes exceed" if size is not None else "it exceeds"
    return APIError(413, f"body: {what} the endpoint's limit of {max_body_bytes(max_model_len)} bytes "
                         f"({BODY_BYTES_PER_TOKEN} per token of the {max_model_len}-token context, plus "
                         f"{BODY_OVERHEAD_BYTES} for the JSON around it); a request this large cannot fit "
                         f"the context", param="body")


async def _read_body(request: Request, max_model_len: int) -> bytes:
    """The body, refused with a 413 once it is known to exceed ``max_body_bytes``: by its declared
    length before any of it is read, else (chunked) at the chunk that crosses the limit."""
    limit = max_body_bytes(max_model_len)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(max_model_len, int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(max_model_len)
        chunks.append(chunk)
    return b"".join(chunks)


async def _parse(model_cls, request: Request, max_model_len: int):
    """The request body as ``model_cls``: JSON parsing and validation in one pass."""
    body = await _read_body(request, max_model_len)
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "json_invalid":
            detail = first["msg"].removeprefix("Invalid JSON: ")
            raise APIError(400, f"body: request body is not valid JSON ({detail})", param="body") from None
        if first["type"] == "model_type" and not first["loc"]:
            raise APIError(400, "body: expected a JSON object", param="body") from None
        field = _field(first["loc"]) or "body"
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"{field}: {message}", param=field) from None


_encode = msgspec.json.Encoder().encode


def _json(payload: dict, status: int = 200) -> Response:
    return Response(_encode(payload), status_code=status, media_type="application/json")


def _finish_reason(sample) -> str:
    return sample.finish_reason or "stop"


def decode_samples(tokenizer, samples: list, token_text: bool) -> None:
    """Each sample's ``response_text`` (and with ``token_text`` its tokens' texts, in
    ``metadata["tokens"]``) from its token ids, as vLLM's detokenizer gives them: the text with
    special tokens skipped (``SamplingParams.skip_special_tokens``' default), each token alone by
    vLLM's own ``convert_ids_list_to_tokens`` (tests/engine/rollout/test_http.py holds both
    against the engine's own detokenization)."""
    texts = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    for sample, text in zip(samples, texts, strict=True):
        sample.response_text = text
    if token_text:
        from vllm.tokenizers.detokenizer_utils import convert_ids_list_to_tokens

        for sample in samples:
            sample.metadata["tokens"] = convert_ids_list_to_tokens(tokenizer, sample.response_ids)


def api_key(request: Request) -> str | None:
    """The request's API key, as the Anthropic (``x-api-key``) or OpenAI (bearer token) SDKs send it."""
    key = request.headers.get("x-api-key")
    if key:
        return key
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer":
        return None
    return token.strip() or None


NO_ROOM = "leave no room"  # in the 400 a full episode gets: environment loops end the episode on it


def chat_ids(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """A chat as the model's template renders it, opening the assistant's turn, in token ids."""
    return list(tokenizer.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=True,
                                              return_dict=False))


def make_app(pool, tokenizer, episodes: EpisodeLog | None = None) -> Starlette:
    """``tokenizer``: the served model's; ``episodes``: the record of agent episodes whose keys
    the driver hands out."""
    episodes = episodes if episodes is not None else EpisodeLog()
    router = StickyRouter(len(pool.engines))
    rollout = pool.spec.rollout
    max_model_len = rollout.context_length()
    served = pool.served_model_name
    # The model's vocabulary, or the tokenizer's where that is larger: what vLLM accepts.
    vocab_size = max(pool.vocab_size, len(tokenizer))
    tokenizer_threads = anyio.CapacityLimiter(TOKENIZER_THREADS)

    async def tokenized(fn, *args) -> list[int]:
        """``fn(*args)``, which renders or tokenizes, in a worker thread: off the event loop."""
        try:
            return await anyio.to_thread.run_sync(fn, *args, limiter=tokenizer_threads)
        except TemplateError as err:  # the template's own checks (raise_exception), e.g. on role order
            raise APIError(400, f"messages: the model's chat template refused this chat: {err}",
                           param="messages") from None

    def check_model(name: str) -> None:
        if name != served:
            raise APIError(404, f"model: {name!r} is not served here; use {served!r} (GET /v1/models)",
                           param="model")

    def check_length(prompt_ids: list[int], max_tokens: int, prompt_field: str, tokens_field: str) -> None:
        if len(prompt_ids) > rollout.max_prompt_length:
            raise APIError(400, f"{prompt_field}: {len(prompt_ids)} tokens exceed rollout.maxPromptLength "
                                f"({rollout.max_prompt_length})", param=prompt_field)
        if len(prompt_ids) + max_tokens > max_model_len:
            raise APIError(400, f"{tokens_field}: {max_tokens} + {len(prompt_ids)} prompt tokens exceed the "
                                f"context of {max_model_len} tokens", param=tokens_field)

    def engine_for(request: Request, user: str | None, key: str | None = None):
        engines = pool.engines  # fewer than the router was made for while a lost engine is replaced
        return engines[router.route(request.headers.get(SESSION_HEADER) or user or key) % len(engines)]

    async def episode_prompt(key: str | None, chat: list[dict],
                             tools: list[dict] | None = None) -> tuple[list[int], bool]:
        """The turn's prompt ids, and whether they continue the episode's previous turn."""
        follows = episodes.continuation(key, chat) if key is not None else None
        if follows is None:
            return await tokenized(chat_ids, tokenizer, chat, tools), False
        context, new_messages = follows
        try:
            return context + await tokenized(continuation_ids, tokenizer, new_messages, context, tools), True
        except ValueError as err:  # the template cannot be continued token by token
            raise APIError(400, f"messages: {err}", param="messages") from None

    def turn_tokens(prompt_ids: list[int], max_tokens: int, continued: bool, prompt_field: str,
                    tokens_field: str) -> int:
        """``max_tokens`` checked against the limits (capped at the room left for a continued turn)."""
        if not continued:
            check_length(prompt_ids, max_tokens, prompt_field, tokens_field)
            return max_tokens
        room = max_model_len - len(prompt_ids)
        if room < 1:
            raise APIError(400, f"{prompt_field}: the episode's {len(prompt_ids)} tokens {NO_ROOM} in the "
                                f"context of {max_model_len} tokens", param=prompt_field)
        return min(max_tokens, room)

    def episode_params(key: str | None, params: dict) -> dict:
        """The engine's sampling parameters: the request's, or for an episode turn the episode's."""
        episode = episodes.sampling(key)
        if episode is None:
            return params
        sampling, turn = episode
        return dict(params, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
                    stop=list(sampling.stop), seed=sampling.turn_seed(turn), logprobs=True,
                    max_tokens=min(params["max_tokens"], sampling.max_tokens or params["max_tokens"]))

    def episode_key(request: Request) -> str | None:
        key = api_key(request)
        return key if episodes.sampling(key) is not None else None

    def record(key: str | None, chat: list[dict], prompt_ids: list[int], sample, reply: dict) -> None:
        if key is not None:
            episodes.record(key, chat, Transition(
                prompt_ids=prompt_ids, response_ids=list(sample.response_ids),
                response_logprobs=sample.response_logprobs,
                metadata={"weight_version": sample.weight_version, "finish_reason": sample.finish_reason}),
                reply)

    async def run(engine, prompt_ids, *, token_text: bool = False, **params):
        """The engine's samples with their text, and with each token's text when ``token_text``
        (for a response's logprobs objects). Stop strings are found by vLLM's incremental
        detokenizer, so a request with some is detokenized there; one without is decoded here,
        once, in a worker thread: decoding every sequence at every step in the engine's process
        cost it half its generation speed at Qwen2.5-1.5B's shape on an H200."""
        decode_here = not params.get("stop")
        try:
            samples = await engine.complete.remote(prompt_ids, detokenize=not decode_here, **params)
        except RequestRefused as err:  # the engine's (and vLLM's) input checks; any other error is a 500
            refused = _cause(err)
            raise APIError(400, str(refused), param=refused.field) from None
        if decode_here:
            await anyio.to_thread.run_sync(decode_samples, tokenizer, samples, token_text, limiter=tokenizer_threads)
        return samples

    def openai_response(id_prefix: str, kind: str, choices: list[dict], prompt_ids: list[int], samples) -> dict:
        """The envelope chat and text completions share: ids, usage and the weight version."""
        completion_tokens = sum(len(s.response_ids) for s in samples)
        return {"id": f"{id_prefix}-{uuid.uuid4().hex}", "object": kind, "created": int(time.time()),
                "model": served, "choices": choices, "prompt_token_ids": prompt_ids,
                "weight_version": samples[0].weight_version,
                "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens,
                          "total_tokens": len(prompt_ids) + completion_tokens}}

    def handler(fn, error_shape):
        """``fn``'s response, or its error in ``error_shape`` (the API's): never Starlette's
        plain-text 500."""
        async def handle(request: Request) -> Response:
            try:
                return _json(await fn(request))
            except APIError as err:
                return _json(error_shape(err), err.status)
            except Exception as err:
                failure = _failure(err)
                return _json(error_shape(failure), failure.status)
        return handle

    async def chat_completions(request: Request):
        req: ChatCompletionRequest = await _parse(ChatCompletionRequest, request, max_model_len)
        check_model(req.model)
        key = episode_key(request)
        if key is not None and req.n != 1:
            raise APIError(400, "n: an episode key records one conversation; set n to 1", param="n")
        engine = engine_for(request, req.user, key)
        chat = [{"role": m.role, "content": m.text()} for m in req.messages]
        prompt_ids, continued = await episode_prompt(key, chat)
        max_tokens = req.max_completion_tokens or req.max_tokens or max(1, rollout.response_limit(len(prompt_ids)))
        params = episode_params(key, dict(temperature=req.temperature, top_p=req.top_p, max_tokens=max_tokens,
                                          stop=req.stop, seed=req.seed, logprobs=req.logprobs))
        params["max_tokens"] = turn_tokens(prompt_ids, params["max_tokens"], continued, "messages", "max_tokens")
        samples = await run(engine, prompt_ids, n=req.n, token_text=bool(req.logprobs), **params)
        record(key, chat, prompt_ids, samples[0], {"role": "assistant", "content": samples[0].response_text})
        choices = []
        for i, s in enumerate(samples):
            logprobs = None
            if req.logprobs:
                logprobs = {"content": [{"token": tok, "logprob": lp, "bytes": list(tok.encode()),
                                         "top_logprobs": []}
                                        for tok, lp in zip(s.metadata["tokens"], s.response_logprobs)]}
            choices.append({"index": i, "message": {"role": "assistant", "content": s.response_text},
                            "finish_reason": _finish_reason(s), "logprobs": logprobs,
                            "token_ids": s.response_ids})
        return openai_response("chatcmpl", "chat.completion", choices, prompt_ids, samples)

    async def completions(request: Request):
        req: CompletionRequest = await _parse(CompletionRequest, request, max_model_len)
        check_model(req.model)
        if episode_key(request) is not None:  # else served with the client's sampling and recorded nowhere
            raise APIError(400, "prompt: an episode key records chat turns, which a raw prompt is not; "
                                "send the episode's turns to /v1/messages or /v1/chat/completions", param="prompt")
        engine = engine_for(request, req.user)
        if isinstance(req.prompt, list):
            prompt_ids = req.prompt
            check_length(prompt_ids, req.max_tokens, "prompt", "max_tokens")
            check_token_ids(prompt_ids, vocab_size, "prompt")
        else:
            prompt_ids = await tokenized(tokenizer.encode, req.prompt)
            check_length(prompt_ids, req.max_tokens, "prompt", "max_tokens")
        samples = await run(engine, prompt_ids, n=req.n, temperature=req.temperature, top_p=req.top_p,
                            max_tokens=req.max_tokens, stop=req.stop, seed=req.seed,
                            logprobs=req.logprobs is not None, token_text=req.logprobs is not None)
        choices = []
        for i, s in enumerate(samples):
            logprobs = None
            if req.logprobs is not None:
                tokens = s.metadata["tokens"]
                offsets = list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0)) if tokens else []
                logprobs = {"tokens": tokens, "token_logprobs": s.response_logprobs, "top_logprobs": None,
                            "text_offset": offsets}
            choices.append({"index": i, "text": s.response_text, "finish_reason": _finish_reason(s),
                            "logprobs": logprobs, "token_ids": s.response_ids})
        return openai_response("cmpl", "text_completion", choices, prompt_ids, samples)

    async def messages(request: Request):
        req: MessagesRequest = await _parse(MessagesRequest, request, max_model_len)
        check_model(req.model)
        check_top_k(req.top_k, vocab_size)
        key = episode_key(request)
        engine = engine_for(request, req.metadata.user_id if req.metadata else None, key)
        chat = req.chat_messages()
        prompt_ids, continued = await episode_prompt(key, chat, req.template_tools())
        params = episode_params(key, dict(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k,
                                          max_tokens=req.max_tokens, stop=req.stop_sequences, logprobs=False))
        params["max_tokens"] = turn_tokens(prompt_ids, params["max_tokens"], continued, "messages", "max_tokens")
        (s,) = await run(engine, prompt_ids, n=1, **params)
        blocks = reply_blocks(s.response_text, req.tools)
        record(key, chat, prompt_ids, s, assistant_message(blocks))
        stop_sequence = s.metadata.get("stop_reason") if isinstance(s.metadata.get("stop_reason"), str) else None
        if any(isinstance(b, ToolUseBlock) for b in blocks):
            stop_reason = "tool_use"
        elif s.finish_reason == "length":
            stop_reason = "max_tokens"
        elif stop_sequence is not None:
            stop_reason = "stop_sequence"
        else:
            stop_reason = "end_turn"
        return {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant", "model": served,
                "content": [b.model_dump() for b in blocks], "stop_reason": stop_reason,
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": len(prompt_ids), "output_tokens": len(s.response_ids)},
                "prompt_token_ids": prompt_ids, "token_ids": s.response_ids,
                "weight_version": s.weight_version}

    async def models(request: Request):
        return {"object": "list", "data": [{"id": served, "object": "model", "created": 0,
                                            "owned_by": "kuberl", "max_model_len": max_model_len}]}

    return Starlette(routes=[
        Route("/v1/chat/completions", handler(chat_completions, _openai_error), methods=["POST"]),
        Route("/v1/completions", handler(completions, _openai_error), methods=["POST"]),
        Route("/v1/messages", handler(messages, _anthropic_error), methods=["POST"]),
        Route("/v1/models", handler(models, _openai_error), methods=["GET"]),
    ])


class BackgroundServer:
    """uvicorn in a daemon thread, so the driver keeps its own control flow."""

    def __init__(self, app, host: str, port: int):
        import uvicorn

        if port == 0:
            with socket.socket() as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
        self.host, self.port = host, port
        self.server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning",
                                                    access_log=False))
        self.thread = threading.Thread(target=self.server.run, name="kuberl-rollout-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"rollout HTTP endpoint failed to start on {self.url}")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
