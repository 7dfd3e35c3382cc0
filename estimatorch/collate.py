"""Batches of tokenized text as tensors at the cost of a plain collate: :class:`ArrowCollate`
turns the rows of a Hugging Face ``datasets`` dataset formatted as Arrow into padded tensors,
column by column, with numpy, where ``with_format("torch")`` builds a tensor per row and per
column (docs/transformers.md, "A fast data path"); :class:`PadCollate` pads the rows of any
map-style dataset (dicts of lists, arrays, tensors and numbers), what ``fit(dataset,
batch_size=...)`` collates with when no ``collate_fn`` is given.

Lowest layer; ``pyarrow`` (which ``datasets`` brings) is imported only when a batch is collated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

import numpy as np
import torch

from ._checks import is_int

__all__ = ["ArrowCollate", "PadCollate"]


class ArrowCollate:
    """Collate rows of ``ds.with_format("arrow")`` (each a one-row ``pyarrow.Table``; a whole
    table is taken too) into a dict of tensors: a list column (``input_ids``,
    ``attention_mask``...) becomes ``(rows, longest)``, padded on the right, a number column
    ``(rows,)``, other columns a list of Python values. Integers come as int64 (token ids,
    class indices), floats as float32, as ``transformers``' collators give them.

    Args:
        pad_value: what pads a list column. Defaults to 0.
        pad_values: per column, overriding ``pad_value``. Defaults to ``{"labels": -100,
            "attention_mask": 0}`` (the positions a loss skips, no attention to padding).
        causal_lm_labels: add ``labels``, a copy of ``input_ids`` with every ``pad_value`` token
            set to -100, as ``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` does (so
            pass the tokenizer's ``pad_token_id`` as ``pad_value``). Defaults to False.

    Example:
        >>> import pyarrow as pa
        >>> rows = [pa.table({"input_ids": [[5, 6, 7]], "label": [1]}), pa.table({"input_ids": [[8]], "label": [0]})]
        >>> batch = ArrowCollate(pad_value=0, causal_lm_labels=True)(rows)
        >>> batch["input_ids"], batch["labels"], batch["label"]
        (tensor([[5, 6, 7],
                [8, 0, 0]]), tensor([[   5,    6,    7],
                [   8, -100, -100]]), tensor([1, 0]))
    """

    def __init__(self, pad_value: int = 0, *, pad_values: Optional[Mapping[str, Any]] = None,
                 causal_lm_labels: bool = False):
        if not is_int(pad_value):
            raise ValueError(f"pad_value must be an int, got {pad_value!r}")
        if pad_values is not None and not isinstance(pad_values, Mapping):
            raise TypeError(f"pad_values must be a dict of column name -> value, got {pad_values!r}")
        if not isinstance(causal_lm_labels, bool):
            raise TypeError(f"causal_lm_labels must be a bool, got {causal_lm_labels!r}")
        self.pad_value = pad_value
        self.pad_values = {"labels": -100, "attention_mask": 0, **(pad_values or {})}
        self.causal_lm_labels = causal_lm_labels

    def __call__(self, rows: Any) -> dict[str, Any]:
        import pyarrow as pa  # optional: what datasets brings; needed only for its Arrow rows

        if isinstance(rows, Sequence) and rows and all(isinstance(r, pa.Table) for r in rows):
            table = pa.concat_tables(rows)
        elif isinstance(rows, pa.Table):
            table = rows
        else:
            raise TypeError("ArrowCollate collates the rows of a datasets dataset formatted as Arrow "
                            f"(ds.with_format('arrow')), got {type(rows).__name__}"
                            + (f" of {type(rows[0]).__name__}" if isinstance(rows, Sequence) and rows else ""))
        batch = {name: self._column(table.column(name), self.pad_values.get(name, self.pad_value), pa)
                 for name in table.column_names}
        if self.causal_lm_labels:
            ids = batch["input_ids"]
            batch["labels"] = ids.masked_fill(ids == self.pad_value, -100)
        return batch

    @staticmethod
    def _column(column: Any, pad: Any, pa: Any) -> Any:
        """One column as a tensor (a list column padded to its longest row) or a list."""
        column = column.combine_chunks()
        kind = column.type
        if pa.types.is_list(kind) or pa.types.is_large_list(kind):
            offsets = column.offsets.to_numpy()
            values = _widened(column.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]])
            lengths = np.diff(offsets)
            longest = int(lengths.max()) if len(lengths) else 0
            if (lengths == longest).all():
                return torch.from_numpy(values.reshape(len(lengths), longest).copy())
            out = np.full((len(lengths), longest), pad, dtype=values.dtype)
            out[np.arange(longest) < lengths[:, None]] = values
            return torch.from_numpy(out)
        if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
            return torch.from_numpy(_widened(column.to_numpy(zero_copy_only=False)).copy())
        return column.to_pylist()


class PadCollate:
    """Collate rows (dicts, as a ``datasets.Dataset`` or a tokenizing ``Dataset`` gives them) into
    a dict of tensors: a column of sequences (lists, 1-d arrays or tensors) becomes ``(rows,
    longest)``, padded on the right; a column of numbers (or of equal-shaped arrays) is stacked;
    anything else stays a list. Integers come as int64, floats as float32 (as ``transformers``'
    collators give them). ``label`` and ``label_ids`` are renamed ``labels`` (as
    ``DataCollatorWithPadding`` does) when ``rename_labels``. Rows that are not dicts go to
    ``torch.utils.data.default_collate``.

    Args:
        pad_value: what pads a sequence column (the model's ``pad_token_id``). Defaults to 0.
        pad_values: per column, overriding ``pad_value``. Defaults to ``{"labels": -100,
            "attention_mask": 0, "token_type_ids": 0}``: the positions a loss skips, no
            attention to padding.
        rename_labels: rename ``label``/``label_ids`` to ``labels``. Defaults to True.
        keep: the only columns kept (None: all), what ``fit`` passes to drop the columns the
            model's ``forward`` does not take. Defaults to None.

    Example:
        >>> batch = PadCollate(pad_value=0)([{"input_ids": [5, 6, 7], "label": 1}, {"input_ids": [8], "label": 0}])
        >>> batch["input_ids"], batch["labels"]
        (tensor([[5, 6, 7],
                [8, 0, 0]]), tensor([1, 0]))
    """

    def __init__(self, pad_value: int = 0, *, pad_values: Optional[Mapping[str, Any]] = None,
                 rename_labels: bool = True, keep: Optional[Sequence[str]] = None):
        if not is_int(pad_value):
            raise ValueError(f"pad_value must be an int, got {pad_value!r}")
        if pad_values is not None and not isinstance(pad_values, Mapping):
            raise TypeError(f"pad_values must be a dict of column name -> value, got {pad_values!r}")
        if not isinstance(rename_labels, bool):
            raise TypeError(f"rename_labels must be a bool, got {rename_labels!r}")
        self.pad_value = pad_value
        self.pad_values = {"labels": -100, "attention_mask": 0, "token_type_ids": 0, **(pad_values or {})}
        self.rename_labels = rename_labels
        self.keep = None if keep is None else frozenset(keep)

    def __call__(self, rows: Sequence[Any]) -> Any:
        if not rows or not all(isinstance(row, Mapping) for row in rows):
            return torch.utils.data.default_collate(list(rows))
        batch: dict[str, Any] = {}
        for name in rows[0]:
            if self.keep is not None and name not in self.keep:
                continue
            out = "labels" if self.rename_labels and name in ("label", "label_ids") and "labels" not in rows[0] \
                else name
            batch[out] = _padded([row[name] for row in rows], self.pad_values.get(out, self.pad_value))
        return batch


def _padded(values: list[Any], pad: Any) -> Any:
    """One column of rows as a tensor: sequences padded to the longest, numbers stacked."""
    if all(isinstance(v, bool) or isinstance(v, (int, float, np.integer, np.floating)) for v in values):
        return torch.from_numpy(_widened(np.asarray(values)))
    arrays = []
    for value in values:
        if isinstance(value, torch.Tensor):
            value = value.numpy(force=True)
        elif isinstance(value, (list, tuple, np.ndarray)):
            value = np.asarray(value)
            if value.dtype.kind not in "biuf":
                return values  # text, or mixed values: left as they are
        else:
            return values
        arrays.append(_widened(value))
    shapes = {a.shape for a in arrays}
    if len(shapes) == 1:
        return torch.from_numpy(np.stack(arrays))
    if any(a.ndim != 1 for a in arrays):
        return values  # not sequences of one axis: nothing to pad
    longest = max(len(a) for a in arrays)
    out = np.full((len(arrays), longest), pad, dtype=np.result_type(*arrays))
    for i, a in enumerate(arrays):
        out[i, :len(a)] = a
    return torch.from_numpy(out)


def _widened(values: np.ndarray) -> np.ndarray:
    """Integers as int64 (what a loss takes as class indices, and what a collate of Python ints
    gives; datasets stores token ids as int32), floats as float32."""
    if values.dtype.kind in "iu":
        return values.astype(np.int64, copy=False)
    if values.dtype.kind == "b":
        return values
    if values.dtype.kind == "f":
        return values.astype(np.float32, copy=False)
    return values
