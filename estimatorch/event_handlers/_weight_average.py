"""What ``EMAHandler`` and ``SWAHandler`` share: an average of the trainable parameters kept on the
model's device (one copy, each rank its own shards under FSDP2), swapped into the net for every
evaluation of the fit and left there when the fit ends, and its state by parameter name.

A subclass says when it updates the average (:meth:`WeightAverage._update` from its hooks) and
with what weight (``average = lerp(average, weights, weight)``, ``torch._foreach_lerp_``: device
work on the local tensors, no value read on the host).
"""

from __future__ import annotations

import contextlib
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from .._checks import check_bool, check_positive_int, check_state_keys
from ..checkpoint import plain_key, plain_module
from ..events import AfterTrainEnd, EpochBegin, EstimatorView, StatefulHandler, TrainBegin
from .gradient_update import GradientUpdateHandler

__all__ = ["FINALS", "WeightAverage"]

#: what ``final=`` accepts: the weights the net holds when a fit ends its plan.
FINALS = ("average", "raw")


def _is_dtensor(tensor: Any) -> bool:
    """A ``DTensor`` (a shard of a sharded net's): none exists before ``torch.distributed.tensor``,
    a heavy import, ran."""
    tensors = sys.modules.get("torch.distributed.tensor")
    return tensors is not None and isinstance(tensor, tensors.DTensor)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (a DTensor's local shard, a view), detached."""
    return tensor.to_local().detach() if _is_dtensor(tensor) else tensor.detach()  # type: ignore[attr-defined]


class WeightAverage(StatefulHandler, TrainBegin, EpochBegin, AfterTrainEnd):
    """The average of a net's trainable parameters (a base class: ``EMAHandler``, ``SWAHandler``).

    Runs at priority -1500: after ``GradientUpdateHandler`` has stepped the optimizer (-2000),
    before the metrics and the validation (-1000), which then run on this step's average.

    Args:
        evaluate: run every evaluation during ``fit`` (validation, an ``evaluate`` a handler calls,
            a ``CheckpointHandler``'s weights export) on the average.
        final: ``"average"``: when a fit ends its plan the net holds the average and
            :meth:`raw_state_dict` the weights it trained; ``"raw"``: the net keeps the trained
            weights and :meth:`average_state_dict` gives the average.
    """

    priority = -1500
    #: how the logs name the weights evaluations run on
    label: ClassVar[str] = "average"

    def __init__(self, *, evaluate: bool = True, final: str = "average"):
        self.evaluate = check_bool(evaluate, "evaluate")
        if final not in FINALS:
            raise ValueError(f"final must be one of {list(FINALS)}, got {final!r}")
        self.final = final
        self.steps = 0  # optimizer steps of the run
        self.updates = 0  # updates of the average
        self._net: Optional[nn.Module] = None
        self._params: dict[str, torch.Tensor] = {}  # name -> the net's trainable parameter
        self._average: Optional[dict[str, torch.Tensor]] = None  # name -> its average (or, swapped, its raw weights)
        self._swapped = False  # True: the net holds the average, _average the raw weights
        self._pairs: Optional[tuple[list[torch.Tensor], list[torch.Tensor]]] = None
        self._loaded: Optional[dict[str, Any]] = None  # loaded outside a fit: kept as it is
        self._raw_buffers: dict[str, torch.Tensor] = {}  # the net's before the end changed them (SWA's BatchNorm)
        self._stepper: Optional[GradientUpdateHandler] = None
        self._fresh = False  # the average is the weights of train_begin, no state loaded since
        self.shared_state = True  # the same on every rank (DDP); not for shards (set in train_begin)

    # -- the fit ------------------------------------------------------------------------------
    def _check_alone(self, estimator: EstimatorView) -> None:
        enters = [h for h in estimator.handlers
                  if isinstance(h, WeightAverage) and (h.evaluate or h.final == "average")]
        if len(enters) > 1 and self in enters:
            raise ValueError(f"{enters[0].name} and {enters[1].name} both put their average into the net (for "
                             "evaluation or at the end): give all but one of them evaluate=False, final='raw'")

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._check_alone(estimator)  # (the fit's handlers are known from train_begin on)
        self._stepper = next((h for h in estimator.handlers if isinstance(h, GradientUpdateHandler)), None)
        self._pairs, self._loaded = None, None
        net = plain_module(estimator.net)
        params: dict[str, torch.Tensor] = {plain_key(n): p for n, p in net.named_parameters() if p.requires_grad}
        ours = self._average is not None and self._net is net and params.keys() == self._average.keys() \
            and all(_same_layout(self._average[n], p) for n, p in params.items())
        if self._swapped and ours and estimator.resume_pending:
            self._exchange()  # fit(resume=True) trains on from the weights the last fit trained
            with torch.no_grad():
                buffers = dict(net.named_buffers())
                for name, value in self._raw_buffers.items():
                    buffers[name].copy_(value)
        self._swapped, self._raw_buffers = False, {}
        self.steps = self.updates = 0
        self._fresh = not estimator.resume_pending
        if ours and estimator.resume_pending:
            # fit(resume=True): the snapshot it resumes holds these very tensors, loaded as it resumes
            self._net, self._params = net, params
        else:
            # reused in place when it can be: no second copy while the old one is freed
            average = self._average if ours and self._average is not None else \
                {n: torch.empty_like(p.detach()) for n, p in params.items()}
            self._average = None
            for name, p in params.items():
                _local(average[name]).copy_(_local(p))
            self._net, self._params, self._average = net, params, average
        self.shared_state = not any(_is_dtensor(p) for p in params.values())

    def epoch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """At the fit's first epoch, the average starts again from the weights unless a resume
        loaded it: a checkpoint restores the weights after ``train_begin``, and one written
        without this handler must not leave it averaging the weights the fit started from."""
        if self._fresh:
            self._fresh = False
            with torch.no_grad():
                assert self._average is not None
                for name, p in self._params.items():
                    _local(self._average[name]).copy_(_local(p))

    def after_train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """A fit that ended its plan (not stopped by a signal, not failed) leaves the average in
        the net (``final="average"``), after every ``train_end`` (a preemption checkpoint holds
        the trained weights)."""
        self._pairs = None
        if self.final != "average" or self._average is None or not self._has_average():
            return
        if estimator.interruption is not None or not estimator.position.stop:
            return
        self._exchange()
        self._swapped = True
        self._finished(estimator)

    def _finished(self, estimator: EstimatorView) -> None:
        """After the average went into the net at the end of a fit (``SWAHandler``: BatchNorm)."""

    def _has_average(self) -> bool:
        """Whether there is an average to evaluate or leave in the net (SWA: once it has begun)."""
        return True

    # -- the average ----------------------------------------------------------------------------
    def _local_pairs(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """``(averages, weights)``: this rank's tensors of each, in one order."""
        pairs = self._pairs
        if pairs is None:  # once per fit, after the first step: FSDP2 settles its shards by then
            assert self._average is not None
            pairs = self._pairs = ([_local(self._average[n]) for n in self._params],
                                   [_local(p) for p in self._params.values()])
        return pairs

    def _update(self, weight: Optional[float]) -> None:
        """``average = lerp(average, weights, weight)`` on every local tensor (None: a copy)."""
        averages, weights = self._local_pairs()
        if weight is None:
            torch._foreach_copy_(averages, weights)
        else:
            torch._foreach_lerp_(averages, weights, weight)

    def _optimizer_stepped(self) -> bool:
        """Whether the optimizer stepped at this ``batch_end`` (every batch without a
        ``GradientUpdateHandler``, which says so otherwise)."""
        return self._stepper is None or self._stepper.stepped

    @torch.no_grad()
    def _exchange(self) -> None:
        """Swap the net's trainable parameters with ``_average``, tensor by tensor (one tensor's
        worth of memory meanwhile), and let FSDP2 gather the new values at the next forward."""
        assert self._average is not None
        for name, p in self._params.items():
            mine, theirs = _local(self._average[name]), _local(p)
            held = theirs.clone()
            theirs.copy_(mine)
            mine.copy_(held)
        fsdp = sys.modules.get("torch.distributed.fsdp")  # (heavy: an FSDP module exists only once it ran)
        if self._net is not None and fsdp is not None:
            for module in self._net.modules():
                if isinstance(module, fsdp.FSDPModule):
                    module.reshard()  # an unsharded copy kept from the last forward is stale now

    def evaluation_weights(self, estimator: EstimatorView) -> Optional[contextlib.AbstractContextManager[str]]:
        """The average, for each evaluation during the fit (``evaluate=True``, once there is one)."""
        if not self.evaluate or self._average is None or self._swapped or not self._has_average():
            return None
        return self._averaged()

    @contextlib.contextmanager
    def _averaged(self) -> Iterator[str]:
        self._exchange()
        try:
            yield self.label
        finally:
            self._exchange()

    # -- what a user reads ------------------------------------------------------------------------
    def _where(self) -> tuple[Mapping[str, torch.Tensor], Mapping[str, torch.Tensor]]:
        """``(average, raw)``: where each lives now, by parameter name."""
        if self._average is None:
            raise RuntimeError(f"{self.name} has no average yet: it is made during fit")
        return (self._params, self._average) if self._swapped else (self._average, self._params)

    def average_state_dict(self) -> dict[str, torch.Tensor]:
        """The net's state dict with the average in place of its trainable parameters (copies;
        under FSDP2 each rank's shards, as ``net.state_dict()`` gives them): what
        ``net.load_state_dict`` takes to hold the average."""
        return self._state_with(self._where()[0])

    def raw_state_dict(self) -> dict[str, torch.Tensor]:
        """The net's state dict with the trained (not averaged) weights in place of its trainable
        parameters (copies): after a fit that left the average in the net,
        ``net.load_state_dict(handler.raw_state_dict())`` gives the trained weights back."""
        return self._state_with(self._where()[1], self._raw_buffers)

    def _state_with(self, weights: Mapping[str, torch.Tensor],
                    buffers: Optional[Mapping[str, torch.Tensor]] = None) -> dict[str, torch.Tensor]:
        assert self._net is not None
        state: dict[str, torch.Tensor] = OrderedDict()
        for key, value in self._net.state_dict(keep_vars=True).items():
            value = weights.get(plain_key(key), value)
            if buffers:
                value = buffers.get(key, value)
            state[key] = value.detach().clone()
        return state

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``{"weights": {parameter name: its average}, "steps": optimizer steps, "updates":
        updates of the average}``. The average's tensors are this handler's own (a DTensor per
        parameter under FSDP2, which a sharded checkpoint writes through DCP), not copies: a
        checkpoint writes or stages them at once."""
        if self._loaded is not None:
            return dict(self._loaded)
        weights = None
        if self._average is not None:
            weights = {name: t.detach() for name, t in self._where()[0].items()}
        return {"weights": weights, "steps": self.steps, "updates": self.updates}

    def check_state_dict(self, state: Any) -> None:
        """A saved average must hold one tensor per trainable parameter of this fit's net, by name,
        of its (global) shape and dtype."""
        if self._average is None or not isinstance(state, dict) or state.get("weights") is None:
            return
        weights = state["weights"]
        if not isinstance(weights, Mapping):
            raise ValueError(f"its weights must be a dict of tensors by parameter name, got {type(weights).__name__}")
        missing = [n for n in self._params if n not in weights]
        if missing:
            raise ValueError(f"it holds no average of the parameter {missing[0]!r}"
                             + (f" (nor of {len(missing) - 1} more)" if len(missing) > 1 else "")
                             + " (saved from another model, or with other parameters trainable)")
        extra = [n for n in weights if n not in self._params]
        if extra:
            raise ValueError(f"it holds an average of {extra[0]!r}, which is no trainable parameter of this net")
        for name, p in self._params.items():
            saved = weights[name]
            if not isinstance(saved, torch.Tensor):
                raise ValueError(f"the average of the parameter {name!r} is a {type(saved).__name__}, not a tensor")
            if tuple(saved.shape) != tuple(p.shape):
                raise ValueError(f"the average of the parameter {name!r} has shape {list(saved.shape)}; the "
                                 f"parameter has shape {list(p.shape)}")
            if saved.dtype != p.dtype:
                raise ValueError(f"the average of the parameter {name!r} is {saved.dtype}; the parameter is {p.dtype}")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("weights", "steps", "updates"), self.name)
        steps = check_positive_int(state["steps"], f"state of {self.name}: steps", minimum=0)
        updates = check_positive_int(state["updates"], f"state of {self.name}: updates", minimum=0)
        if self._average is None:  # outside a fit: kept as it is (a fit starts afresh)
            self._loaded = dict(state)
            self.steps, self.updates = steps, updates
            return
        self.check_state_dict(state)
        self._fresh = False
        if state["weights"] is not None:
            with torch.no_grad():
                for name, saved in state["weights"].items():
                    _copy_into(self._where()[0][name], saved)
        self.steps, self.updates = steps, updates


def _same_layout(a: Any, b: Any) -> bool:
    """``a`` can hold ``b``'s values in place: shape, dtype, device, and sharding alike."""
    if (a.shape, a.dtype, a.device) != (b.shape, b.dtype, b.device) or _is_dtensor(a) != _is_dtensor(b):
        return False
    return not _is_dtensor(a) or (a.placements == b.placements and a.device_mesh == b.device_mesh)


def _copy_into(target: torch.Tensor, saved: torch.Tensor) -> None:
    """Copy a saved average into this handler's tensor: shard into shard, or a whole tensor
    (from a file, on another device) into a whole one."""
    if _is_dtensor(target) != _is_dtensor(saved):
        raise ValueError("a saved average of a sharded net resumes only a sharded one through a sharded checkpoint")
    _local(target).copy_(_local(saved))
