"""The handler contract: the layer between the loop and every handler, built-in or yours.

- the event mixins (:mod:`.mixins`): a handler subscribes to an event by inheriting its mixin and
  overriding its hook; the notices ``checkpoint_saved``, ``validation_end`` and ``after_train_end`` come the same way;
- :class:`Handler`: what a handler may declare (``priority``, :meth:`~Handler.listens_to`,
  :meth:`~Handler.check_fit`, ``state_attributes``, ``elastic_batch_counters``, capabilities), and
  :class:`StatefulHandler`, which saves the declared state;
- :class:`EstimatorView`: what a handler may read and call on the estimator;
- :class:`Dispatch`: the per-event lists a step walks, decided once per ``fit``;
- :mod:`.timing`: where the steps' time goes (``estimator.step_times``), for a handler that
  declares ``times_steps``;
- :mod:`.monitor`: the rule a handler monitoring a metric follows;
- :mod:`.weights`: the weights an evaluation during ``fit`` runs on (a handler's average).

The built-in handlers (:mod:`estimatorch.event_handlers`) use nothing else.
"""

from .dispatch import (
    Dispatch,
    accumulation_steps,
    check_fit,
    check_handlers,
    check_metric_references,
    handler_name,
    order_handlers,
    state_attributes,
    subscribes,
)
from .handler import Handler, StatefulHandler, declared, is_rank_identical_stop, rank_identical_stop
from .mixins import (
    BATCH_EVENTS,
    EVENTS,
    NOTICES,
    AfterTrainEnd,
    BackwardBegin,
    BackwardEnd,
    BatchBegin,
    BatchEnd,
    CheckpointSaved,
    EpochBegin,
    EpochEnd,
    ForwardBegin,
    ForwardEnd,
    TrainBegin,
    TrainEnd,
    ValidationEnd,
)
from .timing import PARTS, StepSplit, StepTimes
from .view import EstimatorView, PositionView
from .weights import evaluation_weights

__all__ = [
    "BATCH_EVENTS",
    "EVENTS",
    "NOTICES",
    "PARTS",
    "AfterTrainEnd",
    "BackwardBegin",
    "BackwardEnd",
    "BatchBegin",
    "BatchEnd",
    "CheckpointSaved",
    "Dispatch",
    "EpochBegin",
    "EpochEnd",
    "EstimatorView",
    "ForwardBegin",
    "ForwardEnd",
    "Handler",
    "PositionView",
    "StatefulHandler",
    "StepSplit",
    "StepTimes",
    "TrainBegin",
    "TrainEnd",
    "ValidationEnd",
    "accumulation_steps",
    "check_fit",
    "check_handlers",
    "check_metric_references",
    "declared",
    "evaluation_weights",
    "handler_name",
    "order_handlers",
    "is_rank_identical_stop",
    "rank_identical_stop",
    "state_attributes",
    "subscribes",
]
