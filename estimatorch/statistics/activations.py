"""ActivationStatistics: norms and histograms of module outputs (instantaneous, forward hooks)."""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .._checks import check_bool
from .base import Value
from .callback import CallbackStatistic

__all__ = ["ActivationStatistics"]


class ActivationStatistics(CallbackStatistic):
    """The output of named submodules on a firing step's forward: ``activations/<module>/norm``,
    ``.../mean``, ``.../std`` and, with ``histograms=True``, a histogram
    ``activations/<module>``.

    Forward hooks are registered at the firing step's ``batch_begin`` and removed at its
    ``forward_end``. For a module called several times in one forward, the last call counts.

    Args:
        modules: submodule names (as in ``net.named_modules()``). Defaults to every leaf module
            that holds parameters.
        histograms: also write each output's histogram. Defaults to False.
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to ``"activations"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> class Est: net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> s = ActivationStatistics(["1"], period=1)
        >>> s.setup(Est()); s.batch_begin(Est())
        >>> _ = Est.net(torch.randn(4, 2)); s.forward_end(Est())
        >>> sorted(s.scalars()), s.attached
        (['1/mean', '1/norm', '1/std'], False)
    """

    default_name = "activations"

    def __init__(self, modules: Optional[list[str]] = None, *, histograms: bool = False, period: int = 100,
                 start: int = 1, name: Optional[str] = None):
        super().__init__(modules, period=period, start=start, name=name)
        check_bool(histograms, "histograms")
        self.with_histograms = histograms

    def reset(self) -> None:
        self._values: dict[str, Value] = {}
        self._hists: dict[str, torch.Tensor] = {}

    def register(self, name: str, module: nn.Module) -> RemovableHandle:
        return module.register_forward_hook(functools.partial(self._record, name))

    def _record(self, name: str, module: nn.Module, inputs: Any, output: Any) -> None:
        if isinstance(output, (tuple, list)):
            output = next((o for o in output if isinstance(o, torch.Tensor)), None)
        if not isinstance(output, torch.Tensor) or not output.is_floating_point():
            return
        out = output.detach().float()
        self._values[f"{name}/norm"] = torch.linalg.vector_norm(out)
        self._values[f"{name}/mean"] = out.mean()
        self._values[f"{name}/std"] = out.std() if out.numel() > 1 else torch.zeros((), device=out.device)
        if self.with_histograms:
            self._hists[name] = out

    def scalars(self) -> dict[str, Value]:
        return dict(self._values)

    def histograms(self) -> dict[str, torch.Tensor]:
        return dict(self._hists)
