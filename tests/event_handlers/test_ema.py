"""EMAHandler in one process: the average is torch's ``AveragedModel`` with
``get_ema_multi_avg_fn`` bit for bit (and its options their formula), training is unchanged,
validation and the end of the fit use the average, a resume continues it exactly, and a saved
average that does not fit the net is refused naming the parameter."""

from __future__ import annotations

import copy
import os
from collections import Counter

import pytest
import torch
from torch import nn
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

from estimatorch import CheckpointHandler, EMAHandler, Estimator, GradientUpdateHandler, SWAHandler, checkpoint
from estimatorch.checkpoint import CheckpointError
from estimatorch.event_handlers import BatchEnd, EpochEnd, LambdaHandler
from tests.conftest import CtrlC, assert_tree_equal, losses_recorder, make_batches

EPOCHS, N_BATCHES = 3, 5
DATA = make_batches(n_batches=N_BATCHES)
VAL = make_batches(n_batches=2, seed=5)


@pytest.fixture(scope="module", autouse=True)
def _one_thread_for_the_module():
    """The module's shared reference runs use one thread, as each test does (conftest's
    ``_one_thread``, which is set up after module fixtures): the bits depend on it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _estimator():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
                     seed=1)


class Reference(BatchEnd, EpochEnd):
    """After every optimizer step (as GradientUpdateHandler says), the reference average's update:
    torch's AveragedModel (``update(avg, step)`` another rule). Runs before the EMAHandler (-1500)
    and after the step (-2000)."""

    priority = -1800

    def __init__(self, net, update=None, decay=0.9):
        self.avg = AveragedModel(copy.deepcopy(net), multi_avg_fn=get_ema_multi_avg_fn(decay))
        self.avg.update_parameters(net)  # the average starts as the initial weights
        self.update, self.steps = update, 0

    def _stepped(self, est):
        self.steps += 1
        if self.update is None:
            self.avg.update_parameters(est.net)
        else:
            self.update([p.detach() for p in self.avg.parameters()], [p.detach() for p in est.net.parameters()],
                        self.steps)

    def batch_end(self, est, **kw):
        if next(h for h in est.handlers if isinstance(h, GradientUpdateHandler)).stepped:
            self._stepped(est)

    def epoch_end(self, est, **kw):
        if next(h for h in est.handlers if isinstance(h, GradientUpdateHandler)).stepped:
            self._stepped(est)

    def weights(self):
        return dict(zip([n for n, _ in self.avg.module.named_parameters()], self.avg.parameters()))


def _fit(handlers=(), epochs=EPOCHS, **kwargs):
    est = _estimator()
    losses, recorder = losses_recorder()
    history = est.fit(DATA, VAL, epochs=epochs, event_handlers=[*handlers, recorder], **kwargs)
    return est, history.to_dict(), losses


def _params(state):
    return {k: v for k, v in state.items() if k.endswith(("weight", "bias"))}


@pytest.fixture(scope="module")
def plain():
    """The same fit without an average."""
    return _fit()


@pytest.fixture(scope="module")
def averaged():
    """The fit with EMAHandler(0.9) and accumulation 2 (an epoch's leftover step included), and
    torch's AveragedModel fed the same steps."""
    est = _estimator()
    reference, ema = Reference(est.net), EMAHandler(0.9)
    losses, recorder = losses_recorder()
    history = est.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[ema, reference, recorder])
    return est, ema, reference, history.to_dict(), losses


def test_the_average_is_torchs_averaged_model_bit_for_bit(averaged):
    est, ema, reference, _, _ = averaged
    assert ema.updates == reference.steps == EPOCHS * N_BATCHES
    assert_tree_equal(_params(est.net.state_dict()), reference.weights(), "average")


def test_with_accumulation_the_leftover_step_of_an_epoch_updates_it_too():
    est = _estimator()
    reference, ema = Reference(est.net), EMAHandler(0.9)
    est.fit(DATA, epochs=2, event_handlers=[ema, reference, GradientUpdateHandler(accumulation_steps=2)])
    assert ema.updates == reference.steps == 2 * 3  # 5 batches: steps after 2, 4 and the leftover 5th
    assert_tree_equal(_params(est.net.state_dict()), reference.weights(), "average")


