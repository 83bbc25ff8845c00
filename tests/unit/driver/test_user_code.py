"""The code a job names by import path (spec.reward.function, spec.agent.environment) is loaded
with pkgutil.resolve_name, and one that cannot be loaded is reported before any GPU time: by the
check-data init container (the worker image, before Ray starts) and by `kuberl train` before Ray,
engines or trainers."""

import sys

import pytest
import yaml

from kuberl.api.types import RewardSpec
from kuberl.api.validate import validate_manifest
from kuberl.common.reward_values import RewardError
from kuberl.driver.rewards import load_reward
from kuberl.job import plan as plans
from kuberl.rollout.agents.environment import AgentError, load_environment
from tests.unit.api.bad_manifests import minimal_manifest


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    """A module directory on sys.path, as a worker image's site-packages would be."""
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "my_rewards.py").write_text("def score(batch):\n    return [0.0 for _ in batch]\nLIMIT = 3\n")
    (tmp_path / "broken_rewards.py").write_text("import json\nBAD = json.no_such_thing\n")
    yield tmp_path
    for name in ("my_rewards", "broken_rewards"):
        sys.modules.pop(name, None)


def test_reward_functions_and_environments_load_by_import_path(user_modules):
    assert load_reward(RewardSpec(function="my_rewards:score")).__name__ == "score"
    with pytest.raises(RewardError, match=r"spec.reward.function: cannot import 'no_such_rewards' .* install "
                                          r"the module in the worker image or fix the module path before ':'"):
        load_reward(RewardSpec(function="no_such_rewards:score"))
    with pytest.raises(RewardError, match=r"spec.reward.function: 'my_rewards' has no function 'scor'; "
                                          r"fix the name after ':'"):
        load_reward(RewardSpec(function="my_rewards:scor"))
    with pytest.raises(RewardError, match=r"spec.reward.function: my_rewards:LIMIT is a int, not a function"):
        load_reward(RewardSpec(function="my_rewards:LIMIT"))
    # The module's own AttributeError is its failure, not a missing name.
    with pytest.raises(RewardError, match=r"importing 'broken_rewards' failed: AttributeError: .*no_such_thing"):
        load_reward(RewardSpec(function="broken_rewards:score"))
    with pytest.raises(AgentError, match=r"spec.agent.environment: kuberl.rollout.agents.calculator:evaluate is a "
                                         r"function, not a class"):
        load_environment("kuberl.rollout.agents.calculator:evaluate")


