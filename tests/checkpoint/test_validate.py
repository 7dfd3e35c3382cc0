"""Validate before you trust: a checkpoint whose problem would only show while it is restored is
reported (file and reason, in words) and the resume falls back to the previous file, before
anything is restored."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import CheckpointError
from tests.checkpoint.runs import (BATCHES, FEATURES, STEPS, build, copy_files, dir_state, fit_run, name,
                                   rewrite)
from tests.conftest import Count, assert_same_training_state, assert_tree_equal


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    run = fit_run(tmp_path_factory.mktemp("reference"))
    assert len(run.losses) == STEPS
    return run


NEWEST = BATCHES + 2  # mid second epoch: the file that gets damaged; the one before it is used


def _ranks(p):
    return p["ranks"][0]


def _set(path, value):
    def change(payload):
        *parents, last = path
        target = payload
        for key in parents:
            target = target[key]
        target[last] = value(target[last]) if callable(value) else value
    return change


def _delete(path):
    def change(payload):
        *parents, last = path
        target = payload
        for key in parents:
            target = target[key]
        del target[last]
    return change


def _other_model(payload):
    payload["model"] = nn.Linear(FEATURES, 2).state_dict()


def _extra_group(payload):
    payload["optimizer"]["param_groups"].append(dict(payload["optimizer"]["param_groups"][0], params=[]))


# (id, change, words the report must contain)
DEFECTS = [
    ("another-model", _other_model, "a checkpoint of another model"),
    ("wrong-shape-parameter", _set(["model", "0.weight"], torch.zeros(5, FEATURES)), "'0.weight' is a float32 tensor of shape [5, 4]"),
    ("missing-parameter", _delete(["model", "3.bias"]), "['3.bias'] is missing"),
    ("unexpected-parameter", _set(["model", "9.weight"], torch.zeros(2)), "['9.weight'] is not in this net"),
    ("wrong-dtype-parameter", _set(["model", "0.weight"], lambda t: t.double()), "float64"),
    ("missing-rng-entry", _delete(["ranks", 0, "rng", "torch"]), "rng lacks ['torch']"),
    ("wrong-dtype-rng", _set(["ranks", 0, "rng", "torch"], lambda t: t.float()), "rng['torch'] must be a uint8 tensor"),
    ("bad-python-rng", _set(["ranks", 0, "rng", "python"], (3, (1, 2), None)), "rng['python']"),
    ("bad-numpy-rng", _set(["ranks", 0, "rng", "numpy", "bit_generator"], "MT19937"), "'MT19937'"),
    ("position-without-step", _delete(["ranks", 0, "position", "step"]), "lacks ['step']"),
    ("string-epoch", _set(["ranks", 0, "position", "epoch"], "1"), "['epoch'] must be a non-negative int, got '1'"),
    ("bad-phase", _set(["ranks", 0, "position", "phase"], "middle"), "['phase'] must be one of"),
    ("string-plan", _set(["ranks", 0, "plan", "epochs"], "2"), "plan['epochs'] must be a positive int"),
    ("string-in-handler-state", _set(["ranks", 0, "handlers", "CheckpointHandler", "current_batch"], "3"),
     "handler 'CheckpointHandler'['current_batch'] must be a number, got '3'"),
    ("handler-entry-lacks-a-key", _delete(["ranks", 0, "handlers", "CheckpointHandler", "best"]),
     "handler 'CheckpointHandler' lacks 'best'"),
    ("handler-state-not-a-dict", _set(["ranks", 0, "handlers", "CheckpointHandler"], [1, 2]), "must be a dict"),
    ("optimizer-state-of-wrong-type", _set(["optimizer", "state", 0, "exp_avg"], "zeros"),
     "optimizer state of parameter 0['exp_avg'] must be a tensor or a number, got 'zeros'"),
    ("optimizer-state-of-wrong-shape", _set(["optimizer", "state", 0, "exp_avg"], torch.zeros(7)), "its parameter has shape"),
    ("optimizer-of-another-class", _set(["optimizer_class"], "SGD"), "of a SGD; this fit's optimizer is a AdamW"),
    ("optimizer-groups", _extra_group, "2 parameter groups; this optimizer has 1"),
    ("optimizer-group-string", _set(["optimizer", "param_groups", 0, "lr"], "0.1"), "['lr'] must be a number"),
    ("optimizer-unknown-parameter", _set(["optimizer", "state", 99], {}), "holds parameter 99"),
    ("scheduler-string", _set(["lr_scheduler", "last_epoch"], "2"), "lr_scheduler state['last_epoch'] must be a number"),
    ("scheduler-of-another-kind", _set(["lr_scheduler"], {"milestones": {}, "last_epoch": 1}), "lr_scheduler state"),
    ("metric-lacks-a-key", _set(["ranks", 0, "metrics", "train_loss"], {}), "metric 'train_loss' lacks"),
    ("history-string", _set(["ranks", 0, "history", "values", "train_loss"], ["high"]), "list of numbers"),
    ("history-no-epochs", _delete(["ranks", 0, "history", "epochs"]), "history['epochs']"),
    ("partial-string", _set(["ranks", 0, "partial"], "no"), "'partial' must be a bool"),
    ("pending-stop-string", _set(["ranks", 0, "pending_stop"], "yes"), "'pending_stop' must be a bool"),
    ("data-not-a-dict", _set(["ranks", 0, "data"], 3), "data must be a dict"),
    ("fingerprint-not-a-dict", _set(["ranks", 0, "fingerprint"], [1]), "fingerprint must be a dict"),
    ("handlers-not-a-dict", _set(["ranks", 0, "handlers"], None), "handler states of rank 0"),
    ("shared-not-a-list", _set(["ranks", 0, "shared"], "GradientUpdateHandler"), "'shared' of rank 0"),
    ("world-size-string", _set(["world_size"], "1"), "world_size must be a positive int"),
]


@pytest.mark.filterwarnings("error::UserWarning")
@pytest.mark.parametrize("change, words", [d[1:] for d in DEFECTS], ids=[d[0] for d in DEFECTS])
def test_an_invalid_newest_file_is_reported_and_the_previous_one_resumes_exactly(
        reference, tmp_path, estimatorch_log, change, words):
    copy_files(reference, tmp_path, [NEWEST - 1, NEWEST])
    rewrite(tmp_path / name(NEWEST), change)

    resumed = fit_run(tmp_path, resume_from_checkpoint=True)

    skipped = [r.getMessage() for r in estimatorch_log if r.levelno == logging.WARNING and name(NEWEST) in r.getMessage()]
    assert len(skipped) == 1 and words in skipped[0], skipped
    assert resumed.losses == reference.losses[NEWEST - 1:]
    assert_same_training_state(resumed.estimator, reference.estimator)
    assert_tree_equal(resumed.history.to_dict(), reference.history.to_dict(), "history")


def test_an_empty_file_says_so(tmp_path):
    (tmp_path / name(1)).write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"model-epoch0batch1.pt': the file is empty \(0 bytes\)"):
        checkpoint.load(tmp_path / name(1))


def test_an_empty_newest_file_falls_back_with_a_warning_that_says_empty(reference, tmp_path, estimatorch_log):
    copy_files(reference, tmp_path, [NEWEST - 1])
    (tmp_path / name(NEWEST)).write_bytes(b"")
    resumed = fit_run(tmp_path, resume_from_checkpoint=True)
    assert any("empty (0 bytes)" in r.getMessage() and name(NEWEST) in r.getMessage() for r in estimatorch_log)
    assert resumed.losses == reference.losses[NEWEST - 1:]


@pytest.mark.parametrize("change", [DEFECTS[0][1], DEFECTS[1][1], DEFECTS[9][1]], ids=[DEFECTS[i][0] for i in (0, 1, 9)])
def test_when_no_file_fits_the_fit_stops_at_start_and_changes_nothing(reference, tmp_path, change):
    copy_files(reference, tmp_path, [NEWEST - 1, NEWEST])
    for step in (NEWEST - 1, NEWEST):
        rewrite(tmp_path / name(step), change)
    before = dir_state(tmp_path)
    estimator, loader = build()
    params = {k: v.clone() for k, v in estimator.net.state_dict().items()}
    count = Count()
    with pytest.raises(CheckpointError, match="none of the 2 checkpoints of prefix 'model'.*can resume this fit") as info:
        estimator.fit(loader, epochs=2, event_handlers=[count, CheckpointHandler(tmp_path, batch_period=1,
                                                                                 resume_from_checkpoint=True)])
    assert name(NEWEST) in str(info.value) and name(NEWEST - 1) in str(info.value)
    assert count.batches == 0
    assert_tree_equal(estimator.net.state_dict(), params, "model")  # validation restored nothing
    assert estimator.optimizer.state_dict()["state"] == {}
    assert dir_state(tmp_path) == before


def test_an_optimizer_state_saved_by_a_captured_step_resumes_an_eager_fit_on_the_cpu():
    """cuda_graphs=True saves the optimizer capturable, its rate a tensor: loaded as it is, an
    optimizer on the CPU refuses to step; restored in this optimizer's mode, it steps as the
    eager optimizer would have (the values are the saved ones)."""
    import copy

    from estimatorch.checkpoint._validate import _in_this_mode

    def adam_after_one_step():
        torch.manual_seed(0)
        net = nn.Linear(3, 2)
        optimizer = torch.optim.Adam(net.parameters(), lr=0.125)  # exact in float32
        net(torch.randn(4, 3)).sum().backward()
        optimizer.step()
        return net, optimizer

    _, saver = adam_after_one_step()
    saved = copy.deepcopy(saver.state_dict())
    saved["param_groups"][0].update(capturable=True, lr=torch.tensor(0.125))  # as a captured step keeps them
    as_is_net, as_is = adam_after_one_step()
    as_is.load_state_dict(copy.deepcopy(saved))
    with pytest.raises((AssertionError, RuntimeError), match="capturable"):
        as_is.step()
    net, resumed = adam_after_one_step()
    resumed.load_state_dict(_in_this_mode(saved, resumed))
    group = resumed.param_groups[0]
    assert group["capturable"] is False and group["lr"] == 0.125 and type(group["lr"]) is float
    reference_net, reference = adam_after_one_step()
    for optimizer in (resumed, reference):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), reference_net.parameters()))
    assert _in_this_mode(saved, resumed)["param_groups"][0]["lr"] == 0.125
    assert saved["param_groups"][0]["capturable"] is True  # the saved state is not changed
