"""Adapters: what recognises a kind of training data and opens its :class:`TrainStream`, and the
one registry ``fit`` asks (:func:`open_stream`).

An adapter is any object with a ``name`` and the two methods of :class:`StreamAdapter`; it is
registered with :func:`register_adapter`, the call every built-in adapter goes through too.
``open_stream`` tries the registered adapters in the order of their ``priority`` (lower first;
equal ones in the order they were registered) and opens the stream with the first that
recognises the data. An adapter recognises its data without importing its library (by the
module and class names of the object's type, or by duck typing), so that estimatorch imports
no data library and a library that is not installed costs nothing.

The built-in adapters, by priority (a third-party adapter's default, 0, comes before them all):

=====  =====================  ====================================================================
 100   ``torchdata``          torchdata's ``StatefulDataLoader``: a loaded state refused, then
                              taken as the ``DataLoader`` it replaces (:meth:`DataSource.pass_on`)
 200   ``hf-iterable``        Hugging Face ``datasets.IterableDataset``, in a loader or alone
 210   ``mosaic``             MosaicML ``streaming.StreamingDataset``, in a loader or alone
 300   ``stateful-iterable``  an ``IterableDataset`` with ``state_dict``/``load_state_dict``,
                              any number of workers
 400   ``map-loader``         a map-style ``DataLoader`` (``datasets.Dataset`` included),
                              rebuilt around a resumable sampler
 500   ``sequence``           a list or tuple of batches
 1000  ``replay``             any other iterable of batches: replayed (not exact)
=====  =====================  ====================================================================
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Mapping
from typing import Any, Optional, Protocol, runtime_checkable

import torch
from torch.utils.data import DataLoader

from .._checks import is_int
from ._stream_base import TrainStream

__all__ = ["DataSource", "StreamAdapter", "open_stream", "register_adapter", "registered_adapters",
           "unregister_adapter"]


@dataclasses.dataclass(frozen=True)
class DataSource:
    """What an adapter is shown: ``fit``'s ``train_data`` and its parts.

    Attributes:
        data: ``train_data`` as given to ``fit``.
        loader: ``data`` when it is a :class:`~torch.utils.data.DataLoader` (any subclass), else None.
        dataset: the loader's dataset, else ``data`` itself.
        seed: the fit's seed (the estimator's ``seed``); every random draw of the stream derives from it.
    """

    data: Any
    loader: Optional[DataLoader[Any]]
    dataset: Any
    seed: int
    #: the adapters already tried (by :meth:`pass_on`), skipped by the next search.
    passed: tuple[str, ...] = ()

    def pass_on(self, adapter: StreamAdapter) -> TrainStream:
        """The stream the adapters after ``adapter`` open for this data: for an adapter that only
        checks or converts what it recognises and leaves the stream to the others."""
        return _open(dataclasses.replace(self, passed=self.passed + (adapter.name,)))


@runtime_checkable
class StreamAdapter(Protocol):
    """What a data adapter provides (a ``typing.Protocol``: any object with these members).

    Attributes:
        name: a short unique name ("hf-iterable"), shown in messages and used by
            :func:`unregister_adapter`.
    """

    name: str

    def recognises(self, source: DataSource) -> bool:
        """Whether this adapter opens ``source`` (told without importing a data library: by the
        module and class names of ``type(source.dataset).__mro__``, or by duck typing)."""
        ...  # pragma: no cover - a protocol

    def open(self, source: DataSource) -> TrainStream:
        """The training stream of ``source``; raises ``ValueError``/``TypeError`` naming
        ``train_data`` when it cannot be trained on (empty, misconfigured), before any work."""
        ...  # pragma: no cover - a protocol


@dataclasses.dataclass
class _Entry:
    adapter: StreamAdapter
    priority: float
    order: int


_REGISTRY: list[_Entry] = []
_ORDER = itertools.count()


def register_adapter(adapter: StreamAdapter, *, priority: float = 0) -> StreamAdapter:
    """Make ``fit`` (and :func:`open_stream`) open the data ``adapter`` recognises with it.

    Args:
        adapter: a :class:`StreamAdapter`; its ``name`` must not be registered already.
        priority: where it is tried: lower first, equal ones in the order they were registered.
            Defaults to 0 (before every built-in adapter, whose priorities are 100 and above).

    Returns:
        ``adapter``.

    Raises:
        TypeError: ``adapter`` lacks ``name``, ``recognises`` or ``open``.
        ValueError: an adapter of that name is registered, or ``priority`` is not a number.
    """
    name = getattr(adapter, "name", None)
    if not isinstance(name, str) or not name or not isinstance(adapter, StreamAdapter):
        raise TypeError(f"adapter must have a non-empty str name and recognises(source) and open(source) methods, "
                        f"got {adapter!r}")
    if isinstance(priority, bool) or not isinstance(priority, (int, float)) or priority != priority:
        raise ValueError(f"priority must be a number, got {priority!r}")
    if any(entry.adapter.name == name for entry in _REGISTRY):
        raise ValueError(f"an adapter named {name!r} is registered already: unregister_adapter({name!r}) first, "
                         "or give yours another name")
    _REGISTRY.append(_Entry(adapter, priority, next(_ORDER)))
    _REGISTRY.sort(key=lambda entry: (entry.priority, entry.order))
    return adapter


def unregister_adapter(name: str) -> StreamAdapter:
    """Remove the adapter registered as ``name`` and return it.

    Raises:
        KeyError: no adapter of that name is registered.
    """
    for i, entry in enumerate(_REGISTRY):
        if entry.adapter.name == name:
            return _REGISTRY.pop(i).adapter
    raise KeyError(f"no adapter named {name!r} is registered (registered: {[e.adapter.name for e in _REGISTRY]})")


def registered_adapters() -> list[tuple[str, float]]:
    """``(name, priority)`` of every registered adapter, in the order they are tried."""
    return [(entry.adapter.name, entry.priority) for entry in _REGISTRY]


def open_stream(train_data: Any, seed: int, *, elastic_steps: Optional[int] = None,
                device: Optional[torch.device] = None) -> TrainStream:
    """The training stream of ``train_data``: the one way into the data layer (``fit`` and
    ``Estimator.planned_steps`` open their data here).

    Args:
        train_data: what ``fit`` was given: an iterable of batches (a ``DataLoader``, a list...).
        seed: the fit's seed.
        elastic_steps: when given (``CheckpointHandler(..., elastic=True)``), the batches are laid
            out in global optimizer steps of ``elastic_steps`` accumulation steps per process
            (:meth:`TrainStream.use_elastic`). Defaults to None (each process's own shard).
        device: the device whose CUDA generator an elastic layout reseeds too. Defaults to None.

    Raises:
        TypeError: ``train_data`` is not an iterable of batches.
        ValueError: it is empty, misconfigured, or cannot be laid out for ``elastic_steps``.
    """
    if isinstance(train_data, (torch.Tensor, str, bytes, Mapping)) or not isinstance(train_data, Iterable):
        raise TypeError(
            "train_data must be an iterable of batches (a DataLoader, a list of (data, label) "
            f"pairs, ...), got {type(train_data).__name__}"
        )
    if elastic_steps is not None and (not is_int(elastic_steps) or elastic_steps < 1):
        raise ValueError(f"elastic_steps must be a positive int or None, got {elastic_steps!r}")
    loader = train_data if isinstance(train_data, DataLoader) else None
    dataset = loader.dataset if loader is not None else train_data
    stream = _open(DataSource(train_data, loader, dataset, seed))
    if elastic_steps is not None:
        try:
            stream.use_elastic(elastic_steps, device)
        except BaseException:
            stream.close()
            raise
    return stream


def _open(source: DataSource) -> TrainStream:
    for entry in list(_REGISTRY):
        adapter = entry.adapter
        if adapter.name in source.passed or not adapter.recognises(source):
            continue
        stream = adapter.open(source)
        if not isinstance(stream, TrainStream):
            raise TypeError(f"data adapter {adapter.name!r} opened {type(stream).__name__}, not an "
                            "estimatorch.data.TrainStream")
        return stream
    raise TypeError(f"no registered data adapter opens train_data of type {type(source.data).__name__} "
                    f"(tried {[e.adapter.name for e in _REGISTRY if e.adapter.name not in source.passed]})")
