"""Estimator.predict in one process: label-free batches, outputs joined in order on the CPU, the
events, eval mode without gradients, generators and training mode untouched, bad input."""

from __future__ import annotations

import collections

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from estimatorch import BatchProcessor, Estimator, rng
from estimatorch.estimator._inference.predict import join_outputs
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochBegin, EpochEnd
from tests.conftest import make_batches, make_estimator


def estimator_of(net, **kwargs):
    params = list(net.parameters()) or [nn.Parameter(torch.zeros(1))]
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(params, lr=0.1), **kwargs)


def plain_loop(net, inputs):
    """What a user writes without predict: eval mode, no grad, one concatenation."""
    net.eval()
    with torch.no_grad():
        out = torch.cat([net(x) for x in inputs])
    net.train()
    return out


def test_predict_equals_a_plain_loop_for_every_batch_layout():
    est = make_estimator()
    batches = make_batches(n_batches=3)
    inputs = [x for x, _ in batches]
    want = plain_loop(make_estimator().net, inputs)
    dataset = TensorDataset(torch.cat(inputs))
    # a CPU matmul need not give bitwise the same rows for another batch size (kernels block by it)
    want_in_fives = plain_loop(make_estimator().net, torch.cat(inputs).split(5))
    layouts = {
        "(x, y) pairs: the label dropped": batches,
        "bare tensors": inputs,
        "(x,) one-element tuples": [(x,) for x in inputs],
        "a DataLoader over TensorDataset(x)": DataLoader(dataset, batch_size=5),  # 24 = 4 * 5 + 4
        "dicts with a label": [{"x": x, "label": y} for x, y in batches],
    }
    est.net = est.val_net = DictOrTensor(est.net)
    for name, data in layouts.items():
        got = est.predict(data)
        assert got.device.type == "cpu" and torch.equal(got, want_in_fives if "DataLoader" in name else want), name


