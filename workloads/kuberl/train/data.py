"""Training prompts: loaded from jsonl/parquet (a file or a directory of them), served in a
deterministic order that depends only on (seed, step), so a resumed run sees exactly the prompts
an uninterrupted one would."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class DataError(ValueError):
    """The data set cannot be used; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Prompt:
    text: str
    answer: Any
    index: int  # position in the data set


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


def load_prompts(path: str | Path, *, prompt_field: str = "prompt", answer_field: str = "answer",
                 fmt: str = "auto") -> list[Prompt]:
    prompts = []
    for file in _files(Path(path), fmt):
        for where, row in _rows(file, fmt):
            if prompt_field not in row:
                raise DataError(f"{where}: no field {prompt_field!r} (spec.data.promptField); "
                                f"fields are {sorted(row)}")
            if not isinstance(row[prompt_field], str) or not row[prompt_field]:
                raise DataError(f"{where}: field {prompt_field!r} must be a non-empty string")
            prompts.append(Prompt(row[prompt_field], row.get(answer_field), len(prompts)))
    if not prompts:
        raise DataError(f"spec.data.uri: {path} holds no prompts")
    return prompts


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

    def batch(self, step: int, size: int) -> list[Prompt]:
        start = step * size
        out = []
        for position in range(start, start + size):
            epoch, offset = divmod(position, len(self.prompts))
            out.append(self.prompts[self._order(epoch)[offset]])
        return out
