"""Every kind of training data x every kind of stop: docs/resume.md's table of what resumes
exactly. Each case trains an uninterrupted run, then for each stop a run that crashes right
after the checkpoint there and a fresh one that resumes from it; the resumed losses and the
final parameters must equal the uninterrupted run's, bit for bit, and data that can only be
replayed must say so with the documented warning."""

from __future__ import annotations

import warnings
from typing import Any, Callable

import pytest
import torch
from torch import nn
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, SequentialSampler, WeightedRandomSampler

from estimatorch import CheckpointHandler, Estimator
from estimatorch.event_handlers import BatchEnd
from tests.conftest import CrashAt, losses_recorder
from tests.data.test_iterable_streams import StatefulRange

N = 16  # samples; batches of 4: 4 batches per epoch (partial cases: 14 samples)


class Noisy(torch.utils.data.Dataset):
    """Sample i: i in every feature plus noise from torch's global generator (random augmentation);
    a list of indices gives their samples stacked (a dataset that fetches whole batches)."""

    def __len__(self):
        return N

    def __getitem__(self, i):
        if isinstance(i, list):
            x, y = zip(*(self[j] for j in i))
            return torch.stack(x), torch.stack(y)
        return torch.full((4,), float(i)) + torch.rand(4), torch.tensor(i % 3)


class Plain(torch.utils.data.IterableDataset):
    """An IterableDataset without state: its share of N samples, with noise."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i in range(N) if info is None else range(info.id, N, info.num_workers):
            yield torch.full((4,), float(i)) + torch.rand(4), torch.tensor(i % 3)


class OddFirst(RandomSampler):
    """A RandomSampler subclass with an order of its own: the odd indices first, each half shuffled."""

    def __iter__(self):
        order = list(super().__iter__())
        return iter([i for i in order if i % 2] + [i for i in order if not i % 2])


class Reversed(SequentialSampler):
    def __iter__(self):
        return iter(range(len(self.data_source) - 1, -1, -1))


def generator_of_batches():
    g = torch.Generator().manual_seed(3)
    for i in range(4):
        yield torch.randn(4, 4, generator=g) + torch.rand(4, 4), torch.tensor([i % 3] * 4)


#: kind -> (a function making fresh train_data, replayed?, epochs)
KINDS: dict[str, tuple[Callable[[], Any], bool, int]] = {
    "map, 0 workers": (lambda: DataLoader(Noisy(), batch_size=4, shuffle=True), False, 2),
    "map, 2 workers": (lambda: DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2), False, 2),
    "map, 2 persistent workers": (lambda: DataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=2,
                                                     persistent_workers=True), False, 2),
    "RandomSampler subclass": (lambda: DataLoader(Noisy(), batch_size=4, sampler=OddFirst(Noisy())), True, 2),
    "SequentialSampler subclass": (lambda: DataLoader(Noisy(), batch_size=4, sampler=Reversed(Noisy())), True, 2),
    "WeightedRandomSampler": (lambda: DataLoader(Noisy(), batch_size=4, sampler=WeightedRandomSampler(
        [1.0 + i % 4 for i in range(N)], N)), True, 2),
    "BatchSampler as batch_sampler": (lambda: DataLoader(Noisy(), batch_sampler=BatchSampler(
        RandomSampler(range(N)), 4, drop_last=False)), False, 2),
    "BatchSampler as sampler": (lambda: DataLoader(Noisy(), batch_size=None, sampler=BatchSampler(
        RandomSampler(range(N)), 4, drop_last=True)), True, 2),
    "stateful iterable, 0 workers, full last batch": (
        lambda: DataLoader(StatefulRange(16, noise=True), batch_size=4), False, 2),
    "stateful iterable, 0 workers, partial last batch": (
        lambda: DataLoader(StatefulRange(14, noise=True), batch_size=4), False, 2),
    "stateful iterable, 2 workers, full last batch": (
        lambda: DataLoader(StatefulRange(16, noise=True), batch_size=4, num_workers=2), False, 2),
    "stateful iterable, 2 workers, partial last batch": (
        lambda: DataLoader(StatefulRange(14, noise=True), batch_size=4, num_workers=2), False, 2),
    "stateful iterable, 2 persistent workers, partial last batch": (
        lambda: DataLoader(StatefulRange(14, noise=True), batch_size=4, num_workers=2,
                           persistent_workers=True), False, 2),
    "stateless iterable, 0 workers": (lambda: DataLoader(Plain(), batch_size=4), True, 2),
    "stateless iterable, 2 workers": (lambda: DataLoader(Plain(), batch_size=4, num_workers=2), True, 2),
    "generator": (generator_of_batches, True, 1),
    "list of dicts": (lambda: [{"input": torch.full((4, 4), float(i)), "label": torch.tensor([i % 3] * 4)}
                               for i in range(4)], False, 2),
}


class CrashAfter(BatchEnd):
    """Crashes at the boundary after step ``step``, once the checkpoint there is written."""

    priority = float("inf")

    def __init__(self, step: int):
        self.step, self.seen = step, 0

    def batch_end(self, estimator, **kwargs):
        self.seen += 1
        if self.seen == self.step:
            estimator.at_boundary(self.crash)

    def crash(self):
        raise RuntimeError(f"crash after step {self.step}")


def dropout_estimator() -> Estimator:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 3))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def fit(data: Any, epochs: int, handlers: list) -> tuple[list[str], Estimator, list[str]]:
    """Losses, the estimator and the warnings of one fit."""
    losses, rec = losses_recorder()
    est = dropout_estimator()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(data, epochs=epochs, event_handlers=[rec, *handlers])
    return losses, est, [str(w.message) for w in caught]


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_of_data_resumes_as_documented(kind, tmp_path):
    make_data, replayed, epochs = KINDS[kind]
    reference, full, _ = fit(make_data(), epochs, [])
    per_epoch = len(reference) // epochs
    stops = {"mid-epoch": per_epoch // 2, "an epoch's last step": per_epoch}
    if epochs > 1:
        stops["an epoch's end"] = per_epoch
    for where, step in stops.items():
        directory = tmp_path / where.replace(" ", "_").replace("'", "")
        at_end = where == "an epoch's end"
        save = dict(batch_period=None, epoch_period=1) if at_end else dict(batch_period=step, epoch_period=None)
        crash = CrashAt(step + 1) if at_end else CrashAfter(step)
        with pytest.raises(RuntimeError, match="crash "):
            fit(make_data(), epochs, [CheckpointHandler(directory, **save), crash])
        rest, resumed, messages = fit(make_data(), epochs, [CheckpointHandler(directory, resume_from_checkpoint=True,
                                                                              **save)])
        context = f"{kind}, stopped at {where} (step {step})"
        assert rest == reference[step:], context
        assert all(torch.equal(a, b) for a, b in zip(full.net.parameters(), resumed.net.parameters())), context
        warned = any("cannot be positioned" in m or "is not a sampler estimatorch knows" in m for m in messages)
        assert warned == replayed, (context, messages)
