"""SWAHandler: stochastic weight averaging (``torch.optim.swa_utils``), with its learning-rate
schedule and BatchNorm statistics recomputed for the average, resumed exactly."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Optional, Union

import torch
from torch.optim.swa_utils import SWALR, update_bn
from torch.utils import _foreach_utils

from .. import distributed, rng
from .._checks import check_positive_int, check_state_keys, is_real
from ..events import EpochEnd, EstimatorView
from ._weight_average import WeightAverage

__all__ = ["SWAHandler"]


class SWAHandler(WeightAverage, EpochEnd):
    """Stochastic weight averaging: the equal-weight average of the net's trainable parameters at
    the end of every epoch from epoch ``swa_start`` on, as ``torch.optim.swa_utils.AveragedModel``
    computes it (``average += (weights - average) / (n + 1)``, a ``_foreach_lerp_``), with
    ``SWALR``'s learning rate when ``swa_lr`` is given, and the BatchNorm statistics recomputed
    for the average at the end (``update_bn`` over ``bn_data``).

    The average is used as ``EMAHandler``'s is (see there): every evaluation during ``fit`` runs
    on it once it has begun (before, on the trained weights), and a fit that ends its plan leaves
    it in the net (``final="average"``), the trained weights in :meth:`raw_state_dict`. It costs
    one copy of the trainable parameters (each rank its own shards under FSDP2) and one
    ``_foreach_lerp_`` per epoch; its state (the average by parameter name, the count, the
    schedule) resumes exactly.

    With ``swa_lr``, ``SWALR(optimizer, swa_lr, anneal_epochs, anneal_strategy)`` is stepped at
    the end of every epoch from ``swa_start`` on (after the average's update, as in torch's
    example): the rate anneals to ``swa_lr`` and stays there. It is refused beside an estimator's
    ``lr_scheduler`` (two schedules would set the same rates).

    Args:
        swa_start: the first epoch (counted from 0) whose final weights enter the average.
        swa_lr: SWALR's rate (one for every param group, or one per group). Defaults to None
            (the rates are left to the fit's own schedule).
        anneal_epochs: SWALR's epochs from the rate to ``swa_lr``. Defaults to 10.
        anneal_strategy: SWALR's ``"cos"`` or ``"linear"``. Defaults to ``"cos"``.
        bn_data: batches (``(inputs, ...)`` or inputs, as ``update_bn`` takes them: usually the
            train data) over which the BatchNorm statistics are recomputed for the average once a
            fit leaves it in the net; under torch.distributed every rank runs its own and the
            statistics are averaged over the ranks. Defaults to None (not recomputed).
        evaluate: run every evaluation during ``fit`` on the average. Defaults to True.
        final: ``"average"`` or ``"raw"``, as for ``EMAHandler``. Defaults to ``"average"``.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> from estimatorch import Estimator
        >>> net = nn.Linear(4, 2)
        >>> est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
        >>> swa = SWAHandler(swa_start=1, swa_lr=0.05)
        >>> data = [(torch.randn(8, 4), torch.randn(8, 2)) for _ in range(4)]
        >>> _ = est.fit(data, epochs=3, event_handlers=[swa])  # doctest: +ELLIPSIS
        Training begin: ...
        >>> swa.updates, est.optimizer.param_groups[0]["lr"] < 0.1
        (2, True)
    """

    label = "SWA"

    def __init__(self, swa_start: int, swa_lr: Union[None, float, Sequence[float]] = None, *,
                 anneal_epochs: int = 10, anneal_strategy: str = "cos", bn_data: Optional[Iterable[Any]] = None,
                 evaluate: bool = True, final: str = "average"):
        self.swa_start = check_positive_int(swa_start, "swa_start", minimum=0)
        rates = swa_lr if isinstance(swa_lr, (list, tuple)) else [swa_lr]
        if swa_lr is not None and (not rates or not all(is_real(r) and r >= 0 for r in rates)):
            raise ValueError(f"swa_lr must be a non-negative number, a list of them or None, got {swa_lr!r}")
        self.swa_lr = swa_lr
        self.anneal_epochs = check_positive_int(anneal_epochs, "anneal_epochs", minimum=0)
        if anneal_strategy not in ("cos", "linear"):
            raise ValueError(f"anneal_strategy must be 'cos' or 'linear', got {anneal_strategy!r}")
        self.anneal_strategy = anneal_strategy
        if bn_data is not None and (not isinstance(bn_data, Iterable) or isinstance(bn_data, Iterator)):
            raise TypeError(f"bn_data must be a re-iterable of batches (a DataLoader, a list), got {bn_data!r}")
        self.bn_data = bn_data
        self._scheduler: Optional[SWALR] = None
        self._rates: Optional[tuple[int, list[float]]] = None  # (epoch, rates it trained with)
        super().__init__(evaluate=evaluate, final=final)

    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        if self.swa_lr is not None and estimator.lr_scheduler is not None:
            raise ValueError("SWAHandler(swa_lr=...) steps SWALR, and the estimator has an lr_scheduler that would "
                             "set the same rates: pass swa_lr=None to keep your schedule, or drop the lr_scheduler")

    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        super().train_begin(estimator, **kwargs)
        self._rates = None
        self._scheduler = None
        if self.swa_lr is not None:
            swa_lr: Any = list(self.swa_lr) if isinstance(self.swa_lr, (list, tuple)) else self.swa_lr
            self._scheduler = SWALR(estimator.optimizer, swa_lr, anneal_epochs=self.anneal_epochs,
                                    anneal_strategy=self.anneal_strategy)  # type: ignore[arg-type]

    def stepped_schedule(self, estimator: EstimatorView) -> Optional[tuple[Any, str]]:
        return (self._scheduler, "epoch") if self._scheduler is not None else None

    def epoch_rates(self, epoch: int) -> Optional[Sequence[float]]:
        """The rates the epoch trained with, when SWALR changed them at its end."""
        return self._rates[1] if self._rates is not None and self._rates[0] == epoch else None

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        epoch = estimator.position.epoch
        if epoch < self.swa_start:
            return
        self._add_to_average()
        self.updates += 1
        if self._scheduler is not None:
            self._rates = (epoch, [float(group["lr"]) for group in estimator.optimizer.param_groups])
            self._scheduler.step()

    def _add_to_average(self) -> None:
        """``AveragedModel.update_parameters``' arithmetic: a copy first, then ``average + (weights -
        average) / (n + 1)``, as ``_foreach_lerp_`` where torch has foreach kernels (CUDA), else
        as that formula tensor by tensor."""
        n = self.updates
        if n == 0:
            self._update(None)
            return
        averages, weights = self._local_pairs()
        # the devices AveragedModel takes its foreach branch on (a torch helper it calls too)
        fused = getattr(_foreach_utils, "_get_foreach_kernels_supported_devices", lambda: ["cuda"])()
        if averages and averages[0].device.type in fused:
            self._update(1.0 / (n + 1))
            return
        count = torch.tensor(n + 1)
        for average, current in zip(averages, weights):
            average.copy_(average + (current - average) / count)

    def _has_average(self) -> bool:
        return self.updates > 0

    def _finished(self, estimator: EstimatorView) -> None:
        """The BatchNorm statistics of the average, over ``bn_data`` (each rank its own, then
        averaged over the ranks), the random generators kept."""
        if self.bn_data is None or self._net is None:
            return
        self._raw_buffers = {name: b.detach().clone() for name, b in self._net.named_buffers()
                             if _in_batch_norm(self._net, name)}  # the trained weights' (raw_state_dict)
        with rng.keep_random_state():
            update_bn(self.bn_data, self._net, device=estimator.device)
        if distributed.is_distributed():
            stats = [b for m in self._net.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                     for b in (m.running_mean, m.running_var) if b is not None]
            if stats:
                distributed.all_reduce_mean_(stats)

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """``EMAHandler``'s (the average, the counts) and SWALR's state (None without ``swa_lr``)."""
        state = super().state_dict()
        if "scheduler" not in state:
            state["scheduler"] = self._scheduler.state_dict() if self._scheduler is not None else None
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        check_state_keys(state, ("weights", "steps", "updates", "scheduler"), self.name)
        super().load_state_dict(state)
        if state["scheduler"] is not None and self._scheduler is not None:
            self._scheduler.load_state_dict(state["scheduler"])


def _in_batch_norm(net: torch.nn.Module, buffer: str) -> bool:
    """``buffer`` (a name in ``net``) belongs to a BatchNorm module, whose statistics update_bn resets."""
    module = net.get_submodule(buffer.rpartition(".")[0]) if "." in buffer else net
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