def test_a_source_directory_goes_first_on_sys_path_and_errors_name_the_source_and_the_key(tmp_path, monkeypatch):
    """A mounted ConfigMap as the kubelet writes it (files plus its hidden ..data entries)."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "cm_rewards", raising=False)
    mounted = tmp_path / "reward"
    mounted.mkdir()
    (mounted / "cm_rewards.py").write_text("def score(batch):\n    return [1.0 for _ in batch]\n")
    (mounted / "..data").mkdir()
    source = {"configMap": {"name": "rewards", "key": "cm_rewards.py"}}
    spec = RewardSpec(function="cm_rewards:score", source=source)
    assert load_reward(spec, str(mounted))([None]) == [1.0]
    assert sys.path[0] == str(mounted)
    missing_key = RewardSpec(function="cm_rewards:score", source={"configMap": {"name": "rewards", "key": "r.py"}})
    with pytest.raises(RewardError, match=r"^spec.reward.source.configMap.key: ConfigMap rewards has no key 'r.py' "
                                          r"\(its keys: cm_rewards.py\); add the key or fix the name$"):
        load_reward(missing_key, str(mounted))
    with pytest.raises(RewardError, match=r"spec.reward.function: cannot import 'other' from spec.reward.source "
                                          r"\(ConfigMap rewards key cm_rewards.py, at .*reward\) .*add the module "
                                          r"to the source"):
        load_reward(RewardSpec(function="other:score", source=source), str(mounted))
    # kuberl train has no ConfigMaps: the plan gives no directory, and the error says what to use.
    with pytest.raises(RewardError, match=r"spec.reward.source: the code of ConfigMap rewards .* is not at None .*"
                                          r"kuberl train needs source.uri"):
        load_reward(spec, None)


def _config(tmp_path, spec: dict) -> str:
    manifest = minimal_manifest("user-code")
    manifest["spec"].update(spec)
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(manifest))
    return str(path)


@pytest.mark.parametrize("spec,needle", [
    ({"agent": {"environment": "no_such_envs:Env"}}, "spec.agent.environment: cannot import 'no_such_envs'"),
    ({"agent": {"environment": "kuberl.rollout.agents.calculator:Calculater"}},
     "spec.agent.environment: 'kuberl.rollout.agents.calculator' has no class 'Calculater'"),
    ({"reward": {"function": "no_such_rewards:score"}}, "spec.reward.function: cannot import 'no_such_rewards'"),
])
def test_check_data_refuses_code_that_cannot_be_loaded_before_ray_starts(tmp_path, capsys, spec, needle):
    from kuberl.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "q", "answer": "1"}\n')
    assert main(["check-data", "--config", _config(tmp_path, spec), str(data)]) == 1
    assert needle in capsys.readouterr().err
    # The validation file's check (same job) is about the file only.
    assert main(["check-data", "--validation", "--config", _config(tmp_path, spec), str(data)]) == 0


class RecordingReporter:
    """Stands in for the Kubernetes status reporter (whose patches of the real API server
    tests/cluster/driver/test_report.py checks): records what the driver reports as status.workloadError."""

    def __init__(self):
        self.failures = []

    def failed(self, attempt, reason, message):
        self.failures.append((attempt, reason, message))


def _ray_running() -> bool:
    """Without importing Ray: the check runs where Ray is not installed, too."""
    ray = sys.modules.get("ray")
    return ray is not None and ray.is_initialized()


def test_kuberl_train_reports_a_missing_environment_class_before_ray_engines_or_trainers(tmp_path, monkeypatch):
    from kuberl.driver import __main__ as train
    from kuberl.driver import report
    from kuberl.train import group

    if _ray_running():
        pytest.skip("Ray already runs in this process; the check is that this run starts none")
    reporter = RecordingReporter()
    monkeypatch.setattr(report, "reporter_from_env", lambda: reporter)
    monkeypatch.setattr(group, "TrainerGroup", lambda *a, **k: pytest.fail("a trainer started"))
    manifest = minimal_manifest("user-code")
    manifest["spec"]["model"]["uri"] = str(tmp_path / "model")
    manifest["spec"]["agent"] = {"environment": "my_envs.search:SearchEnv"}
    job = validate_manifest(manifest)
    with pytest.raises(AgentError, match="spec.agent.environment: cannot import 'my_envs.search'"):
        train.run(job, plans.local(job, tmp_path / "work", attempt=2))
    assert not _ray_running()
    ((attempt, reason, message),) = reporter.failures
    assert (attempt, reason) == (2, "AgentFailed")
    assert message.startswith("spec.agent.environment: cannot import 'my_envs.search'")
    assert "install the module in the worker image or fix the module path" in message


def test_kuberl_train_refuses_a_source_uri_whose_digest_differs_before_ray(tmp_path, monkeypatch):
    """kuberl train fetches source.uri (a local file here) as the stager does in a pod."""
    from kuberl.driver import __main__ as train
    from kuberl.driver import report

    if _ray_running():
        pytest.skip("Ray already runs in this process; the check is that this run starts none")
    reporter = RecordingReporter()
    monkeypatch.setattr(report, "reporter_from_env", lambda: reporter)
    (tmp_path / "my_rewards.py").write_text("def score(batch):\n    return [1.0] * len(batch)\n")
    manifest = minimal_manifest("user-code")
    manifest["spec"]["reward"] = {"function": "my_rewards:score",
                                  "source": {"uri": str(tmp_path / "my_rewards.py"), "sha256": "0" * 64}}
    job = validate_manifest(manifest)
    with pytest.raises(RewardError, match=r"^spec.reward.source.sha256: .*my_rewards.py has sha256 [0-9a-f]{64}, "
                                          r"the job pins 0{64}"):
        train.run(job, plans.local(job, tmp_path / "work"))
    assert not _ray_running() and not (tmp_path / "work" / "code" / "reward").exists()
    ((_, reason, _),) = reporter.failures
    assert reason == "RewardFunctionFailed"
