"""What handlers (and a checkpoint store) read of the fit in progress, or the last one: where it
stands, whether it validated, stopped for a signal or resumes, and ``at_boundary``. A base class of
:class:`~estimatorch.estimator.Estimator`, which holds the run (``_run``) these read."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Optional

from ..events import Dispatch
from ..events.timing import StepTimes
from ..metrics.base import metric_name
from ._state.run import Position, Run, Stage, resume_plan

__all__ = ["RunView"]


class RunView:
    """The current (or last) fit as handlers see it; :class:`Estimator` sets the attributes."""

    _run: Optional[Run]
    _fitting: bool
    val_metrics: list[Any]
    #: the current fit's handlers, one list per event, in dispatch order (empty outside ``fit``):
    #: ``dispatch.forward_begin`` is falsy when no handler listens to ``forward_begin``, so that a
    #: batch processor fires only what someone hears (see :class:`~estimatorch.events.Dispatch`)
    dispatch: Dispatch

    @property
    def _dispatch(self) -> Dispatch:
        """Deprecated: read :attr:`dispatch`."""
        warnings.warn("Estimator._dispatch is deprecated: read Estimator.dispatch (the same Dispatch)",
                      DeprecationWarning, stacklevel=2)
        return self.dispatch

    def at_boundary(self, action: Callable[[], None]) -> None:
        """Run ``action()`` once the current event has reached every handler.

        A handler that must see the state *between* events (a checkpoint, say) registers its
        work here from ``batch_end`` or ``epoch_end``.
        """
        self._current_run("at_boundary").boundary_actions.append(action)

    # -- state: snapshots, resume -----------------------------------------------------------
    @property
    def batches_per_epoch(self) -> Optional[int]:
        """Batches an epoch of the current (or last) fit trains (its data's, capped by
        ``fit(batches_per_epoch=...)``), when known."""
        return self._run.counts.per_epoch if self._run is not None else None

    @property
    def handlers(self) -> tuple[Any, ...]:
        """The current fit's handlers, in the order events reach them (empty outside fit)."""
        return tuple(self.dispatch.handlers)

    @property
    def boundary_actions_pending(self) -> bool:
        """True while work registered with :meth:`at_boundary` (a checkpoint save, say) waits
        for the current event to reach every handler; False outside ``fit``."""
        run = self._active
        return run is not None and bool(run.boundary_actions)

    @property
    def step_times(self) -> Optional[StepTimes]:
        """Where the current (or last) fit's steps spent their time, when one of its handlers
        declares ``times_steps`` (else None): see :mod:`estimatorch.events.timing`."""
        return self._run.step_times if self._run is not None else None

    @property
    def validated(self) -> bool:
        """True when ``evaluate`` ran during the current epoch of ``fit`` (until that epoch's
        ``epoch_end`` has reached every handler): val metrics then hold this epoch's values."""
        run = self._active
        return run is not None and run.evaluated

    def record_validation(self, values: Optional[Mapping[str, float]] = None) -> bool:
        """Record a validation that just ran during ``fit`` (a ``ValidationHandler`` calls it
        after each): ``values`` (the val metrics' values, computed when None: a collective) go
        to ``History.validations`` with the step validated (the batches trained, the current one
        included when it runs inside a step's events) and the epoch it runs in, then the notice
        ``validation_end`` reaches every handler that listens (loggers, trackers, early stopping,
        the best checkpoint). Returns True when one of them asks to stop."""
        run = self._current_run("record_validation")
        if values is None:
            values = {metric_name(m): float(m.compute()) for m in self.val_metrics}
        values = {str(name): float(value) for name, value in values.items()}
        pos = run.pos
        in_step = run.stage is Stage.STEPPING and not run.in_epoch_event
        after_epoch = run.stage is Stage.AT_BOUNDARY and pos.phase == "epoch_end"  # the epoch was counted
        step, epoch = pos.step + (1 if in_step else 0), pos.epoch + (0 if after_epoch else 1)
        phase = "batch_end" if in_step else "epoch_end" if run.in_epoch_event else pos.phase
        run.history.validations.record(step, epoch, values)
        return run.dispatch.fire("validation_end", self, values=values, step=step,  # type: ignore[arg-type]
                                 epoch=epoch, phase=phase)

    @property
    def evaluated_on(self) -> Optional[str]:
        """The name of the weights the current epoch's validation ran on when a handler put its
        own into the net for it (``"EMA"``: see :meth:`~estimatorch.events.Handler.evaluation_weights`),
        None for the net's own weights or before any validation of the epoch."""
        run = self._active
        return run.evaluated_on if run is not None and run.evaluated else None

    @property
    def interruption(self) -> Optional[str]:
        """``"SIGINT"`` or ``"SIGTERM"`` when the current (or last) fit ends because of that
        signal at a step boundary, so that its state is exactly resumable (``CheckpointHandler``
        saves it in ``train_end``); None otherwise (also after a second Ctrl-C, mid-step)."""
        return self._run.signals.stopped if self._run is not None else None

    @property
    def position(self) -> Position:
        """A copy of where the current (or last) fit stands."""
        return dataclasses.replace(self._run.pos) if self._run is not None else Position()

    def request_resume(self, snapshot: dict[str, Any], source: str) -> None:
        """Resume the current fit from ``snapshot`` (a CheckpointHandler calls this in
        ``train_begin``). Validated at once; applied when the loop reaches the saved position."""
        run = self._current_run("request_resume")
        run.pending = resume_plan(run, snapshot, source)

    @property
    def resume_pending(self) -> bool:
        """True when the current fit will resume from a snapshot."""
        run = self._active
        return run is not None and run.pending is not None

    @property
    def resume_step(self) -> Optional[int]:
        """The step (batches trained) the current fit resumes from, while a resume is pending."""
        run = self._active
        return run.pending["position"]["step"] if run is not None and run.pending is not None else None

    @property
    def _active(self) -> Optional[Run]:
        """The run of the fit in progress, None outside fit."""
        return self._run if self._fitting else None

    def _current_run(self, method: str) -> Run:
        if not self._fitting or self._run is None:
            raise RuntimeError(f"{method}() is only available during fit")
        return self._run
