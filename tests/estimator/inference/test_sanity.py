"""The sanity pass at fit start (``num_sanity_val_steps``): val_data's mistakes before the first
step, named as val_data's, the user's own exceptions passed through as raised, and a run that is
bitwise the same with the pass or without it."""

from __future__ import annotations

import signal
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from estimatorch import Estimator, distributed
from estimatorch.event_handlers import BatchEnd
from tests.conftest import losses_recorder, make_batches, make_estimator


class Steps(BatchEnd):
    def __init__(self):
        self.n = 0

    def batch_end(self, est, **kw):
        self.n += 1


def dict_batches(keys, n=2):
    return [{keys[0]: x, keys[1]: y} for x, y in make_batches(n)]


def test_a_val_loader_with_other_keys_fails_before_the_first_step():
    """The issue's run: val batches as dicts with 'image'/'target' failed after a whole epoch."""
    est, steps = make_estimator(), Steps()
    before = [p.clone() for p in est.net.parameters()]
    with pytest.raises(ValueError) as info:
        est.fit(make_batches(), val_data=dict_batches(("image", "target")), epochs=2, event_handlers=[steps])
    message = str(info.value)
    assert message.startswith("val_data failed the sanity pass before training (at its batch 1")
    assert "'label' or 'labels' key" in message and "['image', 'target']" in message
    assert "num_sanity_val_steps=0" in message
    assert steps.n == 0
    assert all(torch.equal(a, b) for a, b in zip(before, est.net.parameters()))


def test_a_val_label_format_the_metrics_cannot_read_is_named():
    est = make_estimator()
    val = [(x, y.float()) for x, y in make_batches(1)]  # float class indices: cross entropy refuses them too
    with pytest.raises(ValueError, match=r"val_data failed the sanity pass .*The labels of val_data .*\.long\(\)"):
        est.fit(make_batches(), val_data=val, epochs=1, event_handlers=[Steps()])


def test_a_shape_mistake_in_val_data_reaches_the_caller_as_raised():
    """A RuntimeError from inside the net is the net's, not a batch rule's: it passes through."""
    est = make_estimator()
    val = [(torch.randn(8, 5), torch.zeros(8, dtype=torch.long))]  # 5 features for a net of 4
    with pytest.raises(RuntimeError, match="shapes") as info:
        est.fit(make_batches(), val_data=val, epochs=1)
    assert "val_data failed the sanity pass" not in str(info.value)


def test_inputs_that_do_not_fit_forward_are_named_as_val_data():
    est = make_estimator()
    val = [(torch.randn(8, 4), torch.randn(8, 4), torch.zeros(8, dtype=torch.long))]  # 2 inputs, forward takes 1
    with pytest.raises(ValueError, match=r"val_data failed the sanity pass .*TypeError: .*cannot take what the batch"):
        est.fit(make_batches(), val_data=val, epochs=1)


class MyError(Exception):
    """The user's own exception type (module level: it crosses processes in the gloo test)."""


class Fails(nn.Module):
    """A net whose forward raises the user's exception in eval mode (validation), from rank ``rank``
    on (0: every rank)."""

    def __init__(self, rank=0):
        super().__init__()
        self.linear, self.rank = nn.Linear(4, 3), rank

    def forward(self, x):
        if not self.training and distributed.get_rank() >= self.rank:
            raise MyError("my forward refuses")
        return self.linear(x)


class FailingMetric:
    """A duck-typed metric (torchmetrics-like) whose update raises the user's exception."""

    name, higher_is_better = "mine", True

    def update(self, preds, target):
        raise MyError("my metric refuses")

    def compute(self):
        return 0.0

    def reset(self):
        pass

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        pass


def _fit_failing(where):
    net = Fails() if where == "forward" else nn.Linear(4, 3)
    kwargs = {}
    if where == "loss":
        def loss(pred, label):
            if not torch.is_grad_enabled():
                raise MyError("my loss refuses")
            return nn.functional.cross_entropy(pred, label)
    else:
        loss = nn.CrossEntropyLoss()
    if where == "metric":
        kwargs["val_metrics"] = [FailingMetric()]
    est = Estimator(net, loss, optimizer=torch.optim.SGD(net.parameters(), lr=0.1), **kwargs)
    steps = Steps()
    try:
        est.fit(make_batches(), val_data=make_batches(1), epochs=1, event_handlers=[steps])
    except MyError as err:  # as a user writes it: their own type around fit
        return err, steps.n
    return None, steps.n


@pytest.mark.parametrize("where", ["forward", "loss", "metric"])
def test_the_users_exception_reaches_their_except_around_fit(where):
    err, steps = _fit_failing(where)
    assert type(err) is MyError and str(err) == f"my {where} refuses"
    assert steps == 0  # still before the first step
    if sys.version_info >= (3, 11):
        assert any("fit's sanity pass over val_data" in note and "num_sanity_val_steps=0" in note
                   for note in err.__notes__)


def test_the_users_exception_is_the_object_raised():
    raised = []

    class Keeps(Fails):
        def forward(self, x):
            if not self.training:
                raised.append(MyError("mine"))
                raise raised[-1]
            return self.linear(x)

    net = Keeps()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.raises(MyError) as info:
        est.fit(make_batches(), val_data=make_batches(1), epochs=1)
    assert info.value is raised[0]


