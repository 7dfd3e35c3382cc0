"""Callback-based statistics: hooks on named submodules, present only on firing steps.

Callback-free statistics read tensors the loop already has (parameters, gradients, the loss).
Callback-based ones need tensors that live only inside the network (activations, the gradients
flowing between modules), which PyTorch exposes through module hooks. A hook costs every call
of its module, so :class:`CallbackStatistic` registers its hooks at the ``batch_begin`` of a
firing step and removes them at that step's ``batch_end``; :meth:`~CallbackStatistic.teardown`
(called when ``fit`` ends, also on an exception) removes any left behind.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from ..events import EstimatorView
from .base import InstantaneousStatistic, check_names

__all__ = ["CallbackStatistic"]


class CallbackStatistic(InstantaneousStatistic):
    """An instantaneous statistic measured through hooks on named submodules of ``est.net``.

    Subclasses implement :meth:`register` (one module's hooks). Hooks exist only on firing
    steps: registered at ``batch_begin``, removed at ``detach_on`` (``"forward_end"`` for
    forward hooks, ``"backward_end"`` for backward hooks), so that nothing else (a validation
    pass at ``batch_end``, say) reaches them, and at ``batch_end`` in any case.

    Args:
        modules: names of submodules (as in ``net.named_modules()``). Defaults to every leaf
            module that holds parameters.
        period: fire every this many steps. Defaults to 100.
        start: the first step that may fire. Defaults to 1.
        name: Defaults to the class's ``default_name``.

    Example:
        >>> from torch import nn
        >>> class Calls(CallbackStatistic):
        ...     def register(self, name, module):
        ...         return module.register_forward_hook(lambda *a: self.seen.append(name))
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
        >>> s = Calls(period=1)
        >>> class Est: pass
        >>> Est.net = net
        >>> s.setup(Est); s.seen = []
        >>> s.batch_begin(Est); _ = net(torch.zeros(1, 2)); s.forward_end(Est)
        >>> s.seen, len(net[0]._forward_hooks)
        (['0', '2'], 0)
    """

    #: the event that ends the measurement: ``"forward_end"`` or ``"backward_end"``.
    detach_on = "forward_end"
    events = frozenset({"batch_begin", "forward_end"})

    def __init__(self, modules: Optional[list[str]] = None, *, period: int = 100, start: int = 1,
                 name: Optional[str] = None):
        super().__init__(period=period, start=start, name=name)
        self.modules = check_names(modules, "modules")
        self._targets: list[tuple[str, nn.Module]] = []
        self._handles: list[RemovableHandle] = []

    def setup(self, estimator: EstimatorView) -> None:
        super().setup(estimator)
        self.teardown()
        named = dict(estimator.net.named_modules())
        if self.modules is None:
            self._targets = [(n, m) for n, m in named.items()
                             if n and not any(True for _ in m.children())
                             and any(True for _ in m.parameters(recurse=False))]
        else:
            missing = [n for n in self.modules if n not in named]
            if missing:
                raise ValueError(f"{type(self).__name__}: the network has no submodule {missing[0]!r}; "
                                 f"it has {sorted(n for n in named if n)}")
            self._targets = [(n, named[n]) for n in self.modules]

    def register(self, name: str, module: nn.Module) -> RemovableHandle:  # pragma: no cover - abstract
        """Register this statistic's hook on ``module`` and return its handle."""
        raise NotImplementedError

    @property
    def attached(self) -> bool:
        """True while its hooks are registered."""
        return bool(self._handles)

    def batch_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Register the hooks (a firing step begins)."""
        self.detach()
        try:
            for name, module in self._targets:
                self._handles.append(self.register(name, module))
        except BaseException:
            self.detach()
            raise

    def forward_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self.detach_on == "forward_end":
            self.detach()

    def backward_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        if self.detach_on == "backward_end":
            self.detach()

    def batch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        """Remove the hooks if still there (the firing step is over)."""
        self.detach()

    def detach(self) -> None:
        """Remove every hook this statistic registered."""
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def teardown(self) -> None:
        self.detach()


def tensor_norm(value: Any) -> Optional[torch.Tensor]:
    """The 2-norm (float32, detached) of a tensor, or of the first tensor in a tuple; None if
    there is none."""
    if isinstance(value, (tuple, list)):
        value = next((v for v in value if isinstance(v, torch.Tensor)), None)
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        return None
    return torch.linalg.vector_norm(value.detach().float())
