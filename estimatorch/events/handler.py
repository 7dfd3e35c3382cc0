"""The handler base: what a handler may declare and the hooks ``fit`` may call besides the events.

:class:`Handler` declares, with a default each, everything the loop reads of a handler: its
``priority``; which events of the mixins it inherits it listens to (:meth:`~Handler.listens_to`);
:meth:`~Handler.check_fit`, called before any work; which attributes are its state
(``state_attributes``) and which of those count batches (``elastic_batch_counters``); and its
capabilities (``checkpoint_location``, ``resumes_run``, ``elastic_checkpoints``,
``accumulation_steps``, ``times_steps``, :meth:`~Handler.stop_limits`, ``capturable_batch_end``
with :meth:`~Handler.record_batch_end`, :meth:`~Handler.stepped_schedule`, what it measured of
an epoch: :meth:`~Handler.epoch_rates`, :meth:`~Handler.epoch_readings`; the handlers it attaches
to every evaluation during ``fit``: :meth:`~Handler.evaluation_handlers`; the weights those
evaluations run on: :meth:`~Handler.evaluation_weights`; and the check of a saved state before
any is loaded: :meth:`~Handler.check_state_dict`). :class:`StatefulHandler` adds the
``state_dict`` / ``load_state_dict`` of the declared state.

The loop reads each of them through :func:`declared`, never ``getattr``: a name the loop reads is
a member of :class:`Handler` (``tests/test_layers.py`` checks).

A handler that inherits only the mixins works too: every declaration then has its default.
"""

from __future__ import annotations

import copy
import inspect
import warnings
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Optional, TypeVar

import torch

from .._checks import check_state_keys

if TYPE_CHECKING:  # the estimator's side of the contract; typing only
    from .view import EstimatorView

__all__ = ["Handler", "StatefulHandler", "declared", "is_rank_identical_stop", "rank_identical_stop"]

_F = TypeVar("_F", bound=Callable[..., Any])


def rank_identical_stop(batch_end: _F) -> _F:
    """Mark a ``batch_end`` whose ``True`` is the same on every rank at the same step by
    construction (counters every rank advances alike, a value reduced across ranks): under
    torch.distributed ``fit`` then stops every rank at that very step without exchanging it.
    A subclass that overrides the method is not marked. A wrong mark stops one rank while the
    others wait in the next step's all-reduce: mark only what you can prove."""
    batch_end.rank_identical_stop = True  # type: ignore[attr-defined]
    return batch_end


def is_rank_identical_stop(batch_end: object) -> bool:
    """Whether the hook ``batch_end`` (a handler's bound method) is marked :func:`rank_identical_stop`.

    Example:
        >>> from estimatorch.events import BatchEnd
        >>> class Counted(Handler, BatchEnd):
        ...     @rank_identical_stop
        ...     def batch_end(self, estimator, **kwargs):
        ...         return False
        >>> is_rank_identical_stop(Counted().batch_end), is_rank_identical_stop(print)
        (True, False)
    """
    return bool(getattr(batch_end, "rank_identical_stop", False))


