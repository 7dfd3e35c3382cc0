"""Run a worker script as ``python SCRIPT ARGS...`` would, in a process forked from a server that
imported torch and estimatorch once: a fresh process (nothing of the test's process, nothing of
an earlier run: each is a fork of the same server, which never trains, starts a thread or
touches CUDA) without the seconds a fresh interpreter spends importing torch.

    proc = forked.run(WORKER, ["chain", "--kill", path], env=env, timeout=300)
    proc.returncode, proc.stdout, proc.stderr        # as subprocess.run(..., capture_output=True, text=True)

The child behaves as the interpreter does for a script: ``__name__ == "__main__"``, ``sys.argv``
``[SCRIPT, *ARGS]``, the script's directory first on ``sys.path``, the environment ``env`` (the
caller's when None; read by the child's code, not by what the server imported already: torch's
thread and device settings are the server's, which is why every worker sets its threads), the
working directory ``cwd``; ``SystemExit`` gives the status, an uncaught exception goes to
``sys.excepthook`` and gives 1 (a ``KeyboardInterrupt``: the process ends by SIGINT, as Python's
does); at the end the non-daemon threads are joined, then the ``atexit`` functions run; a signal
that kills it (its own SIGKILL) is the negative status. Its stdin is ``/dev/null``; stdout and
stderr are read once it has ended (no live streams: a test that talks to its worker starts a
real process). Calls may come from several threads at once.

The server (``python -c "...serve()"``, one per test process, so one per xdist worker) starts at
the first run with :data:`PRELOAD` imported, forks a child per request and reports its end; it
ends, killing any child still running, when the test process closes its stdin (at exit).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import threading
from typing import Any, Optional, Sequence

#: what the server imports before its first fork (a module it cannot import is skipped);
#: ``torch._dynamo``: torch imports it at a process's first optimizer (1.3 of a fit's 1.5 s here)
PRELOAD = ("torch", "torch._dynamo", "torch.utils.data", "estimatorch", "estimatorch.checkpoint", "fsspec", "s3fs")
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: what the suite's multiprocessing forkserver imports (one per test process: stdlib multiprocessing
#: has one forkserver, so its users share one list): distributed.spawn's ranks (tests/conftest.py),
#: the ported data-library kills (tests/data/sigkill.py) and the ledger's attempts. A module that
#: fails to import (not installed, or the streaming tests' module without mosaicml-streaming) is
#: skipped: they are imported by :func:`preload_forkserver`, not by multiprocessing itself.
FORKSERVER_PRELOAD = ("torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp",
                      "torch.distributed.checkpoint", "estimatorch", "estimatorch.checkpoint", "transformers",
                      "datasets", "torchdata.stateful_dataloader", "tests.data.test_iterable_streams",
                      "tests.data.test_mosaic_streaming")


def preload_forkserver() -> None:
    """In the forkserver, before its first fork: import :data:`FORKSERVER_PRELOAD`."""
    import importlib

    for name in FORKSERVER_PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - an optional library, or a test module it needs: its forks import it
            continue


def forkserver() -> Any:
    """The ``"forkserver"`` multiprocessing context, its server importing :data:`FORKSERVER_PRELOAD`
    once (from its first start; each child is then a fork of a server that never ran a test's code)."""
    import multiprocessing

    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.forked_preload"])  # runs preload_forkserver()
    return context


# -- the server (its own process) -----------------------------------------------------------------
def serve(extra: Sequence[str] = ()) -> None:
    """The server's loop: a request per line on stdin, its pid then its status on stdout."""
    for name in (*PRELOAD, *extra):
        try:
            __import__(name)
        except ImportError:
            pass
    replies = os.dup(1)
    quiet = os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 1)  # a stray print of the server's never reaches the replies
    children: dict[int, int] = {}  # pid -> request id
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        if ready:
            chunk = os.read(0, 65536)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                if "kill" in request:
                    pid = next((p for p, i in children.items() if i == request["kill"]), None)
                    if pid is not None:
                        os.kill(pid, signal.SIGKILL)
                    continue
                pid = os.fork()
                if pid == 0:
                    os.close(replies)
                    _child(**request["run"])  # never returns
                children[pid] = request["id"]
                os.write(replies, (json.dumps({"id": request["id"], "pid": pid}) + "\n").encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            os.write(replies, (json.dumps({"id": children.pop(pid), "status": code}) + "\n").encode())
    for pid in children:
        os.kill(pid, signal.SIGKILL)


def _child(script: str, args: Sequence[str], env: dict, cwd: str, out: str, err: str) -> None:
    """In the forked process: the script's run, ended as the interpreter ends it."""
    for fd, path, flags in ((1, out, os.O_WRONLY), (2, err, os.O_WRONLY), (0, os.devnull, os.O_RDONLY)):
        target = os.open(path, flags)
        os.dup2(target, fd)
        os.close(target)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(script))
    code, interrupted = 0, False
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit:
        if exit.code is None or isinstance(exit.code, int):
            code = exit.code or 0
        else:
            print(exit.code, file=sys.stderr)
            code = 1
    except BaseException as error:  # noqa: BLE001 - reported as the interpreter reports it
        sys.excepthook(type(error), error, error.__traceback__)
        code, interrupted = 1, isinstance(error, KeyboardInterrupt)
    threading._shutdown()  # as the interpreter at exit: the non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    if interrupted:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    os._exit(code)


