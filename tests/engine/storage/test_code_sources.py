"""The job's own code from a URI (spec.reward.source.uri, kuberl stage --sha256) against moto's S3
server: fetched, checked against the pinned sha256, unpacked through kuberl.storage.archive, and
imported from the staged directory; a wrong digest or a hostile archive leaves nothing behind."""

import hashlib
import sys

import pytest

from kuberl.api.types import RewardSpec
from kuberl.cli.stage import main as stage_main
from kuberl.driver.rewards import RewardInput, load_reward
from kuberl.storage import StorageError
from kuberl.storage.code import stage_code
from tests.shared.archives import tar_of


PACKAGE = tar_of({"staged_rewards/__init__.py": b"",
                "staged_rewards/score.py": b"def exact(batch):\n    return [float(x.response == x.answer) for x in batch]\n"})


def test_a_pinned_tar_is_staged_and_its_module_scores(s3, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys, "path", list(sys.path))
    fs, bucket = s3
    fs.pipe({f"{bucket}/code/rewards.tar": PACKAGE})
    uri, digest = f"s3://{bucket}/code/rewards.tar", hashlib.sha256(PACKAGE).hexdigest()
    dst = tmp_path / "code" / "reward"
    assert stage_main(["--sha256", digest, "--field", "spec.reward.source", uri, str(dst)]) == 0
    assert (dst / "staged_rewards" / "score.py").is_file()
    spec = RewardSpec(function="staged_rewards.score:exact", source={"uri": uri, "sha256": digest})
    try:
        fn = load_reward(spec, str(dst))
        assert fn([RewardInput(prompt="", response="a", answer="a"),
                   RewardInput(prompt="", response="b", answer="a")]) == [1.0, 0.0]
    finally:
        for name in ("staged_rewards", "staged_rewards.score"):
            sys.modules.pop(name, None)


def test_a_wrong_digest_is_refused_naming_the_field_and_both_digests(s3, tmp_path, capsys):
    fs, bucket = s3
    fs.pipe({f"{bucket}/code/my_rewards.py": b"def score(batch):\n    return [1.0] * len(batch)\n"})
    pinned = hashlib.sha256(b"what was reviewed").hexdigest()
    got = hashlib.sha256(b"def score(batch):\n    return [1.0] * len(batch)\n").hexdigest()
    dst = tmp_path / "reward"
    assert stage_main(["--sha256", pinned, "--field", "spec.reward.source",
                       f"s3://{bucket}/code/my_rewards.py", str(dst)]) == 1
    err = capsys.readouterr().err
    assert f"spec.reward.source.sha256: s3://{bucket}/code/my_rewards.py has sha256 {got}, the job pins {pinned}" in err
    assert not dst.exists() and list(tmp_path.iterdir()) == []  # nothing of the unpinned bytes is left


@pytest.mark.parametrize("members, problem", [
    ({"../escape.py": b"x = 1\n"}, "escape.py"),
    ({"a/../../escape.py": b"x = 1\n"}, "outside the destination"),
])
def test_an_archive_that_climbs_out_is_refused_even_when_pinned(s3, tmp_path, members, problem):
    fs, bucket = s3
    data = tar_of(members)
    fs.pipe({f"{bucket}/code/evil.tar": data})
    with pytest.raises(StorageError, match=problem):
        stage_code(f"s3://{bucket}/code/evil.tar", tmp_path / "code" / "reward", hashlib.sha256(data).hexdigest(),
                   field="spec.reward.source")
    assert list((tmp_path / "code").iterdir()) == [] and not (tmp_path / "escape.py").exists()
