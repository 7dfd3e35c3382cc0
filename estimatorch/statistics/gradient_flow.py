"""GradientFlow: gradients entering and leaving named modules (instantaneous, backward hooks)."""

from __future__ import annotations

import functools
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from .base import Value
from .callback import CallbackStatistic, tensor_norm

__all__ = ["GradientFlow"]


class GradientFlow(CallbackStatistic):
    """How gradients flow back through the network on a firing step: the 2-norm of the gradient
    with respect to each named module's output (``gradient_flow/<module>/grad_output_norm``)
    and input (``.../grad_input_norm``, when its input requires a gradient; for the first
    layer it usually does not, and PyTorch warns that the hook sees the output only).

    Full backward hooks (``register_full_backward_hook``) are registered at the firing step's
    ``batch_begin`` and removed at its ``backward_end``. Such hooks refuse a module whose output
    is then modified in place (``nn.ReLU(inplace=True)`` right after it): name other modules.

    Args:
        modules: submodule names (as in ``net.named_modules()``). Defaults to every leaf module
            that holds parameters.
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to ``"gradient_flow"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Est: net = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
        >>> s = GradientFlow(period=1)
        >>> s.setup(Est()); s.batch_begin(Est())
        >>> x = torch.randn(4, 2, requires_grad=True)
        >>> Est.net(x).sum().backward(); s.backward_end(Est())
        >>> sorted(s.scalars()), s.attached
        (['0/grad_input_norm', '0/grad_output_norm', '2/grad_input_norm', '2/grad_output_norm'], False)
    """

    default_name = "gradient_flow"
    detach_on = "backward_end"
    events = frozenset({"batch_begin", "backward_end"})

    def reset(self) -> None:
        self._values: dict[str, Value] = {}

    def register(self, name: str, module: nn.Module) -> RemovableHandle:
        return module.register_full_backward_hook(functools.partial(self._record, name))

    def _record(self, name: str, module: nn.Module, grad_input: Any, grad_output: Any) -> None:
        for key, grads in (("grad_output_norm", grad_output), ("grad_input_norm", grad_input)):
            norm = tensor_norm(grads)
            if norm is not None:
                self._values[f"{name}/{key}"] = norm

    def scalars(self) -> dict[str, Value]:
        return dict(self._values)
