"""Statistics of a training run, after QuantLab's meter, driven by :class:`~estimatorch.event_handlers.MeterHandler`.

Two axes:

- instantaneous (measured every ``period`` steps from ``start``, written at that step) vs
  running (accumulated over an epoch on the device, written at its end; stateful);
- callback-free (tensors the loop already has) vs callback-based (module hooks registered only
  on firing steps).

| statistic | axis | reads |
|---|---|---|
| :class:`LearningRate` | instantaneous | the optimizer's param groups |
| :class:`Throughput` | running | label shapes, wall time |
| :class:`WeightNorm` | instantaneous | parameters after the step |
| :class:`GradientNorm` | instantaneous | gradients after backward |
| :class:`UpdateToWeightRatio` | instantaneous | parameters before and after the step |
| :class:`EpochGradientNorm` | running | gradients after backward |
| :class:`ActivationStatistics` | instantaneous, forward hooks | module outputs |
| :class:`GradientFlow` | instantaneous, full backward hooks | gradients at module boundaries |
"""

from .activations import ActivationStatistics
from .base import InstantaneousStatistic, ParameterStatistic, RunningStatistic, Statistic
from .callback import CallbackStatistic
from .epoch_gradient_norm import EpochGradientNorm
from .gradient_flow import GradientFlow
from .gradient_norm import GradientNorm
from .learning_rate import LearningRate
from .throughput import Throughput
from .update_ratio import UpdateToWeightRatio
from .weight_norm import WeightNorm

__all__ = [
    "ActivationStatistics",
    "CallbackStatistic",
    "EpochGradientNorm",
    "GradientFlow",
    "GradientNorm",
    "InstantaneousStatistic",
    "LearningRate",
    "ParameterStatistic",
    "RunningStatistic",
    "Statistic",
    "Throughput",
    "UpdateToWeightRatio",
    "WeightNorm",
]
