"""Checkpoints hold the plain module's keys whatever wraps it: compiled and plain nets resume from
each other's files, and evaluate works on a compiled net."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from estimatorch import checkpoint
from tests.checkpoint.runs import BATCHES, FEATURES, build, fit_run, name
from tests.conftest import assert_tree_equal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning:torch._dynamo")


@pytest.fixture(scope="module")
def plain_reference(tmp_path_factory):
    return fit_run(tmp_path_factory.mktemp("plain"))


@pytest.fixture(scope="module")
def compiled_reference(tmp_path_factory):
    estimator, loader = build(compile_net=True)
    return fit_run(tmp_path_factory.mktemp("compiled"), estimator=estimator, loader=loader)


def test_a_compiled_net_checkpoints_the_plain_modules_keys(plain_reference, compiled_reference):
    compiled = checkpoint.load(os.path.join(compiled_reference.dir, name(3)))["model"]
    plain = checkpoint.load(os.path.join(plain_reference.dir, name(3)))["model"]
    assert list(compiled) == list(plain) and not any("_orig_mod" in key for key in compiled)
    assert_tree_equal(compiled, plain, "model")  # the eager backend computes exactly what the plain net does
    assert compiled_reference.losses == plain_reference.losses


@pytest.mark.parametrize("written_by, resumed_by", [("compiled", "plain"), ("plain", "compiled")])
def test_compiled_and_plain_nets_resume_from_each_others_files(plain_reference, compiled_reference, tmp_path,
                                                               written_by, resumed_by):
    source = compiled_reference if written_by == "compiled" else plain_reference
    step = BATCHES + 1
    shutil.copy(os.path.join(source.dir, name(step)), tmp_path)
    estimator, loader = build(compile_net=resumed_by == "compiled")
    resumed = fit_run(tmp_path, estimator=estimator, loader=loader, resume_from_checkpoint=True)
    assert resumed.losses == plain_reference.losses[step:]
    assert_tree_equal(dict(checkpoint.model_state(resumed.estimator.net)),
                      dict(plain_reference.estimator.net.state_dict()), "model")
    assert_tree_equal(resumed.estimator.optimizer.state_dict(), plain_reference.estimator.optimizer.state_dict(),
                      "optimizer")


def test_evaluate_works_on_a_compiled_net(plain_reference, compiled_reference):
    data = [(torch.randn(5, FEATURES, generator=torch.Generator().manual_seed(i)), torch.arange(5) % 3) for i in range(2)]
    assert compiled_reference.estimator.evaluate(data) == plain_reference.estimator.evaluate(data)


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
        self.head = nn.Linear(4, 2)


def test_a_compiled_submodule_keeps_plain_keys_and_module_versions():
    torch.manual_seed(0)
    plain = Encoder()
    wrapped = Encoder()
    wrapped.load_state_dict(plain.state_dict())
    wrapped.body = torch.compile(wrapped.body, backend="eager")
    state = checkpoint.model_state(wrapped)
    assert list(state) == list(plain.state_dict())
    assert state._metadata["body.1"] == plain.state_dict()._metadata["body.1"]  # BatchNorm's version
    assert_tree_equal(dict(state), dict(plain.state_dict()), "state")

    target = Encoder()
    target.body = torch.compile(target.body, backend="eager")
    checkpoint.load_model_state(target, plain.state_dict())
    assert_tree_equal(dict(checkpoint.model_state(target)), dict(plain.state_dict()), "loaded")
    checkpoint.load_model_state(plain, state)  # and back into the plain module


def test_plain_module_unwraps_compile_and_data_parallel():
    net = nn.Linear(2, 2)
    assert checkpoint.plain_module(torch.compile(nn.DataParallel(net), backend="eager")) is net
    assert list(checkpoint.model_state(nn.DataParallel(net))) == ["weight", "bias"]
