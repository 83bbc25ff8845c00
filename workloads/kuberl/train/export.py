"""Hugging Face export: a directory ``from_pretrained`` can load, remote code included.

The trainer writes weights (safetensors), config, generation config and tokenizer
(``TrainerGroup.export_hf``). A ``trust_remote_code`` model also needs its own Python files: every
module an ``auto_map`` (in config.json or tokenizer_config.json) points at, and the files those
import. They are copied from the source model; one that is missing fails the export loudly, since
an export without it cannot be reloaded. Without ``trustRemoteCode`` no Python file is copied (the
stager never fetched them): the model loaded with transformers' own classes, and so does the export.

An ``auto_map`` entry names a module (``module.Class``), never a path: a module name that is not a
Python identifier (``../x``, ``a/b``) is refused, so the copy cannot read or write outside the
model and export directories.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

log = logging.getLogger("kuberl.train")
_RELATIVE_IMPORT = re.compile(r"^\s*from\s+\.([A-Za-z_][A-Za-z0-9_]*)\s+import", re.MULTILINE)
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


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
                # "module.Class", or "org/repo--module.Class" (code in another repo: not ours to copy).
                if ref is None or (isinstance(ref, str) and "--" in ref):
                    continue
                module, _, cls = str(ref).rpartition(".")
                if not (_MODULE.match(module) and _MODULE.match(cls)):
                    raise ExportError(f"{path}: auto_map entry {ref!r} is not module.Class with a Python "
                                      f"module name; refusing to copy remote code for it")
                modules.add(module)
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


def publish_export(out_dir: Path, model_path: str | Path, target_uri: str, *, trust_remote_code: bool) -> str:
    """Rank 0, once the trainer wrote the model to ``out_dir``: add the model's remote code (only
    with ``trustRemoteCode``: otherwise the stager never fetched it and no Python file is copied)
    and upload the directory to ``target_uri``. Returns ``target_uri``."""
    from kuberl.storage import upload_dir

    copied = copy_remote_code(Path(model_path), Path(out_dir)) if trust_remote_code else []
    if copied:
        log.info("export: copied remote code %s", ", ".join(copied))
    upload_dir(out_dir, target_uri)
    log.info("export: Hugging Face model at %s", target_uri)
    return target_uri