def test_zero_turns_it_off():
    est, steps = make_estimator(), Steps()
    with pytest.raises(ValueError, match="a dict batch needs a 'label' or 'labels' key") as info:
        est.fit(make_batches(), val_data=dict_batches(("image", "target")), epochs=1, event_handlers=[steps],
                num_sanity_val_steps=0)
    assert "sanity" not in str(info.value) and steps.n == 4  # the epoch trained first


@pytest.mark.parametrize("bad", [-1, 1.5, "1", None])
def test_bad_num_sanity_val_steps(bad):
    with pytest.raises(ValueError, match=f"num_sanity_val_steps must be a non-negative int, got {bad!r}"):
        make_estimator().fit(make_batches(), val_data=make_batches(1), epochs=1, num_sanity_val_steps=bad)


def test_metric_state_is_untouched():
    est = make_estimator()
    seen = []

    class Peek(BatchEnd):
        def batch_end(self, est, **kw):
            if not seen:  # the first step: validation has not run yet
                seen.append([m.state_dict() for m in est.val_metrics])

    est.fit(make_batches(), val_data=make_batches(3), epochs=1, event_handlers=[Peek()], num_sanity_val_steps=3)
    fresh = make_estimator()
    for state, metric in zip(seen[0], fresh.val_metrics):
        for key, value in metric.state_dict().items():
            assert str(state[key]) == str(value), key


class NoisyVal(Dataset):
    """Validation samples with augmentation drawn from torch's global generator."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(24, 4, generator=g), torch.randint(0, 3, (24,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


def setup():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.AdamW(net.parameters(), lr=0.01)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, seed=3)
    g = torch.Generator().manual_seed(1)
    train = DataLoader(TensorDataset(torch.randn(50, 4, generator=g), torch.randint(0, 3, (50,), generator=g)),
                       batch_size=8, shuffle=True)
    val = DataLoader(NoisyVal(), batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(9))
    return est, train, val


class CtrlC(BatchEnd):
    def __init__(self, at):
        self.at, self.n = at, 0

    def batch_end(self, est, **kw):
        self.n += 1
        if self.n == self.at:
            signal.raise_signal(signal.SIGINT)


def test_a_resumed_run_with_the_pass_is_bitwise_one_without():
    est, train, val = setup()
    full, rec = losses_recorder()
    reference_history = est.fit(train, val_data=val, epochs=3, event_handlers=[rec], num_sanity_val_steps=0)
    reference = {k: v.clone() for k, v in est.net.state_dict().items()}

    est, train, val = setup()
    part, rec = losses_recorder()
    with pytest.raises(KeyboardInterrupt):
        est.fit(train, val_data=val, epochs=3, event_handlers=[rec, CtrlC(10)], num_sanity_val_steps=2)
    rest, rec2 = losses_recorder()
    history = est.fit(train, val_data=val, epochs=3, event_handlers=[rec2], resume=True, num_sanity_val_steps=2)
    assert part + rest == full
    assert all(torch.equal(reference[k], v) for k, v in est.net.state_dict().items())
    for name in ("val_loss", "val_accuracy", "train_loss"):
        assert history[name] == reference_history[name], name


def _one_rank_has_bad_val_data():
    torch.set_num_threads(1)
    est, steps = make_estimator(), Steps()
    val = make_batches(1) if distributed.get_rank() == 0 else dict_batches(("image", "target"), 1)
    try:
        est.fit(make_batches(2), val_data=val, epochs=1, event_handlers=[steps])
    except ValueError as err:
        return {"error": str(err), "steps": steps.n}
    return {"error": None, "steps": steps.n}


def _one_rank_raises_the_users_error():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net, steps = Fails(rank=1), Steps()
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    try:
        est.fit(make_batches(2), val_data=make_batches(1), epochs=1, event_handlers=[steps])
    except MyError as err:
        return {"error": str(err), "type": type(err).__name__, "notes": getattr(err, "__notes__", []),
                "steps": steps.n}
    return {"error": None, "steps": steps.n}


@pytest.mark.distributed
def test_the_users_exception_on_one_rank_reaches_every_ranks_except():
    results = distributed.spawn(_one_rank_raises_the_users_error, 2, backend="gloo")
    assert [r["steps"] for r in results] == [0, 0]
    assert [(r["type"], r["error"]) for r in results] == [("MyError", "my forward refuses")] * 2
    if sys.version_info >= (3, 11):
        assert all(any("sanity pass" in note for note in r["notes"]) for r in results)
        assert any("rank 1 failed" in note for note in results[0]["notes"])  # rank 0 raises rank 1's copy


@pytest.mark.distributed
def test_a_sanity_failure_on_one_rank_stops_every_rank_before_any_step():
    results = distributed.spawn(_one_rank_has_bad_val_data, 2, backend="gloo")
    assert [r["steps"] for r in results] == [0, 0]
    for result in results:
        assert result["error"] is not None and result["error"].startswith("val_data failed the sanity pass")
        assert "['image', 'target']" in result["error"]
