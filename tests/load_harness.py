"""Run one test many times while every core is busy, and count passes, failures and hangs.

    python -m tests.load_harness -n 50 --load tests/integration/test_preemption.py::test_x

Each run is ``python -m pytest -q -x -p no:cacheprovider <node id>`` in a session of its own,
one run at a time, with a per-run timeout (``--timeout``, 300 s by default). With ``--load`` the
harness first starts one spinning process per core (``os.cpu_count()``; ``--spinners`` to
change it), *not niced* unless ``--nice N`` is given, so that the test competes with them as
it would with other jobs; they are ended when the harness ends, also on Ctrl-C or an error.

Every Python process of a run (pytest, the scripts a test starts, DataLoader workers, torchrun
agents and their workers, whatever their session) imports the harness's ``sitecustomize``,
which registers :mod:`faulthandler` on SIGQUIT, writing to a file of its own. The harness finds
a run's processes by a marker in their environment, not by their parent, so processes in other
sessions and orphans are found too. When a run passes its timeout it is a *hang*: the harness
sends SIGQUIT to each of the run's processes (each dumps every thread's stack), then SIGKILL,
and prints the stacks. A run whose tests had already ended when its timeout came (pytest had
printed its last line: a slow run, not a hang) gets ``EXIT_GRACE`` seconds more to exit; if it
does, it counts by its exit status and is reported as ended past the limit; if not, it is a hang
at exit, and the report says so. A run that ends but leaves processes behind is reported (and
they are killed) so a leaked worker does not load the next run; one that ends by itself within
``GRACE`` seconds of the run (multiprocessing's resource tracker, which exits once its pipe
closes, or a child busy exiting on a loaded machine) is not counted.

The report (also written to ``--report DIR``: one log per failed or hung run) gives for each
failure its exit status and the tail of its captured output, and for each hang the stacks.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Optional

MARKER = "ESTIMATORCH_LOAD_RUN"
DUMPS = "ESTIMATORCH_LOAD_DUMPS"

SITECUSTOMIZE = '''\
"""Installed by tests/load_harness.py: SIGQUIT dumps every thread's stack to a file per process."""
import faulthandler
import os
import signal

_dir = os.environ.get("ESTIMATORCH_LOAD_DUMPS")


def _register():
    path = os.path.join(_dir, "%d.txt" % os.getpid())
    stream = open(path, "a")
    stream.write("pid %d (parent %d)\\n" % (os.getpid(), os.getppid()))
    stream.flush()
    faulthandler.register(signal.SIGQUIT, file=stream, all_threads=True, chain=False)
    globals()["_stream"] = stream  # kept open for the process's life


if _dir and os.path.isdir(_dir):
    _register()
    os.register_at_fork(after_in_child=_register)  # a forked worker gets a file of its own
