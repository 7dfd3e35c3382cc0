"""Each mistake a new user made (issue 34), as they made it, answered with its fix naming the
argument."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from estimatorch import CheckpointHandler, Estimator
from estimatorch._shadow import shadowing_folder
from estimatorch.event_handlers import LoggingHandler, TrainBegin
from tests.conftest import make_batches, make_estimator


@pytest.mark.parametrize("dtype", [torch.float32, torch.int32])
@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss(), nn.NLLLoss()], ids=["cross_entropy", "nll"])
def test_float_or_int32_labels_get_long(dtype, loss):
    est = make_estimator()
    est.loss = est.val_loss = loss
    data = [(x, y.to(dtype)) for x, y in make_batches(2)]
    with pytest.raises(RuntimeError) as info:
        est.fit(data, epochs=1, event_handlers=[])
    message = str(info.value)
    assert "expected target dtype" in message  # torch's own words stay first
    assert f"The labels of train_data (each batch's last element or its 'label' key) are {dtype} of shape (8,) " \
        "for predictions of shape (8, 3)" in message
    assert "label.long()" in message and "one-hot/probability targets of shape (8, 3)" in message


def test_labels_of_another_shape_name_both_shapes_and_the_formats():
    est = make_estimator()
    data = [(x, torch.zeros(8, 2)) for x, _ in make_batches(2)]  # neither indices nor (8, 3) targets
    with pytest.raises(RuntimeError) as info:
        est.fit(data, epochs=1, event_handlers=[])
    message = str(info.value)
    assert "torch.float32 of shape (8, 2) for predictions of shape (8, 3)" in message
    assert "class indices of shape (8,)" in message and "targets of the predictions' shape (8, 3)" in message


def test_a_loss_error_the_labels_do_not_explain_is_left_alone():
    def loss(pred, label):
        raise RuntimeError("my loss is broken")

    est = make_estimator()
    est.loss = loss
    with pytest.raises(RuntimeError) as info:
        est.fit(make_batches(2), epochs=1, event_handlers=[])
    assert str(info.value) == "my loss is broken"


def test_a_one_argument_lr_scheduler_is_refused_at_construction():
    """The issue's ``lr_scheduler=lambda optimizer: ...`` raised a raw TypeError at fit start."""
    with pytest.raises(TypeError) as info:
        make_estimator(lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LinearLR(optimizer),
                       lr_scheduler_interval="batch")
    message = str(info.value)
    assert message.startswith("lr_scheduler is called as lr_scheduler(optimizer, total_steps), but")
    assert "takes (optimizer)" in message and "lambda optimizer, total_steps:" in message


@pytest.mark.parametrize("factory", [lambda optimizer, total_steps: None, lambda *args: None,
                                     lambda optimizer, total_steps, extra=1: None])
def test_factories_that_take_two_arguments_are_accepted(factory):
    assert make_estimator(lr_scheduler=factory).lr_scheduler_factory is factory


def no_optimizer_estimator():
    torch.manual_seed(0)
    return Estimator(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)), nn.CrossEntropyLoss())


def test_an_estimator_that_only_evaluates_and_predicts_does_not_warn_about_its_optimizer():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est = no_optimizer_estimator()
        est.evaluate(make_batches(2))
        est.predict([x for x, _ in make_batches(2)])


def test_fit_without_an_optimizer_warns_at_the_fit_line_once_and_trains_with_sgd():
    est = no_optimizer_estimator()
    assert isinstance(est.optimizer, torch.optim.SGD) and est.optimizer.param_groups[0]["lr"] == 0.01
    with pytest.warns(UserWarning, match=r"no optimizer given to Estimator: fit trains with "
                                         r"torch\.optim\.SGD\(net\.parameters\(\), lr=0\.01\)\. Pass "
                                         r"Estimator\(\.\.\., optimizer=\.\.\.\)") as record:
        est.fit(make_batches(2), epochs=1, event_handlers=[])
    assert [w.filename for w in record if "no optimizer" in str(w.message)] == [__file__]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.fit(make_batches(2), epochs=1, event_handlers=[])  # said once


def test_an_optimizer_set_after_construction_is_no_default():
    est = no_optimizer_estimator()
    est.optimizer = torch.optim.Adam(est.net.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        est.fit(make_batches(2), epochs=1, event_handlers=[])


def logged_fit(caplog, est, *args, **kwargs):
    est.logger.addHandler(caplog.handler)
    try:
        return est.fit(*args, **kwargs)
    finally:
        est.logger.removeHandler(caplog.handler)


def test_a_resume_refused_for_another_batch_size_has_no_train_failed_line(tmp_path, caplog):
    x, y = zip(*make_batches(8))
    dataset = TensorDataset(torch.cat(x), torch.cat(y))
    make_estimator().fit(DataLoader(dataset, batch_size=8), epochs=1,
                         event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True)])
    with pytest.raises(ValueError, match=r"the data stream differs \(batch_size: saved 8, now 16\)"):
        logged_fit(caplog, make_estimator(), DataLoader(dataset, batch_size=16), epochs=2,
                   event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True), LoggingHandler()])
    assert "Train failed" not in caplog.text


