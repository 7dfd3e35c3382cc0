"""Signals during ``fit``: SIGTERM and a first Ctrl-C stop training at the next step boundary.

SIGTERM is what SLURM, Kubernetes and spot instances send before they kill a job. Python's
default would end the process at once (SIGTERM) or raise ``KeyboardInterrupt`` in the middle of
a step (Ctrl-C), and the steps since the last periodic checkpoint would be lost. During ``fit``
both are deferred instead: the loop stops at the next step boundary, every ``CheckpointHandler``
saves that boundary in ``train_end`` (``Estimator.interruption`` names the signal), and only then
does ``fit`` raise what the signal would have: ``KeyboardInterrupt`` for Ctrl-C,
``SystemExit(143)`` (128 + SIGTERM, the status a shell reports for a job ended by SIGTERM) for
SIGTERM, so ``finally`` blocks run and the process exits with the conventional status.

- A second Ctrl-C stops at once (a ``KeyboardInterrupt`` in the middle of a step, or of the
  save of the stop, which leaves no file half-written), with a one-line message. A
  SIGTERM after a Ctrl-C turns the pending stop into a SIGTERM one (the process must end).
- Handlers are installed only in the main thread, only over Python's defaults (SIGINT's
  ``default_int_handler``, SIGTERM's ``SIG_DFL``): an ignored SIGINT (a job started in the
  background) or a handler of your own is left alone. They are restored when ``fit`` ends,
  also when it fails.
- Under SLURM, the requeue signal (SIGUSR1 unless ``ESTIMATORCH_REQUEUE_SIGNAL`` names another;
  ``ESTIMATORCH_REQUEUE=0`` turns it off, see :mod:`estimatorch.distributed.cluster`) stops like SIGTERM and
  checkpoints the boundary; then rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` (when a
  ``CheckpointHandler`` resumes from that checkpoint) and ``fit`` raises ``SystemExit(128 +
  signal)`` on every rank. It wins over SIGTERM and Ctrl-C when several arrive.
- DataLoader worker processes ignore both signals (SLURM and a terminal's Ctrl-C signal the whole
  process group): the main process decides, stops at a boundary and then shuts its workers down.
  Workers forked during ``fit`` inherit the handlers; workers started by ``spawn`` or
  ``forkserver`` (macOS's default, or ``multiprocessing_context=``) run
  :class:`IgnoreStopSignals` as their ``worker_init_fn``, which ``fit`` wraps around yours.
  A stop that lands while the loop waits for a batch leaves the loader's frames out of its
  traceback (:func:`drop_data_frames`), so the workers are shut down before the stop is saved;
  and a process whose workers still run at exit ends them in bounded time
  (``estimatorch.data._workers``): never an exit that waits for them forever.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Any, Callable, Optional

from ... import distributed
from ...data import IgnoreStopSignals
from ...distributed import cluster

__all__ = ["SIGNAL_CODES", "IgnoreStopSignals", "SignalGuard", "drop_data_frames", "install_excepthook", "interrupted",
           "is_clean_stop", "stop_exception", "stop_message", "stopped_at_once"]

#: signal name -> the code ranks exchange; a larger code wins when ranks agree (MAX), so a
#: SIGTERM on any rank ends every rank with SIGTERM's exit status.
SIGNAL_CODES = {"SIGINT": 1, "SIGTERM": 2}
SIGNAL_NAMES = {code: name for name, code in SIGNAL_CODES.items()}
#: the code of SLURM's requeue signal (whichever it is: :func:`estimatorch.distributed.cluster.requeue_signal`)
REQUEUE_CODE = 3
_DEFAULTS: dict[int, Any] = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}


def drop_data_frames(error: BaseException) -> BaseException:
    """``error``, a stop at a step boundary, without its traceback.

    A signal that arrives while the loop waits for the next batch stops there, inside the
    DataLoader's iterator: the traceback's frames would hold that iterator, and so its worker
    processes (which ignore SIGINT and SIGTERM), for as long as the error lives, usually until
    the process exits. Without them the iterator is released, and its workers shut down, before
    the stop is saved. The stop's message says where it stopped; the frames only showed the wait.
    """
    return error.with_traceback(None)


def interrupted(message: str) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` ``fit`` raises after a Ctrl-C, once it has stopped at a step
    boundary and its checkpoints are saved; ``message`` says what was saved and how to resume.

    A plain ``KeyboardInterrupt`` (marked ``estimatorch_stop``): uncaught in a script, it ends
    the process with that one line instead of a traceback (:func:`install_excepthook`) and, as
    Python does for Ctrl-C, with the status of a process ended by SIGINT (130 in a shell); in a
    notebook it shows as any ``KeyboardInterrupt`` does.
    """
    error = KeyboardInterrupt(message)
    error.estimatorch_stop = True  # type: ignore[attr-defined]
    return error


