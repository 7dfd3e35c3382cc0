"""The ledger of the run, kept by the attempt in progress: where its time goes, its progress mark,
its entry in every snapshot, and what the attempts before it lost (the structure, the totals and
the mark's file are the store's: ``checkpoint/_ledger.py``, ``checkpoint/_progress.py``).

Every ``fit`` is an attempt of a run: a fresh fit starts a run, a fit that resumes (from a
checkpoint, or ``fit(..., resume=True)``) continues the run of the state it resumes, whose ledger
the snapshot carries. Global rank 0 keeps it (the other ranks' snapshots hold None): it times the
parts of its attempt at the few places they happen (the start, the loop's beginning, each
boundary's work, each validation, ``train_end``; the split of ``SpeedMonitor`` where it runs),
never per step; where a handler writes resumable checkpoints it keeps the progress mark beside
them, whose step counter is the one thing a step writes (a memory store, from a ``batch_end``
hook added to the loop only then). When the fit ends the attempt's entry is closed (finished,
signal or failed) and the totals go to ``History.ledger``; an attempt that never closes is
found killed by the next one.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import Any, Callable, Optional

from ... import _console, distributed
from ...checkpoint import (
    ProgressMark,
    attempt_times,
    ledger_summary,
    merge_ledgers,
    progress_path,
    read_progress,
    scale_steps,
    settle,
)
from ...events import declared
from .._fit_estimator import FitEstimator

__all__ = ["RunLedger", "describe_previous"]

_TIMED = ("load", "save", "validation", "end")
_FIRST_FIT = [True]  # whether no fit of this process has started yet


def _process_started() -> Optional[float]:
    """When this process started (seconds since the epoch, to 10 ms), where Linux says."""
    try:
        with open("/proc/self/stat") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime, in ticks since boot
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _attempt_start() -> float:
    """When this attempt started: a script's first fit counts from the process's start (its
    imports and set-up are the attempt's start-up); any other ``fit`` (a notebook's, a second
    one) from its call."""
    now = time.time()
    first, _FIRST_FIT[0] = _FIRST_FIT[0], False
    started = _process_started() if first and not _console.in_notebook() else None
    return started if started is not None and now - 3600 < started <= now else now


def describe_previous(entry: dict[str, Any], resumed_from: int) -> str:
    """What the attempt before this one lost, for the line that says this fit resumes.

    Example:
        >>> describe_previous({"ended": "killed", "last_step": 13, "exact": True, "reason": None}, 10)
        'the last attempt was killed after step 13, 3 steps to train again'
    """
    lost = max(0, entry["last_step"] - resumed_from)
    again = f"{lost} step{'s' if lost != 1 else ''} to train again" if lost else "no step to train again"
    ended = entry["ended"]
    if ended == "killed":
        how = f"was killed after step {entry['last_step']}" + ("" if entry["exact"] else " or later (no progress mark)")
    elif ended == "signal":
        how = f"stopped for {entry['reason'] or 'a signal'} after step {entry['last_step']}"
    elif ended == "failed":
        how = f"failed after step {entry['last_step']} ({entry['reason']})"
    else:
        how = f"finished at step {entry['last_step']}"
    return f"the last attempt {how}, {again}"


class RunLedger:
    """The current attempt of a run, as one ``fit`` keeps it (see the module's notes)."""

    def __init__(self) -> None:
        self.started = _attempt_start()
        self.main = distributed.is_main_process()
        self.run_id: Optional[str] = None  # set by open(), after train_begin
        self.previous: list[dict[str, Any]] = []  # the run's attempts before this one, closed
        self.resumed_from: Optional[int] = None
        self.ns = dict.fromkeys(_TIMED, 0)
        self.loop_ns = 0  # when the loop began (ns since the epoch), 0 before
        self.mark: Optional[ProgressMark] = None
        #: the ``batch_end`` hook writing the mark's step counter, None without a mark
        self.step_hook: Optional[Callable[..., None]] = None
        #: the attempt's ending once decided (``ended``, ``reason``)
        self.outcome: Optional[tuple[str, Optional[str]]] = None
        #: what the attempt before this one lost, in words (None for a run's first attempt)
        self.previous_note: Optional[str] = None
        #: the run's totals once the fit ended (``checkpoint/_ledger.py``'s ``ledger_summary``)
        self.totals: Optional[dict[str, Any]] = None
        #: this attempt's last step and ending as the last checkpoint it saved records them
        self._saved: Optional[tuple[int, str]] = None
        self._step_times: Any = None

    # -- the attempt's start ----------------------------------------------------------------
    def open(self, estimator: FitEstimator, run: Any, train_begin_ns: int, resumed_from_files: bool) -> None:
        """After ``train_begin`` (the checkpoint directory is open and locked, a resume from it
        requested): take the run's ledger from the snapshot to resume (closing the attempt before
        with what its mark says) or start a run, and write this attempt's mark. ``train_begin``
        counts as the checkpoint's load when it requested a resume from files."""
        self._step_times = run.step_times
        if resumed_from_files:
            self.ns["load"] += train_begin_ns
        if not self.main:
            return
        location = _mark_location(run.dispatch.handlers)
        path = progress_path(location) if location is not None else None
        marked = read_progress(path) if path is not None else None
        accumulation = run.counts.accumulation if run.counts is not None else 1
        pending = run.pending
        ledger = None
        if pending is not None:
            self.resumed_from = pending["position"]["step"]
            mark_ledger = None
            if marked is not None:
                mark_ledger, old = marked["ledger"], marked["accumulation"]
                if old != accumulation and getattr(run.stream, "layout", None) is not None:  # elastic, resized
                    mark_ledger = dict(mark_ledger, attempts=scale_steps(mark_ledger["attempts"],
                                                                         lambda c: c // old * accumulation))
            ledger = merge_ledgers(pending.get("ledger"), mark_ledger, over=True)
        self.run_id = ledger["run_id"] if ledger is not None else uuid.uuid4().hex[:12]
        self.previous = list(ledger["attempts"]) if ledger is not None else []
        if self.previous and self.resumed_from is not None:
            self.previous_note = describe_previous(self.previous[-1], self.resumed_from)
        if path is None:
            return
        document = {"run_id": self.run_id, "attempts": self._attempts(run)["attempts"], "pid": os.getpid(),
                    "host": socket.gethostname(), "accumulation": accumulation}
        try:
            self.mark = ProgressMark.create(path, document, step=self.resumed_from or 0)
        except OSError as err:  # a hint for the next attempt, never a reason to stop this one
            estimator.logger.warning("Could not write the progress mark %s (%s): if this attempt is killed, the "
                                     "next one counts its steps up to its last checkpoint", path, err)
            return
        for part, ns in self.ns.items():
            if ns:
                self.mark.set(part, ns)
        step, pos = self.mark.step, run.pos

        def progress(estimator: FitEstimator, **kwargs: Any) -> None:  # the last batch_end hook of each step
            step(pos.step + 1)

        self.step_hook = progress

    def loop_began(self) -> None:
        """The loop takes its first batch: the attempt's start-up is over."""
        self.loop_ns = time.time_ns()
        if self.mark is not None:
            self.mark.set("loop", self.loop_ns)

    def add(self, part: str, ns: int) -> None:
        """``ns`` nanoseconds more of ``part`` (``load``, ``save``, ``validation``, ``end``)."""
        self.ns[part] += ns
        if self.mark is not None:
            self.mark.set(part, self.ns[part])
            if part == "save" and self._step_times is not None:
                self.mark.set("data", self._step_times.ns["data"])

    # -- the attempt's entry ----------------------------------------------------------------
    def _entry(self, run: Any, ended: str, reason: Optional[str]) -> dict[str, Any]:
        seconds = max(0.0, time.time() - self.started)
        data = self._step_times.ns["data"] if self._step_times is not None else -1
        return {"attempt": len(self.previous) + 1, "started": self.started, "resumed_from": self.resumed_from,
                "last_step": max(run.pos.step, self.resumed_from or 0), "exact": ended != "running", "ended": ended,
                "reason": reason,                "world_size": distributed.get_world_size(), "seconds": seconds,
                "times": attempt_times(seconds, self.started, loop=self.loop_ns, data=data, **self.ns),
                "steps_lost": 0}

    def _attempts(self, run: Any) -> dict[str, Any]:
        if self.outcome is not None:
            ended, reason = self.outcome
        elif run.signals.stopped is not None:  # a stop's boundary, saved in train_end
            ended, reason = "signal", run.signals.stopped
        elif run.pos.stop or _plan_done(run):  # the loop ends at this boundary (or at the epoch's end just after)
            ended, reason = "finished", None
        else:
            ended, reason = "running", None
        return {"run_id": self.run_id, "attempts": settle([*self.previous, self._entry(run, ended, reason)])}

    def saved(self, ledger: Optional[dict[str, Any]]) -> None:
        """A store took ``ledger`` (:meth:`state`'s) for a checkpoint."""
        if ledger is not None:
            last = ledger["attempts"][-1]
            self._saved = (last["last_step"], last["ended"])

    def state(self, run: Any) -> Optional[dict[str, Any]]:
        """The run's ledger for a snapshot taken now (rank 0; None on the other ranks): the
        attempts before and this one, ``"running"`` unless its ending is decided."""
        if not self.main or self.run_id is None:
            return None
        return self._attempts(run)

    # -- the attempt's end --------------------------------------------------------------------
    def decide(self, run: Any, failed: bool, error: Optional[BaseException]) -> None:
        """How the attempt ends, before the final snapshot records it."""
        if run.signals.stopped is not None:
            self.outcome = ("signal", run.signals.stopped)
        elif failed:
            text = f"{type(error).__name__}: {error}" if error is not None else "an error"
            text = text if len(text) <= 300 else text[:297] + "..."
            if error is not None and _peer_lost(error):  # the job lost a rank without a word: killed
                self.outcome = ("killed", f"another rank ended without a word ({text})")
            else:
                self.outcome = ("failed", text)
        else:
            self.outcome = ("finished", None)

    def close(self, estimator: FitEstimator, run: Any) -> None:
        """Once ``train_end`` ran: the attempt's closed entry into its mark, the run's totals into
        the History (and a debug line, for a run of several attempts)."""
        if not self.main or self.run_id is None:
            return
        ledger = self._attempts(run)
        self.totals = ledger_summary(ledger)
        run.history.ledger = self.totals
        mark, self.mark, self.step_hook = self.mark, None, None
        if mark is not None:
            # the plan's end with a checkpoint of its last step: that checkpoint's ledger says it all (not
            # after a signal: the stop's checkpoint is written in train_end, whose time the mark adds)
            last = ledger["attempts"][-1]
            told = self._saved == (last["last_step"], last["ended"]) and last["ended"] == "finished"
            try:
                mark.close(None if told else {**mark.document, "attempts": ledger["attempts"]})
                if told:
                    os.remove(mark.path)
            except OSError as err:
                estimator.logger.warning("Could not close the progress mark %s: %s", mark.path, err)
        if self.previous:
            goodput = self.totals["goodput"]
            estimator.logger.debug("Run %s, attempt %d: %d steps trained again over the run, goodput %s",
                                  self.run_id, len(ledger["attempts"]), self.totals["steps_lost"],
                                  "n/a" if goodput is None else f"{goodput:.3f}")


#: what a collective raises where a peer process vanished (killed, its machine lost), by backend
_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "NCCL communicator was aborted")


def _peer_lost(error: BaseException) -> bool:
    """Whether ``error`` (or an error it was raised from) is a collective's, met because another
    rank vanished without publishing a failure of its own."""
    seen: Optional[BaseException] = error
    for _ in range(8):  # a chain of causes, bounded
        if seen is None:
            return False
        if isinstance(seen, RuntimeError) and distributed.get_world_size() > 1 and any(
                words in str(seen) for words in _PEER_LOST):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _plan_done(run: Any) -> bool:
    """The plan's last batch is trained (only its epoch's end is left), where the plan counts it."""
    counts = run.counts
    if counts is None:
        return False
    total = counts.batches if counts.batches is not None else (
        counts.per_epoch * counts.epochs if counts.per_epoch is not None and counts.epochs is not None else None)
    return total is not None and run.pos.step >= total


def _mark_location(handlers: Any) -> Optional[str]:
    """The directory of the progress mark: that of the handler that resumes the run, else of the
    first that writes resumable checkpoints; None without one."""
    savers = [h for h in handlers if declared(h, "checkpoint_location") is not None]
    resuming = [h for h in savers if declared(h, "resumes_run")]
    chosen = (resuming or savers or [None])[0]
    return None if chosen is None else str(declared(chosen, "checkpoint_location"))
