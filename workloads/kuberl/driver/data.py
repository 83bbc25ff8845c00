"""Training prompts: loaded from jsonl/parquet (a file or a directory of them), served in a
deterministic order that depends only on (seed, step), so a resumed run sees exactly the prompts
an uninterrupted one would.

A row's prompt is a string or a chat-message list (verl/SkyRL data sets); fields are reached by
dotted paths (``reward_model.ground_truth``). ``kuberl check-data`` runs the same loader in the
init container that stages the data, so a bad file fails there, naming the row and the field.
"""

from __future__ import annotations

import codecs
import json
import logging
import random
from collections.abc import Collection
from pathlib import Path
from typing import Any

from kuberl.api.types import DataSpec
from kuberl.common.prompts import Prompt, checked_chat
from kuberl.storage import filesystems
from kuberl.storage.errors import StorageError

log = logging.getLogger("kuberl.train")


class DataError(ValueError):
    """The data set cannot be used; the message names the file, the line and the field."""


SUFFIXES = {"jsonl": (".jsonl",), "parquet": (".parquet",)}
PARQUET_MAGIC = b"PAR1"
UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)  # UTF-32's begin with these too
# How deep a row's answer or extra_info may nest. They travel on to reward functions and agent
# harnesses through pickle and JSON, which recurse: a value that parses here must not fail there,
# mid-run. No real data set comes close.
MAX_NESTING = 100


def _files(path: Path, fmt: str) -> list[Path]:
    if not path.exists():
        raise DataError(f"spec.data.uri: {path} does not exist")
    try:
        # In a pod the data is a staged copy or a mounted claim, read where it lies: none of its
        # symlinks may lead out of it (or its claim), as for model sources.
        filesystems.check_containment(path.absolute(), str(path))
    except StorageError as exc:
        raise DataError(str(exc)) from None
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"spec.data.uri: {path} is neither a file nor a directory")
    suffixes = SUFFIXES.get(fmt, (".jsonl", ".parquet"))
    found = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in suffixes)
    if not found:
        others = sorted({p.suffix for p in path.rglob("*") if p.is_file() and p.suffix in (".jsonl", ".parquet")})
        hint = f" (it holds {' and '.join(others)} files: set spec.data.format to auto)" if others else ""
        raise DataError(f"spec.data.uri: no {' or '.join(suffixes)} files under {path}{hint}")
    return found


def _kind(path: Path, fmt: str) -> str:
    return fmt if fmt != "auto" else ("parquet" if path.suffix == ".parquet" else "jsonl")


def _fix_format(fmt: str, actual: str) -> str:
    """How to make a file whose bytes are ``actual`` read as that: its name or spec.data.format."""
    if fmt == "auto":
        return (f"name it {SUFFIXES[actual][0]} (spec.data.format auto goes by the name) "
                f"or set spec.data.format: {actual}")
    return f"set spec.data.format: {actual} (or auto, which goes by the file name)"


def _rows(path: Path, fmt: str) -> list[tuple[str, dict[str, Any]]]:
    try:
        return _parquet_rows(path, fmt) if _kind(path, fmt) == "parquet" else _jsonl_rows(path, fmt)
    except OSError as exc:
        raise DataError(f"{path}: cannot be read ({exc.strerror or exc})") from None


