"""Whether ``fit`` may capture the train step in a CUDA graph (``Estimator(..., cuda_graphs=True)``).

One pure decision, taken at ``fit`` start from the estimator's configuration and the fit's
handlers, before any work: :func:`capture_refusal` returns the reason a captured step cannot
train this configuration (``fit`` raises it as a ``ValueError`` naming ``cuda_graphs``), or None.
What only running the step can find out (a ``.item()`` or a branch on a tensor's value in the
model, a tensor on the CPU) is found in the eager step before the capture, watched for
synchronising calls: that fit then trains eagerly with one warning (:func:`fallback_message`).
A capture CUDA refuses all the same ends the fit (:func:`capture_error`).
docs/cuda-graphs.md has the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch

from ...events import declared, subscribes
from ...events.dispatch import handler_name
from .._fit_estimator import FitEstimator

__all__ = ["CaptureConfig", "INSIDE_STEP_EVENTS", "capture_error", "capture_refusal", "check_capture", "config_of",
           "fallback_message", "in_graph", "refusal_error", "schedule_refusal"]

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


def config_of(estimator: FitEstimator, handlers: Sequence[Any], world_size: int) -> CaptureConfig:
    """The :class:`CaptureConfig` of ``estimator`` for a fit with ``handlers``."""
    return CaptureConfig(estimator.device, estimator.precision, estimator.optimizer, world_size,
                         estimator.strategy, tuple(handlers), estimator.lr_scheduler)


def capture_refusal(config: CaptureConfig) -> Optional[str]:
    """Why a captured step cannot train ``config``, in words (None: it can be captured).

    The checks, in order: a CUDA device; one process; no fp16 grad scaler; an optimizer with a
    capturable mode; a handler stepping it at ``batch_end`` (it declares ``accumulation_steps``),
    one batch per step, whose ``batch_end`` the graph can hold (:func:`in_graph`); no handler
    listening inside the step; no scheduler cycling the momentum (:func:`schedule_refusal`).

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


def check_capture(estimator: FitEstimator, handlers: Sequence[Any], world_size: int) -> None:
    """Refuse, before any work, a fit ``Estimator(..., cuda_graphs=True)`` cannot capture.

    Raises:
        ValueError: ``cuda_graphs=True`` and why it cannot train this configuration.
    """
    if not estimator.cuda_graphs:
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


def fallback_message(where: str) -> str:
    """The one warning of a fit whose step synchronises with the host (seen at ``where`` in its
    last eager step before the capture): it then trains eagerly."""
    return (f"cuda_graphs=True: the train step makes a synchronising CUDA call ({where}), which a CUDA graph "
            "cannot record; this fit trains eagerly, as with cuda_graphs=False. Usual causes: the model reads "
            "a tensor's value on the host (.item(), bool(t), a Python branch on a tensor), copies a CPU tensor "
            "to the GPU in forward, or a custom BatchProcessor or capturable batch_end synchronises.")


def capture_error(error: BaseException) -> RuntimeError:
    """The error of a capture CUDA refused although the eager step before it made no
    synchronising call. PyTorch does not undo a failed capture (the memory pool it was filling,
    on 2.11 the random generators): the fit ends with this error, its state that of before the
    step, rather than go on in a process that would leak memory or fail at its next draw."""
    cause = error.__context__ if isinstance(error.__context__, RuntimeError) else error  # capture_end's masks it
    return RuntimeError(
        f"cuda_graphs=True: CUDA refused to record the train step ({type(cause).__name__}: {cause}). A failed "
        "capture leaves this process's CUDA memory pool and random generators in a state PyTorch does not undo, "
        "so the fit stops here, its state that of before this step: train with cuda_graphs=False (in a new "
        "process; a checkpoint of this run resumes there). Usual causes: the model reads a tensor's value on "
        "the host in some batches only, draws from a torch.Generator of its own on torch before 2.13, or "
        "allocates pinned memory in forward.")


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


def in_graph(handlers: Sequence[Any]) -> list[Any]:
    """The handlers whose ``batch_end`` the step's graph records, of ``handlers`` in dispatch
    order: those listening to ``batch_end``, from the first up to the first that does not declare
    ``capturable_batch_end`` (the others run after each replay, in their order, as always)."""
    held = []
    for handler in handlers:
        if subscribes(handler, "batch_end"):
            if not declared(handler, "capturable_batch_end"):
                break
            held.append(handler)
    return held


def _stepper(config: CaptureConfig) -> Optional[str]:
    steppers = [h for h in config.handlers
                if declared(h, "accumulation_steps") is not None and subscribes(h, "batch_end")]
    if not steppers:
        return ("no handler steps the optimizer at batch_end (none declares accumulation_steps, as "
                "GradientUpdateHandler does), and the captured step holds the optimizer's step")
    stepper = steppers[0]
    steps = declared(stepper, "accumulation_steps")
    if steps > 1:
        return (f"{handler_name(stepper)}(accumulation_steps={steps}) accumulates batches that do not step "
                "and one that does: one graph holds one whole step; use a larger batch, or cuda_graphs=False")
    if any(h is stepper for h in in_graph(config.handlers)):
        return None
    if not declared(stepper, "capturable_batch_end"):
        return (f"the optimizer is stepped by {handler_name(stepper)} ({type(stepper).__name__}), whose "
                "batch_end does not declare capturable_batch_end, so the graph cannot hold the step (a "
                "subclass overriding batch_end must declare it again); use GradientUpdateHandler itself")
    blocker = next(h for h in config.handlers
                   if subscribes(h, "batch_end") and not declared(h, "capturable_batch_end"))
    return (f"{handler_name(blocker)} (priority {declared(blocker, 'priority')}) runs at batch_end before "
            f"{handler_name(stepper)}'s optimizer step, which the graph holds, and cannot be recorded in it "
            "(it does not declare capturable_batch_end): it would see the parameters after the step; give it "
            f"a priority above {declared(stepper, 'priority')}")


def _handlers(config: CaptureConfig) -> Optional[str]:
    for handler in config.handlers:
        inside = [event for event in INSIDE_STEP_EVENTS if subscribes(handler, event)]
        if inside:
            return (f"{handler_name(handler)} listens to {inside[0]}, which fires inside the step: captured, "
                    "it would run once, when the graph is recorded, and never again; move its work to "
                    "batch_begin or batch_end, or pass cuda_graphs=False")
    return None


def _schedule(config: CaptureConfig) -> Optional[str]:
    return schedule_refusal(config.scheduler)
