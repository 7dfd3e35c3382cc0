"""Checks of saved state, in words: what a value is, and whether a saved value may take the place
of the one it replaces. They raise :class:`CheckpointError`, which the checkpoint store
(:mod:`estimatorch.checkpoint`) and the run's state (``estimator/_state/run.py``) both report.

Lowest layer: it imports nothing of the package.

Example:
    >>> check_like("3", 1.0, "the state of handler 'x'['best']")
    Traceback (most recent call last):
    ...
    estimatorch._saved.CheckpointError: the state of handler 'x'['best'] must be a number, got '3' (str)
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
from typing import Any

import torch

from ._checks import is_int

__all__ = ["MISSING", "CheckpointError", "check_count", "check_dict", "check_keys", "check_like", "kind", "show"]

#: what ``dict.get`` gives for a key a saved state lacks.
MISSING: Any = object()


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: unreadable, invalid, too new, or for other data."""



def show(value: Any) -> str:
    """``value`` in a few words: a tensor's dtype and shape, else a short repr and the type."""
    if isinstance(value, torch.Tensor):
        return f"a {str(value.dtype).replace('torch.', '')} tensor of shape {list(value.shape)}"
    text = repr(value)
    return f"{text[:60]}{'...' if len(text) > 60 else ''} ({type(value).__name__})"


def kind(value: Any) -> str:
    """The kind of a saved value: number, tensor, text, dict, sequence, or its type's name."""
    if isinstance(value, numbers.Number):
        return "number"
    if isinstance(value, torch.Tensor):
        return "tensor"
    if isinstance(value, (str, bytes)):
        return "text"
    if isinstance(value, Mapping):
        return "dict"
    if isinstance(value, (list, tuple)):
        return "sequence"
    return type(value).__name__


_WORDS = {"number": "a number", "tensor": "a tensor or a number", "text": "a string", "dict": "a dict",
          "sequence": "a list or tuple"}


def check_like(saved: Any, current: Any, where: str) -> None:
    """``saved`` may take the place of ``current``: the same kind of value (numbers and tensors
    stand for each other); None on either side is accepted (an unset value)."""
    if saved is None or current is None:
        return
    have, want = kind(saved), kind(current)
    if have == want or {have, want} == {"number", "tensor"}:
        return
    raise CheckpointError(f"{where} must be {_WORDS.get(want, 'a ' + want)}, got {show(saved)}")


def check_count(value: Any, where: str) -> None:
    """A non-negative int (a count of epochs, batches or steps)."""
    if value is MISSING:
        raise CheckpointError(f"{where} is missing")
    if not is_int(value) or value < 0:
        raise CheckpointError(f"{where} must be a non-negative int, got {show(value)}")


def check_dict(value: Any, where: str) -> dict:
    """``value`` as a dict, or the error naming ``where``."""
    if value is MISSING:
        raise CheckpointError(f"{where} is missing")
    if not isinstance(value, Mapping):
        raise CheckpointError(f"{where} must be a dict, got {show(value)}")
    return dict(value)


def check_keys(saved: Mapping, current: Mapping, where: str) -> None:
    """``saved`` has exactly the keys of ``current``."""
    missing = [k for k in current if k not in saved]
    extra = [k for k in saved if k not in current]
    if missing or extra:
        parts = ([f"lacks {missing[:5]}"] if missing else []) + ([f"has unknown {extra[:5]}"] if extra else [])
        raise CheckpointError(f"{where} {' and '.join(parts)}")