def test_a_failure_in_train_begin_after_the_start_line_says_no_step_ran(caplog):
    class Refuse(TrainBegin):
        priority = float("inf")  # after LoggingHandler's start line (given after it: ties keep the order)

        def train_begin(self, est, **kw):
            raise ValueError("refused")

    with pytest.raises(ValueError, match="refused"):
        logged_fit(caplog, make_estimator(), make_batches(2), epochs=1, event_handlers=[LoggingHandler(), Refuse()])
    assert "Training begin" in caplog.text and "Train failed before its first step after" in caplog.text
    assert "in step 1" not in caplog.text


DOUBLE_CTRL_C = r"""
import os, signal, sys
import torch
from estimatorch import CheckpointHandler, checkpoint
from estimatorch.event_handlers import BatchEnd
from tests.conftest import make_batches, make_estimator

signal.signal(signal.SIGINT, signal.default_int_handler)  # a background start inherits SIGINT ignored
model_dir, mid_step = sys.argv[1], sys.argv[2] == "mid-step"
real_save = checkpoint.atomic_save
pressed = []


def save(obj, path, **kwargs):
    def writer(state, f):
        torch.save(state, f)  # the whole file is written, not yet renamed into place
        if pressed:
            signal.raise_signal(signal.SIGINT)  # the second Ctrl-C lands inside the save
    real_save(obj, path, writer=writer)


checkpoint.atomic_save = save


class CtrlC(BatchEnd):  # the first Ctrl-C, in the step after `after`; before its periodic save if `early`

    def __init__(self, after, early):
        self.after, self.priority = after, -10_000 if early else 0

    def batch_end(self, est, **kw):
        if est.position.step == self.after and not pressed:
            pressed.append(1)
            signal.raise_signal(signal.SIGINT)


# saving the stop: Ctrl-C in step 3 (step 2's periodic save is done), again in the save of step 3;
# mid-step: Ctrl-C twice in step 4, the second in its periodic save
first = CtrlC(after=3, early=True) if mid_step else CtrlC(after=2, early=False)
est = make_estimator()
handlers = [first, CheckpointHandler(model_dir, batch_period=2, epoch_period=None, resume_from_checkpoint=True)]
est.fit(make_batches(8), epochs=1, event_handlers=handlers)
"""


@pytest.mark.slow
@pytest.mark.parametrize("when", ["saving-the-stop", "mid-step"])
def test_a_double_ctrl_c_during_a_save_ends_with_one_line_and_a_clean_directory(tmp_path, when):
    """The issue's double Ctrl-C: the second landed inside torch.save and printed ~40 lines."""

    model_dir = tmp_path / "ckpt"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    proc = subprocess.run([sys.executable, "-c", DOUBLE_CTRL_C, str(model_dir), when], cwd=root,
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert proc.returncode == -2, proc.stderr[-3000:]  # as a process ended by Ctrl-C
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    where = "while fit saved the stop" if when == "saving-the-stop" else "in the middle of a step"
    assert proc.stderr.strip().splitlines()[-1] == (
        f"KeyboardInterrupt: stopped at once by a second Ctrl-C {where}: a checkpoint being written was discarded "
        "(files are written whole or not at all); a resume continues from the last complete checkpoint")
    files = sorted(os.listdir(model_dir))
    assert not [f for f in files if f.endswith(".tmp")]  # nothing half-written left behind
    assert "model-epoch0batch2.pt" in files
    assert "model-epoch0batch3.pt" not in files and "model-epoch0batch4.pt" not in files
    est = make_estimator()  # the last complete checkpoint resumes
    est.fit(make_batches(8), epochs=1, event_handlers=[CheckpointHandler(model_dir, resume_from_checkpoint=True)])
    assert est.position.step == 8


def test_a_folder_named_estimatorch_is_explained_by_the_command_line(tmp_path):
    """The issue's script beside the clone got "cannot import name 'CheckpointHandler' from
    'estimatorch' (unknown location)"; the command line, which runs where the user works, says why."""

    (tmp_path / "estimatorch" / "estimatorch").mkdir(parents=True)  # a clone: the package folder inside
    script = tmp_path / "train.py"
    script.write_text("from estimatorch import CheckpointHandler\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    failed = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, env=env)
    cli = subprocess.run([sys.executable, "-m", "estimatorch", "--help"], cwd=tmp_path, capture_output=True,
                         text=True, env=env)
    assert cli.returncode == 0, cli.stderr
    assert shadowing_folder(str(tmp_path)) == str(tmp_path / "estimatorch")
    assert (f"The folder {tmp_path / 'estimatorch'} (a clone of the repository) hides the estimatorch package from a "
            f"script in {tmp_path}") in cli.stderr
    assert "Keep your scripts in another directory (or inside the clone), or rename the folder" in cli.stderr
    if "unknown location" in failed.stderr:  # installed in editable mode (or not at all): the user's case
        assert "cannot import name 'CheckpointHandler' from 'estimatorch' (unknown location)" in failed.stderr
        assert "cannot import name ... from 'estimatorch' (unknown location)" in cli.stderr  # the same words


def test_no_word_about_a_folder_where_there_is_none(tmp_path):

    cli = subprocess.run([sys.executable, "-m", "estimatorch", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert cli.returncode == 0 and "hides the estimatorch package" not in cli.stderr