class DictOrTensor(nn.Module):
    """Accepts its input positionally or as the keyword ``x``."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return self.inner(x)


class Recorder(EpochBegin, BatchBegin, BatchEnd, EpochEnd):
    def __init__(self):
        self.events = []

    def epoch_begin(self, est, **kw):
        self.events.append(("epoch_begin", est.val_net.training, torch.is_grad_enabled()))

    def batch_begin(self, est, *, batch, **kw):
        self.events.append(("batch_begin",))

    def batch_end(self, est, *, batch, pred, label, loss, **kw):
        self.events.append(("batch_end", tuple(pred.shape), label, loss, torch.is_grad_enabled(),
                            est.val_net.training))

    def epoch_end(self, est, **kw):
        self.events.append(("epoch_end",))


def test_predict_fires_the_four_events_in_eval_mode_without_gradients():
    est, rec = make_estimator(), Recorder()
    est.predict(make_batches(n_batches=2, batch_size=3), event_handlers=rec)
    batch = ("batch_end", (3, 3), None, None, False, False)
    assert rec.events == [("epoch_begin", False, False), ("batch_begin",), batch, ("batch_begin",), batch,
                          ("epoch_end",)]


def test_predict_during_fit_attaches_the_fit_handlers_companions():
    """As evaluate does: the progress bar's validation bar sees predict's batches too."""
    companion = Recorder()

    class Owner(EpochEnd):
        def __init__(self):
            self.preds = []

        def evaluation_handlers(self, data):
            return [companion]

        def epoch_end(self, est, **kw):
            self.preds.append(est.predict(make_batches(n_batches=2)))

    est, owner = make_estimator(), Owner()
    est.fit(make_batches(), epochs=1, event_handlers=[owner])
    assert [e[0] for e in companion.events] == ["epoch_begin", "batch_begin", "batch_end", "batch_begin",
                                                "batch_end", "epoch_end"]
    assert owner.preds[0].shape == (16, 3)
    est.predict(make_batches(n_batches=1))  # outside fit: no companions
    assert len(companion.events) == 6


def test_predict_leaves_the_generators_and_the_training_mode_as_they_were():
    est = make_estimator()
    est.net.add_module("dropout", nn.Dropout(0.5))  # would draw in training mode
    loader = DataLoader(TensorDataset(torch.randn(10, 4)), batch_size=4, shuffle=True)  # draws a base seed
    for training in (True, False):
        est.net.train(training)
        rng.seed_everything(3)
        before = rng.get_state()
        est.predict(loader)
        after = rng.get_state()
        assert torch.equal(before["torch"], after["torch"]) and before["python"] == after["python"]
        assert before["numpy"] == after["numpy"]
        assert est.net.training is training and all(m.training is training for m in est.net.modules())


def test_predict_uses_val_net():
    torch.manual_seed(1)
    other = nn.Linear(4, 3)
    est = estimator_of(nn.Linear(4, 3), val_net=other)
    inputs = [x for x, _ in make_batches(n_batches=2)]
    assert torch.equal(est.predict(inputs), plain_loop(other, inputs))


def test_predict_under_mixed_precision_autocasts_like_evaluate_and_returns_float32():
    """The forward runs in bf16 (as evaluate's does), the outputs come back as float32: what
    a user takes them on with (numpy, argmax over sampled logits) without a cast of their own."""
    est = make_estimator(precision="bf16-mixed")
    got = est.predict(make_batches(n_batches=2))
    assert got.dtype == torch.float32 and got.shape == (16, 3)
    with torch.no_grad(), est.autocast():
        bf16 = torch.cat([est.val_net(x) for x, _ in make_batches(n_batches=2)])
    assert bf16.dtype == torch.bfloat16 and torch.equal(got, bf16.float())
    assert make_estimator().predict(make_batches(n_batches=2)).dtype == torch.float32


class Heads(nn.Module):
    """Several output layouts at once: a tuple, a namedtuple, a dict, a list per sample."""

    Out = collections.namedtuple("Out", "logits feature")

    def __init__(self, layout):
        super().__init__()
        self.layout = layout
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        logits = self.lin(x)
        if self.layout == "tuple":
            return logits, logits.sum(1)
        if self.layout == "namedtuple":
            return self.Out(logits, logits.sum(1))
        if self.layout == "dict":
            return {"logits": logits, "sum": logits.sum(1)}
        if self.layout == "list":
            return [{"best": int(i)} for i in logits.argmax(1)]
        if self.layout == "scalar":
            return logits.sum()
        if self.layout == "ragged":
            return logits[:, : x.shape[0] % 3 + 1]
        return "not a tensor"


@pytest.mark.parametrize("layout", ["tuple", "namedtuple", "dict", "list", "scalar", "ragged", "string"])
def test_outputs_are_joined_by_their_structure(layout):
    net = Heads(layout)
    est = estimator_of(net)
    inputs = [x for x, _ in make_batches(n_batches=3, batch_size=4)] + [torch.randn(2, 4)]
    with torch.no_grad():
        per_batch = [net.eval()(x) for x in inputs]
    got = est.predict(inputs)
    if layout in ("tuple", "namedtuple"):
        assert type(got) is type(per_batch[0]) and len(got) == 2
        assert torch.equal(got[0], torch.cat([p[0] for p in per_batch])) and got[1].shape == (14,)
    elif layout == "dict":
        assert list(got) == ["logits", "sum"] and torch.equal(got["sum"], torch.cat([p["sum"] for p in per_batch]))
    elif layout == "list":
        assert got == [item for p in per_batch for item in p] and len(got) == 14
    else:  # do not join: one output per batch
        assert isinstance(got, list) and len(got) == len(inputs)
        if layout != "string":
            assert all(torch.equal(g, p) for g, p in zip(got, per_batch))


def test_join_outputs_along_another_batch_axis():
    parts = [torch.randn(3, 2, 5), torch.randn(3, 1, 5)]
    assert torch.equal(join_outputs(parts, batch_axis=1), torch.cat(parts, 1))
    along_0 = join_outputs(parts, batch_axis=0)  # shapes differ off axis 0: one output per batch
    assert isinstance(along_0, list) and len(along_0) == 2 and along_0[0] is parts[0]


def test_predict_concatenates_along_batch_axis():
    class Transposed(nn.Module):
        def forward(self, x):  # (batch, features) -> (features, batch)
            return x.t() * 2

    est = estimator_of(Transposed())
    inputs = [torch.randn(3, 4), torch.randn(2, 4)]
    assert torch.equal(est.predict(inputs, batch_axis=1), torch.cat(inputs).t() * 2)


def test_a_batch_processor_without_a_predict_step_falls_back_to_its_evaluation_forward():
    class Triples:
        """Its own batch layout (x, y, index); no predict_batch."""

        def fit_batch(self, est, batch, batch_axis=0):
            raise AssertionError("not used")

        def evaluate_batch(self, est, batch, batch_axis=0):
            x, y, _ = batch
            return BatchProcessor().evaluate_batch(est, (x, y), batch_axis)

    est = make_estimator(batch_processor=Triples())
    batches = [(x, y, torch.arange(len(y))) for x, y in make_batches(n_batches=2)]
    assert torch.equal(est.predict(batches), plain_loop(make_estimator().net, [b[0] for b in batches]))


def test_a_custom_predict_step_is_used():
    class Doubled(BatchProcessor):
        def predict_batch(self, est, batch, batch_axis=0):
            return super().predict_batch(est, batch, batch_axis) * 2

    est = make_estimator(batch_processor=Doubled())
    inputs = [x for x, _ in make_batches(n_batches=2)]
    assert torch.equal(est.predict(inputs), plain_loop(make_estimator().net, inputs) * 2)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(data=torch.zeros(3, 4)), TypeError, r"data must be an iterable of batches .*got Tensor; for one tensor x pass \[x\]"),
    (dict(data=3), TypeError, "data must be an iterable of batches .*got int"),
    (dict(data={"x": torch.zeros(2)}), TypeError, "data must be an iterable of batches .*got dict"),
    (dict(data=[torch.zeros(2, 4)], batch_axis=-1), ValueError, "batch_axis must be a non-negative int, got -1"),
    (dict(data=[torch.zeros(2, 4)], batch_axis=True), ValueError, "batch_axis must be a non-negative int, got True"),
    (dict(data=[torch.zeros(2, 4)], event_handlers=[object()]), TypeError, "event_handlers holds .*inherits no event mixin"),
    (dict(data=[]), ValueError, "data is empty: a list of length 0"),
])
def test_bad_arguments_are_refused_before_any_work(kwargs, error, match):
    est, rec = make_estimator(), Recorder()
    handlers = kwargs.pop("event_handlers", [rec])
    with pytest.raises(error, match=match):
        est.predict(**kwargs, event_handlers=handlers)
    assert rec.events == [], "nothing ran"


def test_an_iterable_that_yields_nothing_is_an_error():
    est = make_estimator()
    with pytest.raises(ValueError, match="data yielded no batches"):
        est.predict(iter([]))