class Handler:
    """Base of handlers: the declarations ``fit`` reads, each with its default.

    Subclass it together with the event mixins whose hooks you override.

    Example:
        >>> from estimatorch.events import BatchEnd, Dispatch
        >>> class Every(Handler, BatchEnd):
        ...     def __init__(self, period=None):
        ...         self.period = period
        ...     def listens_to(self, event):
        ...         return self.period is not None  # no call per step without a period
        ...     def batch_end(self, estimator, **kwargs):
        ...         return False
        >>> len(Dispatch([Every(5)]).batch_end), len(Dispatch([Every()]).batch_end)
        (1, 0)
    """

    #: Dispatch rank: lower runs first. Ties keep the order handlers were given in.
    priority: float = 0
    #: True when the state is the same on every rank (decisions on reduced values, weights or
    #: gradients DDP keeps in step): a checkpoint then stores it once, not once per rank.
    shared_state: bool = False
    #: the attributes that make up this handler's state (:class:`StatefulHandler` saves them; a
    #: resume checks each saved one against the current value's type before loading any).
    state_attributes: ClassVar[tuple[str, ...]] = ()
    #: state keys that count this process's batches (or samples); an elastic resume on another
    #: world size scales them like the position (``"a.b"``: entry ``b`` of the dict ``a``). Those
    #: of the base classes count too.
    elastic_batch_counters: ClassVar[tuple[str, ...]] = ()
    #: batches per optimizer step, for the handler that steps the optimizer; None for the others.
    accumulation_steps: Optional[int] = None
    #: True when this handler reads ``estimator.step_times``: ``fit`` then measures where each
    #: step's time goes (a few microseconds per step; nothing when no handler asks).
    times_steps: bool = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        legacy = cls.__dict__.get("_state_attrs")
        if legacy is not None and "state_attributes" not in cls.__dict__:
            warnings.warn(f"{cls.__qualname__}._state_attrs is deprecated: name the state attributes in "
                          "state_attributes", DeprecationWarning, stacklevel=2)
            cls.state_attributes = tuple(legacy)
        legacy_check = cls.__dict__.get("_check_fit")
        if legacy_check is not None and "check_fit" not in cls.__dict__:
            warnings.warn(f"{cls.__qualname__}._check_fit is deprecated: override check_fit",
                          DeprecationWarning, stacklevel=2)
            cls.check_fit = legacy_check  # type: ignore[method-assign]

    @property
    def name(self) -> str:
        """The key this handler's state is saved under. Defaults to the class name."""
        return self.__dict__.get("_name") or type(self).__name__

    @name.setter
    def name(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError(f"name must be a non-empty str, got {value!r}")
        self._name = value

    def listens_to(self, event: str) -> bool:
        """Whether ``fit`` calls this handler's hook of ``event``, one whose mixin the class
        inherits and whose hook it overrides. Asked once per event at the start of each ``fit``
        (never per step): say False for the events your options leave unused (a per-batch
        feature that is off), so that a step does not call you for nothing. Defaults to True."""
        return True

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Called at the start of ``fit``, after every handler is known and before any work
        (before ``train_begin``, before any data is read): raise ``ValueError`` (or
        ``FileExistsError``...) for a setting this fit cannot honour. ``resume`` is
        ``fit(..., resume=True)``. Defaults to nothing."""

    @property
    def checkpoint_location(self) -> Optional[str]:
        """Where this handler writes checkpoints a fit resumes from (a directory), None when it
        writes none: ``fit`` then tells a stopped user where the state went and saves a signal's
        boundary only when some handler has one."""
        return None

    @property
    def diagnostics_location(self) -> Optional[str]:
        """Where this handler writes diagnostic files (traces, say), None when it writes none:
        ``fit`` writes a CUDA memory snapshot there on an out-of-memory error."""
        return None

    @property
    def resumes_run(self) -> bool:
        """True when this handler resumes the fit from a checkpoint of its own in
        ``train_begin`` (a rerun of the script continues the run)."""
        return False

    @property
    def elastic_checkpoints(self) -> bool:
        """True when this handler's checkpoints must resume on another world size: ``fit`` then
        lays the data out in global steps (see ``CheckpointHandler(elastic=True)``)."""
        return False

    def stop_limits(self) -> tuple[Optional[int], Optional[int]]:
        """``(epochs, batches)`` after which this handler stops the fit whatever happens (None
        each where it does not): ``fit`` counts its plan with them."""
        return None, None

    @property
    def capturable_batch_end(self) -> bool:
        """True when ``batch_end`` may be recorded in the train step's CUDA graph
        (``Estimator(cuda_graphs=True)``): it only queues device work on the step's tensors, the
        same for every batch of one shape (no value read on the host, no Python branch on one),
        and the tensors it keeps it updates in place. A replay repeats that device work, not the
        Python around it: :meth:`record_batch_end` says what the host does after each replay.
        The graph holds the ``batch_end`` of the handlers that say so, from the first in dispatch
        order up to the first that does not; it must hold the optimizer's step. Its return value
        is not read (a replay returns nothing): a held handler cannot stop the fit. Defaults to False:
        ``batch_end`` runs after each replay, outside the graph, as without one."""
        return False

    def record_batch_end(self, estimator: EstimatorView) -> Callable[[], None]:
        """Called once, right after ``fit`` recorded this handler's ``batch_end`` in the step's
        graph (:attr:`capturable_batch_end`): return what the host must do after each replay in
        place of the Python that ``batch_end`` ran (a flag it sets, a counter it advances by what
        the recorded batch added). Defaults to a function that does nothing."""
        return _nothing

    def stepped_schedule(self, estimator: EstimatorView) -> Optional[tuple[Any, str]]:
        """The learning-rate schedule this handler steps in this fit and when (``"batch"``: after
        each optimizer step; ``"epoch"``: at ``epoch_end``), None when it steps none: ``fit``
        checks that schedule's horizon against its plan. Defaults to None."""
        return None

    def epoch_rates(self, epoch: int) -> Optional[Sequence[float]]:
        """The learning rates (one per param group of the estimator's optimizer) epoch ``epoch``
        (counted from 0, the one ending) trained with, when this handler changed them at that
        epoch's end or after its last step (a scheduler), so that the epoch's record shows the
        rates it trained with; None when it changed none. The first handler in dispatch order
        that says is the one read. Defaults to None."""
        return None

    def epoch_readings(self, epoch: int) -> Mapping[str, float]:
        """What this handler measured of epoch ``epoch`` (counted from 0, the one ending) by its
        ``epoch_end``, named (``time_step``, ``mfu``...): ``History``, the loggers and trackers
        record it (:func:`~estimatorch.events.readings.epoch_readings`). Defaults to none."""
        return {}

    def evaluation_handlers(self, batches: Iterable[Any]) -> Sequence[Any]:
        """The handlers this handler attaches to every evaluation of its ``fit`` (``evaluate``
        and the validation ``fit`` runs call them with its own): the progress bar's validation
        bar. ``batches`` is this rank's share of the data evaluated (its ``len`` when it has one).
        Called once per evaluation, never per step. Defaults to none."""
        return ()

    def evaluation_weights(self, estimator: EstimatorView) -> Optional[AbstractContextManager[str]]:
        """A context in which ``estimator.net`` holds the weights this handler keeps for
        evaluation (an average of the weights), None to leave the net's own. Every evaluation
        during ``fit`` (the validation, an ``evaluate`` a handler calls) and the weights export a
        ``CheckpointHandler`` writes run inside it (:func:`~estimatorch.events.weights.evaluation_weights`);
        what it enters as names those weights in the logs (``"EMA"``). It must leave the net's own
        weights back, bit for bit, when it exits. Called once per evaluation, never per step.
        Defaults to None."""
        return None

    def check_state_dict(self, state: Any) -> None:
        """Check a saved state of this handler (from a checkpoint a resume considers) against
        this fit before any state is loaded, after every ``train_begin`` of the fit: raise
        ``ValueError`` saying what does not fit (a tensor by name and shape), so that the resume
        refuses that checkpoint (and tries an older one) instead of failing when it loads it.
        Defaults to nothing (``load_state_dict`` is the judge)."""


class StatefulHandler(Handler):
    """A :class:`Handler` whose ``state_attributes`` are its state: :meth:`state_dict` copies
    them and :meth:`load_state_dict` checks that each is present.

    Counters are reset in ``train_begin`` so one instance can serve many ``fit`` calls.

    Example:
        >>> import inspect
        >>> class Counter(StatefulHandler):
        ...     state_attributes = ("count",)
        ...     def __init__(self, start=0):
        ...         self.count = start
        >>> str(inspect.signature(Counter)), Counter(3).state_dict()
        ('(start=0)', {'count': 3})
    """

    def state_dict(self) -> dict[str, Any]:
        """This handler's counters, as tensors and plain python values."""
        return {attr: _copy(getattr(self, attr)) for attr in self.state_attributes}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; raises ``ValueError`` naming a missing key."""
        check_state_keys(state, self.state_attributes, self.name)
        for attr in self.state_attributes:
            setattr(self, attr, _copy(state[attr]))


def declared(handler: Any, attribute: str) -> Any:
    """``handler``'s declaration ``attribute`` (a value, property or method :class:`Handler`
    defines), or its default for a handler that inherits only the mixins (a method: the default
    bound to ``handler``).

    Example:
        >>> from estimatorch.events import TrainBegin
        >>> class Plain(TrainBegin): pass
        >>> declared(Plain(), "resumes_run"), declared(Plain(), "state_attributes"), declared(Plain(), "stop_limits")()
        (False, (), (None, None))
    """
    if isinstance(handler, Handler):
        return getattr(handler, attribute)
    default = inspect.getattr_static(Handler, attribute)
    if isinstance(default, property):
        return getattr(handler, attribute) if hasattr(handler, attribute) else default.fget(handler)  # type: ignore[misc]
    if inspect.isfunction(default):
        return getattr(handler, attribute) if hasattr(handler, attribute) else default.__get__(handler)
    return getattr(handler, attribute, default)


def _nothing() -> None:
    """What a replay asks of a handler that keeps no Python state in ``batch_end``."""


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)
