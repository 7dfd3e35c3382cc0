"""The stop flags of every rank, carried inside DDP's own gradient all-reduce.

``fit`` registers :meth:`FlagCarrier.hook` as the communication hook of the DDP wrapper it
builds. The hook is DDP's default one (``allreduce_hook``: divide the bucket by the world size,
all-reduce it with SUM) except for bucket 0, the first one reduced (DDP caps it at about 1 MiB):
there it appends this rank's *outbox*, a few numbers, and all-reduces bucket and outbox
together (DDP reads the bucket's gradients back by offset: the flags trail them). The gradients
are the same numbers DDP's default reduces, divided the same way; only the length of the
reduced tensor grows by :data:`SLOTS`. On two ranks the sums are bit-identical to DDP's (a sum
of two numbers has one order); on more ranks the collective may sum an element in another
order, as it may after DDP rebuilds its buckets.

The outbox holds 1.0 in a slot when this rank asks for it, else 0.0, so that after the SUM a
positive slot means "some rank asked" (exact in any float dtype: nothing but zeros can sum to
zero). Slot 0 is "stop"; slot ``c`` is signal code ``c`` (one-hot), and the strongest code
present wins.

When the result can be read: on the CPU (gloo) DDP has waited for the all-reduce when
``backward`` returns, so the step's own boundary reads it (``lag`` 0). On a GPU the result is
copied to pinned host memory behind the all-reduce and read at the *next* boundary (``lag`` 1):
reading it at once would make the host wait for the GPU every step.

Cost: a communication hook written in Python costs more than DDP's built-in C++ one whatever
it does (on 2 gloo ranks of the CPU benchmark, torch's own ``allreduce_hook`` adds about
0.1 ms of CPU per step); this one adds a ``cat`` of the first bucket and a dictionary look-up.
That is still less than a collective of its own per step (docs/performance.md).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from ._interrupts import SIGNAL_CODES

__all__ = ["SLOTS", "FlagCarrier", "attach_carrier", "encode"]

#: slots of the outbox: stop, then one per signal code (1 SIGINT, 2 SIGTERM)
SLOTS = 1 + max(SIGNAL_CODES.values())


class FlagCarrier:
    """This rank's outbox, the communication hook that sends it, and what came back.

    Args:
        world_size: ranks in DDP's process group.
        lag: 0 to read a step's result at its own boundary, 1 at the next one (see above).
    """

    def __init__(self, world_size: int, lag: int):
        self.world_size = world_size
        self.lag = lag
        #: flags in the outbox, as a tuple of SLOTS ints (what the next all-reduce sends)
        self.outbox: tuple[int, ...] = (0,) * SLOTS
        self._constants: dict[tuple[int, ...], torch.Tensor] = {}  # outbox -> tensor, on _where
        self._where: tuple[Any, Any] = (None, None)  # the bucket's device and dtype
        self._sent: Optional[torch.Tensor] = None  # this step's reduced outbox (on lag 1: a host copy)
        self._event: Any = None
        self._unread: Optional[tuple[torch.Tensor, Any]] = None  # lag 1: the previous step's
        self._host = [torch.zeros(SLOTS), torch.zeros(SLOTS)]  # lag 1: alternate pinned buffers
        self._flip = 0
        if lag and torch.cuda.is_available():
            self._host = [t.pin_memory() for t in self._host]

    def reset(self) -> None:
        """Forget everything: a new fit starts (or resumes) with an empty outbox."""
        self.outbox, self._sent, self._event, self._unread = (0,) * SLOTS, None, None, None

    # -- the hook -----------------------------------------------------------------------------
    def hook(self, state: Any, bucket: Any) -> torch.futures.Future:
        """DDP's communication hook (``register_comm_hook(None, carrier.hook)``)."""
        group = state if state is not None else dist.group.WORLD
        buffer = bucket.buffer()
        buffer.div_(self.world_size)  # as DDP's allreduce_hook: divide first, then SUM
        if bucket.index() != 0:
            return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(_first)
        joined = torch.cat((buffer, self._constant(buffer)))
        fut = dist.all_reduce(joined, group=group, async_op=True).get_future()
        if not self.lag:  # DDP waits for it before backward returns; it reads only the first
            self._sent = joined  # numel() elements of the result, by offset: the flags may stay
            return fut.then(_first)

        def copy_out(done: torch.futures.Future) -> torch.Tensor:
            out = done.value()[0]
            self._keep(out[-SLOTS:])  # here the result is ready on the current stream
            return out

        return fut.then(copy_out)

    def _constant(self, buffer: torch.Tensor) -> torch.Tensor:
        """The outbox as a tensor on the bucket's device, made once per value (no copy per step)."""
        if self._where != (buffer.device, buffer.dtype):
            self._where, self._constants = (buffer.device, buffer.dtype), {}
        tensor = self._constants.get(self.outbox)
        if tensor is None:
            tensor = self._constants[self.outbox] = torch.tensor(self.outbox, dtype=buffer.dtype,
                                                                 device=buffer.device)
        return tensor

    def _keep(self, flags: torch.Tensor) -> None:
        """Lag 1: copy the reduced flags to the host behind the all-reduce, without waiting."""
        host = self._host[self._flip]
        self._flip ^= 1
        host.copy_(flags, non_blocking=True)
        event = torch.cuda.Event() if flags.is_cuda else None
        if event is not None:
            event.record()
        self._sent, self._event = host, event

    # -- the boundary ---------------------------------------------------------------------------
    def collect(self) -> tuple[bool, Optional[tuple[int, ...]]]:
        """At a step's boundary -> ``(sent, arrived)``: whether this step's all-reduce took the
        outbox, and the agreed flags to act on here (None when nothing arrives here)."""
        sent, event = self._sent, self._event
        self._sent = self._event = None
        arrived: Optional[tuple[int, ...]] = None
        if not self.lag:
            if sent is not None:
                arrived = _decode(sent[-SLOTS:])
            return sent is not None, arrived
        if self._unread is not None:
            host, unread_event = self._unread
            if unread_event is not None:
                unread_event.synchronize()  # recorded a step ago: long complete
            arrived = _decode(host)
        self._unread = (sent, event) if sent is not None else None
        return sent is not None, arrived

    def in_flight(self) -> Optional[tuple[int, ...]]:
        """Lag 1: the agreed flags an all-reduce already carried but no boundary read yet (waits
        for them: for a snapshot or an epoch's end), or None. They stay to be read."""
        if self._unread is None:
            return None
        host, event = self._unread
        if event is not None:
            event.synchronize()
        return _decode(host)

    def drop_in_flight(self) -> None:
        """Lag 1: forget the result in flight (an epoch's end read it with :meth:`in_flight`)."""
        self._unread = None

    def set_in_flight(self, stop: bool) -> None:
        """Lag 1, on resume: the stop a saved run had in flight arrives at the next boundary."""
        self._unread = (torch.tensor(encode(stop, 0), dtype=torch.float32), None)


# register_comm_hook checks the hook's annotations as objects; this module's are strings
FlagCarrier.hook.__annotations__.update({"bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]})


def _first(done: torch.futures.Future) -> torch.Tensor:
    return done.value()[0]


def _decode(flags: torch.Tensor) -> tuple[int, ...]:
    """Summed slots -> ``(stop, signal code)``: some rank asked to stop; the strongest code sent."""
    values = flags.tolist()
    code = max((c for c in range(1, SLOTS) if values[c] > 0), default=0)
    return int(values[0] > 0), code


def encode(stop: bool, code: int) -> tuple[int, ...]:
    """``(stop, signal code)`` -> an outbox."""
    return (int(stop),) + tuple(int(code == c) for c in range(1, SLOTS))


def attach_carrier(ddp: nn.parallel.DistributedDataParallel) -> FlagCarrier:
    """Register a :class:`FlagCarrier` as ``ddp``'s communication hook and return it."""
    device = next((p.device for p in ddp.parameters()), torch.device("cpu"))
    carrier = FlagCarrier(dist.get_world_size(), lag=int(device.type != "cpu"))
    ddp.register_comm_hook(None, carrier.hook)
    return carrier
