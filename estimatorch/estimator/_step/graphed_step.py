"""The captured train step of ``Estimator(..., cuda_graphs=True)``: PyTorch's whole-network
capture recipe (``torch.cuda.graph``), run by the loop in place of the batch processor.

For a fit that :mod:`._capture` accepted, :class:`GraphedStep` owns the step: the batch
processor's forward, loss and backward, and the ``batch_end`` of the handlers that declare
``capturable_batch_end`` (:func:`._capture.in_graph`: ``GradientUpdateHandler``'s clipping and
optimizer step, ``MetricHandler``'s updates), taken out of the ``batch_end`` dispatch. It runs

1. the first :data:`WARMUP_STEPS` batches eagerly on a side stream (lazy state: the optimizer's
   moments, cuBLAS handles, autograd's streams), as the recipe asks;
2. then records the step for the next batch whose layout (structure, shapes, dtypes, strides)
   is the previous batch's (never a one-off such as an epoch's partial last batch) in one
   graph, on static input buffers cloned from that batch, in a private memory pool, and
   replays it;
3. every later batch of that layout: copied into the static buffers, the graph replayed; any
   other batch (the partial last one) eagerly, on the current stream.

The optimizer is switched to ``capturable=True`` with its learning rate in a device tensor
first, so that the graph reads the rate a scheduler sets (in place, ``fill_``). Dropout's
random numbers come from the default CUDA generator, which ``torch.cuda.graph`` registers: a
replay draws what the eager step would and advances the generator as it would, so the
generator state a checkpoint saves is exact. After each replay the host does what each
recorded handler's ``record_batch_end`` asked (a flag, counts). The other ``batch_end``
handlers get copies of the graph's ``pred`` and ``loss`` (its own are overwritten by the next
replay) and the batch's own inputs and label. The warm-up steps are watched for synchronising
calls (a host read in the model): one seen in the step before the capture leaves the fit eager,
with one warning. A capture CUDA refuses all the same cannot be undone in the process: the held
handlers' attributes and the train metrics' states are put back as they were before it, and the
fit ends with the error.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ..._batches import map_tensors, tensors_in
from ..._checks import warn_user
from ...events import declared
from .._fit_estimator import FitEstimator
from .._state.run import Run
from .capture import capture_error, fallback_message, in_graph, refusal_error, schedule_refusal

__all__ = ["GraphedStep", "WARMUP_STEPS", "graphed_step", "layout_of"]

#: eager steps on a side stream before the capture (PyTorch's examples take 3; DDP would need 11)
WARMUP_STEPS = 3

# torch warns once per optimizer that a capturable one steps uncaptured: the warm-up steps do
_UNCAPTURED = r".*capturable=True.*"
#: torch's warning for a synchronising call under ``torch.cuda.set_sync_debug_mode("warn")``
SYNC_WARNING = "called a synchronizing CUDA operation"


def graphed_step(estimator: FitEstimator, run: Run) -> Optional[GraphedStep]:
    """The step ``fit`` runs for ``estimator`` (None without ``cuda_graphs``): takes the
    ``batch_end`` of the handlers the graph records (:func:`._capture.in_graph`, the optimizer's
    step among them: ``_capture`` checked) out of ``run``'s dispatch, into the step. Called after
    ``train_begin`` (a resume's scheduler and handler states are in place)."""
    if not estimator.cuda_graphs:
        return None
    reason = schedule_refusal(estimator.lr_scheduler)  # one given as a callable is built by now
    if reason is not None:
        raise refusal_error(reason)
    held = in_graph(run.dispatch.handlers)
    run.dispatch.batch_end = run.dispatch.batch_end[len(held):]  # held: the first batch_end listeners
    return GraphedStep(estimator, held)


def layout_of(obj: Any, tensors: list[torch.Tensor]) -> Any:
    """A hashable key of ``obj``'s structure, its tensors' shapes, dtypes and devices and its
    other values, collecting its tensors into ``tensors`` (in order): batches of one key can
    share a graph.

    Example:
        >>> found = []
        >>> layout_of([torch.zeros(2, 3), {"n": 1}], found) == layout_of([torch.ones(2, 3), {"n": 1}], [])
        True
        >>> len(found)
        1
    """
    if isinstance(obj, torch.Tensor):
        tensors.append(obj)
        return (obj.shape, obj.dtype, obj.device, obj.stride())
    if isinstance(obj, (tuple, list)):
        return (type(obj), tuple(layout_of(x, tensors) for x in obj))
    if isinstance(obj, Mapping):
        return (type(obj), tuple((k, layout_of(v, tensors)) for k, v in obj.items()))
    try:
        hash(obj)
    except TypeError:
        return ("unhashable", id(obj))  # never equal to another batch's: eager
    return ("value", obj)


class GraphedStep:
    """The loop's step under ``cuda_graphs=True`` (see the module): ``fit_batch`` as a batch
    processor's, plus the optimizer step."""

    def __init__(self, estimator: FitEstimator, held: list[Any]):
        self.estimator = estimator
        self.processor = estimator.batch_processor
        #: the handlers whose ``batch_end`` the step runs (and the graph records), in order
        self.held = held
        #: what the host does after each replay, one per held handler (``record_batch_end``)
        self.after_replay: list[Any] = []
        self.device = estimator.device
        self.warm = 0
        self.failed = False  # the step synchronises: eager for the rest of the fit
        self.synced: Optional[str] = None  # where the last watched eager step synchronised
        self.prepared = False
        self.graph: Optional[torch.cuda.CUDAGraph] = None
        self.key: Any = None
        self.last_key: Any = None  # the layout of the last warm-up batch
        self.static: list[torch.Tensor] = []
        self.static_batch: Any = None
        self.rates: list[torch.Tensor] = []
        self.outputs: Any = None
        self.side = torch.cuda.Stream(self.device)
        self.pool = torch.cuda.graph_pool_handle()
        #: steps replayed from the graph, and steps run eagerly (warm-up, other layouts, a fallback)
        self.replayed = 0
        self.eager = 0

    def fit_batch(self, estimator: FitEstimator, batch: Any, batch_axis: int = 0) -> tuple[Any, Any, Any, Any]:
        """One training step on ``batch`` (on the device): forward, loss, backward and the
        optimizer step; returns ``(data, label, pred, loss)`` for ``batch_end``."""
        tensors: list[torch.Tensor] = []
        key = layout_of(batch, tensors)
        if self.graph is not None:
            if key == self.key:
                self._keep_rates(estimator.optimizer)
                for static, tensor in zip(self.static, tensors):
                    static.copy_(tensor, non_blocking=True)
                self.graph.replay()
                self.replayed += 1
                for after in self.after_replay:  # the held handlers' Python, which no replay runs
                    after()
                return self._outputs(tensors)
            return self._eager(batch, batch_axis, side=False)
        if not self.prepared:
            _make_capturable(estimator.optimizer, self.device)
            self.prepared = True
        if self.failed:
            return self._eager(batch, batch_axis, side=False)
        if self.warm < WARMUP_STEPS or key != self.last_key:  # never a one-off layout
            self.warm += 1
            self.last_key = key
            return self._watched(batch, batch_axis)
        if self.synced is not None:  # the step before, of this layout, synchronised: so would this one
            self.failed = True
            warn_user(fallback_message(self.synced))
            return self._eager(batch, batch_axis, side=False)
        return self._capture(batch, batch_axis, key, tensors)

    # -- eager ---------------------------------------------------------------------------------
    def _eager(self, batch: Any, batch_axis: int, side: bool) -> tuple[Any, Any, Any, Any]:
        self.eager += 1
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=_UNCAPTURED)
            if not side:
                return self._step(batch, batch_axis)
            current = torch.cuda.current_stream(self.device)
            self.side.wait_stream(current)
            with torch.cuda.stream(self.side):
                out = self._step(batch, batch_axis)
            current.wait_stream(self.side)
        for t in tensors_in(out):  # made on the side stream, used on this one: not reused before
            t.record_stream(current)
        return out

    def _watched(self, batch: Any, batch_axis: int) -> tuple[Any, Any, Any, Any]:
        """An eager warm-up step watched for synchronising calls (torch's sync debug mode, set to
        warn): a step that synchronises cannot be captured, and a capture CUDA refuses cannot be
        undone, so the capture waits for a step of its layout that made none. Only this thread's
        warnings count (the mode is the process's: a pin-memory or writer thread's are dropped)."""
        seen: list[str] = []
        me = threading.get_ident()
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings():
            warnings.filterwarnings("always", message=SYNC_WARNING)
            shown = warnings.showwarning

            def show(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
                if SYNC_WARNING not in str(message):
                    shown(message, category, filename, lineno, *args, **kwargs)
                elif threading.get_ident() == me:
                    seen.append(f"{filename}:{lineno}")

            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = self._eager(batch, batch_axis, side=True)
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self.synced = f"at {seen[0]}" + (f" and {len(seen) - 1} more" if len(seen) > 1 else "") if seen else None
        return out

    def _step(self, batch: Any, batch_axis: int) -> tuple[Any, Any, Any, Any]:
        data, label, pred, loss = self.processor.fit_batch(self.estimator, batch, batch_axis)
        for handler in self.held:
            handler.batch_end(self.estimator, batch=batch, pred=pred, label=label, loss=loss)
        return data, label, pred, loss

    # -- captured ------------------------------------------------------------------------------
    def _capture(self, batch: Any, batch_axis: int, key: Any, tensors: list[torch.Tensor]) -> tuple[Any, Any, Any, Any]:
        static = [t.clone() for t in tensors]
        ids = {id(t): s for t, s in zip(tensors, static)}
        static_batch = map_tensors(batch, lambda t: ids.get(id(t), t))
        optimizer = self.estimator.optimizer
        optimizer.zero_grad(set_to_none=True)  # backward allocates the gradients in the graph's pool
        before = _python_state(self.held, self.estimator.train_metrics)
        graph = torch.cuda.CUDAGraph()
        try:
            # on the step's device and side stream (torch's default capture stream is the current
            # device's: a model on another GPU would not be recorded); thread_local: the
            # DataLoader's pin-memory thread may allocate pinned memory meanwhile (an error for
            # the capture in "global" mode), this thread's host reads still fail it
            with torch.cuda.device(self.device), \
                    torch.cuda.graph(graph, pool=self.pool, stream=self.side, capture_error_mode="thread_local"):
                outputs = self._step(static_batch, batch_axis)
        except torch.cuda.OutOfMemoryError:  # fit describes it (where the memory went)
            _restore(before)
            optimizer.zero_grad(set_to_none=True)
            raise
        except RuntimeError as err:  # CUDA refused the capture: PyTorch cannot undo it, the fit ends
            _restore(before)  # the held handlers' Python ran for a step no kernel of which did
            optimizer.zero_grad(set_to_none=True)  # the capture's gradients were never computed
            raise capture_error(err) from err
        self.graph, self.key, self.static, self.static_batch = graph, key, static, static_batch
        self.after_replay = [_after_replay(handler, self.estimator) for handler in self.held]
        self.rates = [group["lr"] for group in optimizer.param_groups]  # the tensors the graph reads
        inputs = {id(s): i for i, s in enumerate(static)}
        self.outputs = (outputs, inputs)
        graph.replay()
        self.replayed += 1
        return self._outputs(tensors)

    def _keep_rates(self, optimizer: torch.optim.Optimizer) -> None:
        """Keep each group's learning rate in the tensor the graph reads: a rate assigned
        instead of filled in (``group["lr"] = 0.01``) is copied into it (no host sync)."""
        for group, rate in zip(optimizer.param_groups, self.rates):
            lr = group["lr"]
            if lr is not rate:
                if isinstance(lr, torch.Tensor):
                    rate.copy_(lr.reshape(()), non_blocking=True)
                else:
                    rate.fill_(lr)
                group["lr"] = rate

    def _outputs(self, tensors: list[torch.Tensor]) -> tuple[Any, Any, Any, Any]:
        """The graph's outputs for ``batch_end``: the batch's own tensors where the step returned
        its inputs, copies of the rest (the next replay overwrites the graph's)."""
        outputs, inputs = self.outputs

        def swap(t: torch.Tensor) -> torch.Tensor:
            index = inputs.get(id(t))
            return tensors[index] if index is not None else t.detach().clone()

        data, label, pred, loss = map_tensors(outputs, swap)  # fit_batch's four
        return data, label, pred, loss


def _after_replay(handler: Any, estimator: FitEstimator) -> Any:
    """What ``handler`` asks the host to do after each replay (``record_batch_end``; nothing
    for a handler of the mixins alone, which has no such hook)."""
    return declared(handler, "record_batch_end")(estimator)


def _python_state(held: list[Any], metrics: list[Any]) -> tuple[list[Any], list[Any]]:
    """What a failed capture must put back: the held handlers' attributes (a shallow copy) and
    the capturable metrics' states (a capture queues no kernel: only the Python side moved)."""
    handlers = [(handler, dict(getattr(handler, "__dict__", {}))) for handler in held]
    return handlers, [(metric, metric.state_dict()) for metric in metrics if getattr(metric, "capturable", False)]


def _restore(state: tuple[list[Any], list[Any]]) -> None:
    handlers, metrics = state
    for handler, attributes in handlers:
        if hasattr(handler, "__dict__"):
            vars(handler).clear()
            vars(handler).update(attributes)
    for metric, saved in metrics:
        metric.load_state_dict(saved)


def _make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """Switch ``optimizer`` to its capturable mode: ``capturable=True`` in every group, each
    learning rate in a 0-dim device tensor (a scheduler then fills it in place, and the graph
    reads it), the step counts on the device. Idempotent; a state restored from a checkpoint of
    an eager run is moved as it is."""
    for group in optimizer.param_groups:
        group["capturable"] = True
        lr = group["lr"]
        if not (isinstance(lr, torch.Tensor) and lr.device == device and lr.dim() == 0):
            group["lr"] = torch.tensor(float(lr), dtype=torch.float32, device=device)
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor) and step.device != device:
            state["step"] = step.to(device)
        elif isinstance(step, (int, float)):
            state["step"] = torch.tensor(float(step), dtype=torch.float32, device=device)
