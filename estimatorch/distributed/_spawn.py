"""The launcher of :func:`estimatorch.distributed.spawn`: ranks in spawned processes on this
machine, their results handed back before an exit without interpreter teardown, and one rank's
failure raised in the caller (:class:`RankFailedError`) instead of a hang.

Part of :mod:`estimatorch.distributed` (which re-exports :func:`spawn` and
:class:`RankFailedError`).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import warnings
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Optional, cast

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .._checks import is_int

__all__ = ["RankFailedError", "portable_exception", "report_failure", "spawn"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailedError(RuntimeError):
    """A process started by :func:`spawn` raised, or died before it returned a result.

    Attributes:
        rank: the global rank of the process that failed.
        exception: the exception it raised, when it could be sent back (also the
            ``__cause__``); None when it died without one (a signal, ``os._exit``).
        remote_traceback: the formatted traceback from that process ("" when it died).
    """

    def __init__(self, message: str, rank: int, exception: Optional[BaseException] = None,
                 remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exception = exception
        self.remote_traceback = remote_traceback


#: after a rank failed, how long the others get to report before they are terminated.
_FAILURE_GRACE_S = 10.0
#: how long a child that delivered its result waits for the parent's go-ahead to exit.
_RELEASE_WAIT_S = 60.0


#: how the ranks' processes start: "spawn", a fresh interpreter each. The test suite sets
#: "forkserver" (tests/conftest.py): forks of one server that imported torch once, as fresh as a
#: spawned process but without its seconds of imports; the environment goes with the request.
_START_METHOD = "spawn"

#: in a process :func:`spawn` started: sends a failure to the parent at once.
_REPORT: Optional[Callable[[BaseException], None]] = None


def report_failure(error: BaseException) -> None:
    """In a process :func:`spawn` started, hand ``error`` to the parent now (before this process
    ends without unwinding, see :mod:`estimatorch.distributed._rank_watch`); elsewhere nothing."""
    if _REPORT is not None:
        _REPORT(error)


def _send_error(conn: Any, err: BaseException) -> None:
    with contextlib.suppress(Exception):
        conn.send_bytes(pickle.dumps(("error", portable_exception(err), type(err).__name__, str(err),
                                      "".join(traceback.format_exception(err)))))


def portable_exception(err: BaseException) -> Optional[BaseException]:
    """``err`` when it survives pickling (so the parent can re-raise it), else None."""
    try:
        pickle.loads(pickle.dumps(err))
    except Exception:  # noqa: BLE001 - any pickling failure means: send the text only
        return None
    return err


def _spawn_entry(local_rank: int, fn: Callable[..., Any], nprocs: int, port: int, backend: str,
                 args: tuple, conn: Any, environ: dict[str, str]) -> None:
    """One spawned process: run ``fn``, hand its result (or error) to the parent through
    ``conn``, wait until the parent has heard from every rank, then leave with ``os._exit``.

    Leaving without interpreter teardown is deliberate: with torch 2.13 a gloo process
    sometimes aborts while tearing down ("terminate called without an active exception"),
    after its work is done. The result is already delivered by then, and nothing the teardown
    would do (flushing streams aside, done here) is needed.
    """
    if os.environ != environ:  # a forkserver's child has the server's environment, not the caller's
        os.environ.clear()
        os.environ.update(environ)
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(nprocs),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    code = 0
    global _REPORT
    _REPORT = lambda err: _send_error(conn, err)  # noqa: E731
    try:
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
        dist.init_process_group(backend=backend, rank=local_rank, world_size=nprocs)
        result = fn(*args)
        try:
            # Plain pickle (tensors copied into the message), not torch's shared-memory
            # reductions: those need this process alive until the parent has unpickled.
            message = pickle.dumps(("ok", result))
        except Exception as err:  # an unpicklable result is the caller's error
            raise TypeError(f"spawn: the result of {getattr(fn, '__name__', fn)!r} on rank {local_rank} "
                            f"cannot be sent to the parent process ({err}); return picklable values") from err
        conn.send_bytes(message)
    except BaseException as err:  # noqa: BLE001 - every failure is reported to the parent
        code = 1
        _send_error(conn, err)
    try:
        if code == 0:  # a failed rank leaves at once, so that peers in a collective notice
            with contextlib.suppress(Exception):
                if conn.poll(_RELEASE_WAIT_S):
                    conn.recv_bytes()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    finally:
        os._exit(code)


def _describe_exit(exitcode: Optional[int]) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        try:
            return f"killed by signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


def spawn(fn: Callable[..., Any], nprocs: int, *args: Any, backend: Optional[str] = None) -> list[Any]:
    """Run ``fn(*args)`` in ``nprocs`` new processes on this machine, each a rank of one process
    group, and return every rank's return value.

    ``fn`` must be importable (defined at module level) and its arguments and return value
    picklable. Each process hands its result to this one as soon as ``fn`` returns, waits until
    every rank has reported, and then exits without interpreter teardown (with torch 2.13 a gloo
    process can abort during teardown; a process that still dies after delivering its result
    only gets a warning).

    Args:
        fn: the function each process runs; ``estimatorch.distributed.get_rank()`` tells it
            which rank it is.
        nprocs: the number of processes (>= 1).
        *args: passed to ``fn`` in every process.
        backend: Defaults to ``"nccl"`` when there is a CUDA device per process, else ``"gloo"``.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``.

    Raises:
        RankFailedError: a rank raised (its exception is the ``__cause__``; the message names the
            rank and carries its traceback) or died before returning. The other ranks get a few
            seconds to finish, then they are terminated: a failure never hangs the caller.

    Example (a function of an importable module)::

        def train(lr):
            est = Estimator(...)
            est.fit(loader, epochs=2)
            return est.evaluate(val_loader)

        scores = spawn(train, 2, 0.1)   # [scores on rank 0, scores on rank 1]
    """
    if not is_int(nprocs) or nprocs < 1:
        raise ValueError(f"nprocs must be a positive int, got {nprocs!r}")
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {fn!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs else "gloo"
    if backend not in ("gloo", "nccl", "mpi"):
        raise ValueError(f"backend must be 'gloo', 'nccl', 'mpi' or None, got {backend!r}")
    procs, conns = _start_ranks(fn, nprocs, backend, args)
    try:
        reports, failed = _collect_reports(procs, conns)
        for conn in conns:  # the go-ahead: every rank has reported (or the run failed)
            with contextlib.suppress(Exception):
                conn.send_bytes(b"exit")
        for proc in procs:
            proc.join(1.0 if failed else _FAILURE_GRACE_S)
    finally:
        _reap(procs, conns)
    failures = [(rank, report) for rank, report in reports.items() if report[0] != "ok"]
    if failures or len(reports) < nprocs:
        _raise_rank_failure(failures, [r for r in range(nprocs) if r not in reports], procs)
    for rank, proc in enumerate(procs):
        if proc.exitcode != 0:
            warnings.warn(f"spawn: rank {rank} delivered its result, then its process ended "
                          f"({_describe_exit(proc.exitcode)}); the result is kept", RuntimeWarning, stacklevel=2)
    return [reports[rank][1] for rank in range(nprocs)]


def _start_ranks(fn: Callable[..., Any], nprocs: int, backend: str, args: tuple) -> tuple[list[Any], list[Any]]:
    """Start one spawned process per rank, each with a pipe to this one."""
    ctx: Any = mp.get_context(_START_METHOD)  # "spawn" (or the suite's "forkserver")
    port, environ = _free_port(), dict(os.environ)
    procs, conns = [], []
    for rank in range(nprocs):
        parent_end, child_end = ctx.Pipe(duplex=True)
        proc = ctx.Process(target=_spawn_entry, args=(rank, fn, nprocs, port, backend, args, child_end, environ),
                           name=f"estimatorch-rank{rank}", daemon=False)
        proc.start()
        child_end.close()
        procs.append(proc)
        conns.append(parent_end)
    return procs, conns


def _collect_reports(procs: list[Any], conns: list[Any]) -> tuple[dict[int, tuple], bool]:
    """Every rank's report, in the order they arrived (the first failure is the cause); after a
    failure the others get ``_FAILURE_GRACE_S`` to report. Also whether any rank failed."""
    reports: dict[int, tuple] = {}
    failure_deadline: Optional[float] = None
    waiting = {conn: rank for rank, conn in enumerate(conns)}
    while waiting:
        timeout = None if failure_deadline is None else max(failure_deadline - time.monotonic(), 0.0)
        ready = wait(list(waiting), timeout=timeout)
        if not ready:  # the grace period after a failure is over
            break
        for conn in ready:
            rank = waiting.pop(conn)
            try:
                reports[rank] = pickle.loads(cast(Connection, conn).recv_bytes())
            except (EOFError, OSError):  # it died without a word
                procs[rank].join(5.0)
                reports[rank] = ("died", _describe_exit(procs[rank].exitcode))
            if reports[rank][0] != "ok" and failure_deadline is None:
                failure_deadline = time.monotonic() + _FAILURE_GRACE_S
    return reports, failure_deadline is not None


def _reap(procs: list[Any], conns: list[Any]) -> None:
    """Terminate (then kill) every process still alive and close the pipes."""
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join()
    for conn in conns:
        conn.close()


def _raise_rank_failure(failures: list[tuple[int, tuple]], silent: list[int], procs: list[Any]) -> None:
    """Raise a :class:`RankFailedError` for the rank that raised first (later failures are
    usually its consequence: a collective that lost a peer), or else the first that died; the
    message names every other failure too (a rank killed before a peer raised among them)."""
    raised = [(rank, report) for rank, report in failures if report[0] == "error"]
    # a rank that stopped because another failed (RankFailedError) is a consequence: the cause first
    raised.sort(key=lambda item: isinstance(item[1][1], RankFailedError))
    cause = raised[0][0] if raised else failures[0][0] if failures else silent[0]
    others = [f"rank {rank}: {report[3] if report[0] == 'error' else report[1]}"
              for rank, report in failures if rank != cause and report[0] in ("error", "died")]
    others += [f"rank {rank}: no report ({_describe_exit(procs[rank].exitcode)}, terminated)"
               for rank in silent if rank != cause]
    tail = f"\n(also: {'; '.join(others)})" if others else ""
    if raised:
        rank, (_, exc, type_name, text, remote_tb) = raised[0]
        message = f"rank {rank} of {len(procs)} raised {type_name}: {text}\n\n{remote_tb.rstrip()}{tail}"
        raise RankFailedError(message, rank, exc, remote_tb) from exc
    if failures:
        rank, (_, how) = failures[0]
        raise RankFailedError(f"rank {rank} of {len(procs)} ended before returning a result ({how}){tail}", rank)
    rank = silent[0]
    raise RankFailedError(f"rank {rank} of {len(procs)} did not report{tail}", rank)
