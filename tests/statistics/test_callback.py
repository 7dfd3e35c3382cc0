"""CallbackStatistic: hooks registered on firing steps and always removed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.statistics import CallbackStatistic


class Calls(CallbackStatistic):
    def reset(self):
        self.seen = []

    def register(self, name, module):
        return module.register_forward_hook(lambda *args: self.seen.append(name))


class Est:
    def __init__(self, net):
        self.net = net


def make_net():
    return nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 1)))


def test_default_targets_are_leaf_modules_with_parameters():
    net = make_net()
    stat = Calls(period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    net(torch.zeros(1, 2))
    assert stat.seen == ["0", "2.0", "2.1"]


def test_named_targets_and_detach_on_forward_end_or_batch_end():
    net = make_net()
    stat = Calls(["1", "2"], period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    assert stat.attached and len(net[1]._forward_hooks) == len(net[2]._forward_hooks) == 1
    stat.forward_end(None)
    assert not stat.attached and not net[1]._forward_hooks
    stat.batch_begin(None)
    stat.batch_end(None)
    assert not stat.attached and not net[2]._forward_hooks


def test_backward_statistics_keep_their_hooks_until_backward_end():
    class Back(Calls):
        detach_on = "backward_end"

    net = make_net()
    stat = Back(period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    stat.forward_end(None)
    assert stat.attached
    stat.backward_end(None)
    assert not stat.attached


def test_teardown_and_a_new_setup_remove_everything():
    net = make_net()
    stat = Calls(period=1)
    stat.setup(Est(net))
    stat.batch_begin(None)
    stat.setup(Est(net))
    assert not any(m._forward_hooks for m in net.modules())
    stat.batch_begin(None)
    stat.teardown()
    assert not any(m._forward_hooks for m in net.modules())


def test_a_failed_registration_leaves_no_hook():
    class Fails(Calls):
        def register(self, name, module):
            if name == "2.1":
                raise RuntimeError("cannot hook")
            return super().register(name, module)

    net = make_net()
    stat = Fails(period=1)
    stat.setup(Est(net))
    with pytest.raises(RuntimeError, match="cannot hook"):
        stat.batch_begin(None)
    assert not any(m._forward_hooks for m in net.modules())


def test_unknown_module_names_are_refused_with_the_known_ones():
    stat = Calls(["3"])
    with pytest.raises(ValueError, match=r"no submodule '3'; it has \['0', '1', '2', '2.0', '2.1'\]"):
        stat.setup(Est(make_net()))
