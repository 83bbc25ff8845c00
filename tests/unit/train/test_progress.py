"""What a local `kuberl train` shows on its console (kuberl.driver.progress): pure, no Ray or vLLM."""

import io
import logging
import os
import subprocess
import sys

import pytest

from kuberl.driver import progress


@pytest.mark.parametrize(("seconds", "shown"), [
    (None, "?"), (0, "0s"), (44.6, "45s"), (60, "1m00s"), (185, "3m05s"), (3599, "59m59s"),
    (3600, "1h00m"), (7440, "2h04m")])
def test_format_duration(seconds, shown):
    assert progress.format_duration(seconds) == shown


def test_eta_is_the_mean_pace_of_the_timed_steps_times_the_steps_left():
    assert progress.eta_seconds(0, 0.0, 39) is None
    assert progress.eta_seconds(4, 10.0, 36) == 90.0
    assert progress.eta_seconds(4, 10.0, 0) == 0.0


def test_step_line():
    assert progress.step_line(3, 40, 0.45312, 812.34, 80) == "step 3/40 reward 0.4531 tokens/s 812.3 eta 1m20s"
    assert progress.step_line(1, 40, None, None, None) == "step 1/40 reward n/a tokens/s n/a eta ?"


@pytest.mark.parametrize(("verbose", "in_ray_job", "is_tty", "mode"), [
    (False, False, True, progress.BAR), (False, False, False, progress.LINES),
    (True, False, True, progress.LOGS), (True, False, False, progress.LOGS),
    # A RayJob's pod: KubeRay keeps stdout as the pod's logs, whatever the terminal.
    (False, True, True, progress.LOGS), (False, True, False, progress.LOGS)])
def test_console_mode(verbose, in_ray_job, is_tty, mode):
    assert progress.console_mode(verbose=verbose, in_ray_job=in_ray_job, is_tty=is_tty) == mode


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_lines_time_the_eta_from_the_first_step_and_to_the_runs_last():
    console, clock = io.StringIO(), Clock()
    display = progress.Display(console, bar=False, clock=clock)
    display.start(10, 40, 20)  # resumed at step 10, --max-steps 10
    display.step(11, 40, 0.1, 50.0)
    clock.now += 6
    display.step(12, 40, 0.2, 60.0)
    display.event("checkpoint step 12 saved: /c/step-000000012")
    assert console.getvalue().splitlines() == [
        "step 11/40 reward 0.1000 tokens/s 50.0 eta ?",
        "step 12/40 reward 0.2000 tokens/s 60.0 eta 48s",
        "checkpoint step 12 saved: /c/step-000000012"]


def test_bar_shows_step_reward_tokens_eta_and_events_on_lines_of_their_own():
    console, clock = io.StringIO(), Clock()
    display = progress.Display(console, bar=True, clock=clock)
    display.start(0, 40, 40)
    display.step(1, 40, 0.25, 100.0)
    clock.now += 2
    display.step(2, 40, 0.5, 120.0)
    display.event("resumed from /c/step-000000010 (step 10)")
    display.close()
    out = console.getvalue()
    assert "2/40, reward 0.5000 tokens/s 120.0 eta 1m16s" in out
    assert "\rresumed from /c/step-000000010 (step 10)\n" in out  # over the bar, which is then redrawn


def test_reporter_logs_and_shows_the_checkpoint_events(caplog):
    console = io.StringIO()
    reporter = progress.ConsoleReporter(progress.Display(console, bar=False))
    with caplog.at_level(logging.INFO, logger="kuberl.train"):
        reporter.resumed("s3://b/run/step-000000010", 10)
        reporter.validation(10, 0.5)
        reporter.checkpoint("s3://b/run/step-000000020", 20)
    assert console.getvalue().splitlines() == [
        "resumed from s3://b/run/step-000000010 (step 10)", "validation at step 10: reward 0.5000",
        "checkpoint step 20 saved: s3://b/run/step-000000020"]
    # The log file keeps the lines the driver always logged.
    assert [r.getMessage() for r in caplog.records] == [
        "resumed from s3://b/run/step-000000010 (step 10)", "validation at step 10: reward 0.5000",
        "checkpoint step 20 complete: s3://b/run/step-000000020"]


def test_console_handler_shows_kuberls_warnings_and_every_error_only():
    console = io.StringIO()
    handler = progress.ConsoleHandler(progress.Display(console, bar=False))
    for name, level, message in [("kuberl.train", logging.INFO, "checkpoint step 1 started"),
                                 ("kuberl.train", logging.WARNING, "SIGTERM: finishing the step"),
                                 ("vllm.engine", logging.WARNING, "pin memory unavailable"),
                                 ("ray", logging.ERROR, "actor died")]:
        handler.handle(logging.LogRecord(name, level, __file__, 1, message, None, None))
    assert console.getvalue().splitlines() == ["WARNING kuberl.train: SIGTERM: finishing the step",
                                               "ERROR ray: actor died"]


def test_logs_to_file_takes_fd_1_and_2_from_this_process_and_its_children(tmp_path, capfd):
    path = tmp_path / "runs" / "job" / progress.LOG_FILE
    with progress.logs_to_file(path) as console:
        os.write(1, b"native stdout\n")
        os.write(2, b"native stderr\n")
        subprocess.run([sys.executable, "-c", "print('a child, as Ray starts them')"], check=True)
        print("step 1/40 shown", file=console)
    out, err = capfd.readouterr()
    assert (out, err) == ("step 1/40 shown\n", "")
    assert path.read_text().splitlines()[1:] == ["native stdout", "native stderr", "a child, as Ray starts them"]
    with progress.logs_to_file(path):  # a rerun appends: the run before's log stays
        os.write(1, b"second run\n")
    assert path.read_text().count("==== kuberl train") == 2 and "native stdout" in path.read_text()


def test_logs_to_file_writes_an_error_there_and_leaves_it_to_the_console(tmp_path, capfd):
    path = tmp_path / progress.LOG_FILE
    with pytest.raises(RuntimeError, match="engine died"), progress.logs_to_file(path):
        raise RuntimeError("engine died")
    assert "RuntimeError: engine died" in path.read_text()
    # Back on the console: pytest (or, in kuberl train, Python itself) prints what propagates.
    os.write(2, b"console again\n")
    assert capfd.readouterr().err == "console again\n"


def test_logs_to_file_names_an_unwritable_path_and_the_fix(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SystemExit, match=r"cannot write the log file .*a-file/kuberl-train.log: .*--work-dir.*-v"):
        with progress.logs_to_file(tmp_path / "a-file" / progress.LOG_FILE):
            pass
