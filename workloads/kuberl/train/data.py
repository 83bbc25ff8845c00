"""Training prompts: loaded from jsonl/parquet (a file or a directory of them), served in a
deterministic order that depends only on (seed, step), so a resumed run sees exactly the prompts
an uninterrupted one would.

A row's prompt is a string or a chat-message list (verl/SkyRL data sets); fields are reached by
dotted paths (``reward_model.ground_truth``). ``kuberl check-data`` runs the same loader in the
init container that stages the data, so a bad file fails there, naming the row and the field.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """The data set cannot be used; the message names the file, the line and the field."""


ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Prompt:
    text: str  # the last user message, template applied: what reward functions see as the prompt
    answer: Any
    index: int  # position in the data set
    messages: tuple[dict[str, str], ...] = ()  # the chat the model is given (system prompt included)
    data_source: str = ""
    extra_info: dict = field(default_factory=dict)


def _files(path: Path, fmt: str) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"spec.data.uri: {path} does not exist")
    suffixes = {"jsonl": (".jsonl",), "parquet": (".parquet",)}.get(fmt, (".jsonl", ".parquet"))
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not found:
        raise DataError(f"spec.data.uri: no {' or '.join(suffixes)} files under {path}")
    return found


def _rows(path: Path, fmt: str) -> list[tuple[str, dict[str, Any]]]:
    kind = fmt if fmt != "auto" else ("parquet" if path.suffix == ".parquet" else "jsonl")
    if kind == "parquet":
        import pyarrow.parquet as pq

        return [(f"{path} row {i}", row) for i, row in enumerate(pq.read_table(path).to_pylist())]
    rows = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{n}: expected a JSON object, got {type(row).__name__}")
            rows.append((f"{path}:{n}", row))
    return rows


_MISSING = object()


def lookup(row: dict[str, Any], path: str) -> Any:
    """``row[a][b]`` for the dotted path ``a.b``; ``_MISSING`` when any part is absent. A key that
    itself contains the dot wins (flat column names like ``reward_model.ground_truth``)."""
    if path in row:
        return row[path]
    value: Any = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _messages(value: Any, where: str, field_name: str) -> list[dict[str, str]]:
    if isinstance(value, str):
        if not value:
            raise DataError(f"{where}: field {field_name!r} must be a non-empty string or chat-message list")
        return [{"role": "user", "content": value}]
    if hasattr(value, "tolist"):  # parquet list columns may arrive as numpy arrays
        value = value.tolist()
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {field_name!r} must be a non-empty string or a chat-message list "
                        f"[{{role, content}}], got {type(value).__name__}")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or set(message) - {"role", "content"} - {"name"} or \
                not isinstance(message.get("content"), str) or message.get("role") not in ROLES:
            raise DataError(f"{where}: {field_name}[{i}] must be {{role: {'|'.join(ROLES)}, content: string}}, "
                            f"got {message!r:.120}")
        out.append({"role": message["role"], "content": message["content"]})
    if out[-1]["role"] != "user":
        raise DataError(f"{where}: {field_name}: the last message must be the user's (the model answers it), "
                        f"got {out[-1]['role']!r}")
    return out


def load_prompts(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                 fmt: str = "auto", system_prompt: str | None = None, prompt_template: str | None = None,
                 data_source_field: str = "data_source", extra_info_field: str = "extra_info",
                 spec_field: str = "spec.data") -> list[Prompt]:
    """Every row as a ``Prompt``; raises ``DataError`` naming the file, the row and the field.
    ``spec_field`` names the spec section in messages (spec.data or spec.validation)."""
    prompts = []
    for file in _files(Path(path), fmt):
        for where, row in _rows(file, fmt):
            value = lookup(row, prompt_field)
            if value is _MISSING:
                raise DataError(f"{where}: no field {prompt_field!r} (spec.data.promptField); "
                                f"fields are {sorted(row)}")
            messages = _messages(value, where, prompt_field)
            if prompt_template is not None:
                messages[-1]["content"] = prompt_template.replace("{prompt}", messages[-1]["content"])
            if system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system_prompt})
            answer = lookup(row, answer_field)
            extra = lookup(row, extra_info_field)
            if extra is not _MISSING and extra is not None and not isinstance(extra, dict):
                raise DataError(f"{where}: field {extra_info_field!r} (spec.data.extraInfoField) must be an "
                                f"object, got {type(extra).__name__}")
            source = lookup(row, data_source_field)
            prompts.append(Prompt(messages[-1]["content"], None if answer is _MISSING else answer, len(prompts),
                                  tuple(messages), "" if source is _MISSING or source is None else str(source),
                                  {} if extra is _MISSING or extra is None else extra))
    if not prompts:
        raise DataError(f"{spec_field}.uri: {path} holds no prompts")
    return prompts


def load_for_spec(path: str | Path, data, *, spec_field: str = "spec.data") -> list[Prompt]:
    """``load_prompts`` with the field names, template and system prompt of ``data`` (a DataSpec)."""
    return load_prompts(path, prompt_field=data.prompt_field, answer_field=data.answer_field, fmt=data.format,
                        system_prompt=data.system_prompt, prompt_template=data.prompt_template,
                        data_source_field=data.data_source_field, extra_info_field=data.extra_info_field,
                        spec_field=spec_field)


def check_prompt_lengths(prompts: list[Prompt], lengths: list[int], max_length: int, policy: str,
                         spec_field: str = "spec.data") -> list[Prompt]:
    """Apply ``data.overlongPrompts``: ``error`` raises naming the first overlong row; ``filter``
    returns the prompts that fit. Prompts are never truncated."""
    fits = [p for p, n in zip(prompts, lengths, strict=True) if n <= max_length]
    if len(fits) == len(prompts):
        return prompts
    first = next(i for i, n in enumerate(lengths) if n > max_length)
    if policy == "error":
        raise DataError(f"{spec_field}: prompt {prompts[first].index} is {lengths[first]} tokens, longer than "
                        f"rollout.maxPromptLength {max_length} ({len(prompts) - len(fits)} of {len(prompts)} "
                        f"prompts are); raise maxPromptLength or set data.overlongPrompts: filter")
    if not fits:
        raise DataError(f"{spec_field}: every prompt is longer than rollout.maxPromptLength {max_length}")
    return fits


def steps_for_epochs(epochs: int, prompts: int, prompts_per_step: int) -> int:
    """``algorithm.epochs`` as a step count: enough steps to serve every prompt ``epochs`` times."""
    return -(-epochs * prompts // prompts_per_step)


class PromptStream:
    """Epoch after epoch, each a permutation seeded by (seed, epoch); step ``s`` always gets the
    same prompts, so resuming needs only the step number."""

    def __init__(self, prompts: list[Prompt], seed: int):
        self.prompts = prompts
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.prompts)))
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch]

    def refill(self, step: int, round_: int, size: int) -> list[Prompt]:
        """Prompts for dynamic sampling's extra round ``round_`` of step ``step``: a permutation
        seeded by (seed, step, round), so a resumed run draws the same ones."""
        order = list(range(len(self.prompts)))
        random.Random(f"refill/{self.seed}/{step}/{round_}").shuffle(order)
        return [self.prompts[order[i % len(order)]] for i in range(size)]

    def batch(self, step: int, size: int) -> list[Prompt]:
        start = step * size
        out = []
        for position in range(start, start + size):
            epoch, offset = divmod(position, len(self.prompts))
            out.append(self.prompts[self._order(epoch)[offset]])
        return out
