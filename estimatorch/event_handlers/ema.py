"""EMAHandler: an exponential moving average of the weights, validated, left in the net at the end
of the fit and resumed exactly."""

from __future__ import annotations

from typing import Any, Optional, Union

from .._checks import check_positive_int, is_real
from ..events import BatchEnd, EpochEnd, EstimatorView
from ._weight_average import WeightAverage

__all__ = ["EMAHandler"]

#: timm's warm-up of the decay for a long run (``ModelEmaV3``'s defaults): ``(gamma, power)``.
WARMUP = (1.0, 2 / 3)


class EMAHandler(WeightAverage, BatchEnd, EpochEnd):
    """Keep an exponential moving average of the net's trainable parameters: after every
    ``update_every``-th optimizer step from ``start_step`` on, ``average = decay * average +
    (1 - decay) * weights`` (``torch._foreach_lerp_`` of the weights into the average, on the
    device: no value crosses to the host).

    The average starts as the weights at ``fit`` start and follows them (a copy at each step)
    until step ``start_step``. With ``warmup=(gamma, power)`` the ``k``-th update uses the decay
    ``min(decay, 1 - (1 + k / gamma) ** -power)`` (timm's warm-up; ``warmup=True`` is timm's
    ``(1, 2/3)``, for long runs; ``(1, 3/4)`` suits short ones): the early average forgets the
    initial weights quickly.

    **Where the average is used.** Every evaluation during ``fit`` (the validation, whose val
    metrics are then the average's: the epoch's log line says so; an ``evaluate`` a handler
    calls; the weights a ``CheckpointHandler(save_weights_only=True)`` exports) runs on the
    average, swapped into the net in place for it; the train metrics are the trained weights'.
    When a fit ends its plan the net holds the average (as Keras' ``use_ema`` and Lightning's
    weight averaging leave it), so ``evaluate``, ``predict`` and ``net.state_dict()`` afterwards
    are the average's; :meth:`raw_state_dict` gives the trained weights (``final="raw"``: the
    other way round, :meth:`average_state_dict` gives the average). A fit stopped by a signal or
    an error leaves the trained weights in the net. ``fit(..., resume=True)`` after a fit that
    ended continues from the trained weights when given this same handler.

    **What it costs.** One copy of the trainable parameters on their device (each rank its own
    shards under FSDP2: no rank holds the whole average); buffers (BatchNorm statistics) are the
    net's own, not averaged nor stored; frozen parameters are not copied. Per optimizer step one
    ``_foreach_lerp_`` over the parameters (one fused kernel per dtype on a GPU), and a few Python
    operations. Per evaluation three copies of the parameters (the swap in and out).

    **Resume.** The average is part of the run's state (``state_dict``, by parameter name): a
    checkpoint holds it (once under DDP, where every rank holds the same average; a sharded
    checkpoint each rank's shards through DCP, resharded on another world size) and a resume
    refuses one whose average does not fit the net, naming the parameter. A resume from any
    step continues the average bit for bit.

    Args:
        decay: the weight of the average at each update, in ``[0, 1)``. Defaults to 0.999.
        update_every: update the average every this many optimizer steps. Defaults to 1.
        start_step: the average follows the weights (a copy) until this many optimizer steps,
            and averages after. Defaults to 0.
        warmup: None, True (timm's ``(1, 2/3)``) or ``(gamma, power)``, both positive: the decay's
            warm-up above. Defaults to None (the decay from the first update).
        evaluate: run every evaluation during ``fit`` on the average. Defaults to True.
        final: ``"average"`` (the net holds the average when a fit ends its plan) or ``"raw"``.
            Defaults to ``"average"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from estimatorch import Estimator
        >>> net = nn.Linear(4, 2)
        >>> est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        >>> ema = EMAHandler(decay=0.9)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(4)]
        >>> _ = est.fit(data, epochs=2, event_handlers=[ema])  # doctest: +ELLIPSIS
        Training begin: ...
        >>> ema.updates, sorted(ema.raw_state_dict())
        (8, ['bias', 'weight'])
    """

    label = "EMA"

    def __init__(self, decay: float = 0.999, *, update_every: int = 1, start_step: int = 0,
                 warmup: Union[None, bool, tuple[float, float]] = None, evaluate: bool = True,
                 final: str = "average"):
        if not is_real(decay) or not 0 <= decay < 1:
            raise ValueError(f"decay must be a number in [0, 1), got {decay!r}")
        self.decay = float(decay)
        self.update_every = check_positive_int(update_every, "update_every")
        self.start_step = check_positive_int(start_step, "start_step", minimum=0)
        self.warmup = _check_warmup(warmup)
        super().__init__(evaluate=evaluate, final=final)

    def decay_at(self, update: int) -> float:
        """The decay of the ``update``-th update of the average (counted from 1).

        Example:
            >>> EMAHandler(0.999).decay_at(1), round(EMAHandler(0.999, warmup=True).decay_at(1), 4)
            (0.999, 0.37)
        """
        if self.warmup is None:
            return self.decay
        gamma, power = self.warmup
        return min(self.decay, 1 - (1 + update / gamma) ** -power)

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self._optimizer_stepped():
            self._stepped()

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """An epoch's leftover accumulation step (``GradientUpdateHandler`` takes it first)."""
        if self._stepper is not None and self._stepper.stepped:
            self._stepped()

    def _stepped(self) -> None:
        self.steps += 1
        if self.steps <= self.start_step:
            self._update(None)
        elif (self.steps - self.start_step) % self.update_every == 0:
            self.updates += 1
            self._update(1.0 - self.decay_at(self.updates))


def _check_warmup(warmup: Any) -> Optional[tuple[float, float]]:
    if warmup is None or warmup is False:
        return None
    if warmup is True:
        return WARMUP
    if isinstance(warmup, (tuple, list)) and len(warmup) == 2 and all(is_real(v) and v > 0 for v in warmup):
        return float(warmup[0]), float(warmup[1])
    raise ValueError(f"warmup must be None, True or a pair (gamma, power) of positive numbers, got {warmup!r}")
