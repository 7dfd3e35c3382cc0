"""How the ranks of one ``fit`` agree on stops and signals without a collective of their own per step.

Every rank must leave the loop at the same step, or the others wait forever in DDP's next
gradient all-reduce. A blocking all-reduce of the stop flags after every step would make each
rank wait for the slowest before it queues the next step; even started asynchronously, an
all-reduce per step costs a round trip where it shares a gloo process group with DDP's gradient
all-reduce (the flags then queue in front of the gradients). So the ranks exchange their flags
only every ``period`` steps (:attr:`Estimator.agree_every`), and never wait for the exchange:

- A ``True`` from a ``batch_end`` handler, or a signal, at step ``k`` goes into this rank's
  outbox. At the boundary of the next step whose number is a multiple of ``period`` (``k`` itself
  when it is one) each rank *starts* an all-reduce of its outbox and goes on; at the next boundary
  it reads the result, which has long arrived, and every rank stops there. So a request stops
  every rank ``1`` to ``period`` steps after it was made, at a step that depends only on ``k`` and
  ``period``: the same on every rank, in every run, after every resume.
- A rank whose handlers asked to stop at the very step that exchanges waits for that exchange at
  once: if *every* rank asked (a rank-identical decision, e.g. a value reduced across ranks),
  all stop at that step. With ``period=1`` every step exchanges, so a request on every rank stops
  at ``k`` and one on some ranks at ``k + 1``.
- A ``True`` from a ``batch_end`` marked ``rank_identical_stop`` (built-in handlers whose
  decision is the same on every rank by construction: ``StoppingHandler``'s counters, so the
  plan's end, and ``TerminateOnNaNHandler``'s reduced check) needs no exchange: every rank stops
  at that step, as in one process.
- At an epoch's end (rare, and a decision point) the flags, the outbox and an exchange in flight
  are agreed in one blocking collective.

A checkpoint taken at a boundary stores this rank's request not agreed yet
(:attr:`StopAgreement.pending_stop`: the outbox, or its part of the exchange in flight); a resume
puts it back where the schedule has it (an exchange started again at a step that exchanges, the
outbox otherwise), so the resumed run stops at the same step as the uninterrupted one. Signals
are not carried over: a rerun must not stop again because the previous process was told to.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Optional, TypeVar

import torch.distributed as dist

from ... import distributed
from ..._checks import check_positive_int
from ...events import is_rank_identical_stop

__all__ = ["StopAgreement", "agreement_period", "rank_identical_stops"]

#: steps between exchanges when the flags share a gloo process group with DDP's gradients
SHARED_GROUP_PERIOD = 16


def agreement_period(every: Optional[int]) -> int:
    """``Estimator.agree_every`` checked, or chosen for this process group when None: every step
    where the flags travel on a gloo group of their own (under NCCL, beside the GPU's work),
    every :data:`SHARED_GROUP_PERIOD` steps where they would queue in DDP's gloo group."""
    check_positive_int(every, "agree_every", allow_none=True)
    if every is not None:
        return every
    if distributed.is_distributed() and dist.get_backend() == "gloo":
        return SHARED_GROUP_PERIOD
    return 1


_Hook = TypeVar("_Hook", bound=Hashable)


def rank_identical_stops(batch_end: Iterable[_Hook]) -> frozenset[_Hook]:
    """The ``batch_end`` methods among ``batch_end`` whose ``True`` every rank returns alike."""
    return frozenset(fn for fn in batch_end if is_rank_identical_stop(fn))


class StopAgreement:
    """The stop and signal flags of one rank, agreed with every other rank every ``period`` steps.

    Args:
        multi: several processes take part. With one, the methods return their inputs.
        period: steps between two exchanges (see :func:`agreement_period`).
    """

    def __init__(self, multi: bool, period: int = 1):
        self.multi = multi
        self.period = period
        #: this rank's stop request not agreed yet: in the outbox, or in the exchange in flight
        #: (part of a snapshot)
        self.pending_stop = False
        self._code = 0  # the strongest signal in the outbox
        self._exchange: Optional[distributed.PendingMax] = None

    def after_batch(self, step: int, requested: bool, identical: bool, code: int) -> tuple[bool, int]:
        """Flags of this rank after step ``step``'s ``batch_end`` (counted over the run, from 1)
        -> ``(stop, signal code)`` agreed for this boundary (the same on every rank).
        ``requested``: a handler not marked ``rank_identical_stop`` returned True; ``identical``:
        a marked one did."""
        if not self.multi:
            return requested or identical, code
        if self._exchange is not None:  # started at the previous boundary: complete by now
            earlier = self._exchange.wait()
            self._exchange = None
            self.pending_stop = False
            if earlier[0] or earlier[2]:  # a signal alone stops here without ending the plan
                return bool(earlier[0]) or identical, earlier[2]
        self.pending_stop, self._code = self.pending_stop or requested, max(self._code, code)
        if step % self.period:
            return identical, 0
        exchange = self._start(self.pending_stop, requested, self._code)
        self._code = 0
        if requested:  # a decision point: is this request the same on every rank?
            agreed = exchange.wait()
            if not agreed[1]:  # every rank asked to stop at this step
                self.pending_stop = False
                return True, agreed[2]
        self._exchange = exchange  # pending_stop: this rank's part of it
        return identical, 0

    def after_epoch(self, requested: bool, code: int) -> tuple[bool, int]:
        """Flags after an epoch's ``epoch_end`` -> ``(stop, signal code)``, agreed at once."""
        if not self.multi:
            return requested, code
        requested, code = requested or self.pending_stop, max(code, self._code)
        if self._exchange is not None:  # the epoch's last step exchanged: its requests stop here
            earlier = self._exchange.wait()
            self._exchange = None
            requested, code = requested or bool(earlier[0]), max(code, earlier[2])
        self.pending_stop, self._code = False, 0
        agreed = self._start(requested, requested, code).wait()
        return bool(agreed[0]), agreed[2]

    def restore(self, pending_stop: bool, step: int, at_batch_end: bool) -> None:
        """A resume at the boundary of step ``step``: put back the request not agreed there."""
        self._exchange, self.pending_stop, self._code = None, False, 0
        if not (self.multi and at_batch_end):
            return
        self.pending_stop = pending_stop
        if step % self.period == 0:  # that boundary exchanged: every rank starts it again
            self._exchange = self._start(pending_stop, pending_stop, 0)

    @staticmethod
    def _start(stop: bool, asked_now: bool, code: int) -> distributed.PendingMax:
        # MAX of [stop, not asked now, code]: any rank asks to stop / not every rank asked at
        # this step / the strongest signal
        return distributed.all_reduce_max_async((int(stop), int(not asked_now), code))
