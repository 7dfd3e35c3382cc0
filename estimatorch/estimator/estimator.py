"""The :class:`Estimator`: ``fit`` runs the loop and dispatches each event to handler objects."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .. import distributed, rng
from .._checks import check_positive_int
from ..distributed import Watchdog
from ..events import Dispatch
from ..metrics.base import metric_name
from ._inference.evaluation import evaluate_groups
from ._inference.predict import run_prediction
from ._inference.sanity import sanity_pass
from ._loop import end_run, run_loop
from ._plan.counts import planned_steps
from ._plan.schedules import build_scheduler, check_horizons
from ._run_view import RunView
from ._setup import arguments as checks
from ._setup import default_optimizer, metric_lists
from ._setup.datasets import as_batches
from ._setup.eval_sets import EvalSets
from ._setup.logger import default_logger as _default_logger
from ._start import start_run
from ._state.payload import check_payload, payload_of, snapshot_to_resume
from ._state.run import Run, Stage
from ._step.graphed_step import graphed_step
from ._step.strategy import check_strategy, train_wrapper, wraps
from ._step.torch_flags import torch_flags
from ._step_view import StepView
from ._stopping.interrupts import drop_data_frames, stop_exception
from ._stopping.oom import describe_out_of_memory
from ._stopping.replicas import replica_check
from ._stopping.stop_messages import describe_stop
from ._stopping.watch import publish_failure, watching
from .batch_processor import BatchProcessor
from .history import History

__all__ = ["Estimator"]



class Estimator(RunView, StepView):
    """Train and evaluate a PyTorch model with a loop that dispatches events to handlers.

    Args:
        net: the model (moved to ``device``).
        loss: a callable ``loss(pred, label)``, e.g. ``nn.CrossEntropyLoss()``. Defaults to None: the model
            computes its own loss (a ``transformers`` model given ``labels``; see docs/transformers.md).
        train_metrics: a metric or list of metrics. Defaults to a ``Loss`` metric, plus
            ``Accuracy`` when ``loss`` is ``nn.CrossEntropyLoss`` or ``nn.NLLLoss``. A ``Loss``
            metric is always present. Names get a ``train_`` prefix.
        val_metrics: Defaults to deep copies of the train metrics. Names get a ``val_`` prefix.
        optimizer: Defaults to ``SGD(net.parameters(), lr=0.01)``, with a warning at the first
            ``fit`` (none for an estimator that only evaluates or predicts). One over none
            of ``net``'s trainable parameters (built over another module) is a ``ValueError``.
        device: Defaults to CUDA (this process's local rank) when available, else the CPU. A
            device this machine cannot train on (``'meta'``, an absent ``'mps'``/``'xpu'``/CUDA
            device) is a ``ValueError``.
        val_net: the network ``evaluate`` runs. Defaults to ``net``.
        val_loss: the loss ``evaluate`` computes. Defaults to ``loss``.
        batch_processor: the step (see :class:`BatchProcessor`). Defaults to ``BatchProcessor()``.
        lr_scheduler: a torch LR scheduler of ``optimizer``, or a callable ``(optimizer,
            total_steps) -> scheduler`` that the first ``fit`` calls at its start with the steps
            the scheduler will take: optimizer steps (see :meth:`planned_steps`), or epochs with
            ``lr_scheduler_interval="epoch"``. ``transformers``' ``get_*_schedule_with_warmup``
            factories thus reach their peak after their warm-up steps with no other argument. A
            default ``LRSchedulerHandler`` steps it. Defaults to None.
        lr_scheduler_interval: ``"epoch"`` (step ``lr_scheduler`` after every epoch, after
            validation) or ``"batch"`` (after every optimizer step). Defaults to None: ``"batch"``
            for a callable ``lr_scheduler`` (sized and stepped in optimizer steps), ``"epoch"``
            for a scheduler object (PyTorch's convention). ``est.lr_scheduler_interval`` holds
            the one chosen. (Before this default a callable was stepped per epoch: pass
            ``"epoch"`` to keep that.)
        seed: seeds every generator at the start of ``fit`` and the data order: an int in
            ``[0, 2**64)`` (what torch, numpy and python's ``random`` all accept). Defaults to
            :data:`estimatorch.rng.DEFAULT_SEED`, so runs are reproducible unless you choose.
        precision: ``"32"``, ``"16-mixed"`` (autocast + gradient scaling) or ``"bf16-mixed"``;
            the aliases ``"bf16"`` (``"bf16-mixed"``), ``"fp16"`` and ``"16"`` (``"16-mixed"``)
            are accepted and ``est.precision`` holds the canonical name. Defaults to ``"32"``.
        deterministic: deterministic algorithms (and one thread for a CPU net) during ``fit``. Defaults to False.
        cudnn_benchmark: let cuDNN pick kernels by timing during ``fit``. Defaults to False.
        strategy: how ``fit`` spreads the net over the ranks of a process group: ``"ddp"`` (a
            copy per rank, wrapped in DDP) or ``"fsdp"`` (FSDP2: ``fully_shard`` on each
            top-level child with parameters and on the root when fit starts, the optimizer
            pointed at the sharded parameters). Defaults to None: a net already sharded with
            ``fully_shard`` trains as it is, any other under DDP. No effect in one process.
        cuda_graphs: capture the train step (forward, loss, backward, gradient clipping, the
            optimizer step and the train metrics' updates) in one CUDA graph after a few eager
            warm-up steps, and replay it for every batch of the captured shapes: the host no
            longer launches each kernel, which is what limits a step of little GPU work. A batch
            of other shapes (a partial last batch) runs eagerly; the other handlers run outside
            the graph, ``batch_end`` seeing the step's outputs (a handler declaring
            ``capturable_batch_end`` is recorded in it).
            The optimizer is switched to ``capturable=True`` with its learning rate in a device
            tensor (LR schedules keep working). A configuration it cannot capture (not CUDA,
            several processes, ``"16-mixed"``, an optimizer without a capturable mode, gradient
            accumulation, a handler listening inside the step) is a ``ValueError`` at ``fit``
            start; a step that synchronises with the host (seen in the warm-up) trains
            eagerly with one warning, and a capture CUDA refuses all the same ends the fit with
            its cause. See docs/cuda-graphs.md. Defaults to False.
        watchdog: report a hang: seconds without a completed step (counted from the first), or
            a :class:`~estimatorch.Watchdog` (``action="raise"`` ends the run). Every rank's
            stacks go to the run's directory and the log, with a one-line summary of where each
            rank is. Defaults to None (off).
        world_size_invariant: train the same bits for any split of an optimizer step's
            ``S = world_size x accumulation_steps`` micro-batches of ``b`` samples (the loader's
            ``batch_size``) over processes and accumulation steps, DDP and FSDP2, and resume
            bit-identically on any such split: the data is laid out in global steps (as
            ``CheckpointHandler(elastic=True)`` lays it out), each micro-batch's gradient is
            computed alone and the step's gradient is their sum in one fixed tree over the
            micro-batches, whatever process holds which (docs/distributed.md, "The same bits on
            any number of processes"). Every process must run torch on the same number of
            threads. Defaults to False.
        check_replicas_every: under torch.distributed, every this many optimizer steps and
            before every checkpoint save, the ranks compare an exact fingerprint of their
            parameters and optimizer state in one small collective (an ``all_gather`` of one
            int64; nothing between checks): a rank whose state differs stops the run with
            :class:`~estimatorch.distributed.ReplicaDivergenceError` naming it and the steps,
            before any checkpoint of that state is written. Under FSDP2 the ranks of the
            replicated mesh dimension are compared; a net sharded without one is refused at
            ``fit`` start. Its cost: docs/observability.md. Defaults to None (off).

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from estimatorch import Estimator
        >>> net = nn.Linear(4, 2)
        >>> est = Estimator(net, nn.CrossEntropyLoss(),
        ...                 optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        >>> data = [(torch.randn(16, 4), torch.randint(0, 2, (16,))) for _ in range(4)]
        >>> history = est.fit(data, epochs=2)  # doctest: +ELLIPSIS
        Training begin: SGD (lr 0.1) on cpu, 2 epochs, seed 0, 1 process. Model: Linear, 10 parameters (10 trainable)...
        [Epoch 1/2] Finished in ...s, 4 batches: train_loss: ..., train_accuracy: ...
        [Epoch 2/2] Finished in ...s, 4 batches: train_loss: ..., train_accuracy: ...
        Train finished in ...s: 2 epochs, 8 batches. train_loss: ..., train_accuracy: ...
        >>> len(history["train_loss"])
        2
    """

    #: Under torch.distributed: the ranks exchange stop requests and signals every this many
    #: steps (see :meth:`fit`), so a request waits at most this many steps to take effect. None
    #: (the default) chooses: every 16 steps where the flags would queue in front of the gradients
    #: in DDP's gloo process group (CPU training), every step where they travel on a group of their
    #: own (NCCL). Set it before ``fit``, e.g. to 1 for steps of seconds on the CPU.
    agree_every: Optional[int] = None

    def __init__(self, net: nn.Module, loss: Optional[Callable[..., Any]] = None, train_metrics: Any = None,
                 val_metrics: Any = None, optimizer: Optional[torch.optim.Optimizer] = None,
                 device: Union[str, torch.device, None] = None, val_net: Optional[nn.Module] = None,
                 val_loss: Optional[Callable[..., torch.Tensor]] = None,
                 batch_processor: Optional[BatchProcessor] = None, *, lr_scheduler: Any = None,
                 lr_scheduler_interval: Optional[str] = None, seed: Optional[int] = None,
                 precision: Union[str, int] = "32", deterministic: bool = False, cudnn_benchmark: bool = False,
                 strategy: Optional[str] = None,
                 cuda_graphs: bool = False, watchdog: Union[float, Watchdog, None] = None,
                 world_size_invariant: bool = False, check_replicas_every: Optional[int] = None):
        checks.check_estimator_arguments(net, loss, val_net, val_loss, optimizer, batch_processor)
        self.check_replicas_every = check_positive_int(check_replicas_every, "check_replicas_every", allow_none=True)
        precision = checks.precision_name(precision)
        checks.check_flags(deterministic=deterministic, cudnn_benchmark=cudnn_benchmark, cuda_graphs=cuda_graphs,
                           world_size_invariant=world_size_invariant)

        seed = rng.DEFAULT_SEED if seed is None else rng.check_seed(seed)
        self.watchdog = Watchdog.of(watchdog)
        self.device = checks.resolve_device(device)
        self.net = net.to(self.device)
        self.loss = loss
        self.val_net = val_net.to(self.device) if val_net is not None else self.net
        self.val_loss = val_loss if val_loss is not None else loss
        self.seed = seed
        self.precision = precision
        self.deterministic = deterministic
        self.cudnn_benchmark = cudnn_benchmark
        self.cuda_graphs = cuda_graphs
        self.world_size_invariant = world_size_invariant
        self.batch_processor = batch_processor if batch_processor is not None else BatchProcessor()
        self.logger = _default_logger()

        self.train_metrics, self.val_metrics = metric_lists(train_metrics, val_metrics, self.loss, self.device)
        self._eval_sets = EvalSets(self.val_metrics)  # several eval sets: each set's copies of these

        self._default_optimizer = None if optimizer is not None else default_optimizer(net)  # fit warns
        optimizer = optimizer if optimizer is not None else self._default_optimizer
        self.optimizer = optimizer
        self.strategy = check_strategy(strategy, net, optimizer)
        #: the scheduler (built by the first fit when ``lr_scheduler`` was a callable: that is
        #: then :attr:`lr_scheduler_factory`)
        self.lr_scheduler, self.lr_scheduler_factory, self.lr_scheduler_interval = checks.check_lr_scheduler(
            lr_scheduler, optimizer, lr_scheduler_interval)
        self._amp_dtype = amp_dtype = checks.PRECISIONS[precision]
        self.grad_scaler: Optional[torch.amp.GradScaler] = (
            torch.amp.GradScaler(self.device.type) if amp_dtype is torch.float16 else None)

        self.max_epoch: Optional[int] = None
        self.max_batch: Optional[int] = None
        self.batch_axis = 0
        self.dispatch, self._fitting = Dispatch([]), False
        self._run: Optional[Run] = None
        self._last: Optional[dict[str, Any]] = None
        self._ddp: Optional[nn.Module] = None
        self._eval_count = 0
        self._step_items: Optional[distributed.StepItems] = None  # the current fit's, when it weighs

    def planned_steps(self, train_data: Iterable[Any], epochs: Optional[int] = None, batches: Optional[int] = None,
                      batches_per_epoch: Optional[int] = None, *, event_handlers: Any = None) -> int:
        """The optimizer steps this process will take in ``fit(train_data, epochs=...)`` (or
        ``batches=``), known before it: under torchrun (also before the process group exists)
        each process's share of a DataLoader, ``GradientUpdateHandler``'s accumulation and a
        ``StoppingHandler``'s limits among ``event_handlers``, and ``batches_per_epoch``
        counted. What to size a per-batch schedule with (or pass ``lr_scheduler`` as a callable).

        Example:
            >>> net = nn.Linear(4, 2)
            >>> est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
            >>> est.planned_steps([(torch.randn(8, 4), torch.randn(8, 2))] * 10, epochs=3, batches_per_epoch=4)
            12
        """
        return planned_steps(self, train_data, epochs, batches, batches_per_epoch, event_handlers)

    def fire(self, event: str, **kwargs: Any) -> bool:
        """Call the current ``fit``'s handlers of ``event``; True when any asked to stop.

        For custom batch processors (forward/backward events). Outside ``fit`` it does nothing.
        """
        return self.dispatch.fire(event, self, **kwargs)

    # -- fit ---------------------------------------------------------------------------------
    def fit(self, train_data: Iterable[Any], val_data: Optional[Iterable[Any]] = None,
            epochs: Optional[int] = None, event_handlers: Any = None, batches: Optional[int] = None,
            batch_axis: int = 0, *, resume: bool = False, batches_per_epoch: Optional[int] = None,
            val_batches: Optional[int] = None, num_sanity_val_steps: int = 1, batch_size: Optional[int] = None,
            collate_fn: Optional[Callable[..., Any]] = None) -> History:
        """Train ``net`` on ``train_data``; returns the :class:`History` of every metric.

        The loop, with every event in place::

            train_begin
            for epoch:                                  (or until `batches` batches in total)
                epoch_begin
                for batch in train_data:
                    batch_begin
                    forward_begin  -> pred = net(data); loss = loss_fn(pred, label) -> forward_end
                    backward_begin -> loss.backward()                               -> backward_end
                    batch_end    (GradientUpdateHandler steps the optimizer here, rank -2000)
                    stop if any batch_end returned True (all batch_end handlers still run)
                epoch_end        (ValidationHandler evaluates here, before checkpoint/early stopping)
                stop if any epoch_end returned True
            train_end          (always runs, also when an exception escapes; it then propagates)

        Handlers run in order of ``priority`` (lower first; ties keep the order given, user
        handlers before defaults). Defaults added when you pass none of their type:
        ``StoppingHandler``, ``GradientUpdateHandler``, ``MetricHandler``,
        ``ValidationHandler`` (with ``val_data``), ``LRSchedulerHandler`` (with
        ``lr_scheduler``, unless one of yours steps it), ``LoggingHandler``, and
        ``ProgressBarHandler`` in a terminal or notebook.

        Ctrl-C and SIGTERM (what SLURM, Kubernetes and spot instances send) stop at the end of
        the current step: every ``CheckpointHandler`` saves that boundary in ``train_end``
        (:attr:`interruption` names the signal), then ``fit`` raises ``KeyboardInterrupt``
        (Ctrl-C; ``fit(..., resume=True)`` continues exactly there) or ``SystemExit(143)``
        (SIGTERM: ``finally`` blocks run, the process exits with the status of a job ended by
        SIGTERM). A second Ctrl-C stops at once, mid-step. Only the main thread's default
        handlers are replaced, and they are restored when ``fit`` ends.
        Under SLURM, SIGUSR1 (``sbatch --signal=USR1@90``) stops the same way, then rank 0
        requeues the job (``scontrol requeue``) and ``fit`` raises ``SystemExit(138)``; see
        :mod:`estimatorch.distributed.cluster`.

        Under torch.distributed every rank stops at the same step, agreed without a collective
        of its own per step: the ranks exchange their flags every :attr:`agree_every` steps
        (``n``), never waiting for the exchange. ``True`` from a ``batch_end`` handler at step
        k, on one rank or on all, and a signal reaching some ranks during step k stop every rank
        at step m + 1, where m is the first multiple of n from k on (or at the epoch's end when
        it comes first); at m itself when every rank asked at step m. With ``n = 1`` that is
        step k for a request on every rank, k + 1 otherwise. Built-in decisions that are the
        same on every rank (``StoppingHandler``, so the plan's end, and
        ``TerminateOnNaNHandler``) stop at step k, as in one process. ``epoch_end`` stops are
        agreed at once.

        Args:
            train_data: an iterable of batches: a ``DataLoader`` (made resumable: see
                :mod:`estimatorch.samplers`), a list of ``(data, label)`` pairs, or any iterable;
                with ``batch_size``, a map-style dataset (a ``datasets.Dataset``, a torch
                ``Dataset``).
            val_data: evaluated every epoch by the default ``ValidationHandler``; a dict of named
                eval sets (``{"a": loader_a, "b": loader_b}``) evaluates each, with metrics
                ``val_<set>_<name>``, the first set's followed by a monitor of ``"val_loss"``.
                Defaults to None.
            epochs: train this many epochs. Exactly one of ``epochs``/``batches``.
            event_handlers: a handler or list of handlers. Defaults to None (defaults only).
            batches: train this many batches in total, re-iterating the data as needed.
            batch_axis: the axis of the batch dimension. Defaults to 0.
            resume: continue this estimator's previous ``fit`` in this process (interrupted or
                finished) up to the given ``epochs``/``batches`` in total. A ``batches`` plan
                that ended mid-epoch already ran that epoch's ``epoch_end``: extending it
                continues with the next epoch (resume from a ``batch_period`` checkpoint to
                continue mid-epoch). Defaults to False.
            batches_per_epoch: train at most this many batches of each epoch (Keras'
                ``steps_per_epoch``, Lightning's ``limit_train_batches``); the next epoch starts
                where its data starts, and a resume continues exactly. Defaults to None (all).
            val_batches: evaluate at most this many batches at each validation during this fit
                (per process). Defaults to None (all).
            num_sanity_val_steps: before training, take this many batches of ``val_data``
                through ``val_net``, ``val_loss`` and copies of the val metrics, so that a mistake
                there (its structure, device, shapes, label format) is an error naming
                ``val_data`` before the first step. It changes nothing of the run (metrics,
                random streams, the data's position): a run is bitwise the same with it. 0 turns
                it off. Defaults to 1.
            batch_size: batch the map-style datasets ``train_data`` (shuffled) and ``val_data``
                into DataLoaders, collated by ``collate_fn`` or a padding
                :class:`~estimatorch.collate.PadCollate`; without a loss, the columns ``forward``
                does not take are dropped, logged (:mod:`._setup.datasets`). Defaults to None.
            collate_fn: the collate of those DataLoaders. Defaults to None.
        """
        distributed.init_from_env()
        error: Optional[Exception] = None
        try:
            train_data = as_batches(self, train_data, "train_data", batch_size, collate_fn, train=True)
            val_data = as_batches(self, val_data, "val_data", batch_size, collate_fn)
            groups, self.val_metrics = self._eval_sets.groups(self.val_metrics, val_data)
            run = start_run(self, train_data, val_data, epochs, event_handlers, batches, batch_axis, resume,
                            (batches_per_epoch, val_batches), last=self._last,
                            default_optimizer=self._default_optimizer, monitor_aliases=self._eval_sets.aliases(groups))
            self._default_optimizer = None  # warned (when still in use): once per estimator
        except Exception as err:  # noqa: BLE001 - every rank must hear of it before any collective
            error = err
        distributed.raise_on_every_rank(error, "fit could not start")
        sanity_pass(self, val_data, num_sanity_val_steps, batch_axis)  # the ranks agree on its outcome too
        return self._fit(run)

    def _fit(self, run: Run) -> History:
        before = (self._run, self.max_epoch, self.max_batch, self.batch_axis, self.lr_scheduler)
        self._run, self.dispatch, self._fitting = run, run.dispatch, True
        self._step_items = run.items
        self.max_epoch, self.max_batch, self.batch_axis = run.plan["epochs"], run.plan["batches"], run.batch_axis
        failed, stopping = False, BaseException()
        try:
            with torch_flags(self.deterministic, self.cudnn_benchmark, self.device.type == "cpu"), run.signals, \
                    watching(self, run.pos, run.dispatch.handlers) as watch:
                try:
                    if self._ddp is None and wraps(self):
                        self._ddp = train_wrapper(self)  # None for a sharded net
                    rng.seed_everything(self.seed if distributed.get_world_size() == 1
                                        else rng.derive_seed(self.seed, distributed.get_rank()), numpy_global=True)
                    self.net.train()
                    build_scheduler(self, run)
                    run.stage = Stage.SETTING_UP
                    pending, began = run.pending is not None, time.perf_counter_ns()
                    run.dispatch.fire("train_begin", self)
                    run.ledger.open(self, run, time.perf_counter_ns() - began,
                                    resumed_from_files=not pending and run.pending is not None)
                    run.replicas = replica_check(self, run)
                    check_horizons(self, run)
                    run.step = graphed_step(self, run)  # cuda_graphs=True: the captured step
                    run_loop(self, run)
                except torch.cuda.OutOfMemoryError as err:  # told where: no cost until it is raised
                    failed, stopping = True, err
                    publish_failure(watch, run.signals, run.pos, err)
                    raise describe_out_of_memory(err, run.pos, run.dispatch.handlers) from err
                except BaseException as err:
                    failed, stopping = True, err
                    publish_failure(watch, run.signals, run.pos, err)  # the other ranks end, not wait for this one
                    if run.signals.stopped is not None:  # a stop at a boundary: see drop_data_frames
                        raise drop_data_frames(err)  # noqa: B904 - the same error, without its frames
                    raise
                finally:
                    end_run(self, run, failed, stopping if failed else None)
                    describe_stop(stopping, self, run.dispatch.handlers)  # a clean Ctrl-C stop's one line
                if run.signals.received is not None:  # it came after the last agreed boundary
                    raise describe_stop(stop_exception(run.signals.received), self, run.dispatch.handlers)
                return run.history
        finally:
            self.dispatch, self._fitting, run.step = Dispatch([]), False, None  # a graph's memory goes with it
            self._step_items = None
            if not run.stage.holds_state:  # failed before training began: the estimator stays as it was
                self._run, self.max_epoch, self.max_batch, self.batch_axis, self.lr_scheduler = before
            else:  # what fit(..., resume=True) continues from
                self._last = run.final_snapshot

    # -- the seam a checkpoint store calls ---------------------------------------------------
    def state_payload(self, *, gather: bool = True) -> Optional[dict[str, Any]]:
        """Everything needed to resume the current fit, for a checkpoint store to write: the
        training state (``model`` under the plain module's keys whatever wraps it, ``optimizer``,
        ``optimizer_class``, ``lr_scheduler``, ``grad_scaler``), ``world_size`` and ``ranks``,
        every rank's snapshot (``estimator/_state/run.py`` declares what one holds). A collective
        under torch.distributed: every rank must call it; global rank 0 gets the payload, the
        other ranks None. With ``gather=False`` (a store where every rank writes its own part,
        as for a sharded net) no collective: every rank gets ``rank``, ``world_size``, its own
        ``snapshot`` and the training state but ``model`` and ``optimizer``."""
        return payload_of(self, self._current_run("state_payload"), gather)

    def check_payload(self, payload: dict[str, Any], source: str, *, rank: Optional[int] = None) -> dict[str, Any]:
        """Check the run's state in a payload a store read (from ``source``) against the current
        fit, as rank ``rank`` (defaults to this process's) would resume it, without changing
        anything; returns the payload as the fit reads it (an elastic run's mapped onto this
        world size). The training state's tensors are the store's to check.

        Raises:
            CheckpointError: naming ``source`` and what is wrong, in words.
        """
        run = self._current_run("check_payload")
        return check_payload(self, run, payload, source, distributed.get_rank() if rank is None else rank)

    def load_payload(self, payload: dict[str, Any], source: str) -> None:
        """Resume the current fit from a payload :meth:`check_payload` passed: refuse one written
        on another world size (unless mapped), check the data and the plan, and request the
        resume, applied when the loop reaches the saved position. The store restores the
        training state (``checkpoint.restore_training_state``) once every rank agreed.

        Raises:
            CheckpointError: written on another world size.
            ValueError: for other data, or beyond this fit's plan.
        """
        self._current_run("load_payload")
        self.request_resume(snapshot_to_resume(self, payload, source), source)

    # -- evaluate, predict -----------------------------------------------------------------
    def evaluate(self, val_data: Iterable[Any], batch_axis: int = 0, event_handlers: Any = None, *,
                 batch_size: Optional[int] = None, collate_fn: Optional[Callable[..., Any]] = None
                 ) -> dict[str, float]:
        """Run ``val_net`` over ``val_data`` in eval mode without gradients.

        Resets and updates the val metrics, fires ``epoch_begin``, ``batch_begin``,
        ``batch_end`` and ``epoch_end`` to ``event_handlers``, and restores the network's
        training mode and every random generator afterwards (validating or not never changes
        a training run's random stream). Under torch.distributed, every rank calls it; a
        map-style DataLoader is shared out so that each sample counts once, as in one process;
        other data is each rank's own (see :mod:`estimatorch.data._sharding`). During ``fit``
        it runs on the weights a handler keeps for evaluation, if one does (``EMAHandler``'s
        average: see :meth:`~estimatorch.events.Handler.evaluation_weights`).

        ``val_data`` may be a dict of named eval sets, each with its metrics ``val_<set>_<name>``
        (then ``est.val_metrics``, outside ``fit``), and with ``batch_size`` (and ``collate_fn``)
        a map-style dataset, batched in order as ``fit`` batches it.

        Returns:
            ``{metric name: value}`` for every val metric (of every set).
        """
        began = time.perf_counter_ns()
        groups, val_metrics = self._eval_sets.groups(self.val_metrics, as_batches(self, val_data, "val_data",
                                                                                  batch_size, collate_fn))
        run = self._active
        if run is None:  # outside fit: the val metrics are those of this data
            self.val_metrics = val_metrics
        weights = evaluate_groups(self, groups, batch_axis, event_handlers,
                                  limit=run.limits[1] if run is not None else None)
        self._eval_count += 1
        if run is not None:
            run.evaluated, run.evaluated_on = True, weights
            run.ledger.add("validation", time.perf_counter_ns() - began)
        return {metric_name(m): float(m.compute()) for _, _, metrics in groups for m in metrics}

    def predict(self, data: Iterable[Any], batch_axis: int = 0, event_handlers: Any = None, *,
                batch_size: Optional[int] = None, collate_fn: Optional[Callable[..., Any]] = None) -> Any:
        """Run ``val_net`` over ``data`` as ``evaluate`` does; return its outputs in order, on the CPU
        (under mixed precision, outputs of its 16-bit dtype as float32).

        Batches need no label (a tensor, ``(x,)``, a dict); a batch's last element (or its
        ``"label"`` key) is dropped as a label (``BatchProcessor.predict_batch``). Tensor outputs
        are concatenated along ``batch_axis``, tuples and dicts of them element-wise, lists
        joined; other outputs give a list per batch (:func:`~estimatorch.estimator._inference.predict.join_outputs`).
        Events as in ``evaluate``, with ``label=None`` and ``loss=None``. Under
        torch.distributed, a map-style DataLoader is shared out as in ``evaluate`` and every
        rank (each must call it) returns all outputs in one process's order, without padding;
        other data is this rank's own and gives this rank's outputs.

        Args:
            data: an iterable of batches (a DataLoader, a list...).
            batch_axis: the axis outputs are joined along. Defaults to 0.
            event_handlers: handlers of the four events. Defaults to None.
            batch_size, collate_fn: batch ``data``, a dataset, in order (as ``fit``). Defaults to None.

        Example:
            >>> net = nn.Linear(3, 2)
            >>> est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
            >>> est.predict([torch.randn(4, 3), (torch.randn(2, 3), torch.randn(2, 2))]).shape
            torch.Size([6, 2])
        """
        return run_prediction(self, as_batches(self, data, "data", batch_size, collate_fn), batch_axis, event_handlers)

    def __repr__(self) -> str:
        loss = None if self.loss is None else type(self.loss).__name__
        return (f"Estimator(net={type(self.net).__name__}, loss={loss}, "
                f"optimizer={type(self.optimizer).__name__}, device={self.device})")