def test_update_every_start_step_and_warmup_follow_their_formula():
    ema = EMAHandler(0.95, update_every=2, start_step=3, warmup=(1.0, 0.75))
    updates = []

    def rule(avg, weights, step):
        if step <= 3:
            torch._foreach_copy_(avg, weights)
        elif (step - 3) % 2 == 0:
            updates.append(min(0.95, 1 - (1 + (len(updates) + 1) / 1.0) ** -0.75))
            torch._foreach_lerp_(avg, weights, 1.0 - updates[-1])

    est = _estimator()
    reference = Reference(est.net, update=rule)
    est.fit(DATA, epochs=EPOCHS, event_handlers=[ema, reference])
    assert ema.steps == 15 and ema.updates == len(updates) == 6
    assert [ema.decay_at(k) for k in range(1, 7)] == updates and updates[0] < updates[-1] <= 0.95
    assert_tree_equal(_params(est.net.state_dict()), reference.weights(), "average")


def test_training_is_unchanged_and_the_trained_weights_stay_reachable(plain, averaged):
    plain_est, plain_history, plain_losses = plain
    est, ema, _, history, losses = averaged
    assert losses == plain_losses
    assert {k: v for k, v in history.items() if k.startswith("train_")} == \
        {k: v for k, v in plain_history.items() if k.startswith("train_")}
    assert_tree_equal(_params(ema.raw_state_dict()), _params(plain_est.net.state_dict()), "trained weights")
    average = ema.average_state_dict()
    assert_tree_equal(average, est.net.state_dict(), "average")
    est.net.load_state_dict(ema.raw_state_dict())  # what a user does to train on
    assert_tree_equal(est.net.state_dict(), plain_est.net.state_dict(), "trained weights loaded")
    est.net.load_state_dict(average)


def test_validation_runs_on_the_average_and_the_log_line_says_so(plain, averaged, estimatorch_log):
    _, plain_history, _ = plain
    est, _, _, history, _ = averaged
    assert history["val_loss"][-1] != plain_history["val_loss"][-1]
    # the last validation ran on the last average, which the net holds now
    assert est.evaluate(VAL)["val_loss"] == history["val_loss"][-1]
    _fit([EMAHandler(0.9)], epochs=1)
    lines = [r.getMessage() for r in estimatorch_log if r.getMessage().startswith("[Epoch")]
    assert lines and all("val_accuracy: " in line and "(val on the EMA weights)" in line for line in lines), lines


def test_evaluate_false_validates_the_trained_weights_and_final_raw_keeps_them(plain, averaged):
    plain_est, plain_history, _ = plain
    est, history, _ = _fit([EMAHandler(0.9, evaluate=False)])
    assert history == plain_history  # the val metrics too
    assert_tree_equal(est.net.state_dict(), averaged[0].net.state_dict(), "average at the end")
    raw = EMAHandler(0.9, final="raw")
    est, history, _ = _fit([raw])
    assert history == averaged[3]
    assert_tree_equal(est.net.state_dict(), plain_est.net.state_dict(), "trained weights at the end")
    assert_tree_equal(raw.average_state_dict(), averaged[0].net.state_dict(), "average")


def test_a_stopped_fit_keeps_the_trained_weights_and_resume_continues_the_average(averaged):
    est, _, _, history, losses = averaged
    stopped_est = _estimator()
    ema = EMAHandler(0.9)
    with pytest.raises(KeyboardInterrupt):
        stopped_est.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[ema, CtrlC(7)])
    assert_tree_equal(stopped_est.net.state_dict(), ema.raw_state_dict(), "trained weights after the stop")
    resumed, recorder = losses_recorder()
    again = stopped_est.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[ema, recorder], resume=True)
    assert resumed == losses[7:] and again.to_dict() == history
    assert_tree_equal(stopped_est.net.state_dict(), est.net.state_dict(), "average")


