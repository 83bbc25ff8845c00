"""``resolve(uri)``: one code path from a model URI to a local directory, for every model-loading
site (tokenizer, trainer, vLLM engine). Callers keep the original URI as the served model name."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kuberl.api.types import REMOTE_CODE_GLOBS
from kuberl.storage import filesystems
from kuberl.storage.errors import explain
from kuberl.storage.staging import stage
from kuberl.api.uri import parse, revision_problem



@contextmanager
def resolve(uri: str, *, revision: str | None = None, trust_remote_code: bool = False,
            cache_dir: str | Path | None = None) -> Iterator[str]:
    """Yield a local directory holding ``uri``.

    - absolute paths and ``pvc://claim/path`` (mounted at ``$KUBERL_PVC_ROOT/claim``, default
      ``/mnt/pvc``) pass through without copying; their symlinks may not lead out of the source
      (or its claim: ``filesystems.check_containment``);
    - ``hf://org/name[@rev]`` and bare ids such as ``Qwen/Qwen2.5-1.5B-Instruct`` go through
      huggingface_hub's snapshot_download (its cache, ``cache_dir`` if given);
    - ``s3://`` and ``gs://`` are staged into a temporary directory (under ``cache_dir`` if given)
      that is removed on exit, also when the body raises.
    """
    parsed = parse(uri, "model")
    if revision is not None and not parsed.info.hub:
        raise ValueError(f"{uri}: revision={revision!r} applies only to Hugging Face sources; "
                         f"put the version in the path instead")
    if revision is not None and (problem := revision_problem(revision)):
        raise ValueError(f"{uri}: revision {revision!r} {problem}")
    exclude = () if trust_remote_code else REMOTE_CODE_GLOBS
    if parsed.info.on_disk is not None:
        path = filesystems.local_path(parsed)
        if not path.exists():
            hint = (f" (is claim {parsed.bucket!r} mounted at {filesystems.pvc_root()}/"
                    f"{parsed.bucket}? KUBERL_PVC_ROOT sets the mount root)"
                    if parsed.info.mounted else "")
            raise FileNotFoundError(f"{uri}: {path} does not exist{hint}")
        filesystems.check_containment(path, uri)
        yield str(path)
        return
    if parsed.info.hub:
        from huggingface_hub import snapshot_download

        try:
            path = snapshot_download(parsed.bucket, revision=revision or parsed.revision,
                                     cache_dir=cache_dir, ignore_patterns=list(exclude) or None)
        except Exception as exc:  # noqa: BLE001 - turned into a message naming the URI
            raise explain(exc, uri) from exc
        yield path
        return
    if cache_dir is not None:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kuberl-model-", dir=cache_dir)
    try:
        stage(uri, tmp, exclude=exclude)
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
