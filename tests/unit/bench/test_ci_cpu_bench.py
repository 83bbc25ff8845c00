"""bench/ci_cpu.py's parts: what names a process, and the CPU a run is charged, from a /proc tree
written by the test. The bench itself runs CI for an hour; docs/development.md has its numbers."""

from pathlib import Path

from tests.unit.bench.scripts import load_bench

bench = load_bench("ci_cpu.py")


def test_a_process_is_named_by_its_title_module_script_or_program():
    assert bench.kind(["ray::TrainerActor.step"], "ray::TrainerAct") == "ray::TrainerActor"
    assert bench.kind(["VLLM::Worker"], "VLLM::Worker") == "VLLM::Worker"
    assert bench.kind(["/opt/kuberl/bin/python", "-m", "kuberl.driver", "--config", "x"], "python") == \
        "python -m kuberl.driver"
    assert bench.kind(["/usr/bin/python3", "/v/lib/python3.11/site-packages/ray/dashboard/agent.py", "--x"],
                      "python3") == "python ray/dashboard/agent.py"
    assert bench.kind(["/root/.cache/kuberl/bin/kube-apiserver-v1.36.3", "--etcd-servers=x"],
                      "kube-apiserv") == "kube-apiserver"
    assert bench.kind(["/opt/kuberl/bin/python", "/opt/kuberl/bin/ray", "start", "--block"], "ray") == "python ray"
    assert bench.kind(["python", "-B", "-c", "from multiprocessing.spawn import spawn_main"], "python") == \
        "python -c from multiprocessing.spawn import spawn_main"
    assert bench.kind(["python", "bench/ci_cpu.py", "--", "python", "-m", "x"], "python") == "python bench/ci_cpu.py"
    assert bench.kind([], "kworker/0:1") == "[kworker/0:1]"


def _stat(pid: int, name: str, user: int, system: int, started: int) -> str:
    """A ``/proc/<pid>/stat`` line: the fields after the name, utime and stime the 12th and 13th,
    starttime the 20th."""
    fields = ["S"] + ["0"] * 10 + [str(user), str(system)] + ["0"] * 6 + [str(started)]
    return f"{pid} ({name}) " + " ".join(fields)


def test_a_name_with_spaces_and_parentheses_does_not_shift_the_fields():
    assert bench.process_ticks(_stat(42, "a) (b c", 150, 50, 12345)) == (200, "12345")


def _process(proc: Path, pid: int, argv: list[str], ticks: int, started: int = 1000) -> None:
    entry = proc / str(pid)
    entry.mkdir(exist_ok=True)
    (entry / "stat").write_text(_stat(pid, "x", ticks, 0, started))
    (entry / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (entry / "comm").write_text("x\n")


def test_a_run_is_charged_what_each_process_used_after_the_start(tmp_path):
    _process(tmp_path, 1, ["etcd"], ticks=5 * bench.TICKS_PER_SECOND)  # up before the run
    sampler = bench.Sampler(tmp_path)
    sampler.sample(baseline=True)
    _process(tmp_path, 1, ["etcd"], ticks=7 * bench.TICKS_PER_SECOND)
    _process(tmp_path, 2, ["/usr/bin/python3", "-B", "-c", "from multiprocessing.spawn import spawn_main"],
             ticks=3 * bench.TICKS_PER_SECOND)  # started during the run, then renames itself:
    sampler.sample()
    _process(tmp_path, 2, ["VLLM::EngineCore"], ticks=4 * bench.TICKS_PER_SECOND)
    _process(tmp_path, 3, ["etcd"], ticks=1 * bench.TICKS_PER_SECOND, started=2000)
    sampler.sample()
    assert sampler.seconds_by_kind() == {"etcd": 3.0, "VLLM::EngineCore": 4.0}
