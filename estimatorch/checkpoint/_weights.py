"""Weights exports: the model's state dict alone, for inference.

An export is what ``torch.save(net.state_dict(), path)`` would write for the plain module (no
``module.`` or ``_orig_mod.`` in its keys), with every tensor on the CPU: a serving process loads
it with ``torch.load(path, weights_only=True)`` and ``net.load_state_dict(...)``, without
estimatorch.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

from .. import distributed
from . import _store
from ._files import PathLike
from ._format import CheckpointError, _read, _url_header, migrate, validate
from ._model import is_sharded_module, model_state

__all__ = ["is_weights", "read_saved", "weights_state"]

#: the suffix of a module's extra state in its state dict (``get_extra_state``): any value.
_EXTRA_STATE = "_extra_state"


def weights_state(net: nn.Module) -> Any:
    """``net``'s state dict under the plain module's keys, every tensor detached and on the CPU
    (tensors already there are not copied); the module versions (``_metadata``) are kept.

    For a net sharded across ranks (FSDP2) it is a collective: every rank calls it, the full
    tensors are gathered onto global rank 0's CPU (one parameter at a time) and the other
    ranks get None.

    Example:
        >>> import torch
        >>> net = torch.nn.Linear(2, 1)
        >>> sorted(weights_state(torch.nn.DataParallel(net)))
        ['bias', 'weight']
    """
    if is_sharded_module(net):
        from torch.distributed.checkpoint.state_dict import (  # heavy: a sharded net imported it already
            StateDictOptions,
            get_model_state_dict,
        )

        full = get_model_state_dict(net, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return OrderedDict(full) if distributed.is_main_process() else None
    state = model_state(net)
    out: Any = OrderedDict((k, v.detach().cpu() if isinstance(v, torch.Tensor) else v) for k, v in state.items())
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        out._metadata = metadata
    return out


def is_weights(obj: Any) -> bool:
    """True for a plain state dict: a dict of string keys whose values are tensors (a module's
    extra state excepted), not an estimatorch checkpoint."""
    if not isinstance(obj, dict) or "format_version" in obj:
        return False
    return all(isinstance(k, str) and (isinstance(v, torch.Tensor) or k.endswith(_EXTRA_STATE))
               for k, v in obj.items())


def read_saved(path: PathLike, header: bool = False) -> tuple[str, Any]:
    """Read a checkpoint or a weights export without running code: ``("checkpoint", payload)``
    (migrated and checked like :func:`~estimatorch.checkpoint.load`) or ``("weights", state)``.
    With ``header``, an object (a URL) is read only up to its tensors (ranged requests), which
    come back on the meta device: shapes and dtypes, no values.

    Raises:
        NewerFormatError: a checkpoint written by a newer estimatorch.
        CheckpointError: unreadable, or neither a checkpoint nor a state dict.
        FileNotFoundError: there is no such file.
    """
    path = os.fspath(path)
    raw = _url_header(path) if header and _store.is_url(path) else _read(path)
    if is_weights(raw):
        return "weights", raw
    if not isinstance(raw, dict) or "format_version" not in raw:
        what = f"a dict with keys {sorted(map(str, raw))[:5]}" if isinstance(raw, dict) else f"a {type(raw).__name__}"
        raise CheckpointError(f"{path!r} is neither an estimatorch checkpoint nor a weights export (a state dict "
                              f"of tensors): torch.load gives {what}")
    payload = migrate(raw, source=repr(path))
    validate(payload, source=repr(path))
    return "checkpoint", payload
