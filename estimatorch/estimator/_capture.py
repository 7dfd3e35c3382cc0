"""Whether ``fit`` may capture the train step in a CUDA graph (``Estimator(..., cuda_graphs=True)``).

One pure decision, taken at ``fit`` start from the estimator's configuration and the fit's
handlers, before any work: :func:`capture_refusal` returns the reason a captured step cannot
train this configuration (``fit`` raises it as a ``ValueError`` naming ``cuda_graphs``), or None.
What only the capture itself can find out (a ``.item()`` or a branch on a tensor's value in the
model, a tensor on the CPU) is found when the step is recorded, after warm-up: that fit then
trains eagerly with one warning (:func:`fallback_message`). docs/cuda-graphs.md has the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ..event_handlers import GradientUpdateHandler
from ..events import subscribes
from ..events.dispatch import handler_name

__all__ = ["CaptureConfig", "INSIDE_STEP_EVENTS", "capture_refusal", "check_capture", "config_of",
           "fallback_message", "refusal_error", "schedule_refusal"]

#: the events fired inside the step (between the batch reaching the device and ``batch_end``):
#: a captured step runs them once, while the graph is recorded, never again.
INSIDE_STEP_EVENTS = ("forward_begin", "forward_end", "backward_begin", "backward_end")


@dataclass(frozen=True)
class CaptureConfig:
    """What the decision reads: the estimator's device, precision, optimizer and strategy, the
    number of processes, and the fit's handlers (in dispatch order)."""

    device: torch.device
    precision: str
    optimizer: Any
    world_size: int
    strategy: Optional[str]
    handlers: Sequence[Any]
    scheduler: Any = None


def config_of(estimator: Any, handlers: Sequence[Any], world_size: int) -> CaptureConfig:
    """The :class:`CaptureConfig` of ``estimator`` for a fit with ``handlers``."""
    return CaptureConfig(estimator.device, estimator.precision, estimator.optimizer, world_size,
                         estimator.strategy, tuple(handlers), getattr(estimator, "lr_scheduler", None))


def capture_refusal(config: CaptureConfig) -> Optional[str]:
    """Why a captured step cannot train ``config``, in words (None: it can be captured).

    The checks, in order: a CUDA device; one process; no fp16 grad scaler; an optimizer with a
    capturable mode; ``GradientUpdateHandler`` (exactly) stepping it, one batch per step; no
    handler listening inside the step or at ``batch_end`` ahead of the optimizer step; no
    scheduler cycling the momentum (:func:`schedule_refusal`).

    Example:
        >>> net = torch.nn.Linear(2, 2)
        >>> config = CaptureConfig(torch.device("cpu"), "32", torch.optim.Adam(net.parameters()), 1, None, ())
        >>> capture_refusal(config).split(";")[0]
        'it needs a CUDA device and this estimator trains on cpu'
    """
    for check in (_device, _processes, _precision, _optimizer, _stepper, _handlers, _schedule):
        reason = check(config)
        if reason is not None:
            return reason
    return None


def check_capture(estimator: Any, handlers: Sequence[Any], world_size: int) -> None:
    """Refuse, before any work, a fit ``Estimator(..., cuda_graphs=True)`` cannot capture.

    Raises:
        ValueError: ``cuda_graphs=True`` and why it cannot train this configuration.
    """
    if not getattr(estimator, "cuda_graphs", False):
        return
    reason = capture_refusal(config_of(estimator, handlers, world_size))
    if reason is not None:
        raise refusal_error(reason)


def refusal_error(reason: str) -> ValueError:
    """The error of a refused capture, naming ``cuda_graphs`` and ``reason``."""
    return ValueError(f"cuda_graphs=True cannot capture this fit's train step: {reason}")


def schedule_refusal(scheduler: Any) -> Optional[str]:
    """Why the graph cannot follow ``scheduler`` (None: it can). A scheduler of the learning
    rate alone can be followed (the rate is a device tensor filled in place); one that cycles
    the momentum (``OneCycleLR``, ``CyclicLR``) changes values the graph keeps as recorded.
    ``fit`` asks again once it built a scheduler given as a callable."""
    if not getattr(scheduler, "cycle_momentum", False):
        return None
    return (f"{type(scheduler).__name__} cycles the optimizer's momentum, which a graph keeps as "
            "recorded; pass cycle_momentum=False")


