"""How the ranks of one ``fit`` agree on stops and signals without a blocking collective per step.

Every rank must leave the loop at the same step, or the others wait forever in DDP's next
gradient all-reduce. A blocking all-reduce of the stop flags after every step would make each
rank wait for the slowest before it queues the next step (a network round trip per step on many
nodes). Instead:

- After step ``k`` each rank *starts* an all-reduce of its flags (a stop requested by one of its
  ``batch_end`` handlers, the signal it received) and goes on; after step ``k + 1`` it reads the
  result, which has long arrived. A request seen there stops every rank at step ``k + 1``.
- Where a rank's handlers asked to stop at step ``k`` (a decision point), that rank waits for
  step ``k``'s exchange at once. If *every* rank asked (the decision is rank-identical, e.g.
  ``StoppingHandler``'s counters or a value reduced across ranks), every rank is waiting there
  and all stop at step ``k``. If only some asked (a rank-local decision), the others have gone on
  and every rank stops at step ``k + 1``.
- At an epoch's end (rare, and a decision point) the flags are agreed in one blocking collective.

A checkpoint taken while an exchange is in flight stores this rank's part of it
(:attr:`StopAgreement.pending_stop`); a resume from it starts the same exchange again, so the
resumed run stops at the same step as the uninterrupted one. Signals are not carried over: a
rerun must not stop again because the previous process was told to.
"""

from __future__ import annotations

from typing import Optional

from .. import distributed

__all__ = ["StopAgreement"]


class StopAgreement:
    """The stop and signal flags of one rank, agreed with every other rank step by step.

    Args:
        multi: several processes take part. With one, the methods return their inputs.
    """

    def __init__(self, multi: bool):
        self.multi = multi
        #: this rank's stop request carried by the exchange in flight (part of a snapshot).
        self.pending_stop = False
        self._exchange: Optional[distributed.PendingMax] = None

    def after_batch(self, requested: bool, code: int) -> tuple[bool, int]:
        """Flags of this rank after a step's ``batch_end`` -> ``(stop, signal code)`` agreed for
        this step's boundary (the same on every rank)."""
        if not self.multi:
            return requested, code
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
        if self._exchange is not None:  # the epoch's last step: its requests stop here
            earlier = self._exchange.wait()
            self._exchange = None
            self.pending_stop = False
            requested, code = requested or bool(earlier[0]), max(code, earlier[2])
        agreed = self._start(requested, code).wait()
        return bool(agreed[0]), agreed[2]

    def restore(self, pending_stop: bool, at_batch_end: bool) -> None:
        """A resume at a saved boundary: start again the exchange that was in flight there."""
        self._exchange, self.pending_stop = None, False
        if self.multi and at_batch_end:  # every rank resumes at the same boundary: all start it
            self._exchange, self.pending_stop = self._start(pending_stop, 0), pending_stop

    @staticmethod
    def _start(requested: bool, code: int) -> distributed.PendingMax:
        # MAX of [requested, not requested, code]: any rank asked / not every rank asked / the
        # strongest signal
        return distributed.all_reduce_max_async((int(requested), int(not requested), code))
