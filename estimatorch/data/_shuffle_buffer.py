"""A Hugging Face ``datasets`` shuffle buffer whose content is part of the dataset's state, so
that ``fit`` resumes a ``.shuffle(seed=..., buffer_size=...)`` pipeline in O(buffer), not by
replaying the epoch.

``datasets``' own buffer (``BufferShuffledExamplesIterable``) leaves its content out of
``state_dict()``: a resume refills it with other examples. ``fit`` runs a copy of the user's
dataset whose buffer nodes are replaced by ``ResumableShuffleBuffer`` nodes, which draw exactly
as datasets' buffer does (fill to ``buffer_size``, permute with the buffer's generator, yield
all but ``buffer_size // 2``, keep those) and keeps in the live state dict:

- the examples it holds (fewer than ``buffer_size``: the half a flush keeps, those read since,
  and, during a flush, those it has still to yield), as a checkpoint can hold them without
  pickle (:func:`encode`): tensors and plain values as they are, numpy arrays as tensors and
  numpy scalars as numbers (each marked with its dtype), PIL images as their mode, size and
  bytes, through nested dicts, lists and tuples; restored to their type when yielded. An example
  holding anything else is kept as it is, and the checkpoints of that fit keep no buffer content
  (a resume replays the epoch), with a warning naming the type;
- its generator's state after the last permutation;
- the state of what feeds it (datasets' own: the shard and example each input shard reached).

The dataset then resumes from its own state like any stateful ``IterableDataset`` (workers
included, :class:`~._iterable_streams.StatefulIterableStream`): restoring the buffer reads
nothing; the input shards re-read the start of the shard each one stopped in (datasets' state).

The node's class derives from datasets' own: it is made once datasets is needed
(:func:`buffer_class`, also reached as this module's ``ResumableShuffleBuffer`` attribute, so a
spawned DataLoader worker unpickles it), and estimatorch itself imports without datasets.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from copy import copy, deepcopy
from typing import Any, Optional

import numpy as np
import torch
from torch.utils.data import DataLoader

from .._checks import warn_user
from ._fingerprint import compare_fingerprints
from ._iterable_streams import StatefulIterableStream, check_num_workers
from ._stream_base import TrainStream

__all__ = ["BufferedStream", "buffer_class", "resumable_copy", "why_not_resumable"]

#: the state's ``type`` (datasets names each node's state by its class)
STATE_TYPE = "estimatorch.ResumableShuffleBuffer"

#: nodes that may sit above a buffer: each resumes exactly from its own state once what feeds it
#: does (a non-batched map or filter, formatting, column selection, skip/take, a rank's step, and
#: the re-batching datasets puts under a map, which passes examples through one by one)
_EXACT_ABOVE = {"MappedExamplesIterable", "FilteredExamplesIterable", "FormattedExamplesIterable",
                "SelectColumnsIterable", "SkipExamplesIterable", "TakeExamplesIterable", "StepExamplesIterable",
                "RebatchedArrowExamplesIterable"}


#: the mark of a datasets ``Key`` in a saved buffer (any other key, a list included, is kept as it is)
_KEY = "datasets.Key"
#: the mark of a value :func:`encode` turned into plain values: ``{_MARK: kind, "value": ...}``
_MARK = "estimatorch.buffered"


class Unsaveable(TypeError):
    """An example holds a value no checkpoint can hold without pickle (its type is ``args[0]``)."""


def encode(value: Any) -> Any:
    """``value`` as plain values and tensors a checkpoint holds (see the module's docstring).

    Raises:
        Unsaveable: naming the type of a value that cannot be held so.

    Example:
        >>> import numpy as np
        >>> decode(encode({"x": np.arange(3, dtype=np.int16), "n": np.float32(0.5), "b": b"raw"}))
        {'x': array([0, 1, 2], dtype=int16), 'n': np.float32(0.5), 'b': b'raw'}
    """
    kind = type(value)
    if value is None or kind in (bool, int, float, str, bytes) or isinstance(value, torch.Tensor):
        return value
    if kind is dict:
        if _MARK in value:
            raise Unsaveable(f"dict with the key {_MARK!r}")
        out = {}
        for key, item in value.items():
            if type(key) not in (str, int, bool, float, type(None)):
                raise Unsaveable(f"dict key of type {type(key).__name__}")
            out[key] = encode(item)
        return out
    if kind in (list, tuple):
        return kind(encode(item) for item in value)
    if isinstance(value, np.ndarray):
        try:
            return {_MARK: "ndarray", "value": torch.from_numpy(np.ascontiguousarray(value))}
        except TypeError:  # a dtype torch has no tensor of (strings, objects)
            raise Unsaveable(f"numpy array of dtype {value.dtype}") from None
    if isinstance(value, np.generic):
        item = value.item()
        if type(item) not in (bool, int, float, str, bytes):
            raise Unsaveable(f"numpy scalar of dtype {value.dtype}")
        return {_MARK: "numpy", "dtype": value.dtype.str, "value": item}
    if type(value).__module__.startswith("PIL.") and hasattr(value, "tobytes") and hasattr(value, "mode"):
        palette = value.getpalette() if value.mode == "P" else None
        return {_MARK: "PIL", "mode": value.mode, "size": list(value.size), "value": value.tobytes(),
                "palette": palette}
    raise Unsaveable(type(value).__qualname__)


def decode(value: Any) -> Any:
    """What :func:`encode` gave, back to its types."""
    kind = type(value)
    if kind is dict:
        mark = value.get(_MARK)
        if mark == "ndarray":
            return value["value"].numpy()
        if mark == "numpy":
            return np.dtype(value["dtype"]).type(value["value"])
        if mark == "PIL":
            from PIL import Image  # optional: only an image dataset's buffer holds one

            image = Image.frombytes(value["mode"], tuple(value["size"]), value["value"])
            if value["palette"] is not None:
                image.putpalette(value["palette"])
            return image
        return {key: decode(item) for key, item in value.items()}
    if kind in (list, tuple):
        return kind(decode(item) for item in value)
    return value


def _unsaveable_in(state: Any) -> Optional[str]:
    """The type a buffer's state names as unsaveable (``"unsaveable"``), anywhere in ``state``."""
    if isinstance(state, dict):
        if state.get("type") == STATE_TYPE and state.get("unsaveable"):
            return str(state["unsaveable"])
        found = (_unsaveable_in(v) for v in state.values() if isinstance(v, (dict, list)))
    elif isinstance(state, list):
        found = (_unsaveable_in(v) for v in state if isinstance(v, (dict, list)))
    else:
        return None
    return next((name for name in found if name is not None), None)


def _key_out(key: Any) -> Any:
    """An example's key as a checkpoint holds it (datasets' ``Key`` as ``{_KEY: [its two ints]}``)."""
    return {_KEY: [key.original_shard_id, key.item_or_batch_id]} if type(key).__name__ == "Key" else key


@functools.cache
def buffer_class() -> type[Any]:
    """``ResumableShuffleBuffer``: :class:`_ResumableBuffer` over datasets' buffer class."""
    from datasets.builder import Key  # optional: estimatorch[hf], imported once a datasets buffer is found
    from datasets.iterable_dataset import BufferShuffledExamplesIterable, _BaseExamplesIterable

    cls = type("ResumableShuffleBuffer", (_ResumableBuffer, BufferShuffledExamplesIterable),
               {"__module__": __name__, "__doc__": _ResumableBuffer.__doc__, "_key": Key,
                "_load": _BaseExamplesIterable.load_state_dict})
    return cls


def __getattr__(name: str) -> Any:  # this module's ResumableShuffleBuffer, for pickle (PEP 562)
    if name == "ResumableShuffleBuffer":
        return buffer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _ResumableBuffer:
    """datasets' shuffle buffer, drawing as it does, with its content and generator in its state.

    The state (a live dict, as datasets' nodes keep it) holds ``examples_iterable`` (what feeds
    the buffer), ``buffer`` (the examples it fills, or keeps from the last flush), ``pending``
    (the examples of the current flush not yet yielded, the next one last), ``ended`` (the
    input is exhausted) and ``rng`` (the generator's state after the last permutation; ``None``
    until the buffer first runs). Examples are ``[key, example]`` pairs, datasets' ``Key`` as a
    list of its two ints. Together they hold fewer than ``buffer_size`` examples.
    """

    _key: Any  # datasets' Key (an example's key)
    _load: Any  # datasets' plain load_state_dict
    ex_iterable: Any
    buffer_size: int
    generator: Any
    _state_dict: Any

    @classmethod
    def of(cls, node: Any) -> Any:
        """This class's node in the place of datasets' buffer ``node``."""
        return cls(node.ex_iterable, buffer_size=node.buffer_size, generator=node.generator)  # type: ignore[call-arg]

    # datasets builds a new node of its own class for each of these: keep ours
    def shift_rngs(self, value: int) -> Any:
        return self.of(super().shift_rngs(value))  # type: ignore[misc]

    def shuffle_data_sources(self, generator: Any) -> Any:
        return self.of(super().shuffle_data_sources(generator))  # type: ignore[misc]

    def shard_data_sources(self, num_shards: int, index: int, contiguous: bool = True) -> Any:
        return self.of(super().shard_data_sources(num_shards, index, contiguous=contiguous))  # type: ignore[misc]

    def reshard_data_sources(self) -> Any:
        return self.of(super().reshard_data_sources())  # type: ignore[misc]

    @property
    def iter_arrow(self) -> None:  # examples one by one: the state holds them
        return None

    def _init_state_dict(self) -> dict[str, Any]:
        # None, not the input's live state: datasets' load_state_dict copies a saved value over
        # None whole, and only recurses into a dict or list it finds. Its DataLoader workers load
        # the saved state into the pipeline before sharding it too (where the input's lists have
        # another length); the input's state is put in place when the buffer runs, below.
        self.ex_iterable._init_state_dict()
        state: dict[str, Any] = {"examples_iterable": None, "buffer": None, "pending": None, "ended": False,
                                 "rng": None, "type": STATE_TYPE, "unsaveable": None}
        self._state_dict = state
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> Any:
        # datasets' buffer warns here that its content is lost: ours is in the state
        return self._load(state_dict)

    def __iter__(self) -> Iterator[tuple[Any, Any]]:
        state: Optional[dict[str, Any]] = self._state_dict
        if state is not None:
            if state["examples_iterable"] is not None:  # restored
                self.ex_iterable.load_state_dict(state["examples_iterable"])
            state["examples_iterable"] = self.ex_iterable._state_dict  # live from here on
        keep = self.buffer_size // 2
        rng = deepcopy(self.generator)
        buffer: list[Any] = []  # filling, or what a flush keeps
        pending: list[Any] = []  # a flush's examples still to yield, the next one last
        ended = False  # the input is exhausted: what is pending is the last
        if state is not None and state["rng"] is not None:  # restored (or run before): go on from there
            rng.bit_generator.state = state["rng"]
            buffer, pending, ended = list(state["buffer"]), list(state["pending"]), bool(state["ended"])
        if state is not None:
            state.update(buffer=buffer, pending=pending, ended=ended, rng=rng.bit_generator.state)
        upstream = iter(self.ex_iterable) if not ended else None
        while True:
            while pending:  # popped before it is yielded: the state is the one after it
                key, example = pending.pop()
                yield (self._key(*key[_KEY]) if type(key) is dict and _KEY in key else key), decode(example)
            if upstream is None:
                return
            item = next(upstream, None)
            if item is not None:
                try:
                    example = encode(item[1])
                except Unsaveable as err:  # kept as it is: this fit's checkpoints replay the epoch
                    example = item[1]
                    if state is not None and not state.get("unsaveable"):
                        state["unsaveable"] = str(err)
                buffer.append([_key_out(item[0]), example])
                if len(buffer) < self.buffer_size:
                    continue
                count = len(buffer) - keep  # datasets: a full buffer yields all but half of it
            else:
                upstream, ended = None, True
                if state is not None:
                    state["ended"] = True
                count = len(buffer)
            indices = rng.permutation(len(buffer))
            pending = [buffer[i] for i in indices[count - 1::-1]] if count else []
            buffer = [buffer[i] for i in indices[count:]]
            if state is not None:
                state.update(buffer=buffer, pending=pending, rng=rng.bit_generator.state)


def _is_buffer(node: Any) -> bool:
    """Whether ``node`` is a datasets shuffle buffer (told by its classes' names)."""
    return any(c.__name__ == "BufferShuffledExamplesIterable" and c.__module__.startswith("datasets.")
               for c in type(node).__mro__)


def _nodes_above(node: Any, path: list[Any]) -> Iterator[tuple[Any, list[Any]]]:
    """Each node of the pipeline under ``node`` with the nodes above it."""
    yield node, path
    for child in [getattr(node, "ex_iterable", None), *(getattr(node, "ex_iterables", None) or ())]:
        if child is not None:
            yield from _nodes_above(child, [*path, node])


def why_not_resumable(dataset: Any) -> Optional[str]:
    """Why ``dataset``'s shuffle buffers cannot resume from a saved buffer (the node above one
    whose own state would not resume exactly), or None when they can."""
    for node, above in _nodes_above(dataset._ex_iterable, []):
        if not _is_buffer(node):
            continue
        for parent in above:
            name = type(parent).__name__
            if name not in _EXACT_ABOVE:
                return f"a {name} after the .shuffle()"
            if getattr(parent, "batched", False):
                return f"a batched .{'filter' if 'Filter' in name else 'map'}() after the .shuffle()"
            if getattr(parent, "formatting", None) is not None and parent.formatting.is_table \
                    or getattr(parent, "force_convert_to_arrow", False):
                return f"a {name} over arrow tables after the .shuffle()"
    return None


def _replaced(node: Any) -> Any:
    """``node``'s pipeline with each datasets buffer replaced by a ``ResumableShuffleBuffer``
    (the nodes on the way copied, the user's left as they are)."""
    if _is_buffer(node) and not isinstance(node, _ResumableBuffer):
        node = buffer_class().of(node)
    else:
        node = copy(node)
    if getattr(node, "ex_iterable", None) is not None:
        node.ex_iterable = _replaced(node.ex_iterable)
    if getattr(node, "ex_iterables", None):
        node.ex_iterables = [_replaced(child) for child in node.ex_iterables]
    return node


def resumable_copy(dataset: Any) -> Any:
    """A copy of the ``datasets.IterableDataset`` ``dataset`` whose shuffle buffers keep their
    content in its ``state_dict()``. Its order is the one datasets' buffer yields when fed example
    by example; datasets feeds it arrow batches where its input reads arrow (json, parquet...),
    another order of the same examples."""
    out = copy(dataset)
    out._ex_iterable = _replaced(dataset._ex_iterable)
    return out


#: the fingerprint key of a checkpoint holding the buffers' content: the number of workers it ran in
_WORKERS_KEY = "buffer_workers"


class BufferedStream(TrainStream):
    """The training stream of a ``datasets.IterableDataset`` with shuffle buffers that resume
    from their saved content: a :class:`StatefulIterableStream` over :func:`resumable_copy`.

    Its fingerprint is the one of the epoch replay that came before it, and a checkpoint written
    by that replay (its data state empty) still resumes, its epoch exactly as the replay would
    have gone on (``earlier``, datasets' own buffer, draws a function of ``(seed, epoch)``; a
    checkpoint within that epoch is again one without the buffer); the epochs after it are this
    stream's.
    """

    kind = "a Hugging Face datasets.IterableDataset with a shuffle buffer"

    def __init__(self, dataset: Any, loader: Optional[DataLoader[Any]], seed: int, buffers: list[int],
                 earlier: TrainStream):
        super().__init__(seed)
        self.dataset = dataset
        self.buffers = buffers
        self.workers = loader.num_workers if loader is not None else 0
        # with workers, the state (up to a buffer of examples) goes to the training process with
        # one batch in every buffer's worth, not with each: a resume re-makes O(buffer) examples
        batch = (loader.batch_size or 1) if loader is not None else 1
        self.inner = StatefulIterableStream(resumable_copy(dataset), loader, seed,
                                            snapshot_every=max(1, max(buffers) // batch))
        # in the training process (workers 0) a half-made batch advances the buffer: a signal then
        # stops at the boundary after that batch, as for any stateful iterable
        self.stops_while_fetching = self.inner.stops_while_fetching
        self.earlier = earlier
        self._iterated = False
        self._resume_earlier = False  # the next resume is from a checkpoint without the buffer's content
        self._in_earlier = False  # this epoch is the earlier stream's
        self._unsaveable: Optional[str] = None  # a type a buffer held that no checkpoint can

    def fingerprint(self) -> dict[str, Any]:
        fp = {**super().fingerprint(), "dataset": type(self.dataset).__name__, "shuffle_buffers": self.buffers}
        if self._holds_content():  # the buffers' content is per worker: a resume needs as many
            fp[_WORKERS_KEY] = self.workers
        return fp

    def check_fingerprint(self, saved: dict[str, Any], source: str) -> None:
        """The number of workers of a checkpoint holding the buffers' content first (each worker's
        copy has its own buffer), then the rest; a checkpoint without the content (written while the
        epoch was replayed) resumes on any number, as the replay does."""
        rest = dict(saved)
        if _WORKERS_KEY in rest:
            check_num_workers(rest.pop(_WORKERS_KEY) or None, self.workers or None, source)
        now = self.fingerprint()
        now.pop(_WORKERS_KEY, None)
        compare_fingerprints(rest, now, source)

    def _holds_content(self) -> bool:
        """Whether :meth:`state_dict` holds the buffers' content (not before anything was read, nor in
        an epoch an earlier checkpoint's replay resumed, nor once a buffer held an unsaveable value)."""
        return self._iterated and not self._in_earlier and self._unsaveable is None

    def state_dict(self) -> dict[str, Any]:
        if not self._holds_content():
            return {}
        state = self.inner.state_dict()
        unsaveable = _unsaveable_in(state)
        if unsaveable is not None:  # from now on: the epoch's replay, as before the buffer was kept
            self._unsaveable = unsaveable
            warn_user(f"the datasets shuffle buffer holds a {unsaveable}, which a checkpoint cannot hold without "
                      "pickle (it holds tensors, numpy arrays and scalars, bytes, PIL images and plain values): "
                      "this fit's checkpoints keep no buffer content and a resume replays its epoch. Format the "
                      "dataset (.with_format('torch')) or map that column to one of those types")
            return {}
        return {"buffered": state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "buffered" not in state:  # written by the epoch replay: no buffer content to restore
            self._resume_earlier = True
            return
        if "num_workers" in state:  # written before the fingerprint carried the number: judged here
            check_num_workers(int(state["num_workers"]) or None, self.workers or None, "the checkpoint")
        self.inner.load_state_dict(state["buffered"])

    def close(self) -> None:
        self.inner.close()
        self.earlier.close()

    def epoch_iter(self, epoch: int, start: int) -> Iterator[Any]:
        self._iterated = True
        earlier, self._resume_earlier = self._resume_earlier, False
        self._in_earlier = earlier and start > 0
        if self._in_earlier:
            return self.earlier.epoch_iter(epoch, start)
        return self.inner.epoch_iter(epoch, start)