def fallback_message(error: BaseException) -> str:
    """The one warning of a fit whose step could not be recorded (it then trains eagerly)."""
    return (f"cuda_graphs=True: the train step could not be captured in a CUDA graph ({type(error).__name__}: "
            f"{error}); this fit trains eagerly, as with cuda_graphs=False. Usual causes: the model reads a "
            "tensor's value on the host (.item(), bool(t), a Python branch on a tensor), holds a CPU tensor "
            "it copies to the GPU in forward, or a custom BatchProcessor synchronises.")


def _device(config: CaptureConfig) -> Optional[str]:
    if config.device.type == "cuda":
        return None
    return (f"it needs a CUDA device and this estimator trains on {config.device}; pass "
            "cuda_graphs=torch.cuda.is_available() in a script meant for both")


def _processes(config: CaptureConfig) -> Optional[str]:
    if config.world_size == 1:
        return None
    if config.strategy == "fsdp":
        return (f"FSDP (strategy='fsdp', {config.world_size} processes) gathers and frees parameters with "
                "host-side bookkeeping in every step, which a CUDA graph cannot hold")
    return (f"under torch.distributed ({config.world_size} processes) the step is DDP's, and PyTorch captures "
            "a DDP backward only when NCCL's asynchronous error handling is off before the process group "
            "starts (TORCH_NCCL_ASYNC_ERROR_HANDLING=0), DDP is built on a side stream and 11 eager steps "
            "run before the capture; fit does not arrange that: train one process with cuda_graphs=True, "
            "or several without it")


def _precision(config: CaptureConfig) -> Optional[str]:
    if config.precision != "16-mixed":
        return None
    return ("precision='16-mixed' steps through a GradScaler, which reads on the host whether the "
            "gradients hold inf or NaN to skip the step; use precision='bf16-mixed' (no scaler) or '32'")


def _optimizer(config: CaptureConfig) -> Optional[str]:
    optimizer = config.optimizer
    if "capturable" in getattr(optimizer, "defaults", {}):
        return None
    return (f"{type(optimizer).__name__} has no capturable mode (a graph would keep its learning rate "
            "as it was when recorded, or its step reads values on the host); use an optimizer with "
            "capturable=True support, e.g. torch.optim.Adam or AdamW (fit turns capturable on)")


def _stepper(config: CaptureConfig) -> Optional[str]:
    steppers = [h for h in config.handlers if isinstance(h, GradientUpdateHandler) and subscribes(h, "batch_end")]
    if not steppers:
        return ("no GradientUpdateHandler steps the optimizer at batch_end; the captured step holds "
                "GradientUpdateHandler's optimizer step")
    stepper = steppers[0]
    if type(stepper) is not GradientUpdateHandler:
        return (f"the optimizer is stepped by {handler_name(stepper)} ({type(stepper).__name__}), whose "
                "step the graph cannot be sure to hold; use GradientUpdateHandler itself")
    if stepper.accumulation_steps > 1:
        return (f"GradientUpdateHandler(accumulation_steps={stepper.accumulation_steps}) accumulates "
                "batches that do not step and one that does: one graph holds one whole step; use a larger "
                "batch, or cuda_graphs=False")
    return None


def _handlers(config: CaptureConfig) -> Optional[str]:
    stepper = next(h for h in config.handlers if isinstance(h, GradientUpdateHandler))  # _stepper found it
    for handler in config.handlers:
        inside = [event for event in INSIDE_STEP_EVENTS if subscribes(handler, event)]
        if inside:
            return (f"{handler_name(handler)} listens to {inside[0]}, which fires inside the step: captured, "
                    "it would run once, when the graph is recorded, and never again; move its work to "
                    "batch_begin or batch_end, or pass cuda_graphs=False")
        if handler is not stepper and subscribes(handler, "batch_end") and \
                getattr(handler, "priority", 0) < stepper.priority:
            return (f"{handler_name(handler)} (priority {handler.priority}) runs at batch_end before "
                    "GradientUpdateHandler's optimizer step, which the graph holds: it would see the "
                    "parameters after the step; give it a priority above -2000")
    return None


def _schedule(config: CaptureConfig) -> Optional[str]:
    return schedule_refusal(config.scheduler)
