"""resolve(): one path from a model URI to a local directory, cleaned up on failure."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kuberl.storage import StorageError, resolve

REPO = Path(__file__).resolve().parents[3]


def test_local_path_passes_through(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with resolve(str(tmp_path)) as path:
        assert path == str(tmp_path)
    assert (tmp_path / "config.json").exists()  # never copied, never deleted


def test_pvc_maps_to_its_mount(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBERL_PVC_ROOT", str(tmp_path))
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    with resolve("pvc://models/qwen") as path:
        assert path == str(tmp_path / "models" / "qwen")
    with pytest.raises(FileNotFoundError, match="pvc://models/absent.*KUBERL_PVC_ROOT"):
        with resolve("pvc://models/absent"):
            pass


def test_revision_only_for_hf(tmp_path):
    with pytest.raises(ValueError, match="revision"):
        with resolve(str(tmp_path), revision="main"):
            pass


def test_s3_temp_dir_removed_even_when_the_body_raises(s3, tmp_path):
    fs, bucket = s3
    fs.pipe_file(f"{bucket}/m/config.json", b"{}")
    fs.pipe_file(f"{bucket}/m/modeling_evil.py", b"import os")
    seen = []
    with pytest.raises(RuntimeError, match="engine failed"):
        with resolve(f"s3://{bucket}/m", cache_dir=tmp_path / "cache") as path:
            seen.append(path)
            assert (Path(path) / "config.json").read_bytes() == b"{}"
            # Without trust_remote_code the repo's Python files are not fetched at all.
            assert not (Path(path) / "modeling_evil.py").exists()
            raise RuntimeError("engine failed to start")
    assert seen and not Path(seen[0]).exists()
    with resolve(f"s3://{bucket}/m", trust_remote_code=True) as path:
        assert (Path(path) / "modeling_evil.py").exists()
    assert not Path(path).exists()


def test_s3_missing_raises_storage_error_naming_uri(s3):
    fs, bucket = s3
    with pytest.raises(StorageError, match=f"s3://{bucket}/absent"):
        with resolve(f"s3://{bucket}/absent"):
            pass


def _hf_cache(home: Path, repo: str, commit: str) -> Path:
    """The layout huggingface_hub's cache uses, as snapshot_download would leave it."""
    repo_dir = home / "hub" / f"models--{repo.replace('/', '--')}"
    snapshot = repo_dir / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text('{"model_type": "tiny"}')
    (repo_dir / "refs").mkdir()
    (repo_dir / "refs" / "main").write_text(commit)
    return snapshot


@pytest.mark.parametrize("uri", ["kuberl-test/Tiny-Model-0.5B", "hf://kuberl-test/Tiny-Model-0.5B",
                                 "hf://kuberl-test/Tiny-Model-0.5B@main"])
def test_bare_hf_id_resolves_through_snapshot_download(tmp_path, uri):
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = _hf_cache(tmp_path / "hf", "kuberl-test/Tiny-Model-0.5B", commit)
    # huggingface_hub reads HF_HUB_OFFLINE at import, so this runs in a fresh interpreter; the
    # hub cannot be reached from the tests, the cache written above stands in for it.
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO / "workloads")}
    code = ("import sys\nfrom kuberl.storage import resolve\n"
            "with resolve(sys.argv[1]) as p: print(p)\n")
    out = subprocess.run([sys.executable, "-c", code, uri], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(snapshot)


def test_unknown_hf_id_is_a_storage_error_not_file_not_found(tmp_path):
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(REPO / "workloads")}
    code = ("from kuberl.storage import resolve, StorageError\n"
            "try:\n    with resolve('kuberl-test/absent'): pass\n"
            "except StorageError as e: print('StorageError', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("StorageError kuberl-test/absent: Hugging Face")


def test_revision_git_would_refuse_never_reaches_huggingface_hub(tmp_path):
    with pytest.raises(ValueError, match="git refuses such names"):
        with resolve("hf://org/model", revision="../../../../tmp/x", cache_dir=tmp_path):
            pass
    assert list(tmp_path.iterdir()) == []
