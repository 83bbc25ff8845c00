"""A small Dockerfile reader: instructions with continuation lines joined, comments and parser
directives dropped, grouped into build stages."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class Instruction:
    line: int
    keyword: str
    args: str


@dataclass
class Stage:
    image: str
    alias: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def instructions(path: Path) -> list[Instruction]:
    result, pending, start = [], "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue  # comments inside a continued instruction are dropped by Docker too
        if not pending:
            start = number
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        text = pending + line
        pending = ""
        keyword, _, args = text.partition(" ")
        result.append(Instruction(start, keyword.upper(), args.strip()))
    assert not pending, f"{path}: file ends inside a continued instruction"
    return result


def global_args(path: Path) -> dict[str, str]:
    """The ARGs before the first FROM, with their defaults (what `${NAME}` in a FROM means)."""
    result = {}
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            break
        if instruction.keyword == "ARG":
            name, _, default = instruction.args.partition("=")
            result[name.strip()] = default.strip()
    return result


def stages(path: Path) -> list[Stage]:
    """Build stages; a FROM's `${ARG}` is replaced by that global ARG's default."""
    defaults = global_args(path)
    result: list[Stage] = []
    for instruction in instructions(path):
        if instruction.keyword == "FROM":
            words = [w for w in instruction.args.split() if not w.startswith("--")]
            alias = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            image = re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: defaults[m.group(1) or m.group(2)], words[0])
            result.append(Stage(image, alias))
        elif not result and instruction.keyword == "ARG":
            continue  # a global ARG (global_args)
        else:
            assert result, f"{path}:{instruction.line}: {instruction.keyword} before FROM"
            result[-1].instructions.append(instruction)
    return result


def copy_sources(instruction: Instruction) -> list[str]:
    """Source paths of a COPY/ADD (shell or JSON form), without its --flags; [] for --from copies."""
    args = instruction.args
    if args.startswith("["):
        import json
        words = json.loads(args)
    else:
        words = shlex.split(args)
    if any(w.startswith("--from") for w in words):
        return []
    words = [w for w in words if not w.startswith("--")]
    return words[:-1]


PINNED_TAG = re.compile(r":[^:/@]*\d+\.\d+\.\d+[^:/@]*$")


def is_pinned(image: str) -> bool:
    """A digest, or an exact version tag (x.y.z); never a floating tag such as `latest` or `3.11`."""
    return "@sha256:" in image or bool(PINNED_TAG.search(image))
