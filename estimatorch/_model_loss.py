"""The batch rule of a model that computes its own loss: ``Estimator(model)`` without ``loss``
(a Hugging Face ``transformers`` model given ``labels``, or any module returning its loss).

The whole batch goes to the model (a dict as keyword arguments, labels included; a tuple or
list positionally; anything else as the one argument) and the loss is read from what it returns:

=========================================  ==================================================
the model returns                          the loss / the predictions metrics read
=========================================  ==================================================
a ``ModelOutput`` or a dict                ``["loss"]`` / ``["logits"]`` (else the output)
a tuple (``return_dict=False``)            its first element, when a scalar / its second
a scalar tensor                            the tensor itself / the tensor
=========================================  ==================================================

Metrics get the logits and the batch's labels (``"labels"`` or ``"label"`` of a dict batch, the
last element of a tuple) in the layout ``nn.CrossEntropyLoss`` takes: per-token logits
``(N, T, C)`` beside labels ``(N, T)`` get their class axis moved to 1, ``(N, C, T)`` (a view),
and for a causal language model (whose loss predicts token t + 1 from tokens up to t) the
logits drop their last position and the labels their first, the shift of the model's loss.

Lowest layer: the step (``BatchProcessor``) and the checks read batches through it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from typing import Any, Optional

import torch

from ._batches import call_net

__all__ = ["is_causal_lm", "labels_of", "logits_of", "loss_of", "metric_view", "model_inputs", "own_loss_step",
           "unwrap_model"]


def model_inputs(batch: Any) -> Any:
    """What the model is called with: the whole batch (a list as a tuple of positional inputs)."""
    return tuple(batch) if type(batch) is list else batch


def labels_of(batch: Any) -> Any:
    """The labels metrics compare with: a dict batch's ``"labels"`` (or ``"label"``), a tuple's last
    element (of two or more); None for anything else.

    Example:
        >>> labels_of({"input_ids": 1, "labels": 2}), labels_of((1, 2)), labels_of(torch.zeros(1))
        (2, 2, None)
    """
    if isinstance(batch, Mapping):
        return batch.get("labels", batch.get("label"))
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return batch[-1]
    return None


def loss_of(output: Any) -> Optional[torch.Tensor]:
    """The loss a model returned (see the module's table), or None when it returned none.

    Example:
        >>> loss_of({"loss": torch.tensor(1.0), "logits": torch.zeros(2)})
        tensor(1.)
        >>> loss_of((torch.zeros(2, 3),)) is None
        True
    """
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    if isinstance(output, Mapping):
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0] if isinstance(output[0], torch.Tensor) and output[0].dim() == 0 else None
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) else None


def logits_of(output: Any) -> Any:
    """What the model predicts: ``output["logits"]`` (a ``ModelOutput``, a dict), the element after
    the loss of a tuple, else the output itself."""
    if isinstance(output, Mapping):
        return output["logits"] if "logits" in output else output
    if isinstance(output, (tuple, list)) and len(output) >= 2 and loss_of(output) is not None:
        return output[1]
    logits = getattr(output, "logits", None)
    return logits if isinstance(logits, torch.Tensor) else output


def metric_view(logits: Any, labels: Any, shift: bool) -> tuple[Any, Any]:
    """``(pred, label)`` as metrics read them (see the module's docstring): views, no copies.

    Example:
        >>> pred, label = metric_view(torch.zeros(2, 5, 7), torch.zeros(2, 5, dtype=torch.long), shift=True)
        >>> tuple(pred.shape), tuple(label.shape)
        ((2, 7, 4), (2, 4))
    """
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        return logits, labels
    if shift and logits.dim() >= 3 and labels.dim() == logits.dim() - 1:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    if logits.dim() >= 3 and labels.dim() == logits.dim() - 1 and logits.shape[:-1] == labels.shape:
        logits = logits.movedim(-1, 1)
    return logits, labels


def unwrap_model(net: Any) -> Any:
    """The model inside DDP (``.module``), ``torch.compile`` (``._orig_mod``) and a PEFT model
    (``get_base_model()``)."""
    for _ in range(8):  # wrappers nest a few deep at most
        inner = getattr(net, "module", None)
        if not isinstance(inner, torch.nn.Module):
            inner = getattr(net, "_orig_mod", None)
        if not isinstance(inner, torch.nn.Module) and callable(getattr(net, "get_base_model", None)):
            inner = net.get_base_model()
        if not isinstance(inner, torch.nn.Module) or inner is net:
            return net
        net = inner
    return net


def is_causal_lm(net: Any) -> bool:
    """Whether ``net`` is a ``transformers`` causal language model (one of the classes its
    ``AutoModelForCausalLM`` builds), whose loss shifts the labels by one token. Never imports
    ``transformers``: a model of it has imported it already."""
    if "transformers" not in sys.modules:
        return False
    # optional dependency, already imported by the model's own module
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for value in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()
             for n in ((value,) if isinstance(value, str) else value)}
    return type(unwrap_model(net)).__name__ in names


def own_loss_step(net: Any, model: Any, batch: Any, data_arg: str, shift: bool,
                  label_smoothing: float = 0.0) -> tuple[Any, Any, Any]:
    """Call ``net`` on the whole batch and read its loss: ``(pred, label, loss)`` for the step's
    events and metrics (``model`` is the plain module, for the error's words). With
    ``label_smoothing`` (a dict batch with ``labels``), the model is called without its labels
    and the loss is the label-smoothed cross-entropy of its logits (shifted for a causal LM,
    -100 skipped), as ``Trainer(label_smoothing_factor=)`` computes it.

    Raises:
        ValueError: the output holds no loss, naming the labels the batch lacks.
    """
    if label_smoothing and isinstance(batch, Mapping) and batch.get("labels") is not None:
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        pred, label = metric_view(logits_of(call_net(net, inputs)), batch["labels"], shift)
        return pred, label, torch.nn.functional.cross_entropy(pred, label, ignore_index=-100,
                                                              label_smoothing=label_smoothing)
    output = call_net(net, model_inputs(batch))
    loss = loss_of(output)
    if loss is None:
        raise ValueError(no_loss_message(model, batch, output, data_arg))
    pred, label = metric_view(logits_of(output), labels_of(batch), shift)
    return pred, label, loss


def no_loss_message(model: Any, batch: Any, output: Any, data_arg: str) -> str:
    """Why a model computed no loss, and what to give it."""
    plain = unwrap_model(model)
    wanted = _label_parameters(plain)
    if isinstance(batch, Mapping):
        held = f"a batch of {data_arg} with the keys {sorted(batch)}"
        lacks = [name for name in wanted if name not in batch]
        if "label" in batch and "labels" in lacks:
            lacks_words = f"; it has 'label' where {type(plain).__name__} takes 'labels': rename the column"
        else:
            lacks_words = f" and no {' / '.join(repr(n) for n in lacks or wanted)}"
    else:
        held = f"a batch of {data_arg} of type {type(batch).__name__}"
        lacks_words = f" (its forward takes the labels as {' / '.join(repr(n) for n in wanted)})"
    return (f"Estimator was built without a loss, so it trains on the loss the model returns, but "
            f"{type(plain).__name__} returned {type(output).__name__} without one, given {held}{lacks_words}. A "
            "transformers model computes its loss only when the batch holds its labels: build the batches with "
            "a collator that adds them (DataCollatorForLanguageModeling, DataCollatorWithPadding over a "
            "'label' column, DataCollatorForSeq2Seq), or pass Estimator(net, loss=...) to compute the loss "
            "from the output")


def _label_parameters(model: Any) -> list[str]:
    """The forward's parameters that take labels (``labels``, ``start_positions``...)."""
    try:
        names = list(inspect.signature(getattr(model, "forward", model)).parameters)
    except (TypeError, ValueError):  # no signature to read
        return ["labels"]
    found = [n for n in names if "label" in n or n.endswith("_positions")]
    return found or ["labels"]
