"""README.md's fresh-machine commands are what CI runs."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _commands() -> list[str]:
    return re.findall(r"```bash\n(.+?)\n```", (REPO / "README.md").read_text())


def test_readme_starts_with_the_two_fresh_machine_commands():
    run_main, run_tests = _commands()[:2]
    assert run_main.startswith("bash .ci/setup && ")
    assert run_tests.startswith("bash .ci/setup --tests && ")


def test_ci_runs_the_readme_test_command():
    run_tests = _commands()[1]
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert run_tests in ci