def stopped_at_once(*, saving: bool) -> KeyboardInterrupt:
    """The ``KeyboardInterrupt`` of a second Ctrl-C, raised wherever it lands (in a step, or in a
    ``torch.save`` of the checkpoint the first one asked for when ``saving``). Uncaught in a script
    it ends with its one line, as a clean stop does (:func:`install_excepthook`): a checkpoint
    file is written whole or not at all, so the line can say what is kept."""
    where = "while fit saved the stop" if saving else "in the middle of a step"
    error = KeyboardInterrupt(f"stopped at once by a second Ctrl-C {where}: a checkpoint being written was "
                              "discarded (files are written whole or not at all); a resume continues from the "
                              "last complete checkpoint")
    error.estimatorch_one_line = True  # type: ignore[attr-defined]
    return error


def is_clean_stop(error: BaseException) -> bool:
    """Whether ``error`` is the ``KeyboardInterrupt`` of a stop at a step boundary (:func:`interrupted`)."""
    return isinstance(error, KeyboardInterrupt) and getattr(error, "estimatorch_stop", False) is True


def stop_exception(name: str) -> BaseException:
    """What ``fit`` raises once it has stopped at a boundary because of signal ``name``: for
    SLURM's requeue signal a ``SystemExit`` marked ``estimatorch_requeue``."""
    if name == "SIGINT":
        return interrupted("stopped by Ctrl-C at the end of a step")
    error = SystemExit(128 + signal.Signals[name])
    if name != "SIGTERM":
        error.estimatorch_requeue = True  # type: ignore[attr-defined]
    return error


def _one_line(previous: Callable[..., Any]) -> Callable[..., Any]:
    def excepthook(kind: type, value: BaseException, tb: Any) -> None:
        if is_clean_stop(value) or getattr(value, "estimatorch_one_line", False) is True:
            if distributed.is_main_process():  # one line for the job, not one per process
                sys.stderr.write(f"KeyboardInterrupt: {value}\n")  # then Python ends the process as Ctrl-C does
            sys.stderr.flush()
            return
        previous(kind, value, tb)

    excepthook.estimatorch = True  # type: ignore[attr-defined]
    return excepthook


def install_excepthook() -> None:
    """Make an uncaught :func:`interrupted` stop end a script with its one line instead of a traceback
    through the library's loop (Python then exits as after Ctrl-C: status 130 in a shell).
    Chains to the hook in place for everything else; installed once per process."""
    if not getattr(sys.excepthook, "estimatorch", False):
        sys.excepthook = _one_line(sys.excepthook)


class SignalGuard:
    """Defers SIGINT and SIGTERM while ``fit`` runs (a context manager around the loop).

    Attributes:
        code: the code (:data:`SIGNAL_CODES`) of the signal received, 0 while none was.
        stoppable: set by the loop while raising at once would leave the fit exactly at a step
            boundary (one process, between steps): a signal then stops without waiting for
            another step.
        stopped: the signal's name once the fit ends because of it at a step boundary.
    """

    def __init__(self, describe: Callable[[str], str], log: Callable[[str], None], *,
                 requeue: Optional[signal.Signals] = None, resumes: bool = False):
        self.code = 0
        self.requeue = requeue  # SLURM's requeue signal, None elsewhere
        self._resumes = resumes  # a requeued job resumes from the checkpoint of the stop
        self.stoppable = False
        self.stopped: Optional[str] = None
        self._describe = describe
        self._log = log
        self._saved: dict[int, Any] = {}
        self._pid = 0

    @property
    def received(self) -> Optional[str]:
        """The name of the signal received during this fit, if any."""
        return self.name_of(self.code) if self.code else None

    def name_of(self, code: int) -> str:
        """The name of the signal with ``code`` (:data:`SIGNAL_CODES`, :data:`REQUEUE_CODE`)."""
        return self.requeue.name if code == REQUEUE_CODE and self.requeue is not None else SIGNAL_NAMES[code]

    def _code(self, name: str) -> int:
        return REQUEUE_CODE if self.requeue is not None and name == self.requeue.name else SIGNAL_CODES[name]

    def __enter__(self) -> "SignalGuard":
        if threading.current_thread() is not threading.main_thread():
            return self  # signals reach only the main thread: nothing to defer here
        self._pid = os.getpid()
        defaults = dict(_DEFAULTS)
        if self.requeue is not None:
            defaults[self.requeue] = signal.SIG_DFL
        for signum, default in defaults.items():
            if signal.getsignal(signum) is default:
                self._saved[signum] = default
                signal.signal(signum, self._on_signal)
        return self

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        saved, self._saved = self._saved, {}
        for signum, previous in saved.items():
            signal.signal(signum, previous)
        # fit stopped for the requeue signal and train_end saved the boundary: requeue once
        if getattr(error, "estimatorch_requeue", False) and self._resumes and distributed.is_main_process():
            cluster.requeue()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a DataLoader worker forked during fit: the main process stops, then ends it
        name = signal.Signals(signum).name
        if not self.code:
            self.code = self._code(name)
            self._log(self._describe(name))
            if self.stoppable:
                self.stopped = name
                raise stop_exception(name)
        elif name == "SIGINT":  # a second Ctrl-C: stop at once
            signal.signal(signal.SIGINT, signal.default_int_handler)
            raise stopped_at_once(saving=self.stopped is not None)
        elif self.code < self._code(name):  # SIGTERM after a Ctrl-C: the process must end; a requeue wins
            self.code = self._code(name)
            self._log(f"{name} too: fit will end with SystemExit({128 + signum}) once it has stopped")


