"""`python -m kuberl.cli check-data` as the head pod's init container runs it: a process of its own,
whose exit status and stderr are all the operator sees. The cases themselves run in process in
tests/unit/driver/test_data_and_rewards.py; here the entry point, its logging and its exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from kuberl.api.types import RLTrainingJobSpec
from tests.harness.harness import REPO_ROOT


def _check_data(tmp_path, rows: bytes) -> subprocess.CompletedProcess:
    config, data = tmp_path / "job.yaml", tmp_path / "d.jsonl"
    spec = RLTrainingJobSpec.model_validate({"image": "i", "model": {"uri": "/m"}, "data": {"uri": "s3://bucket/d"}})
    config.write_text(yaml.safe_dump({"apiVersion": "kuberl.dev/v1alpha1", "kind": "RLTrainingJob",
                                      "metadata": {"name": "j"},
                                      "spec": spec.model_dump(mode="json", by_alias=True, exclude_none=True)}))
    data.write_bytes(rows)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "workloads"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kuberl.cli", "check-data", "--config", str(config), str(data)],
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("rows, code, needle", [
    # Deeper than the interpreter's own stack would go: one message, not a crash.
    (b'{"prompt": "q", "answer": "1"}\n{"prompt": "q", "answer": ' + b"[" * 100000 + b"]" * 100000 + b"}\n",
     1, "d.jsonl:2: nested too deeply to parse"),
    # A warning reaches stderr through the command's own logging set-up, and the data passes.
    ((json.dumps({"prompt": "q", "answer": "1"}) + "\n" + json.dumps({"prompt": "r"}) + "\n").encode(),
     0, "warning: spec.data.uri"),
], ids=["refused", "warned"])
def test_the_command_exits_with_one_message_and_no_traceback(tmp_path, rows, code, needle):
    result = _check_data(tmp_path, rows)
    assert result.returncode == code, (result.stdout, result.stderr)
    assert needle in result.stderr and "Traceback" not in result.stderr, result.stderr
