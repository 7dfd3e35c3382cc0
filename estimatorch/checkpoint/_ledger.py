"""The run's ledger: one entry per attempt of a run (a process, or a torchrun/SLURM restart of the
job), kept in every checkpoint's run state and carried across every resume, and the totals read
from it: the steps trained again, the time lost and the goodput.

This is the storage side: what a ledger holds and its check (run by ``checkpoint.load`` and
``inspect`` on every file), how a checkpoint's ledger and the progress mark beside it
(:mod:`._progress`) combine into what is known of the run, the totals and the table ``inspect``
prints. The estimator keeps the ledger of the attempt in progress (``estimator/_state/ledger.py``).

An attempt's entry (every value a plain python value):

- ``attempt``: its number, from 1; ``started``: when it started (seconds since the epoch): a script's
  first ``fit`` from its process's start (on Linux, a process under an hour old), any other from the call;
- ``resumed_from``: the step (batches this process had trained) of the checkpoint it resumed from,
  None for the run's first attempt;
- ``last_step``: the last step it completed; ``exact``: False when no progress mark told it (a
  killed attempt whose mark was not found: counted to the checkpoint it last wrote);
- ``ended``: ``"finished"`` (its plan's end or a handler's stop), ``"signal"`` (SIGTERM, SLURM's
  requeue signal or Ctrl-C, the boundary saved), ``"killed"`` (no word from it: SIGKILL, a lost
  machine), ``"failed"`` (an exception), or ``"running"`` in the checkpoints it wrote before its end;
  ``reason``: the signal, the error, or None;
- ``world_size``, ``seconds`` (from ``started`` to its end or its last sign of life) and ``times``:
  where the seconds went (:data:`PARTS`);
- ``steps_lost``: the steps it trained that a later attempt trained again.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Sequence
from typing import Any, Callable, Optional

from .._checks import is_int
from .._saved import CheckpointError, check_dict, show

__all__ = ["ENDINGS", "PARTS", "attempt_times", "check_ledger", "ledger_summary", "ledger_table", "merge_ledgers",
           "scale_steps", "settle"]

#: how an attempt ended (``"running"`` too, in the checkpoints it wrote before its end).
ENDINGS = ("finished", "signal", "killed", "failed")
#: where an attempt's time went: ``startup`` (``fit`` called to the first step, the checkpoint's
#: load excluded), ``load`` (reading, checking and restoring the checkpoint it resumed from),
#: ``steps`` (training steps and the loop's own work), ``data`` (the steps' waits for data, counted
#: apart from ``steps`` only where ``SpeedMonitor``'s split runs, else None), ``save`` (checkpoint
#: saves and the other work at step boundaries), ``validation``, ``end`` (``train_end``: the
#: checkpoint of a stop, trackers ending their run).
PARTS = ("startup", "load", "steps", "data", "save", "validation", "end")
_ENTRY = ("attempt", "started", "resumed_from", "last_step", "exact", "ended", "reason", "world_size", "seconds",
          "times", "steps_lost")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def attempt_times(seconds: float, started: float, *, loop: int, load: int, save: int, validation: int, data: int,
                  end: int) -> dict[str, Optional[float]]:
    """Where an attempt's ``seconds`` went (:data:`PARTS`), from its counters in nanoseconds:
    ``loop`` the time (since the epoch) its loop began, 0 before; ``data`` -1 where not measured;
    ``steps`` is what the other parts leave.

    Example:
        >>> attempt_times(10.0, 100.0, loop=103 * 10**9, load=10**9, save=2 * 10**9, validation=0, data=-1, end=0)
        {'startup': 2.0, 'load': 1.0, 'steps': 5.0, 'data': None, 'save': 2.0, 'validation': 0.0, 'end': 0.0}
    """
    ns = 1e-9
    parts = {"load": load * ns, "save": save * ns, "validation": validation * ns, "end": end * ns}
    waits = None if data < 0 else data * ns
    startup = loop * ns - started - parts["load"] if loop else seconds - sum(parts.values())
    startup = max(0.0, startup)
    steps = max(0.0, seconds - startup - sum(parts.values()) - (waits or 0.0)) if loop else 0.0
    return {"startup": startup, "load": parts["load"], "steps": steps, "data": waits, "save": parts["save"],
            "validation": parts["validation"], "end": parts["end"]}


def _check_entry(entry: Any, where: str) -> None:
    entry = check_dict(entry, where)
    missing = [key for key in _ENTRY if key not in entry]
    if missing:
        raise CheckpointError(f"{where} lacks {missing}")
    for key in ("attempt", "last_step", "world_size", "steps_lost"):
        if not is_int(entry[key]) or entry[key] < 0:
            raise CheckpointError(f"{where}[{key!r}] must be a non-negative int, got {show(entry[key])}")
    if entry["resumed_from"] is not None and (not is_int(entry["resumed_from"]) or entry["resumed_from"] < 0):
        raise CheckpointError(f"{where}['resumed_from'] must be a non-negative int or None, "
                              f"got {show(entry['resumed_from'])}")
    if entry["ended"] not in (*ENDINGS, "running"):
        raise CheckpointError(f"{where}['ended'] must be one of {[*ENDINGS, 'running']}, got {show(entry['ended'])}")
    if not isinstance(entry["exact"], bool):
        raise CheckpointError(f"{where}['exact'] must be a bool, got {show(entry['exact'])}")
    if entry["reason"] is not None and not isinstance(entry["reason"], str):
        raise CheckpointError(f"{where}['reason'] must be a str or None, got {show(entry['reason'])}")
    for key in ("started", "seconds"):
        if not _number(entry[key]):
            raise CheckpointError(f"{where}[{key!r}] must be a number, got {show(entry[key])}")
    times = check_dict(entry["times"], f"{where}['times']")
    if sorted(times) != sorted(PARTS):
        raise CheckpointError(f"{where}['times'] must hold {list(PARTS)}, got {sorted(times)}")
    for part, value in times.items():
        if not (value is None and part == "data") and not _number(value):
            raise CheckpointError(f"{where}['times'][{part!r}] must be a number, got {show(value)}")


def check_ledger(ledger: Any) -> None:
    """The structure of a saved ledger (None: a rank other than 0, or a file of an earlier version).

    Raises:
        CheckpointError: saying what is wrong, in words.
    """
    if ledger is None:
        return
    ledger = check_dict(ledger, "ledger")
    if not isinstance(ledger.get("run_id"), str) or not ledger["run_id"]:
        raise CheckpointError(f"ledger['run_id'] must be a non-empty str, got {show(ledger.get('run_id'))}")
    attempts = ledger.get("attempts")
    if not isinstance(attempts, (list, tuple)):
        raise CheckpointError(f"ledger['attempts'] must be a list, got {show(attempts)}")
    for i, entry in enumerate(attempts):
        _check_entry(entry, f"ledger['attempts'][{i}]")


def settle(attempts: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``attempts`` with ``steps_lost`` counted: the steps of an attempt past the point a later
    attempt resumed from (the earliest such point) were trained again.

    Example:
        >>> runs = [{"resumed_from": None, "last_step": 13}, {"resumed_from": 10, "last_step": 27},
        ...         {"resumed_from": 27, "last_step": 40}]
        >>> [a["steps_lost"] for a in settle(runs)]
        [3, 0, 0]
    """
    out, earliest = [], math.inf
    for entry in reversed(attempts):
        start = entry["resumed_from"] or 0
        lost = max(0, entry["last_step"] - max(start, earliest)) if earliest != math.inf else 0
        out.append(dict(entry, steps_lost=int(lost)))
        earliest = min(earliest, start)
    return out[::-1]