def stop_message(name: str, *, notebook: bool, checkpointing: bool, resumes: bool, multi: bool) -> str:
    """What the log says when signal ``name`` first arrives, for where the user is.

    Args:
        name: ``"SIGINT"``, ``"SIGTERM"``, or SLURM's requeue signal (any other name).
        notebook: running in a Jupyter kernel (``fit(..., resume=True)`` is the way back there).
        checkpointing: the fit has a ``CheckpointHandler`` (it saves the boundary).
        resumes: one of them has ``resume_from_checkpoint=True`` (a rerun continues).
        multi: several processes (they agree on the boundary: this step or the next).

    Example:
        >>> stop_message("SIGTERM", notebook=False, checkpointing=False, resumes=False, multi=False)[:46]
        'SIGTERM: stopping at the end of the current st'
    """
    where = "at the end of this step or the next (all processes stop at the same one)" if multi \
        else "at the end of the current step"
    if name == "SIGTERM":
        head = f"SIGTERM: stopping {where}"
        tail = ", then fit raises SystemExit(143)."
    elif name != "SIGINT":
        return requeue_message(name, where, checkpointing=checkpointing, resumes=resumes)
    else:
        head = f"Ctrl-C: stopping {where}"
        tail = f" ({'interrupt' if notebook else 'Ctrl-C'} again to stop at once, mid-step)."
    if checkpointing:
        head += " and writing a checkpoint of it"
        if notebook and name == "SIGINT":
            return head + tail + " fit(..., resume=True) continues from there."
        if resumes:
            return head + tail + " Rerunning the script resumes from that checkpoint."
        return head + tail + (" To resume from it, rerun with CheckpointHandler(..., "
                              "resume_from_checkpoint=True).")
    if notebook and name == "SIGINT":
        return head + tail + " fit(..., resume=True) continues from there."
    return head + tail + (" No CheckpointHandler writes resumable checkpoints: the steps trained are lost when this "
                          "process ends; add CheckpointHandler(model_dir, resume_from_checkpoint=True) to keep them.")


def requeue_message(name: str, where: str, *, checkpointing: bool, resumes: bool) -> str:
    """What the log says when SLURM's requeue signal ``name`` arrives (see :func:`stop_message`)."""
    head = f"{name} (SLURM's warning before the time limit): stopping {where}"
    end = f", then fit raises SystemExit({128 + signal.Signals[name]})."
    if checkpointing and resumes:
        return (head + " and writing a checkpoint of it; then rank 0 requeues the job (scontrol requeue "
                f"{os.environ.get('SLURM_JOB_ID', '$SLURM_JOB_ID')}), which resumes from that checkpoint" + end)
    if checkpointing:
        return (head + " and writing a checkpoint of it" + end + " The job is not requeued: no CheckpointHandler "
                "has resume_from_checkpoint=True, so a requeued job would start again from the beginning.")
    return (head + end + " Nothing is saved and the job is not requeued: the steps trained are lost when this "
            "process ends; add CheckpointHandler(model_dir, resume_from_checkpoint=True) to keep them and requeue.")
