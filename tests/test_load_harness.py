"""tests/load_harness.py counts right: a passing, a failing and a hanging target (written here),
the hang's stacks shown and its processes ended, also one in a session of its own, a run whose
tests ended within its limit but whose exit came after it, and the background load started and
ended. The harness calls run side by side in one module fixture: most of their time is waiting."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import load_harness

pytestmark = pytest.mark.slow

TARGETS = '''
import os, subprocess, sys, time


def _pids(name):
    return open(os.path.join(os.environ["PID_DIR"], name), "a")


def test_passes():
    assert sum(range(4)) == 6


def test_fails():
    print("the failure's own output")
    assert sum(range(4)) == 7


def test_hangs(tmp_path_factory):
    """Waits for a child in a session of its own, which sleeps: found by its environment, not its parent."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    with _pids("test_hangs") as f:
        f.write(f"{child.pid}\\n")
    child.wait()


def test_leaves_a_process_ending_soon():
    """Passes, leaving a child that ends by itself a moment later (as multiprocessing's resource tracker)."""
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1)"], start_new_session=True)


def test_ends_then_lingers_at_exit():
    """Passes at once; its process then takes 20 seconds to exit (a slow exit, not a hang)."""
    import atexit
    atexit.register(time.sleep, 20)


def test_ends_then_never_exits():
    """Passes at once; its process then takes 600 seconds to exit (a hang at exit)."""
    import atexit
    atexit.register(time.sleep, 600)


def test_leaves_a_process():
    """Passes, leaving a child behind in a session of its own (as a leaked worker would)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)  # left behind"],
                             start_new_session=True)
    with _pids("test_leaves_a_process") as f:
        f.write(f"{child.pid}\\n")
'''

#: each harness call the tests read: (target, runs, keyword arguments of run_many). They run side
#: by side (each waits on its own processes, found by a token of its own): the module takes as
#: long as its longest call, two hangs of 20 s, not the sum of every wait.
CALLS = {
    "passes": ("test_passes", 2, {"timeout": 120}),
    "fails": ("test_fails", 2, {"timeout": 120}),
    "hangs": ("test_hangs", 2, {"timeout": 20}),
    "under load": ("test_passes", 1, {"load": os.cpu_count() or 1, "nice": 19, "timeout": 120}),
    "leaves a process": ("test_leaves_a_process", 1, {"timeout": 120}),
    "a process ending soon": ("test_leaves_a_process_ending_soon", 1, {"timeout": 120}),
    "ends past its limit": ("test_ends_then_lingers_at_exit", 1, {"timeout": 15, "exit_grace": 60}),
    "never exits": ("test_ends_then_never_exits", 1, {"timeout": 15, "exit_grace": 1}),
}


def _gone(pid):
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().split(")")[-1].split()[0] == "Z"  # a zombie no one reaped yet
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every call of :data:`CALLS`, made at once; the pid files of the targets' children."""
    root = tmp_path_factory.mktemp("harness")
    targets = root / "test_targets.py"
    targets.write_text(TARGETS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PID_DIR", str(root))
        with ThreadPoolExecutor(max_workers=len(CALLS)) as pool:
            futures = {name: pool.submit(load_harness.run_many, f"{targets}::{target}", n, **kwargs)
                       for name, (target, n, kwargs) in CALLS.items()}
            done = {name: future.result() for name, future in futures.items()}
    return done, root


def test_passes_and_failures_are_counted_with_the_output_of_each_failure(reports):
    done, _ = reports
    assert [run.outcome for run in done["passes"].runs] == ["passed", "passed"]
    report = done["fails"]
    assert (report.count("failed"), report.count("passed"), report.count("hung")) == (2, 0, 0)
    text = load_harness.format_report(report)
    assert text.count("failed (exit status 1") == 2 and "the failure's own output" in text
    assert text.endswith("2 runs -> 0 passed, 2 failed, 0 hung (no background load; 0 runs left processes behind)")


def test_a_hang_is_counted_with_its_stacks_and_leaves_no_process(reports):
    done, root = reports
    report = done["hangs"]
    assert (report.count("hung"), report.count("passed"), report.count("failed")) == (2, 0, 0)
    for run in report.runs:
        assert "in test_hangs" in run.stacks  # the test's own process, stopped in the test
        assert 'File "<string>", line 1 in <module>' in run.stacks  # the child in a session of its own
    pids = [int(line) for line in (root / "test_hangs").read_text().split()]
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)


def test_the_load_runs_one_spinner_per_core_during_the_runs_and_ends_with_them(reports):
    spinners = load_harness.Load(2, nice=19)
    with spinners:
        procs = list(spinners.procs)
        assert len(procs) == 2 and all(proc.poll() is None for proc in procs)
    assert all(proc.returncode is not None for proc in procs)
    report = reports[0]["under load"]
    assert report.count("passed") == 1 and "spinning processes, nice 19" in report.load


def test_a_process_left_behind_is_counted_named_and_ended(reports):
    done, root = reports
    report = done["leaves a process"]
    (run,) = report.runs
    assert run.outcome == "passed" and run.leftovers == 1
    (pid,) = [int(line) for line in (root / "test_leaves_a_process").read_text().split()]
    assert run.left_behind[0].startswith(f"pid {pid} [") and "# left behind" in run.left_behind[0]
    assert _gone(pid) and report.summary().endswith("1 runs left processes behind)")


def test_a_process_ending_by_itself_within_the_grace_is_not_counted(reports):
    report = reports[0]["a process ending soon"]
    assert report.runs[0].outcome == "passed" and report.runs[0].leftovers == 0


def test_a_run_past_its_limit_whose_tests_had_ended_is_not_a_hang_unless_it_never_exits(reports):
    """The run's tests pass within the limit and its exit takes longer: given EXIT_GRACE more, it
    counts as passed (said to have ended past the limit); one that does not exit then is a hang at exit."""
    done, _ = reports
    report = done["ends past its limit"]
    (run,) = report.runs
    assert run.outcome == "passed" and run.seconds > 15 and run.ended.startswith("1 passed in ")
    assert "0 failed (1 ended past the limit, their tests done), 0 hung" in report.summary()
    report = done["never exits"]
    (run,) = report.runs
    assert run.outcome == "hung" and "test_ends_then_never_exits" not in run.stacks
    assert "its tests had ended (1 passed in " in load_harness.format_report(report)
    assert "0 failed, 1 hung" in report.summary()
