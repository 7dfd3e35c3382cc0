"""Adapter-only checkpoints: a net with frozen parameters (a PEFT LoRA model over its base, a
frozen backbone) is checkpointed without them. The file holds the trainable parameters and every
buffer under ``model``, and under ``frozen`` a fingerprint of each frozen parameter it left out
(its shape, dtype and a BLAKE2b digest of its bytes), which a resume compares with the net it
loads into: the frozen weights come from the user's own build of the model (the pretrained base),
and a net whose frozen weights differ is refused, naming the first that differs. Digests are
computed once per parameter and process (again only after an in-place change), so a save costs
no hashing of the base after the first.

Without frozen parameters nothing changes: no ``frozen`` key, the whole state under ``model``.
"""

from __future__ import annotations

import hashlib
import weakref
from collections import OrderedDict
from typing import Any, Optional

import torch
from torch import nn

from .._saved import CheckpointError
from ._model import load_model_state, model_state, plain_key, plain_module

__all__ = ["check_frozen", "frozen_keys", "load_partial_state", "split_frozen"]

#: id(parameter) -> (a weak reference to it, its version counter when hashed, its digest); by id, as a
#: tensor's == is elementwise (a WeakKeyDictionary would compare them)
_DIGESTS: dict[int, tuple["weakref.ReferenceType[torch.Tensor]", int, str]] = {}


def frozen_keys(net: nn.Module) -> list[str]:
    """The keys of ``net``'s state (the plain module's) that hold a parameter that does not train."""
    state = plain_module(net).state_dict(keep_vars=True)
    return [plain_key(k) for k, v in state.items() if isinstance(v, nn.Parameter) and not v.requires_grad]


def _digest(tensor: torch.Tensor) -> str:
    cached = _DIGESTS.get(id(tensor))
    if cached is not None and cached[0]() is tensor and cached[1] == tensor._version:
        return cached[2]
    data = tensor.detach().contiguous().cpu()
    digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes() if data.numel() else b"",
                             digest_size=16).hexdigest()
    key = id(tensor)
    _DIGESTS[key] = (weakref.ref(tensor, lambda _: _DIGESTS.pop(key, None)), tensor._version, digest)
    return digest


def _fingerprint(tensor: torch.Tensor) -> dict[str, Any]:
    return {"shape": list(tensor.shape), "dtype": str(tensor.dtype).replace("torch.", ""), "digest": _digest(tensor)}


def split_frozen(net: nn.Module, state: Any) -> tuple[Any, Optional[dict[str, Any]]]:
    """``(state without the frozen parameters, their fingerprints)``; ``(state, None)`` for a net
    without frozen parameters."""
    frozen = frozen_keys(net)
    if not frozen:
        return state, None
    params = {plain_key(k): v for k, v in plain_module(net).state_dict(keep_vars=True).items()}
    kept: Any = OrderedDict((k, v) for k, v in state.items() if k not in set(frozen))
    metadata = getattr(state, "_metadata", None)
    if metadata is not None:
        kept._metadata = metadata
    return kept, {key: _fingerprint(params[key]) for key in frozen}


def check_frozen(net: nn.Module, saved: dict[str, Any], frozen: Any) -> None:
    """The keys a checkpoint left out are this net's frozen parameters, of the fingerprints saved.

    Raises:
        CheckpointError: naming the first parameter that differs (or is not frozen here).
    """
    if not isinstance(frozen, dict):
        raise CheckpointError(f"its 'frozen' entry must be a dict of fingerprints, got {type(frozen).__name__}")
    here = {plain_key(k): v for k, v in plain_module(net).state_dict(keep_vars=True).items()}
    for key, want in frozen.items():
        have = here.get(key)
        if have is None:
            raise CheckpointError(f"the checkpoint left out the frozen parameter {key!r}, which this net does not have")
        if key in saved:
            raise CheckpointError(f"the checkpoint holds {key!r} and its fingerprint both")
        if not isinstance(want, dict) or {"shape", "dtype", "digest"} - set(want):
            raise CheckpointError(f"the fingerprint of the frozen parameter {key!r} is damaged: {want!r}")
        got = _fingerprint(have)
        if got != {k: want[k] for k in ("shape", "dtype", "digest")}:
            what = "shape or dtype" if (got["shape"], got["dtype"]) != (want["shape"], want["dtype"]) else "values"
            raise CheckpointError(
                f"the frozen parameter {key!r} of this net differs from the one the checkpoint was trained on (its "
                f"{what}: {got['shape']} {got['dtype']} here, {want['shape']} {want['dtype']} there): the checkpoint "
                "holds only the trainable parameters, so resume onto the same base weights (the same pretrained "
                "model, or the same seed), or save the frozen ones too: CheckpointHandler(..., save_frozen=True)")


def load_partial_state(net: nn.Module, saved: Any, frozen: Optional[dict[str, Any]]) -> None:
    """Load a state into ``net``; one that left frozen parameters out (``frozen``) keeps the net's
    own, once :func:`check_frozen` passed."""
    if frozen is None:
        load_model_state(net, saved)
        return
    check_frozen(net, saved, frozen)
    full: Any = OrderedDict(model_state(net))
    full.update(saved)
    metadata = getattr(saved, "_metadata", None)
    if metadata is not None:
        full._metadata = metadata
    load_model_state(net, full)
