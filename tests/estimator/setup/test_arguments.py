"""_checks: devices this machine can train on, precision names and aliases, optimizers over the
net's parameters, handlers passed once."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch.estimator._setup.arguments import check_optimizer, check_unique_handlers, precision_name, resolve_device
from estimatorch.event_handlers import StoppingHandler


@pytest.mark.parametrize("device", ["meta", "xpu", "hpu", "mps", "cuda", "cuda:0"])
def test_a_device_this_machine_cannot_train_on_is_a_value_error_naming_it(device):
    kind = torch.device(device).type
    available = {"xpu": torch.xpu.is_available(), "mps": torch.backends.mps.is_available(),
                 "cuda": torch.cuda.is_available()}.get(kind, False)
    if available:
        pytest.skip(f"this machine has {kind}")
    with pytest.raises(ValueError, match=f"device={device!r}"):
        resolve_device(device)


def test_devices_that_train():
    assert resolve_device(None) == (torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu"))
    assert resolve_device("cpu") == torch.device("cpu") == resolve_device(torch.device("cpu"))
    if torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            resolve_device(f"cuda:{torch.cuda.device_count()}")


@pytest.mark.parametrize("given, name", [("32", "32"), (32, "32"), ("16-mixed", "16-mixed"), ("16", "16-mixed"),
                                         (16, "16-mixed"), ("fp16", "16-mixed"), ("bf16", "bf16-mixed"),
                                         ("bf16-mixed", "bf16-mixed")])
def test_precision_names_and_aliases(given, name):
    assert precision_name(given) == name


@pytest.mark.parametrize("bad", ["8", 8, "fp8", True, None, 16.0, "BF16"])
def test_an_unknown_precision_names_the_choices(bad):
    choices = r"\['32', '16-mixed', 'bf16-mixed', 'bf16', 'fp16', '16'\]"
    with pytest.raises(ValueError, match=rf"precision must be one of {choices}, got {bad!r}"):
        precision_name(bad)


def test_an_optimizer_must_hold_some_of_the_nets_trainable_parameters():
    net, other = nn.Linear(2, 2), nn.Linear(2, 2)
    check_optimizer(torch.optim.SGD(net.parameters(), lr=0.1), net)
    check_optimizer(torch.optim.SGD([net.weight], lr=0.1), net)  # fine-tuning part of the net
    check_optimizer(torch.optim.SGD([*net.parameters(), *other.parameters()], lr=0.1), net)  # extra modules
    check_optimizer(None, net)
    with pytest.raises(ValueError, match="optimizer holds 2 parameter"):
        check_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), net)
    frozen = nn.Linear(2, 2).requires_grad_(False)
    check_optimizer(torch.optim.SGD(other.parameters(), lr=0.1), frozen)  # nothing of the net trains anyway


def test_the_same_handler_twice_is_refused_two_instances_are_not():
    a, b = StoppingHandler(), StoppingHandler()
    check_unique_handlers([a, b])
    with pytest.raises(ValueError, match="same StoppingHandler instance twice"):
        check_unique_handlers([a, b, a])
