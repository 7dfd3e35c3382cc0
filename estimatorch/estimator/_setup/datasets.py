"""Data as it comes: a map-style dataset (a ``datasets.Dataset``, a torch ``Dataset``) given to
``fit``, ``evaluate`` or ``predict`` with ``batch_size=`` becomes a ``DataLoader`` (shuffled for
training: ``fit`` makes it resumable like any other), collated by the ``collate_fn`` given or a
padding one (:class:`~estimatorch.collate.PadCollate`, padding with the model's
``pad_token_id``); the columns the model's ``forward`` does not take are dropped, once, with a
line naming them (as ``Trainer`` does). Without ``batch_size`` a ``datasets.Dataset`` (whose
rows are not batches) is refused, naming ``DataLoader`` and the fix; so is a ``DataLoader``
whose ``transformers`` collator would meet a text column it cannot pad.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Mapping
from typing import Any, Callable, Optional

from torch.utils.data import DataLoader, IterableDataset

from ... import rng
from ..._checks import check_positive_int
from ..._model_loss import unwrap_model
from ...collate import PadCollate
from .._fit_estimator import FitEstimator

__all__ = ["as_batches", "is_hf_dataset"]

#: the label columns a model's forward is given under "labels" (Trainer's default label names)
_LABELS = ("label", "label_ids", "labels")


def is_hf_dataset(data: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` (map-style; never imports ``datasets``)."""
    return type(data).__module__.startswith("datasets.") and hasattr(data, "column_names") \
        and callable(getattr(data, "remove_columns", None)) and not isinstance(data, IterableDataset)


def as_batches(estimator: FitEstimator, data: Any, arg: str, batch_size: Optional[int],
               collate_fn: Optional[Callable[..., Any]], *, train: bool = False) -> Any:
    """``data`` as the iterable of batches the loop reads (a dict of eval sets: each of them), for
    training (``train``: shuffled; ``net`` and ``loss``) or inference (``val_net``, ``val_loss``).

    Raises:
        TypeError: a ``datasets.Dataset`` without ``batch_size``, or a ``batch_size`` for data
            that is not a map-style dataset; naming ``arg``, ``DataLoader`` and the fix.
        ValueError: a bad ``batch_size``, or a text column a ``transformers`` collator would meet.
    """
    if data is None:
        return None
    if isinstance(data, Mapping) and not is_hf_dataset(data):  # named eval sets
        return {name: as_batches(estimator, value, f"{arg}[{name!r}]", batch_size, collate_fn, train=train)
                for name, value in data.items()}
    net = estimator.net if train else estimator.val_net
    own_loss = (estimator.loss if train else estimator.val_loss) is None
    if batch_size is None:
        if collate_fn is not None:
            raise ValueError(f"collate_fn is given without batch_size: pass batch_size= too, so that {arg} "
                             "(a dataset) is batched with it")
        if is_hf_dataset(data):
            raise TypeError(f"{arg} is a datasets.Dataset of {len(data)} rows, not an iterable of batches: pass "
                            f"batch_size= (fit({arg.split('[')[0]}=ds, batch_size=16)) to have it batched, or a "
                            "DataLoader(ds, batch_size=16, shuffle=True, "
                            "collate_fn=DataCollatorWithPadding(tokenizer))")
        if own_loss and isinstance(data, DataLoader):
            _check_text_columns(data, arg, net)
        return data
    check_positive_int(batch_size, "batch_size")
    if isinstance(data, DataLoader):
        raise TypeError(f"{arg} is a DataLoader (batch_size {data.batch_size}) and batch_size={batch_size} is "
                        "given: pass the dataset itself with batch_size=, or the DataLoader alone")
    map_style = hasattr(data, "__getitem__") and hasattr(data, "__len__")
    if isinstance(data, (IterableDataset, str, bytes)) or not map_style:
        raise TypeError(f"batch_size= batches a map-style dataset (a datasets.Dataset, a torch Dataset with "
                        f"__getitem__ and __len__), but {arg} is a {type(data).__name__}: pass "
                        "DataLoader(data, batch_size=..., collate_fn=...) instead")
    if collate_fn is not None and not callable(collate_fn):
        raise TypeError(f"collate_fn must be callable, got {collate_fn!r}")
    keep = None
    if own_loss:
        data, keep = _drop_unused_columns(data, arg, net, estimator.logger)
    collate = collate_fn if collate_fn is not None else PadCollate(_pad_token_id(net), keep=keep)
    return DataLoader(data, batch_size=batch_size, shuffle=train, collate_fn=collate)


def _forward_arguments(net: Any) -> Optional[frozenset[str]]:
    """The arguments the model's ``forward`` names (as ``Trainer`` reads them: a ``**kwargs``
    beside named ones, as ``transformers``' models have, takes nothing else); None for a forward
    of ``**kwargs`` alone, which may take anything."""
    try:
        parameters = list(inspect.signature(unwrap_model(net).forward).parameters.values())
    except (TypeError, ValueError):
        return None
    variadic = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    named = [p.name for p in parameters if p.kind not in variadic]
    return frozenset(named) if named else None


def _pad_token_id(net: Any) -> int:
    """The model's ``config.pad_token_id`` (a ``transformers`` model), else 0."""
    pad = getattr(getattr(unwrap_model(net), "config", None), "pad_token_id", None)
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else 0


def _columns(data: Any) -> Optional[list[str]]:
    """A dataset's columns: a ``datasets.Dataset``'s, or the keys of a torch dataset's first row
    (read with every generator kept: a row's random augmentation draws nothing of the run's)."""
    if is_hf_dataset(data):
        return list(data.column_names)
    if len(data) == 0:
        return None
    with rng.keep_random_state():
        row = data[0]
    return list(row) if isinstance(row, Mapping) else None


def _drop_unused_columns(data: Any, arg: str, net: Any, logger: logging.Logger) -> tuple[Any, Optional[list[str]]]:
    """The columns the model's forward does not take, dropped with one line naming them:
    ``(data, keep)``, a ``datasets.Dataset`` without them, or the columns a collate keeps."""
    taken, columns = _forward_arguments(net), _columns(data)
    if taken is None or columns is None:
        return data, None
    unused = [c for c in columns if c not in taken and c not in _LABELS]
    if not unused:
        return data, None
    logger.info("%s: the columns %s are not arguments of %s.forward and are dropped (as Trainer does)", arg,
                unused, type(unwrap_model(net)).__name__)
    if is_hf_dataset(data):
        return data.remove_columns(unused), None
    return data, [c for c in columns if c not in unused]


def _check_text_columns(loader: DataLoader[Any], arg: str, net: Any) -> None:
    """A ``transformers`` collator over a ``datasets.Dataset`` with a text column the model does
    not take fails at the first batch ("Unable to create tensor"): say which column, and the fix."""
    dataset: Any = loader.dataset
    collate = loader.collate_fn
    if not is_hf_dataset(dataset) or not type(collate).__module__.startswith("transformers."):
        return
    taken = _forward_arguments(net)
    features = getattr(dataset, "features", {}) or {}
    text = [name for name in dataset.column_names
            if (taken is None or name not in taken) and name not in _LABELS
            and getattr(features.get(name), "dtype", None) in ("string", "large_string")]
    if text:
        raise ValueError(f"{arg}: the text columns {text} of its dataset are not arguments of "
                         f"{type(unwrap_model(net)).__name__}.forward, and {type(collate).__name__} cannot pad "
                         f"them into tensors: drop them (ds.remove_columns({text})), or pass the dataset itself "
                         "with batch_size= and fit drops the columns the model does not take")