'''


@dataclasses.dataclass
class Run:
    """One run of the target: ``outcome`` is ``"passed"``, ``"failed"`` or ``"hung"``."""

    index: int
    outcome: str
    returncode: Optional[int]
    seconds: float
    output: str
    stacks: str = ""
    leftovers: int = 0
    left_behind: tuple[str, ...] = ()  # the processes counted in leftovers: pid, state, command
    ended: str = ""  # pytest's last line when the timeout came, if the tests had ended by then


@dataclasses.dataclass
class Report:
    node: str
    load: str
    runs: list[Run] = dataclasses.field(default_factory=list)

    def count(self, outcome: str) -> int:
        return sum(run.outcome == outcome for run in self.runs)

    def summary(self) -> str:
        leaked = sum(run.leftovers > 0 for run in self.runs)
        late = sum(run.outcome != "hung" and bool(run.ended) for run in self.runs)
        late_text = f" ({late} ended past the limit, their tests done)" if late else ""
        return (f"{self.node}: {len(self.runs)} runs -> {self.count('passed')} passed, {self.count('failed')} failed"
                f"{late_text}, {self.count('hung')} hung ({self.load}; {leaked} runs left processes behind)")


def _run_processes(token: str) -> list[int]:
    """The processes (ours) whose environment carries ``token``."""
    found = []
    needle = f"{MARKER}={token}".encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/environ", "rb") as stream:
                if needle in stream.read().split(b"\0"):
                    found.append(int(name))
        except OSError:  # gone, or not ours
            continue
    return found


def _signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def _describe(pid: int) -> str:
    """``pid``, its state and its command line, read from /proc (``"pid N (gone)"`` once it ended)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as stream:
            command = stream.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as stream:
            state = stream.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return f"pid {pid} (gone)"
    return f"pid {pid} [{state}] {command[:200]}"


#: seconds a run's processes get to end by themselves after it, before they count as left behind
GRACE = 5.0
#: seconds more for a run whose tests had ended when its timeout came, to exit.
EXIT_GRACE = 30.0
#: pytest's last line: ``2 passed in 297.43s (0:04:57)``, ``1 failed, 3 passed in 9.1s``.
_PYTEST_END = re.compile(r"^=*\s*\d+ (passed|failed|errors?|skipped|deselected|xfailed|xpassed)\b.* in \d+(\.\d+)?s\b",
                         re.MULTILINE)


def _tests_ended(fd: int) -> str:
    """pytest's last line if the log written to ``fd`` holds it (read without moving the offset the
    run's processes share), else ``""``."""
    text = os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")
    lines = [match.group(0) for match in _PYTEST_END.finditer(text)]
    return lines[-1].strip(" =") if lines else ""


def _wait_gone(token: str, seconds: float) -> None:
    """Wait up to ``seconds`` for the run's processes to end by themselves."""
    deadline = time.monotonic() + seconds
    while _run_processes(token) and time.monotonic() < deadline:
        time.sleep(0.1)


def _kill_all(token: str) -> list[str]:
    """SIGKILL the run's processes until none is left (one may start while the others are
    killed; each takes a moment to die); those there were at first, described."""
    first: Optional[list[str]] = None
    for _ in range(100):
        pids = _run_processes(token)
        if first is None:
            first = [_describe(pid) for pid in pids]
        if not pids:
            break
        _signal_all(pids, signal.SIGKILL)
        time.sleep(0.1)
    return first or []


def _read_stacks(dumps: str) -> str:
    parts = []
    for name in sorted(os.listdir(dumps)):
        with open(os.path.join(dumps, name), errors="replace") as stream:
            text = stream.read()
        if "Thread 0x" in text or "Current thread" in text or "Stack (most recent" in text:
            parts.append(text)
    return "\n".join(parts)


#: a busy core until the harness ends (it checks now and then that the harness still runs, so an
#: ended harness leaves no spinner behind)
SPIN = "import os\nparent = os.getppid()\nwhile os.getppid() == parent:\n    for _ in range(200000):\n        pass\n"


class Load:
    """One spinning process per core (``count``), niced by ``nice`` (0: not niced), while in use."""

    def __init__(self, count: int, nice: int = 0):
        self.count, self.nice = count, nice
        self.procs: list[subprocess.Popen[bytes]] = []

    def describe(self) -> str:
        if not self.count:
            return "no background load"
        return f"{self.count} spinning processes, " + (f"nice {self.nice}" if self.nice else "not niced")

    def __enter__(self) -> "Load":
        nice = self.nice
        for _ in range(self.count):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-c", SPIN],
                preexec_fn=(lambda: os.nice(nice)) if nice else None, start_new_session=True))
        return self

    def __exit__(self, *exc: object) -> None:
        for proc in self.procs:
            proc.kill()
        for proc in self.procs:
            proc.wait()
        self.procs = []


def run_once(node: str, index: int, *, timeout: float, pytest_args: list[str], hooks: str,
             exit_grace: float = EXIT_GRACE) -> Run:
    """Run ``node`` once in a session of its own; a hang past ``timeout`` is dumped and killed
    (``exit_grace`` seconds later if its tests had ended by then)."""
    token = uuid.uuid4().hex
    dumps = tempfile.mkdtemp(prefix="load-dumps-")
    env = dict(os.environ, **{MARKER: token, DUMPS: dumps})
    env["PYTHONPATH"] = os.pathsep.join(p for p in [hooks, os.environ.get("PYTHONPATH", "")] if p)
    env.pop("PYTEST_ADDOPTS", None)
    with tempfile.TemporaryFile(mode="w+") as log:
        start = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                 *pytest_args, node], stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        stacks, outcome, ended = "", None, ""
        try:
            try:
                returncode: Optional[int] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                ended = _tests_ended(log.fileno())
                if not ended:
                    raise
                returncode = proc.wait(exit_grace)  # slow, not hung: its tests are done
        except subprocess.TimeoutExpired:
            outcome, returncode = "hung", None
            _signal_all(_run_processes(token), signal.SIGQUIT)
            time.sleep(2)  # each writes its stacks
            stacks = _read_stacks(dumps)
        except BaseException:  # the harness itself is stopped: leave nothing of the run behind
            _kill_all(token)
            raise
        seconds = time.monotonic() - start
        _wait_gone(token, GRACE)
        leftovers = _kill_all(token)
        proc.kill()
        proc.wait()
        log.seek(0)
        output = log.read()
    shutil.rmtree(dumps, ignore_errors=True)
    if outcome is None:
        outcome = "passed" if returncode == 0 else "failed"
    left = tuple(leftovers) if outcome != "hung" else ()
    return Run(index, outcome, returncode, seconds, output, stacks, len(left), left, ended)


def run_many(node: str, n: int, *, load: int = 0, nice: int = 0, timeout: float = 300.0,
             pytest_args: Optional[list[str]] = None, report_dir: Optional[str] = None,
             echo: bool = False, exit_grace: float = EXIT_GRACE) -> Report:
    """Run ``node`` ``n`` times, one run at a time, beside ``load`` spinning processes."""
    hooks = tempfile.mkdtemp(prefix="load-hooks-")
    with open(os.path.join(hooks, "sitecustomize.py"), "w") as stream:
        stream.write(SITECUSTOMIZE)
    spinners = Load(load, nice)
    report = Report(node, spinners.describe())
    try:
        with spinners:
            for index in range(n):
                run = run_once(node, index, timeout=timeout, pytest_args=pytest_args or [], hooks=hooks,
                               exit_grace=exit_grace)
                report.runs.append(run)
                if report_dir is not None and run.outcome != "passed":
                    os.makedirs(report_dir, exist_ok=True)
                    with open(os.path.join(report_dir, f"run{index:03d}-{run.outcome}.log"), "w") as stream:
                        stream.write(run.output + "\n==== stacks ====\n" + run.stacks)
                if echo:
                    extra = f", {run.leftovers} processes left behind: {'; '.join(run.left_behind)}" \
                        if run.leftovers else ""
                    late = f" (past the {timeout:g} s limit; its tests had ended: {run.ended})" if run.ended else ""
                    print(f"run {index + 1}/{n}: {run.outcome} in {run.seconds:.1f} s{late}{extra}", flush=True)
    finally:
        shutil.rmtree(hooks, ignore_errors=True)
    return report


def format_report(report: Report, tail: int = 3000) -> str:
    lines = []
    for run in report.runs:
        if run.outcome == "failed":
            lines += [f"---- run {run.index + 1} failed (exit status {run.returncode}, {run.seconds:.1f} s) ----",
                      run.output[-tail:]]
        elif run.outcome == "hung":
            at_exit = f"; its tests had ended ({run.ended}) but it did not exit" if run.ended else ""
            lines += [f"---- run {run.index + 1} hung (killed after {run.seconds:.1f} s{at_exit}); output ----",
                      run.output[-tail:], "---- its stacks ----", run.stacks]
    lines.append(report.summary())
    return "\n".join(lines)


def _end(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.load_harness", description=__doc__.split("\n")[0])
    parser.add_argument("-n", type=int, default=10, help="runs, one at a time (default 10)")
    parser.add_argument("--load", action="store_true", help="keep every core busy with a spinning process")
    parser.add_argument("--spinners", type=int, default=os.cpu_count() or 1,
                        help="spinning processes with --load (default: one per core)")
    parser.add_argument("--nice", type=int, default=0, help="niceness of the spinners (default 0: not niced)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds before a run counts as hung")
    parser.add_argument("--report", default=None, help="directory for the logs of failed and hung runs")
    parser.add_argument("node", help="a pytest node id")
    parser.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, _end)  # killed: end the spinners and the run in progress first
    if args.n < 1:
        parser.error(f"-n must be a positive number of runs, got {args.n}")
    report = run_many(args.node, args.n, load=args.spinners if args.load else 0, nice=args.nice,
                      timeout=args.timeout, pytest_args=args.pytest_args, report_dir=args.report, echo=True)
    print(format_report(report))
    return 0 if report.count("passed") == len(report.runs) else 1


if __name__ == "__main__":
    sys.exit(main())
