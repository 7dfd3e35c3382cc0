"""How the ranks of one ``fit`` agree on stops and signals without a collective of their own per step.

Every rank must leave the loop at the same step, or the others wait forever in DDP's next
gradient all-reduce. Two protocols, chosen when ``fit`` starts:

**Carried (a DDP wrapper ``fit`` built).** The flags travel inside DDP's own gradient all-reduce
(:mod:`._flag_carrier`): no collective of their own, no wait.

- A ``True`` from a ``batch_end`` handler at step ``k`` (on one rank or on all), and a signal
  received during step ``k``, go into this rank's outbox at step ``k``'s boundary. The next
  step's all-reduce takes every rank's outbox; where it reads that result (step ``k + 1``'s
  boundary on the CPU, ``k + 2``'s on a GPU, where the result is read a step late so that the
  host never waits for the device), every rank stops. Under gradient accumulation only the
  micro-step that completes a window all-reduces: the flags wait for it.
- A ``True`` from a handler whose ``batch_end`` is marked :func:`rank_identical_stop` (the same
  on every rank by construction: ``StoppingHandler``'s counters, ``TerminateOnNaNHandler``'s
  reduced check) needs no exchange: every rank stops at step ``k``, as in one process. So the
  plan's end stops every rank exactly there.
- At an epoch's end (rare, and a decision point) the flags, the outbox and a result still in
  flight are agreed in one blocking collective.

**Asynchronous (no wrapper ``fit`` owns: an FSDP2-sharded net).** After step ``k`` each rank
*starts* an all-reduce of its flags and goes on; after step ``k + 1`` it reads the result, which
has long arrived. A request seen there stops every rank at step ``k + 1``. A rank whose handlers
asked to stop at step ``k`` waits for step ``k``'s exchange at once: if *every* rank asked, all
stop at step ``k``; if only some did, every rank stops at step ``k + 1``.

A checkpoint stores this rank's request not agreed yet (:attr:`StopAgreement.pending_stop`: the
outbox, or the asynchronous exchange in flight) and, on a GPU, the agreed stop an all-reduce
carried that no boundary read yet (:meth:`StopAgreement.stop_in_flight`); a resume puts them
back where they were, so the resumed run stops at the same step as the uninterrupted one.
Signals are not carried over: a rerun must not stop again because the previous process was
told to.
"""

from __future__ import annotations

from typing import Any, Optional

from .. import distributed
from ._flag_carrier import FlagCarrier, encode

__all__ = ["StopAgreement", "rank_identical_stops"]


def rank_identical_stops(batch_end: Any) -> frozenset:
    """The ``batch_end`` methods among ``batch_end`` whose ``True`` every rank returns alike."""
    return frozenset(fn for fn in batch_end if getattr(fn, "rank_identical_stop", False))


class StopAgreement:
    """The stop and signal flags of one rank, agreed with every other rank step by step.

    Args:
        multi: several processes take part. With one, the methods return their inputs.
    """

    def __init__(self, multi: bool):
        self.multi = multi
        #: this rank's stop request not agreed yet: in the outbox, or in the asynchronous
        #: exchange in flight (part of a snapshot).
        self.pending_stop = False
        #: the carrier of the DDP wrapper fit built, or None (the asynchronous protocol)
        self.carrier: Optional[FlagCarrier] = None
        self._code = 0  # carried: the signal code in the outbox
        self._exchange: Optional[distributed.PendingMax] = None

    def use(self, carrier: Optional[FlagCarrier]) -> None:
        """At fit's start: carry the flags with ``carrier`` (emptied), or None: exchange them."""
        self.carrier = carrier if self.multi else None
        if self.carrier is not None:
            self.carrier.reset()

    def after_batch(self, requested: bool, local: bool, code: int) -> tuple[bool, int]:
        """Flags of this rank after a step's ``batch_end`` -> ``(stop, signal code)`` agreed for
        this step's boundary (the same on every rank). ``requested``: a handler returned True;
        ``local``: one that is not marked :func:`rank_identical_stop` did."""
        if not self.multi:
            return requested, code
        carrier = self.carrier
        if carrier is not None:
            sent, arrived = carrier.collect()
            before = (self.pending_stop, self._code)
            if sent:  # this step's all-reduce took the outbox
                self.pending_stop, self._code = False, 0
            self.pending_stop, self._code = self.pending_stop or local, max(self._code, code)
            if (self.pending_stop, self._code) != before:
                carrier.outbox = encode(self.pending_stop, self._code)
            if arrived is not None and (arrived[0] or arrived[1]):
                return bool(arrived[0]) or (requested and not local), arrived[1]
            return requested and not local, 0
        if self._exchange is not None:
            earlier = self._exchange.wait()  # the previous step's: complete by now
            self._exchange = None
            self.pending_stop = False
            if earlier[0] or earlier[2]:
                return bool(earlier[0]), earlier[2]
        exchange = self._start(requested, code)
        if requested:  # a decision point: is this request the same on every rank?
            agreed = exchange.wait()
            if not agreed[1]:  # every rank asked to stop at this step
                return True, agreed[2]
        self._exchange, self.pending_stop = exchange, requested
        return False, 0

    def after_epoch(self, requested: bool, code: int) -> tuple[bool, int]:
        """Flags after an epoch's ``epoch_end`` -> ``(stop, signal code)``, agreed at once."""
        if not self.multi:
            return requested, code
        carrier = self.carrier
        extra: tuple[int, ...] = (0, 0)
        if carrier is not None:  # the outbox, and on a GPU a result no boundary read yet
            requested, code = requested or self.pending_stop, max(code, self._code)
            extra = carrier.in_flight() or extra
            carrier.drop_in_flight()
            self.pending_stop, self._code, carrier.outbox = False, 0, encode(False, 0)
        if self._exchange is not None:  # the epoch's last step: its requests stop here
            earlier = self._exchange.wait()
            self._exchange = None
            self.pending_stop = False
            requested, code = requested or bool(earlier[0]), max(code, earlier[2])
        agreed = self._start(requested, code).wait()
        return bool(agreed[0] or extra[0]), max(agreed[2], extra[1])

    def stop_in_flight(self) -> bool:
        """Carried on a GPU: the agreed stop an all-reduce carried that no boundary read yet
        (part of a snapshot; reading it waits for the device, as a checkpoint does anyway)."""
        flags = self.carrier.in_flight() if self.carrier is not None else None
        return bool(flags is not None and flags[0])

    def restore(self, pending_stop: bool, at_batch_end: bool, stop_in_flight: bool = False) -> None:
        """A resume at a saved boundary: put back the request not agreed there (in the outbox, or
        in an exchange started again) and the stop that was in flight."""
        self._exchange, self.pending_stop, self._code = None, False, 0
        carrier = self.carrier
        if carrier is not None:
            carrier.reset()
        if not (self.multi and at_batch_end):
            return
        if carrier is None:  # every rank resumes at the same boundary: all start it
            self._exchange, self.pending_stop = self._start(pending_stop, 0), pending_stop
            return
        self.pending_stop, carrier.outbox = pending_stop, encode(pending_stop, 0)
        if carrier.lag and stop_in_flight:
            carrier.set_in_flight(True)

    @staticmethod
    def _start(requested: bool, code: int) -> distributed.PendingMax:
        # MAX of [requested, not requested, code]: any rank asked / not every rank asked / the
        # strongest signal
        return distributed.all_reduce_max_async((int(requested), int(not requested), code))
