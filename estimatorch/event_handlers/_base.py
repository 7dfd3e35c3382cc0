"""What the built-in handlers share: a name, a priority, and checked ``state_dict`` round-trips."""

from __future__ import annotations

import copy
import inspect
from typing import Any, Callable, ClassVar, Optional, TypeVar

import torch

from .._checks import check_state_keys

__all__ = ["StatefulHandler", "rank_identical_stop"]

_F = TypeVar("_F", bound=Callable[..., Any])


def rank_identical_stop(batch_end: _F) -> _F:
    """Mark a ``batch_end`` whose ``True`` is the same on every rank at the same step by
    construction (counters every rank advances alike, a value reduced across ranks): under
    torch.distributed ``fit`` then stops every rank at that very step without exchanging it
    (see ``estimator/_stop_agreement.py``). A subclass that overrides the method is not marked.
    A wrong mark stops one rank while the others wait in the next step's all-reduce: for
    built-in handlers only."""
    batch_end.rank_identical_stop = True  # type: ignore[attr-defined]
    return batch_end


class _InitSignature:
    """``inspect.signature(cls)`` of a handler class: the arguments of ``cls.__init__``.

    A handler that subscribes to events depending on its options may pick its class in
    ``__new__`` (see :mod:`._subscribe`; CheckpointHandler does); ``inspect.signature`` (and so
    ``help()``, Jupyter's call tips and IDEs that ask it) would then show ``__new__``'s
    ``(*args, **kwargs)``. Looked up on each class, so a subclass with its own ``__init__``
    shows its own arguments.
    """

    def __get__(self, instance: Any, owner: type) -> Optional[inspect.Signature]:
        init = owner.__init__  # type: ignore[misc]  # the class's own, as defined
        if instance is not None or init is object.__init__:
            return None  # inspect then falls back to its usual rules
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):  # no introspectable __init__: inspect's usual rules
            return None
        parameters = list(signature.parameters.values())[1:]  # without self
        return signature.replace(parameters=parameters, return_annotation=inspect.Signature.empty)


class StatefulHandler:
    """Base of the built-in handlers.

    Subclasses list the attributes that make up their state in ``_state_attrs``;
    :meth:`state_dict` copies them and :meth:`load_state_dict` checks that each is present.
    Counters are reset in ``train_begin`` so one instance can serve many ``fit`` calls.
    ``inspect.signature`` of a subclass shows its ``__init__`` arguments.

    Example:
        >>> import inspect
        >>> class Counter(StatefulHandler):
        ...     _state_attrs = ("count",)
        ...     def __init__(self, start=0):
        ...         self.count = start
        >>> str(inspect.signature(Counter)), Counter(3).state_dict()
        ('(start=0)', {'count': 3})
    """

    __signature__ = _InitSignature()

    #: Dispatch rank: lower runs first. Ties keep the order handlers were given in.
    priority: float = 0
    #: True when the state is the same on every rank (decisions on reduced values, weights or
    #: gradients DDP keeps in step): a checkpoint then stores it once, not once per rank.
    shared_state: bool = False
    _state_attrs: ClassVar[tuple[str, ...]] = ()
    #: state keys that count this process's batches (or samples); an elastic resume on another
    #: world size scales them like the position (``"a.b"``: entry ``b`` of the dict ``a``). Those
    #: of the base classes count too.
    elastic_batch_counters: ClassVar[tuple[str, ...]] = ()

    @property
    def name(self) -> str:
        """The key this handler's state is saved under. Defaults to the class name."""
        return self.__dict__.get("_name") or type(self).__name__

    @name.setter
    def name(self, value: str) -> None:
        if not isinstance(value, str) or not value:
            raise ValueError(f"name must be a non-empty str, got {value!r}")
        self._name = value

    def state_dict(self) -> dict[str, Any]:
        """This handler's counters, as tensors and plain python values."""
        return {attr: _copy(getattr(self, attr)) for attr in self._state_attrs}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output; raises ``ValueError`` naming a missing key."""
        check_state_keys(state, self._state_attrs, self.name)
        for attr in self._state_attrs:
            setattr(self, attr, _copy(state[attr]))


def _copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    return copy.deepcopy(value)
