"""The order in which the driver starts the trainer group and the engine pool
(``kuberl.driver.__main__.start_trainer_and_engines``). Recording stand-ins: what is checked is the
order of the calls, which the real parts do not record; the real ones start in every
tests/engine/driver run."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import pytest

from kuberl.driver.__main__ import start_trainer_and_engines


def parts(calls: list, *, trainer_fails: bool = False, engines_fail: bool = False):
    class Trainer:
        gpu_slots = [("node", "0")]

        def __init__(self, spec, plan):
            calls.append("trainer starts")
            if trainer_fails:
                raise RuntimeError("no trainer")

        def shutdown(self):
            calls.append("trainer shutdown")

    class Engines:
        def __init__(self, spec, plan, *, served_model_name, gpu_slots=None, wait=True):
            calls.append(f"engines start (wait={wait}, gpu_slots={gpu_slots})")

        def wait_ready(self):
            calls.append("engines ready")
            if engines_fail:
                raise RuntimeError("no engine")

        def shutdown(self):
            calls.append("engines shutdown")

    return Trainer, Engines


SPEC = SimpleNamespace(model=SimpleNamespace(uri="s3://models/tiny"))


def plan(colocated: bool):
    return SimpleNamespace(layout=SimpleNamespace(colocated=colocated))


def test_engines_start_first_and_the_trainer_ranks_beside_them():
    calls = []
    with contextlib.ExitStack() as stack:
        start_trainer_and_engines(SPEC, plan(False), stack, *parts(calls))
        assert calls == ["engines start (wait=False, gpu_slots=None)", "trainer starts", "engines ready"]
    assert calls[3:] == ["trainer shutdown", "engines shutdown"]


def test_colocated_engines_start_after_the_ranks_whose_gpus_they_share():
    calls = []
    with contextlib.ExitStack() as stack:
        start_trainer_and_engines(SPEC, plan(True), stack, *parts(calls))
    assert calls == ["trainer starts", "engines start (wait=True, gpu_slots=[('node', '0')])",
                     "engines shutdown", "trainer shutdown"]


@pytest.mark.parametrize("failing", ["trainer", "engines"])
def test_a_failed_start_stops_the_other_part(failing):
    calls = []
    with pytest.raises(RuntimeError), contextlib.ExitStack() as stack:
        start_trainer_and_engines(SPEC, plan(False), stack,
                                  *parts(calls, trainer_fails=failing == "trainer", engines_fail=failing == "engines"))
    assert "engines shutdown" in calls
    assert ("trainer shutdown" in calls) == (failing == "engines")