def test_resume_after_a_finished_fit_trains_on_from_the_trained_weights(averaged):
    est, ema, _, history, _ = averaged
    short, short_ema = _estimator(), EMAHandler(0.9)
    short.fit(DATA, VAL, epochs=2, event_handlers=[short_ema])
    longer = short.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[short_ema], resume=True)
    assert longer.to_dict() == history
    assert_tree_equal(short.net.state_dict(), est.net.state_dict(), "average")
    assert_tree_equal(short_ema.raw_state_dict(), ema.raw_state_dict(), "trained weights")


def test_the_average_costs_no_transfer_to_the_host(monkeypatch):
    counts: Counter = Counter()
    for name in ("item", "__bool__", "__float__", "tolist", "cpu", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self, *args, _original=original, _name=name, **kwargs):
            counts[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    per_fit = []
    for handlers in ([], [EMAHandler(0.9, warmup=True, update_every=2, start_step=1)]):
        counts.clear()
        _estimator().fit(DATA, epochs=2, event_handlers=handlers)
        per_fit.append(dict(counts))
    assert per_fit[0] == per_fit[1]


# -- checkpoints -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory):
    """The averaged fit with a checkpoint after every batch and a weights export every epoch."""
    directory = tmp_path_factory.mktemp("ema")
    est = _estimator()
    ema = EMAHandler(0.9)
    saves = [CheckpointHandler(directory, batch_period=1, epoch_period=None, max_checkpoints=None),
             CheckpointHandler(directory, model_prefix="export", save_weights_only=True)]
    est.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[ema, *saves])
    return directory, est, ema


