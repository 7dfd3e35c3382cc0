"""tests/forked.py runs a script as ``python SCRIPT`` would: its status (an exit, an exception, a
KeyboardInterrupt, its own SIGKILL), its streams, argv, environment and working directory, its
threads joined and atexit run, each run a fresh process (nothing of an earlier run's state), a
run past its timeout killed; several runs at once from threads."""

from __future__ import annotations

import os
import signal
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests import forked

SCRIPT = '''
import atexit, os, signal, sys, threading, time
preloaded = "torch" in sys.modules  # the server's imports, before the script's own
import estimatorch

seen = getattr(estimatorch, "_marks", 0)  # a module the server imported: a fresh process has no mark
estimatorch._marks = seen + 1
print("argv", sys.argv[1:], "main" if __name__ == "__main__" else __name__, os.getcwd(), os.environ.get("MARK"))
print("state", seen, "torch", preloaded, "path", sys.path[0] == os.path.dirname(__file__))
atexit.register(lambda: print("atexit after", threading.active_count(), "threads", flush=True))
how = sys.argv[1]
if how == "thread":  # a non-daemon thread still running when the script ends: joined first
    threading.Thread(target=lambda: (time.sleep(0.2), print("thread done", flush=True))).start()
elif how == "exit":
    sys.exit(7)
elif how == "raise":
    raise ValueError("boom")
elif how == "interrupt":
    raise KeyboardInterrupt
elif how == "sigkill":
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)
elif how == "hang":
    time.sleep(600)
print("stderr line", file=sys.stderr)
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("forked") / "worker.py"
    path.write_text(SCRIPT)
    return str(path)


def test_a_script_runs_as_python_runs_it(script, tmp_path):
    proc = forked.run(script, ["thread", 2], env=dict(os.environ, MARK="given"), cwd=str(tmp_path), timeout=120)
    assert isinstance(proc, subprocess.CompletedProcess) and proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"argv ['thread', '2'] main {tmp_path} given"
    assert lines[1] == "state 0 torch True path True"
    assert lines[2:] == ["thread done", "atexit after 1 threads"]  # the thread joined, then atexit
    assert proc.stderr == "stderr line\n"


@pytest.mark.parametrize("how, status, in_stderr", [
    ("exit", 7, ""), ("raise", 1, "ValueError: boom"), ("interrupt", -signal.SIGINT, "KeyboardInterrupt"),
    ("sigkill", -signal.SIGKILL, ""),
], ids=["exit", "exception", "keyboard-interrupt", "sigkill"])
def test_the_status_is_the_interpreters(script, how, status, in_stderr):
    proc = forked.run(script, [how], timeout=120)
    assert proc.returncode == status, proc.stderr
    assert in_stderr in proc.stderr
    assert ("atexit after" in proc.stdout) == (how != "sigkill")  # a killed process runs nothing more
    assert proc.stdout.splitlines()[1].startswith("state 0 ")  # each run a fresh process


def test_a_run_past_its_timeout_is_killed(script):
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        forked.run(script, ["hang"], timeout=3)
    assert "argv ['hang']" in raised.value.output


def test_runs_from_several_threads_at_once(script):
    with ThreadPoolExecutor(max_workers=4) as pool:
        procs = list(pool.map(lambda i: forked.run(script, ["thread", i], timeout=120), range(8)))
    assert [p.returncode for p in procs] == [0] * 8
    assert all(p.stdout.startswith(f"argv ['thread', '{i}'] main ") for i, p in enumerate(procs))
    assert all("thread done" in p.stdout for p in procs)