# -- the client (the test's process) -------------------------------------------------------------
class _Client:
    def __init__(self, extra: tuple[str, ...]) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-c", f"from tests.forked import serve; serve({list(extra)!r})"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, cwd=_ROOT)
        self.lock = threading.Lock()
        self.done = threading.Condition()
        self.replies: dict[int, dict[str, Any]] = {}
        self.next_id = 0
        threading.Thread(target=self._read, daemon=True).start()
        atexit.register(self.close)

    def _read(self) -> None:
        for line in self.proc.stdout:
            reply = json.loads(line)
            with self.done:
                self.replies.setdefault(reply["id"], {}).update(reply)
                self.done.notify_all()
        with self.done:
            self.replies[-1] = {"status": None}  # the server is gone
            self.done.notify_all()

    def send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.proc.stdin.write((json.dumps(message) + "\n").encode())
            self.proc.stdin.flush()

    def start(self, run: dict[str, Any]) -> int:
        with self.lock:
            self.next_id += 1
            ident = self.next_id
        self.send({"id": ident, "run": run})
        return ident

    def wait(self, ident: int, timeout: Optional[float]) -> Optional[int]:
        with self.done:
            self.done.wait_for(lambda: "status" in self.replies.get(ident, {}) or -1 in self.replies, timeout)
            if -1 in self.replies and "status" not in self.replies.get(ident, {}):
                raise RuntimeError("the fork server ended")
            reply = self.replies.get(ident, {})
            if "status" not in reply:
                return None
            del self.replies[ident]
            return reply["status"]

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_clients: dict[tuple[str, ...], _Client] = {}
_clients_lock = threading.Lock()


def run(script: str, args: Sequence[object], *, env: Optional[dict] = None, cwd: Optional[str] = None,
        timeout: float = 300, preload: Sequence[str] = ()) -> subprocess.CompletedProcess:
    """``subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=env,
    cwd=cwd, timeout=timeout)``, in a forked process (see the module's docstring). ``preload``:
    heavy modules the script imports beyond :data:`PRELOAD` (``transformers``...): a server of
    their own imports them. Raises ``subprocess.TimeoutExpired`` (the process killed first)
    past ``timeout`` seconds."""
    key = tuple(preload)
    with _clients_lock:
        client = _clients.get(key)
        if client is None or client.proc.poll() is not None:
            client = _clients[key] = _Client(key)
    args = [str(arg) for arg in args]
    with tempfile.TemporaryDirectory(prefix="forked-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        for path in (out, err):
            open(path, "w").close()
        ident = client.start({"script": os.path.abspath(script), "args": args,
                              "env": dict(os.environ if env is None else env), "cwd": cwd or os.getcwd(),
                              "out": out, "err": err})
        status = client.wait(ident, timeout)
        if status is None:
            client.send({"kill": ident})
            client.wait(ident, None)
            raise subprocess.TimeoutExpired([script, *args], timeout, _read(out), _read(err))
        return subprocess.CompletedProcess([sys.executable, script, *args], status, _read(out), _read(err))


def _read(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as stream:
        return stream.read()