def _parquet_rows(path: Path, fmt: str) -> list[tuple[str, dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except pa.ArrowException as exc:
        with path.open("rb") as f:
            head = f.read(64).lstrip(codecs.BOM_UTF8).lstrip()
        if head[:1] in (b"{", b"["):
            why = f"it holds JSON lines; {_fix_format(fmt, 'jsonl')}"
        elif head.startswith(PARQUET_MAGIC):
            why = "it is truncated or corrupt; stage or write it again"
        else:
            why = "it is neither Parquet nor JSON lines"
        raise DataError(f"{path}: cannot be read as Parquet: {why} (pyarrow: {exc})") from None
    return [(f"{path} row {i}", row) for i, row in enumerate(rows)]


def _jsonl_rows(path: Path, fmt: str) -> list[tuple[str, dict[str, Any]]]:
    rows = []
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            where = f"{path}:{n}"
            row = _json_row(_text(line, where, fmt, first=n == 1), where)
            if row is not None:
                rows.append((where, row))
    return rows


def _text(line: bytes, where: str, fmt: str, *, first: bool) -> str:
    """One line of a JSON-lines file as text: UTF-8 (a leading byte-order mark is dropped)."""
    if first:
        if line.startswith(PARQUET_MAGIC):
            raise DataError(f"{where}: this is a Parquet file, read as JSON lines: {_fix_format(fmt, 'parquet')}")
        if line.startswith(UTF16_BOMS):
            raise DataError(f"{where}: the file is UTF-16 (it starts with a UTF-16 byte-order mark); JSON lines "
                            f"must be UTF-8: convert it, e.g. iconv -f UTF-16 -t UTF-8")
        line = line.removeprefix(codecs.BOM_UTF8)
    if b"\x00" in line:  # never in JSON text; every other byte of UTF-16 text
        raise DataError(f"{where}: holds NUL bytes (UTF-16 text without a byte-order mark?); JSON lines must be "
                        f"UTF-8: convert it, e.g. iconv -f UTF-16LE -t UTF-8")
    try:
        return line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"{where}: not valid UTF-8 (byte {line[exc.start]:#04x} at column {exc.start + 1}); "
                        f"JSON lines must be UTF-8: convert the file, e.g. with iconv") from None


def _json_row(text: str, where: str) -> dict[str, Any] | None:
    """The object on one line; None for a blank line."""
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except RecursionError:
        raise DataError(f"{where}: nested too deeply to parse (a field may nest at most {MAX_NESTING} "
                        f"levels)") from None
    except ValueError as exc:  # not JSON, or an integer beyond Python's digit limit
        raise DataError(f"{where}: not valid JSON ({getattr(exc, 'msg', exc)})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def _nesting(value: Any, limit: int) -> int:
    """How many dicts and lists deep ``value`` nests, counted up to ``limit + 1``."""
    deepest, todo = 0, [(value, 1)]
    while todo and deepest <= limit:
        item, depth = todo.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is not None:
            deepest = max(deepest, depth)
            todo.extend((child, depth + 1) for child in children)
    return deepest


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
    try:
        return checked_chat(value, field_name)
    except ValueError as err:
        raise DataError(f"{where}: {err}") from None


def load_prompts(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                 fmt: str = "auto", system_prompt: str | None = None, prompt_template: str | None = None,
                 data_source_field: str = "data_source", extra_info_field: str = "extra_info",
                 spec_field: str = "spec.data", must_match: Collection[str] = ()) -> list[Prompt]:
    """Every row as a ``Prompt``; raises ``DataError`` naming the file, the row and the field.
    ``spec_field`` names the spec section in messages (spec.data or spec.validation).

    Every row needs the prompt field. The answer, data-source and extra-info fields may be absent
    from a row (None, "", {}); rows without them are counted and logged. Those named in
    ``must_match`` (``answerField``, ``dataSourceField``, ``extraInfoField``) must be in at least
    one row: a field in no row at all is a typo or the wrong data set."""
    optional = {"answerField": answer_field, "dataSourceField": data_source_field, "extraInfoField": extra_info_field}
    absent = dict.fromkeys(optional, 0)
    fields: set[str] = set()
    prompts = []
    for file in _files(Path(path), fmt):
        for where, row in _rows(file, fmt):
            fields.update(row)
            value = lookup(row, prompt_field)
            if value is _MISSING:
                raise DataError(f"{where}: no field {prompt_field!r} (spec.data.promptField); "
                                f"fields are {sorted(row)}")
            messages = _messages(value, where, prompt_field)
            if prompt_template is not None:
                messages[-1]["content"] = prompt_template.replace("{prompt}", messages[-1]["content"])
            if system_prompt is not None and messages[0]["role"] != "system":
                messages.insert(0, {"role": "system", "content": system_prompt})
            found = {name: lookup(row, field_path) for name, field_path in optional.items()}
            for name, value in found.items():
                if value is _MISSING:
                    absent[name] += 1
                elif _nesting(value, MAX_NESTING) > MAX_NESTING:
                    raise DataError(f"{where}: field {optional[name]!r} (spec.data.{name}) nests more than "
                                    f"{MAX_NESTING} levels deep")
            answer, source, extra = found["answerField"], found["dataSourceField"], found["extraInfoField"]
            if extra is not _MISSING and extra is not None and not isinstance(extra, dict):
                raise DataError(f"{where}: field {extra_info_field!r} (spec.data.extraInfoField) must be an "
                                f"object, got {type(extra).__name__}")
            prompts.append(Prompt(messages[-1]["content"], None if answer is _MISSING else answer, len(prompts),
                                  tuple(messages), "" if source is _MISSING or source is None else str(source),
                                  {} if extra is _MISSING or extra is None else extra))
    if not prompts:
        raise DataError(f"{spec_field}.uri: {path} holds no prompts")
    for name, count in absent.items():
        if count == len(prompts) and name in must_match:
            raise DataError(f"{spec_field}.uri: {path}: no row has field {optional[name]!r} (spec.data.{name}); "
                            f"the rows' fields are {sorted(fields)[:50]} (a dotted path reaches nested ones)")
        # Metadata fields absent from every row are simply not used by this data set (kuberl's own
        # tiny data has none): no warning. A field some rows lack, or an answer no row has, is worth one.
        if count and not (count == len(prompts) and name in ("dataSourceField", "extraInfoField")):
            log.warning("%s.uri: %s: %d of %d rows have no field %r (spec.data.%s)", spec_field, path, count,
                        len(prompts), optional[name], name)
    return prompts


# The optional fields of spec.data, by their names in the spec and in DataSpec.
OPTIONAL_FIELDS = {"answerField": "answer_field", "dataSourceField": "data_source_field",
                   "extraInfoField": "extra_info_field"}


def fields_that_must_match(spec) -> tuple[str, ...]:
    """The optional fields of ``spec.data`` (``spec`` an RLTrainingJobSpec) that some row must have:
    every one given a name other than its default (a typo must not read as "absent from every row"),
    and the answer whenever a built-in reward scores against it."""
    named = [name for name, attr in OPTIONAL_FIELDS.items()
             if getattr(spec.data, attr) != DataSpec.model_fields[attr].default]
    if spec.agent is None and spec.reward.builtin is not None and "answerField" not in named:
        named.append("answerField")
    return tuple(named)


def load_for_spec(path: str | Path, spec, *, spec_field: str = "spec.data") -> list[Prompt]:
    """``load_prompts`` with the field names, template and system prompt of ``spec.data`` (``spec``
    an RLTrainingJobSpec), and ``fields_that_must_match(spec)``."""
    data = spec.data
    return load_prompts(path, prompt_field=data.prompt_field, answer_field=data.answer_field, fmt=data.format,
                        system_prompt=data.system_prompt, prompt_template=data.prompt_template,
                        data_source_field=data.data_source_field, extra_info_field=data.extra_info_field,
                        spec_field=spec_field, must_match=fields_that_must_match(spec))


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