def scale_steps(attempts: Sequence[dict[str, Any]], scale: Callable[[int], int]) -> list[dict[str, Any]]:
    """``attempts`` with their steps in another count of batches per step (an elastic resume on
    another world size scales the position by ``scale``, and the ledger with it)."""
    return settle([dict(a, last_step=scale(a["last_step"]),
                        resumed_from=None if a["resumed_from"] is None else scale(a["resumed_from"]))
                   for a in attempts])


def merge_ledgers(saved: Optional[dict[str, Any]], marked: Optional[dict[str, Any]], *,
                  over: bool) -> Optional[dict[str, Any]]:
    """What is known of a run from a checkpoint's ledger (``saved``) and the ledger its progress
    mark holds (``marked``, :func:`._progress.read_progress`'s ``ledger``): the mark's where it is of the
    same run and at least as far on (it is written by the newest attempt, the checkpoint by the one
    that saved it; in a checkpoint, the attempt that wrote it is ``"running"``, its ``last_step``
    the checkpoint's, not ``exact``). With ``over`` (a new attempt of the run is starting) an attempt still
    ``"running"`` is one that ended without a word: ``"killed"``, after the last step its mark (or,
    without one, its checkpoint) says. None when neither holds a ledger."""
    if saved is None:  # a file of an earlier version: the ledger starts with the attempt resuming it
        return None
    chosen = saved
    if marked is not None and marked["run_id"] == saved["run_id"] and _newest(marked) >= _newest(saved):
        chosen = marked
    attempts = [dict(a) for a in chosen["attempts"]]
    if over and attempts and attempts[-1]["ended"] == "running":
        last = attempts[-1]
        last.update(ended="killed", reason=f"no word from it after step {last['last_step']}"
                    + ("" if last["exact"] else " (or later: no progress mark was found)"))
    return {"run_id": chosen["run_id"], "attempts": settle(attempts)}