def test_a_resume_from_any_checkpoint_continues_the_average_exactly(checkpointed, averaged, tmp_path):
    directory, _, _ = checkpointed
    est, ema, _, history, losses = averaged
    for step in (4, N_BATCHES, 2 * N_BATCHES + 1):  # mid-epoch, an epoch's last batch, a later epoch
        resume_dir = tmp_path / f"from{step}"
        resume_dir.mkdir()
        name = checkpoint.checkpoint_name("model", (step - 1) // N_BATCHES, step)
        os.link(directory / name, resume_dir / name)
        again, again_ema = _estimator(), EMAHandler(0.9)
        resumed, recorder = losses_recorder()
        got = again.fit(DATA, VAL, epochs=EPOCHS, event_handlers=[
            again_ema, recorder, CheckpointHandler(resume_dir, batch_period=1, resume_from_checkpoint=True)])
        assert resumed == losses[step:] and got.to_dict() == history, step
        assert_tree_equal(again.net.state_dict(), est.net.state_dict(), f"average after a resume at {step}")
        assert_tree_equal(again_ema.raw_state_dict(), ema.raw_state_dict(), f"trained weights, resume at {step}")


def test_load_weights_takes_the_average_and_the_export_holds_it(checkpointed):
    directory, est, ema = checkpointed
    last = directory / checkpoint.checkpoint_name("model", EPOCHS - 1, EPOCHS * N_BATCHES)  # its last batch
    assert_tree_equal(dict(checkpoint.load_weights(last, handler="EMAHandler")), est.net.state_dict(), "average")
    assert_tree_equal(dict(checkpoint.load_weights(last)), ema.raw_state_dict(), "trained weights")
    export = directory / checkpoint.weights_name("export", EPOCHS, EPOCHS * N_BATCHES)
    assert_tree_equal(dict(checkpoint.load_weights(export)), est.net.state_dict(), "exported average")
    with pytest.raises(CheckpointError, match="holds no weights of a handler 'SWAHandler'.*'EMAHandler'"):
        checkpoint.load_weights(last, handler="SWAHandler")
    with pytest.raises(CheckpointError, match="weights export"):
        checkpoint.load_weights(export, handler="EMAHandler")


@pytest.mark.parametrize("damage, message", [
    ("renamed", "it holds no average of the parameter '3.bias'"),
    ("reshaped", r"the average of the parameter '0.weight' has shape \[8, 3\]; the parameter has shape \[8, 4\]"),
])
def test_a_saved_average_that_does_not_fit_the_net_is_refused_naming_the_parameter(checkpointed, tmp_path,
                                                                                    damage, message):
    directory, _, _ = checkpointed
    name = checkpoint.checkpoint_name("model", 0, 3)
    payload = checkpoint.load(directory / name)
    weights = payload["ranks"][0]["handlers"]["EMAHandler"]["weights"]
    if damage == "renamed":
        weights["3.biases"] = weights.pop("3.bias")
    else:
        weights["0.weight"] = weights["0.weight"][:, :3].clone()
    (tmp_path / "damaged").mkdir()
    checkpoint.atomic_save(payload, tmp_path / "damaged" / name)
    est = _estimator()
    with pytest.raises(CheckpointError, match=message):
        est.fit(DATA, epochs=EPOCHS, event_handlers=[
            EMAHandler(0.9), CheckpointHandler(tmp_path / "damaged", resume_from_checkpoint=True)])


# -- arguments -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    ({"decay": 1.0}, "decay must be a number in \\[0, 1\\), got 1.0"),
    ({"decay": -0.5}, "decay must be a number in \\[0, 1\\), got -0.5"),
    ({"update_every": 0}, "update_every must be a positive int, got 0"),
    ({"start_step": -1}, "start_step must be a non-negative int, got -1"),
    ({"warmup": (0, 1)}, "warmup must be None, True or a pair \\(gamma, power\\) of positive numbers, got \\(0, 1\\)"),
    ({"warmup": "timm"}, "warmup must be None, True or a pair"),
    ({"final": "best"}, "final must be one of \\['average', 'raw'\\], got 'best'"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EMAHandler(**kwargs)
    with pytest.raises(TypeError, match="evaluate must be a bool, got 'yes'"):
        EMAHandler(evaluate="yes")


def test_two_averages_that_both_enter_the_net_are_refused_before_any_step():
    est, steps = _estimator(), []
    with pytest.raises(ValueError, match="EMAHandler and SWAHandler both put their average into the net"):
        est.fit(DATA, epochs=1, event_handlers=[EMAHandler(0.9), SWAHandler(swa_start=0),
                                                LambdaHandler(batch_end=lambda e, **k: steps.append(1))])
    assert steps == []
    est.fit(DATA, epochs=1, event_handlers=[EMAHandler(0.9), SWAHandler(swa_start=0, evaluate=False, final="raw")])


@pytest.mark.filterwarnings("ignore:handler 'LambdaHandler' has no saved state:UserWarning")
def test_added_to_a_resumed_run_the_average_starts_from_the_restored_weights(checkpointed, tmp_path):
    directory, _, _ = checkpointed
    name = checkpoint.checkpoint_name("model", 0, 4)
    payload = checkpoint.load(directory / name)
    del payload["ranks"][0]["handlers"]["EMAHandler"]  # as if written by a fit without the handler
    (tmp_path / "plain").mkdir()
    checkpoint.atomic_save(payload, tmp_path / "plain" / name)
    est, ema = _estimator(), EMAHandler(0.9, final="raw")
    restored = {}
    peek = LambdaHandler(epoch_begin=lambda e, **kw: restored.update(ema.average_state_dict()), once=1,
                         priority=0)
    with pytest.warns(UserWarning, match="handler 'EMAHandler' has no saved state"):
        est.fit(DATA, epochs=1, batches_per_epoch=4, event_handlers=[
            ema, peek, CheckpointHandler(tmp_path / "plain", resume_from_checkpoint=True)])
    assert_tree_equal(_params(restored), _params(payload["model"]), "the average at the resume")


def test_every_eval_set_is_validated_on_the_average():
    est, sets = _estimator(), {"near": VAL, "far": make_batches(n_batches=2, seed=9)}
    history = est.fit(DATA, sets, epochs=2, event_handlers=[EMAHandler(0.9)]).to_dict()
    again = est.evaluate(sets)  # the net holds the last average, which the last validation ran on
    for key in ("val_near_loss", "val_far_loss"):
        assert history[key][-1] == again[key], key
