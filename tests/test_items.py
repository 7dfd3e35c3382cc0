"""The items rule: an optimizer step's loss is the mean over its items (labels other than -100 /
the loss's ``ignore_index``, else samples) over every micro-batch of the window and every rank.
Batch 8 trains as 4 x 2 accumulation and as 2 ranks x 4 with padded rows (a tiny Llama from a
config, and a net of the user's with ``CrossEntropyLoss(ignore_index=-100)``); the counts
(:mod:`estimatorch._items`); a micro-batch without items; an uneven last batch; a sum loss."""

from __future__ import annotations

import math

import pytest
import torch
import transformers
from torch import nn

from estimatorch import BatchProcessor, Estimator, GradientUpdateHandler, distributed
from estimatorch._items import loss_items, own_loss_items, passes_num_items, sums_items
from estimatorch.event_handlers import TrainBegin

VOCAB, LENGTH, STEPS = 40, 12, 3


# -- the counts -------------------------------------------------------------------------------------
def test_a_loss_with_ignore_index_counts_the_labels_it_keeps():
    label = torch.tensor([[1, -100, 2], [-100, -100, 0]])
    assert int(loss_items(nn.CrossEntropyLoss(), label)) == 3
    assert int(loss_items(nn.NLLLoss(ignore_index=0), label)) == 5
    assert int(loss_items(nn.CrossEntropyLoss(reduction="sum"), label)) == 3
    weight = torch.tensor([0.5, 2.0, 4.0])  # the mean divides by the kept labels' weights
    assert float(loss_items(nn.CrossEntropyLoss(weight=weight), label)) == 2.0 + 4.0 + 0.5
    assert loss_items(nn.CrossEntropyLoss(reduction="none"), label) == 2  # a per-element loss: samples
    assert loss_items(nn.CrossEntropyLoss(), torch.tensor([1, -100, 2])) == 3  # a label per sample: samples


def test_other_losses_count_samples_along_the_batch_axis_and_sums_are_named():
    assert loss_items(nn.MSELoss(), torch.zeros(5, 3)) == 5
    assert loss_items(nn.MSELoss(), torch.zeros(5, 3), batch_axis=1) == 3
    assert loss_items(lambda p, y: p, torch.zeros(2)) == 2
    assert loss_items(nn.CrossEntropyLoss(), torch.rand(4, 3)) == 4  # probabilities: no index to ignore
    assert sums_items(nn.L1Loss(reduction="sum")) and not sums_items(nn.L1Loss()) and not sums_items(len)


def test_a_models_own_loss_counts_as_trainer_counts_num_items_in_batch():
    labels = torch.tensor([[5, 6, -100, -100], [-100, 7, 8, 9]])
    assert int(own_loss_items({"labels": labels}, shift=True)) == 4  # labels[..., 1:]
    assert int(own_loss_items({"labels": labels}, shift=False)) == 5
    assert int(own_loss_items({"labels": labels, "shift_labels": labels[:, :2]}, shift=True)) == 3
    assert own_loss_items({"x": torch.zeros(3, 2), "labels": torch.zeros(3)}, shift=False) == 3  # floats: samples
    assert int(own_loss_items((torch.zeros(2, 4), torch.tensor([[1, -100]])), shift=False)) == 1
    assert own_loss_items({"x": torch.zeros(3, 2), "labels": torch.tensor([0, 2, 1])}, shift=True) == 3


def test_num_items_in_batch_goes_to_a_model_whose_forward_takes_it():
    class Named(nn.Module):
        def forward(self, x, num_items_in_batch=None):
            return x

    class Kwargs(nn.Module):  # not a transformers model: **kwargs may mean anything
        def forward(self, x, **kwargs):
            return x

    batch = {"x": torch.zeros(1)}
    assert passes_num_items(Named(), batch) and not passes_num_items(Kwargs(), batch)
    assert not passes_num_items(Named(), (torch.zeros(1),))  # positional inputs: no keyword to add
    assert passes_num_items(_llama(), batch)


# -- batch 8 = 4 x 2 accumulation = 2 ranks x 4 -------------------------------------------------------
def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return transformers.LlamaForCausalLM(config)