def _newest(ledger: dict[str, Any]) -> int:
    return ledger["attempts"][-1]["attempt"] if ledger["attempts"] else 0


def _kept_seconds(entry: dict[str, Any]) -> float:
    """The seconds of ``entry``'s steps that no later attempt trained again."""
    trained = entry["last_step"] - (entry["resumed_from"] or 0)
    if trained <= 0:
        return 0.0
    times = entry["times"]
    stepping = times["steps"] + (times["data"] or 0.0)
    return stepping * (trained - entry["steps_lost"]) / trained


def ledger_summary(ledger: dict[str, Any]) -> dict[str, Any]:
    """The ledger with the run's totals, as ``inspect --json`` prints it: ``attempts``,
    ``steps_lost``, ``seconds`` (the run's wall time: from its first attempt's start to its last
    one's end, the waits between attempts included), ``seconds_between`` (those waits),
    ``seconds_lost`` (the wall time not spent on steps that were kept) and ``goodput`` (the share
    spent on them; None before any time passed).

    Example:
        >>> times = dict.fromkeys(PARTS, 0.0)
        >>> entry = dict(attempt=1, started=0.0, resumed_from=None, last_step=10, exact=True, ended="finished",
        ...              reason=None, world_size=1, seconds=4.0, times=dict(times, steps=3.0, startup=1.0))
        >>> total = ledger_summary({"run_id": "r", "attempts": [entry]})
        >>> total["steps_lost"], total["seconds_lost"], total["goodput"]
        (0, 1.0, 0.75)
    """
    attempts = settle(ledger["attempts"])
    if not attempts:
        return {"run_id": ledger["run_id"], "attempts": [], "steps_lost": 0, "seconds": 0.0, "seconds_between": 0.0,
                "seconds_lost": 0.0, "goodput": None}
    wall = max(attempts[-1]["started"] + attempts[-1]["seconds"] - attempts[0]["started"],
               sum(a["seconds"] for a in attempts))  # clocks of other machines may disagree a little
    kept = sum(_kept_seconds(a) for a in attempts)
    return {
        "run_id": ledger["run_id"],
        "attempts": attempts,
        "steps_lost": sum(a["steps_lost"] for a in attempts),
        "seconds": wall,
        "seconds_between": wall - sum(a["seconds"] for a in attempts),
        "seconds_lost": wall - kept,
        "goodput": kept / wall if wall > 0 else None,
    }


def _clock(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).strftime("%Y-%m-%d %H:%M:%S")


def ledger_table(total: dict[str, Any]) -> list[str]:
    """:func:`ledger_summary`'s lines for ``inspect``: one row per attempt, then the totals."""
    head = ("attempt", "started", "resumed", "last", "ended", "lost", "seconds", *PARTS)
    rows = [head]
    for a in total["attempts"]:
        times = [("-" if a["times"][p] is None else f"{a['times'][p]:.2f}") for p in PARTS]
        resumed = "-" if a["resumed_from"] is None else str(a["resumed_from"])
        rows.append((str(a["attempt"]), _clock(a["started"]), resumed,
                     f"{a['last_step']}{'' if a['exact'] else '+'}", a["ended"], str(a["steps_lost"]),
                     f"{a['seconds']:.2f}", *times))
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [f"ledger of run {total['run_id']}: {len(total['attempts'])} attempt(s); steps and times in "
             "batches of this process and seconds"]
    lines += ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]
    reasons = [f"  attempt {a['attempt']}: {a['reason']}" for a in total["attempts"] if a["reason"]]
    lines += reasons
    goodput = "n/a" if total["goodput"] is None else f"{total['goodput']:.3f}"
    lines.append(f"total: {total['steps_lost']} steps trained again; {total['seconds_lost']:.2f} of "
                 f"{total['seconds']:.2f} s not spent on kept steps ({total['seconds_between']:.2f} s between "
                 f"attempts); goodput {goodput}")
    return lines
