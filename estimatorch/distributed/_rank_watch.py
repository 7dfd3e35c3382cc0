"""A light thread per rank that watches the other ranks during ``fit``, beside the process
group and never on the step path: one rank's failure ends every rank within seconds, and a
hang (no step completing for a while) is told where each rank is.

The ranks talk over the default group's key-value store (the TCPStore every launcher's
rendezvous creates), which needs no collective: a rank whose step raised writes ``rank R
failed at step S: <exception>`` there, and every rank's thread reads the store every
:data:`POLL_S` seconds (one small request; nothing runs in the training thread).

What ends a rank that waits in a gloo collective for a peer that will never join (measured on
torch 2.13, CPU): neither ``ProcessGroup.abort()``, ``shutdown()`` nor
``destroy_process_group()`` called from another thread of the waiting process, nor a signal;
only the peer's connections closing (its process ending) makes the collective raise at once.
So a rank that sees a peer's failure gives its training thread :data:`GRACE_S` seconds to
leave ``fit`` on its own (it does at once when the failing process has ended: its next
collective raises), then logs the failure and ends its process with exit code
:data:`EXIT_CODE` (a checkpoint being written then is left as a temporary file that the next
start removes; every complete checkpoint stays valid).

Part of :mod:`estimatorch.distributed`, which exports :class:`Watchdog` and :class:`RankWatch`.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import multiprocessing
import os
import sys
import threading
import time
import traceback
from types import FrameType
from typing import Any, Callable, Optional

import torch.distributed as dist

from .._checks import is_int
from ._rank_where import summarize, where_is
from ._spawn import RankFailedError, report_failure

__all__ = ["EXIT_CODE", "GRACE_S", "POLL_S", "RankWatch", "Watchdog", "mark_agreed"]

_logger = logging.getLogger("estimatorch")

#: how often each rank's thread reads the store, in seconds.
POLL_S = 0.5
#: how long a rank that saw a peer fail waits for its training thread to leave ``fit``.
GRACE_S = 5.0
#: after ``train_end`` began (the training thread left the loop), how long it may still take.
ENDING_GRACE_S = 30.0
_SEEN = "seen_failed"  #: store key ``seen_failed/<rank>``: that rank read an announced failure

#: the exit status of a rank ended because another rank failed (or by ``Watchdog(action="raise")``).
EXIT_CODE = 1

_AGREED = "estimatorch_agreed"


def mark_agreed(error: BaseException) -> BaseException:
    """Mark ``error`` as raised on every rank at once (an agreed outcome, not one rank's failure
    that the others must hear of); returns it."""
    setattr(error, _AGREED, True)
    return error


def is_agreed(error: BaseException) -> bool:
    """Whether ``error`` is an agreed outcome, or was raised from one (``raise ... from agreed``)."""
    seen: Optional[BaseException] = error
    for _ in range(16):  # a chain of causes, bounded
        if seen is None:
            return False
        if getattr(seen, _AGREED, False):
            return True
        seen = seen.__cause__
    return False


class Watchdog:
    """A hang watchdog for ``Estimator(watchdog=...)``: when no training step completes within
    ``timeout`` seconds (counted from the first completed step), every rank writes its Python
    stacks (``faulthandler``) to the run's directory (a handler's ``diagnostics_location``, else
    the local checkpoint directory, else the working directory) and to the log, and rank 0 logs a
    one-line summary of where each rank is, e.g. ``watchdog: no step completed for 60 s; behind:
    rank 1: step 1234, in the dataset's __getitem__ (data.py:41)``.

    Args:
        timeout: seconds without a completed step (> 0). Choose more than your longest
            validation or checkpoint, which count as time without a step.
        action: ``"log"`` (report, never stop the run) or ``"raise"`` (report, then end every
            rank's process with the summary, exit status 1: a hung thread cannot be made to
            raise; rank 0, the store's host, ends once every rank read it, within 30 s).
            Defaults to ``"log"``.

    Example:
        >>> Watchdog(600, action="raise")
        Watchdog(600, action='raise')
    """

    def __init__(self, timeout: float, action: str = "log"):
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0 \
                or timeout == float("inf"):
            raise ValueError(f"watchdog timeout must be a positive number of seconds, got {timeout!r}")
        if action not in ("log", "raise"):
            raise ValueError(f"watchdog action must be 'log' or 'raise', got {action!r}")
        self.timeout, self.action = float(timeout), action

    @classmethod
    def of(cls, value: Any) -> Optional["Watchdog"]:
        """``Estimator(watchdog=...)``'s value as a :class:`Watchdog` (None stays None)."""
        if value is None or isinstance(value, Watchdog):
            return value
        if is_int(value) or isinstance(value, float):
            return cls(value)
        raise TypeError(f"watchdog must be None, a number of seconds or a Watchdog, got {value!r}")

    def __repr__(self) -> str:
        return f"Watchdog({self.timeout:g}, action={self.action!r})"


def _one_line(text: str) -> str:
    """An error's text on one line: a multi-line one (a DataLoader worker's, with the worker's
    traceback) as its first and last lines."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    text = lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}"
    return text[:2000]


class _LocalStore:
    """The store of a single process: the same calls as a c10d store, in memory."""

    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self._lock:
            self._data[key] = value.encode()

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        with self._lock:
            current = self._data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self._data[key] = desired.encode()
            return self._data.get(key, expected.encode())


#: per default group: how many fits it has watched (every rank counts the same), for key spaces.
_FITS: dict[int, tuple[Any, int]] = {}


def _shared_store() -> tuple[Any, int, int]:
    """The default group's store under a key space of this fit (the same on every rank: each
    rank counts its fits), this rank and the world size; a store in memory without a group."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return _LocalStore(), 0, 1
    world = dist.group.WORLD
    previous = _FITS.get(id(world))
    count = previous[1] + 1 if previous is not None and previous[0] is world else 0
    _FITS[id(world)] = (world, count)
    # torchrun's agent keeps its store across restarts: a restart gets a key space of its own
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    try:  # (a private function of torch's, there since torch 1.x)
        shared = dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError) as err:  # a group without a store: no watch
        _logger.warning("estimatorch: the process group has no store (%s): a rank's failure will not end the "
                        "others promptly", err)
        return _LocalStore(), dist.get_rank(), 1  # (a watchdog then reports this rank only)
    return dist.PrefixStore(f"estimatorch/watch/restart{restart}/fit{count}", shared), dist.get_rank(), \
        dist.get_world_size()