class Tokens(nn.Module):
    """A net of the user's: per-token logits in the layout CrossEntropyLoss takes, (N, C, T)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.out = nn.Embedding(VOCAB, 8), nn.Linear(8, VOCAB)

    def forward(self, ids):
        return self.out(torch.tanh(self.embed(ids))).movedim(-1, 1)


def _rows(step):
    """8 padded rows: rows 4-7 hold 2 real tokens (labels -100 after them), rows 0-3 are full."""
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(6, VOCAB, (8, LENGTH), generator=g)
    mask = torch.ones_like(ids)
    mask[4:, 2:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _batch(rows, kind, part=None, parts=1):
    rows = {k: v.chunk(parts)[part] if part is not None else v for k, v in rows.items()}
    return rows if kind.startswith("llama") else (rows["input_ids"], rows["labels"])


def _train(kind, per_step, accumulation, rank=0):
    """``STEPS`` AdamW steps on the 8 rows of each step split in ``per_step`` micro-batches, of
    which this rank trains slots ``rank * accumulation`` to ``rank * accumulation + accumulation - 1``
    (the elastic layout's); the parameters and how many counts were summed over the ranks."""
    torch.set_num_threads(1)
    net = _llama() if kind.startswith("llama") else Tokens()
    loss = None if kind.startswith("llama") else nn.CrossEntropyLoss(ignore_index=-100)
    smoothing = BatchProcessor(label_smoothing=0.1) if kind == "llama-smoothed" else None  # no num_items_in_batch
    # (label smoothing: SGD, since AdamW divides near-zero gradients by their own root, which
    # shows the rounding of the smoothing's sum over the vocabulary at 1e-5; SGD shows the weighing)
    optimizer = torch.optim.SGD(net.parameters(), lr=1.0) if smoothing else torch.optim.AdamW(net.parameters(), lr=1e-2)
    est = Estimator(net, loss, optimizer=optimizer, device="cpu", batch_processor=smoothing)
    batches = [_batch(_rows(step), kind, slot, per_step) for step in range(STEPS)
               for slot in range(rank * accumulation, (rank + 1) * accumulation)]
    watch = WatchItems()
    est.fit(batches, epochs=1, event_handlers=[watch, GradientUpdateHandler(accumulation_steps=accumulation)])
    return {"params": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "sums": watch.items.collectives if watch.items is not None else None}


class WatchItems(TrainBegin):
    def train_begin(self, est, **kwargs):
        self.items = est.step_items


def _threads(fn, *args):
    threads = torch.get_num_threads()
    try:
        return fn(*args)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def batch_of_eight():
    """The references: each step's 8 rows in one batch, for both nets (and the model's loss
    label-smoothed: BatchProcessor(label_smoothing=), a mean over the same shifted labels)."""
    return {kind: _threads(_train, kind, 1, 1) for kind in ("llama", "user-ce", "llama-smoothed")}


def _close(got, want):
    """Equal to float32 rounding, after AdamW (which divides by the gradients' own root and so
    shows a last-bit difference of a near-zero gradient at up to 1e-6 on some CPUs' kernels,
    1.1e-6 seen on an AVX-512 machine): the wrong weighing differs by 0.06-0.09."""
    for key, value in want["params"].items():
        torch.testing.assert_close(got["params"][key], value, rtol=0, atol=1e-5, msg=key)


def _differs(got, want):
    return max(float((got["params"][k] - v).abs().max()) for k, v in want["params"].items())


@pytest.mark.parametrize("kind", ["llama", "user-ce", "llama-smoothed"])
def test_batch_eight_trains_as_four_times_two_accumulation_with_padded_rows(batch_of_eight, kind):
    accumulated = _threads(_train, kind, 2, 2)
    _close(accumulated, batch_of_eight[kind])
    assert accumulated["sums"] == 0  # one process: no collective


def _both_kinds():
    return {kind: _train(kind, 2, 1, distributed.get_rank()) for kind in ("llama", "user-ce")}


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_of_four_train_as_batch_eight(batch_of_eight):
    """Rank 0 holds the full rows, rank 1 the padded ones: their means of means would weigh a
    padded token four times as much; the counts are summed over the ranks, once per step."""
    ranks = distributed.spawn(_both_kinds, 2, backend="gloo")
    for kind in ("llama", "user-ce"):
        for rank in ranks:
            _close(rank[kind], batch_of_eight[kind])
            assert rank[kind]["sums"] == STEPS
        assert all(torch.equal(v, ranks[1][kind]["params"][k]) for k, v in ranks[0][kind]["params"].items())


# -- what each micro-batch weighs ----------------------------------------------------------------------
def test_a_micro_batch_without_items_adds_nothing_and_no_nan():
    rows = _rows(0)
    empty = {**rows, "labels": torch.full_like(rows["labels"], -100)}

    def fit(batches, k):
        net = _llama()
        est = Estimator(net, optimizer=torch.optim.SGD(net.parameters(), lr=1.0), device="cpu")
        est.fit(batches, epochs=1, event_handlers=[GradientUpdateHandler(accumulation_steps=k)])
        return {"params": dict(net.state_dict())}

    with_empty, alone = fit([rows, empty], 2), fit([rows], 1)
    assert all(torch.isfinite(v).all() for v in with_empty["params"].values())
    _close(with_empty, alone)


def _mse_fit(batches, k, processor=None):
    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.5), device="cpu",
                    batch_processor=processor)
    est.fit(batches, epochs=1, event_handlers=[GradientUpdateHandler(accumulation_steps=k)])
    return {"params": dict(net.state_dict())}


