"""Statistic base classes: firing steps, argument checks, parameter selection."""

from __future__ import annotations

import pytest
from torch import nn

from estimatorch.statistics import InstantaneousStatistic, RunningStatistic, Statistic
from estimatorch.statistics.base import check_names, select_parameters


@pytest.mark.parametrize("period, start, expected", [
    (1, 1, list(range(1, 13))),
    (4, 1, [4, 8, 12]),
    (4, 5, [8, 12]),
    (5, 10, [10]),
])
def test_instantaneous_fires_on_multiples_of_period_from_start(period, start, expected):
    stat = InstantaneousStatistic(period=period, start=start)
    assert [s for s in range(1, 13) if stat.fires(s)] == expected


def test_running_statistics_fire_every_step_and_reset_per_epoch():
    class Count(RunningStatistic):
        def reset(self):
            self.n = 0

        def batch_end(self, estimator, **kwargs):
            self.n += 1

    stat = Count()
    assert stat.running and all(stat.fires(s) for s in range(1, 10))
    stat.epoch_begin(None)
    stat.batch_end(None)
    stat.epoch_begin(None)
    assert stat.n == 0


def test_names_default_to_the_class_and_are_checked():
    assert InstantaneousStatistic().name == "statistic"
    assert Statistic(name="mine").name == "mine"
    with pytest.raises(ValueError, match="name"):
        Statistic(name="")


@pytest.mark.parametrize("kwargs, match", [({"period": 0}, "period"), ({"start": 0}, "start"),
                                           ({"period": 2.0}, "period")])
def test_period_and_start_are_checked(kwargs, match):
    with pytest.raises(ValueError, match=match):
        InstantaneousStatistic(**kwargs)


def test_select_parameters():
    net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    net[1].bias.requires_grad_(False)
    assert [n for n, _ in select_parameters(net, None, "X")] == ["0.weight", "0.bias", "1.weight"]
    assert [p for _, p in select_parameters(net, ["1.bias"], "X")] == [net[1].bias]
    with pytest.raises(ValueError, match="X: the network has no parameter '2.weight'"):
        select_parameters(net, ["2.weight"], "X")


@pytest.mark.parametrize("value, error", [("0.weight", TypeError), ([1], TypeError), ([], ValueError)])
def test_check_names(value, error):
    assert check_names(None, "params") is None and check_names(("a",), "params") == ["a"]
    with pytest.raises(error, match="params"):
        check_names(value, "params")