class RankWatch:
    """The watching thread of one rank for one ``fit``: start it with the fit, :meth:`stop` it
    when the fit ends; :meth:`failed` publishes this rank's failure, :meth:`peer_failure`
    reads another rank's.

    Args:
        progress: returns the number of the last completed step (read from the thread).
        logger: where reports go (``extra={"all_ranks": True}`` for this rank's own lines).
        watchdog: a :class:`Watchdog`, or None for failures only.
        stacks_dir: returns the directory stack dumps go to.
    """

    def __init__(self, progress: Callable[[], int], logger: logging.Logger, watchdog: Optional[Watchdog],
                 stacks_dir: Callable[[], str]):
        self.store, self.rank, self.world = _shared_store()
        self.progress, self.logger, self.watchdog, self.stacks_dir = progress, logger, watchdog, stacks_dir
        self.multi = self.world > 1
        self.peer: Optional[dict[str, Any]] = None  # a peer's failure, once seen
        self.ending = False  # the training thread left the loop (train_end runs)
        self._seen_at: Optional[float] = None
        self._stop = threading.Event()
        self._main = threading.get_ident()  # the training thread (the caller of fit)
        self._thread: Optional[threading.Thread] = None
        self._episode = 0
        self._store_lost = False

    # -- the training thread -------------------------------------------------------------------
    def start(self) -> "RankWatch":
        """Start the thread (only where it has something to do: several ranks, or a watchdog)."""
        if self.multi or self.watchdog is not None:
            self._thread = threading.Thread(target=self._run, name="estimatorch-rank-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (the fit ended, one way or another)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(POLL_S * 4)

    def failed(self, error: BaseException, step: int) -> None:
        """Publish this rank's failure (unless it is an agreed one, or a peer's came first)."""
        self.ending = True
        if not self.multi or is_agreed(error) or self.peer_failure() is not None:
            return
        record = {"rank": self.rank, "step": step, "type": type(error).__name__, "text": _one_line(str(error)),
                  "traceback": "".join(traceback.format_exception(error))[-8000:]}
        self._announce("failed", json.dumps(record))  # the first failure is the one told

    def peer_failure(self) -> Optional[dict[str, Any]]:
        """Another rank's published failure (read now), or None."""
        if self.peer is None and self.multi:
            self.peer = self._read_failure()
        return self.peer

    def peer_error(self, error: BaseException) -> Optional[RankFailedError]:
        """The error this rank raises instead of ``error`` when another rank failed first: a
        :class:`RankFailedError` naming it (raise it ``from error``); None otherwise."""
        if is_agreed(error):
            return None
        peer = self.peer_failure()
        if peer is None or (peer.get("type"), peer.get("text")) == (type(error).__name__, _one_line(str(error))):
            return None  # no other rank failed, or every rank met the same error: it is this rank's own
        return RankFailedError(self._describe(peer) + f"; rank {self.rank} stopped too", peer["rank"],
                               remote_traceback=peer.get("traceback", ""))

    # -- the store ---------------------------------------------------------------------------
    def _get(self, key: str) -> Optional[str]:
        """The value of ``key`` (None while it is not set, or once the store is gone)."""
        if self._store_lost:
            return None
        try:
            return self.store.get(key).decode() if self.store.check([key]) else None
        except (RuntimeError, OSError) as err:
            self._lose_store(err)
            return None

    def _put(self, key: str, value: str, expected: Optional[str] = None) -> None:
        """Set ``key`` (only where it holds ``expected`` when given; "" for not set)."""
        if self._store_lost:
            return
        try:
            if expected is None:
                self.store.set(key, value)
            else:
                self.store.compare_set(key, expected, value)
        except (RuntimeError, OSError) as err:
            self._lose_store(err)

    def _announce(self, key: str, value: str, expected: str = "") -> None:
        """Set ``key`` where it holds ``expected``, then count an event: the other ranks' threads
        read the count (one request per poll) and only on a change the keys."""
        self._put(key, value, expected=expected)
        self._events(1)

    def _events(self, add: int = 0) -> Optional[int]:
        """The number of announcements so far (after adding ``add``); None once the store is gone."""
        if self._store_lost:
            return None
        try:
            return int(self.store.add("events", add))
        except (RuntimeError, OSError) as err:
            self._lose_store(err)
            return None

    def _lose_store(self, err: BaseException) -> None:
        """The store is gone (the process hosting it, rank 0's, ended): stop asking it (each
        failed request would log torch's warning)."""
        self._store_lost = True
        _logger.debug("rank %d no longer reaches the store: %s", self.rank, err)

    # -- the watching thread ----------------------------------------------------------------
    def _read_failure(self) -> Optional[dict[str, Any]]:
        value = self._get("failed")
        record = json.loads(value) if value else None
        return record if record is not None and record["rank"] != self.rank else None

    @staticmethod
    def _describe(peer: dict[str, Any]) -> str:
        if "watchdog" in peer:
            return str(peer["watchdog"])
        return f"rank {peer['rank']} failed at step {peer['step'] + 1}: {peer['type']}: {peer['text']}"

    def _run(self) -> None:
        last_step, last_time, armed = self.progress(), time.monotonic(), False
        seen = 0
        while not self._stop.wait(POLL_S):
            events = self._events() if self.multi or self.watchdog is not None else None
            news, seen = events is not None and events != seen, events if events is not None else seen
            if self.multi:
                self._check_peers(news)
            if self.watchdog is None:
                continue
            step, now = self.progress(), time.monotonic()
            if step != last_step:  # a step completed: a later stall is reported again
                last_step, last_time, armed = step, now, True
            elif armed and now - last_time > self.watchdog.timeout:
                armed = False  # one report per stall
                self._raise_alarm()
                news = True
            if news and self._answer_alarm():
                armed = False  # another rank reported this stall

    def _check_peers(self, news: bool) -> None:
        if self.peer is None:
            if not news:
                return
            self.peer = self._read_failure()
            if self.peer is None:
                return
            self._put(f"{_SEEN}/{self.rank}", "1")  # read: the announcing rank may end (_wait_seen)
            self._seen_at = time.monotonic()
            self.logger.error("%s; rank %d stops", self._describe(self.peer), self.rank, extra={"all_ranks": True})
        assert self._seen_at is not None
        if time.monotonic() - self._seen_at > (ENDING_GRACE_S if self.ending else GRACE_S):
            self._end_process()

    def _end_process(self) -> None:
        """The last resort: this rank's training thread is stuck (a collective a failed peer will
        never join cannot be interrupted): log why and end the process."""
        assert self.peer is not None
        message = (f"{self._describe(self.peer)}; rank {self.rank} ends its process (exit code "
                   f"{EXIT_CODE}): its training thread is {where_is(self._main_frame())} and cannot be interrupted")
        self.logger.error(message, extra={"all_ranks": True})
        report_failure(RankFailedError(message, self.peer["rank"], remote_traceback=self.peer.get("traceback", "")))
        for child in multiprocessing.active_children():  # DataLoader workers would outlive it
            child.kill()
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                continue
        os.write(2, f"estimatorch: {message}\n".encode())
        os._exit(EXIT_CODE)

    def _main_frame(self) -> Optional[FrameType]:
        return sys._current_frames().get(self._main) if self._main is not None else None

    def _raise_alarm(self) -> None:
        """No step for longer than the timeout here: start a report (every rank answers)."""
        # one report when several ranks raise the alarm at once: the first one's
        self._announce("hang", str(self._episode + 1), expected=str(self._episode) if self._episode else "")

    def _answer_alarm(self) -> bool:
        """Answer a report a rank started (this one included); True when there was one."""
        value = self._get("hang")
        episode = int(value) if value else 0
        if episode <= self._episode:
            return False
        self._episode = episode
        step, frame = self.progress(), self._main_frame()
        where = where_is(frame)
        path = self._dump_stacks(episode, step)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else ""
        self.logger.warning("watchdog: rank %d, step %d, %s; its training thread's stack:\n%s%s", self.rank, step,
                            where, stack, f"(every thread's stack: {path})" if path else "",
                            extra={"all_ranks": True})
        self._put(f"status/{episode}/{self.rank}", json.dumps({"step": step, "where": where, "path": path}))
        if self.rank == 0:
            self._summarize(episode)
        return True

    def _dump_stacks(self, episode: int, step: int) -> Optional[str]:
        try:
            directory = self.stacks_dir()
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, f"hang_stacks_rank{self.rank}_step{step}_{episode}.txt")
            with open(path, "w") as f:
                faulthandler.dump_traceback(file=f, all_threads=True)
            return path
        except OSError as err:
            self.logger.warning("watchdog: could not write the stacks (%s)", err, extra={"all_ranks": True})
            return None

    def _summarize(self, episode: int) -> None:
        """Rank 0: gather every rank's answer (a few seconds at most) and log the summary."""
        assert self.watchdog is not None
        keys = {r: f"status/{episode}/{r}" for r in range(self.world)}
        deadline = time.monotonic() + max(5.0, 4 * POLL_S)
        statuses: dict[int, dict[str, Any]] = {}
        while len(statuses) < self.world and time.monotonic() < deadline and not self._stop.is_set():
            for r, key in keys.items():
                value = None if r in statuses else self._get(key)
                if value:
                    statuses[r] = json.loads(value)
            if len(statuses) < self.world:
                time.sleep(POLL_S / 5)
        summary = summarize(statuses, self.world, self.watchdog.timeout)
        self.logger.warning(summary)
        if self.watchdog.action == "raise":
            self._announce("failed", json.dumps({"rank": -1, "watchdog": summary}))
            self.peer = {"rank": -1, "watchdog": summary}
            # this process hosts the store: ending it before every rank read the announcement would
            # leave a rank stuck outside a collective (in __getitem__) never told (seen under load)
            self._wait_seen(time.monotonic() + ENDING_GRACE_S)
            self._seen_at = time.monotonic() - GRACE_S  # end at once: the run is hung

    def _wait_seen(self, deadline: float) -> None:
        """Until ``deadline``, wait for every other rank to have read the failure announced."""
        others = [f"{_SEEN}/{r}" for r in range(self.world) if r != self.rank]
        while others and time.monotonic() < deadline and not self._store_lost:
            others = [key for key in others if not self._get(key)]
            if others:
                time.sleep(POLL_S / 5)