def test_an_uneven_last_batch_weighs_its_samples():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)
    whole = _mse_fit([(x, y)], 1)
    _close(_mse_fit([(x[:4], y[:4]), (x[4:], y[4:])], 2), whole)  # 4 + 2 samples: not a mean of two means
    mean_of_means = _mse_fit([(x[:4], y[:4]), (x[4:], y[4:])], 2, processor=_MeanOfMeans())
    assert _differs(mean_of_means, whole) > 1e-3  # what weighing by samples changes here


class _MeanOfMeans(BatchProcessor):
    """Each micro-batch counting one item: the per-micro-batch average of before."""

    def fit_batch(self, estimator, batch, batch_axis=0):
        x, y = batch
        pred = estimator.train_net(x)
        loss = nn.functional.mse_loss(pred, y)
        estimator.backward(loss, 1)
        return x, y, pred, loss


def test_a_processor_of_the_users_passing_no_count_weighs_its_samples():
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 3, generator=g), torch.randn(6, 2, generator=g)

    class Own(BatchProcessor):
        def fit_batch(self, estimator, batch, batch_axis=0):
            data, label = batch
            pred = estimator.train_net(data)
            loss = nn.functional.mse_loss(pred, label)
            estimator.backward(loss)  # no count: the batch's samples
            return data, label, pred, loss

    torch.manual_seed(0)
    net = nn.Linear(3, 2)
    est = Estimator(net, nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.5), device="cpu",
                    batch_processor=Own())
    est.fit([(x[:4], y[:4]), (x[4:], y[4:])], epochs=1, event_handlers=[GradientUpdateHandler(accumulation_steps=2)])
    _close({"params": dict(net.state_dict())}, _mse_fit([(x, y)], 1))


def test_a_sum_loss_is_divided_by_its_items():
    """``CrossEntropyLoss(reduction="sum")`` over its kept labels trains as its mean, in one
    micro-batch per step and with accumulation."""
    rows = [_rows(s) for s in range(2)]
    batches = [(r["input_ids"], r["labels"]) for r in rows]

    def fit(reduction, data, k):
        net = Tokens()
        est = Estimator(net, nn.CrossEntropyLoss(reduction=reduction), device="cpu",
                        optimizer=torch.optim.SGD(net.parameters(), lr=0.5))
        est.fit(data, epochs=1, event_handlers=[GradientUpdateHandler(accumulation_steps=k)])
        return {"params": dict(net.state_dict())}

    mean = fit("mean", batches, 1)
    _close(fit("sum", batches, 1), mean)
    halves = [(x[i:i + 4], y[i:i + 4]) for x, y in batches for i in (0, 4)]
    _close(fit("sum", halves, 2), mean)
    assert math.isfinite(_differs(fit("sum", batches, 1), mean))
