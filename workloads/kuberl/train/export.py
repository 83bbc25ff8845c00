"""Hugging Face export: a directory ``from_pretrained`` can load, remote code included.

The trainer writes weights (safetensors), config, generation config and tokenizer
(``TrainerGroup.export_hf``). A ``trust_remote_code`` model also needs its own Python files: every
module an ``auto_map`` (in config.json or tokenizer_config.json) points at, and the files those
import. They are copied from the source model; one that is missing fails the export loudly, since
an export without it cannot be reloaded.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path
from typing import Any

log = logging.getLogger("kuberl.train")
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.([A-Za-z_][A-Za-z0-9_]*)\s+import", re.MULTILINE)


class ExportError(RuntimeError):
    """The export would not reload; the message names the missing artifact."""


def _auto_map_modules(directory: Path) -> set[str]:
    modules = set()
    for name in ("config.json", "tokenizer_config.json"):
        path = directory / name
        if not path.exists():
            continue
        auto_map = json.loads(path.read_text()).get("auto_map", {})
        for value in auto_map.values():
            for ref in value if isinstance(value, list) else [value]:
                if ref:
                    # "module.Class" or "org/repo--module.Class" (code in another repo: not ours to copy).
                    if "--" in ref:
                        continue
                    modules.add(ref.rsplit(".", 1)[0])
    return modules


def copy_remote_code(source: Path, dest: Path) -> list[str]:
    """Copy every remote-code module ``source``'s auto_map needs (and what they import relatively)."""
    source, dest = Path(source), Path(dest)
    pending = sorted(_auto_map_modules(source))
    copied: list[str] = []
    while pending:
        module = pending.pop()
        file = f"{module}.py"
        if file in copied:
            continue
        src = source / file
        if not src.is_file():
            raise ExportError(f"the model's auto_map needs {file}, which is not in {source}: "
                              f"the export could not be reloaded with trust_remote_code")
        shutil.copy2(src, dest / file)
        copied.append(file)
        pending += _RELATIVE_IMPORT.findall(src.read_text())
    return sorted(copied)


def export_hugging_face(trainer: Any, model_path: str | Path, spec: Any, out_dir: Path, name: str = "hf") -> str:
    """Export the trained model to ``out_dir`` and, when the job has a checkpoint URI, upload it
    to ``<checkpoint.uri>/<name>`` (periodic exports: ``hf-step-<n>``). Returns where it is."""
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    trainer.export_hf(str(out_dir))
    copied = copy_remote_code(Path(model_path), out_dir)
    if copied:
        log.info("export: copied remote code %s", ", ".join(copied))
    if spec.checkpoint.uri is None:
        return str(out_dir)
    from kuberl.storage import upload_dir
    from kuberl.uri import parse

    target = parse(spec.checkpoint.uri, "spec.checkpoint.uri").join(name)
    upload_dir(out_dir, target)
    log.info("export: Hugging Face model at %s", target)
    return target
