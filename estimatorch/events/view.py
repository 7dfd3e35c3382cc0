"""What a handler may read and call on the estimator: the estimator's side of the contract.

Hooks receive the :class:`~estimatorch.Estimator` of the fit as their first argument; a handler
types it as :class:`EstimatorView` and uses only what is listed here. Anything else on the
estimator (attributes starting with ``_`` above all) may change without notice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Optional, Protocol

import torch
from torch import nn

from ..checkpoint import ResumableFit
from ..distributed import StepItems
from .timing import StepTimes

__all__ = ["EstimatorView", "PositionView"]


class PositionView(Protocol):
    """Where the loop stands, at a boundary between events (a copy: changing it changes nothing).

    ``epoch`` and ``batch`` count from 0 (``batch`` within the epoch); ``step`` counts the batches
    trained in all; ``phase`` is ``"start"``, ``"batch_end"`` or ``"epoch_end"`` (then ``epoch``
    is already the next one); ``stop`` records a stop requested there.
    """

    epoch: int
    batch: int
    step: int
    phase: str
    stop: bool


class EstimatorView(ResumableFit, Protocol):
    """The estimator as a handler sees it during ``fit`` (or ``evaluate``, for the epoch and batch
    events an evaluation fires): what a checkpoint store reads (:class:`ResumableFit`: ``net``,
    ``optimizer``, ``lr_scheduler``, ``grad_scaler`` and the payload seam ``state_payload``,
    ``check_payload``, ``load_payload``, since a handler hands the estimator to the store), and
    the members below."""

    #: the loss ``fit`` trains with; None: the model computes its own loss
    loss: Optional[Callable[..., Any]]
    train_metrics: list[Any]
    val_metrics: list[Any]
    logger: logging.Logger
    device: torch.device
    seed: int
    precision: Any
    #: the current fit's plan: epochs or batches (the other None)
    max_epoch: Optional[int]
    max_batch: Optional[int]
    #: the axis of a batch's tensors that counts samples
    batch_axis: int
    #: True when ``fit`` records the train step in a CUDA graph (``Estimator(cuda_graphs=True)``)
    cuda_graphs: bool
    #: how ``fit`` spreads the net over the ranks: ``"ddp"``, ``"fsdp"`` or None (``Estimator(strategy=)``)
    strategy: Optional[str]
    #: a callable ``lr_scheduler`` (``(optimizer, total_steps) -> scheduler``) that ``fit`` builds
    #: the scheduler with at its start, before ``train_begin``; None when none was given
    lr_scheduler_factory: Optional[Callable[[torch.optim.Optimizer, int], object]]
    #: True when a step's bits do not depend on how its micro-batches are split over processes
    #: and accumulation steps (``Estimator(world_size_invariant=True)``)
    world_size_invariant: bool

    @property
    def step_items(self) -> Optional[StepItems]:
        """The items of the optimizer step under way (what its summed gradient is divided by),
        when a step spans several micro-batches; else None."""

    @property
    def train_net(self) -> nn.Module:
        """The module the steps run (the net, or its DDP wrapper)."""

    @property
    def position(self) -> PositionView:
        """A copy of where the current (or last) fit stands."""

    @property
    def handlers(self) -> tuple[Any, ...]:
        """The current fit's handlers, in the order events reach them (empty outside fit)."""

    @property
    def batches_per_epoch(self) -> Optional[int]:
        """Batches an epoch of the current (or last) fit trains, when known."""

    @property
    def step_times(self) -> Optional[StepTimes]:
        """Where the current (or last) fit's steps spent their time, when a handler declares
        ``times_steps`` (else None): take ``.split()`` now and then (see :mod:`.timing`)."""

    @property
    def validated(self) -> bool:
        """True when validation ran during the current epoch (val metrics hold its values)."""

    @property
    def evaluated_on(self) -> Optional[str]:
        """The name of the weights the current epoch's validation ran on (``"EMA"``) when a
        handler put its own into the net for it, else None."""

    @property
    def interruption(self) -> Optional[str]:
        """``"SIGINT"`` or ``"SIGTERM"`` when the fit ends because of that signal at a step boundary."""

    @property
    def resume_pending(self) -> bool:
        """True when the current fit will resume from a snapshot."""

    @property
    def resume_step(self) -> Optional[int]:
        """The step the current fit resumes from, while a resume is pending."""

    @property
    def boundary_actions_pending(self) -> bool:
        """True while work registered with :meth:`at_boundary` (a checkpoint save, say) waits
        for the current event to reach every handler; False outside ``fit``."""

    def at_boundary(self, action: Callable[[], None]) -> None:
        """Run ``action()`` once the current event has reached every handler."""

    def fire(self, event: str, **kwargs: Any) -> bool:
        """Call the current fit's handlers of ``event`` (or of a notice); True when any asked to stop."""

    def record_validation(self, values: Optional[Mapping[str, float]] = None) -> bool:
        """Record a validation that just ran (``values``: the val metrics', computed when None) in
        ``History.validations`` at the current step, then send the notice ``validation_end`` to
        the fit's handlers; True when one asks to stop."""

    def evaluate(self, val_data: Iterable[Any], batch_axis: int = 0, event_handlers: Any = None) -> dict[str, float]:
        """Run the val metrics over ``val_data``."""

    def request_resume(self, snapshot: dict[str, Any], source: str) -> None:
        """Resume the current fit from ``snapshot`` once the loop reaches the saved position."""
