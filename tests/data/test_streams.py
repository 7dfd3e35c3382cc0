"""Training streams: data that can start any epoch at any batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from torch import nn

from estimatorch import CheckpointHandler, Estimator
from estimatorch.data._streams import make_train_stream
from estimatorch.event_handlers import BatchBegin, BatchEnd
from estimatorch.metrics import Accuracy
from estimatorch.testing import assert_resumable
from tests.conftest import losses_recorder, make_batches, make_estimator


def test_streams_by_kind():
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(10, 2), torch.zeros(10)), batch_size=4)
    stream = make_train_stream(loader, seed=0)
    assert stream.batches_per_epoch == 3 and stream.exact
    assert stream.fingerprint() == {"world_size": 1, "seed": 0, "dataset_len": 10, "batch_size": 4,
                                    "drop_last": False, "sampler": "ResumableSequentialSampler"}
    assert [len(b[0]) for b in stream.epoch_iter(0, 1)] == [4, 2]
    assert list(stream.epoch_iter(0, 3)) == []
    batches = make_batches(n_batches=3)
    seq = make_train_stream(batches, seed=0)
    assert [b[0] is batches[i][0] for i, b in zip((1, 2), seq.epoch_iter(5, 1))] == [True, True]


def test_a_shuffled_loader_is_positioned_without_loading_skipped_batches():
    class Counting(torch.utils.data.Dataset):
        def __init__(self):
            self.fetched = []

        def __len__(self):
            return 40

        def __getitem__(self, i):
            self.fetched.append(i)
            return torch.tensor([float(i)]), i % 2

    dataset = Counting()
    stream = make_train_stream(torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True), seed=3)
    full = [b[0].flatten().tolist() for b in stream.epoch_iter(2, 0)]
    dataset.fetched.clear()
    tail = [b[0].flatten().tolist() for b in stream.epoch_iter(2, 7)]
    assert tail == full[7:]
    assert len(dataset.fetched) == 3 * 4  # only the three remaining batches were loaded
    assert [b[0].flatten().tolist() for b in stream.epoch_iter(3, 0)] != full  # a new order each epoch


class CountingIterable(torch.utils.data.IterableDataset):
    """An iterable dataset that saves its position."""

    def __init__(self, n=12):
        self.n, self.pos = n, 0

    def __iter__(self):
        while self.pos < self.n:
            i = self.pos
            self.pos += 1
            yield torch.full((4,), float(i)), torch.tensor(i % 3)
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def test_an_iterable_dataset_with_state_resumes_from_its_own_state(tmp_path):
    full, rec = losses_recorder()
    make_estimator().fit(torch.utils.data.DataLoader(CountingIterable(), batch_size=3), epochs=2, event_handlers=[rec])
    est = make_estimator()
    part, rec = losses_recorder()

    class Stop(BatchEnd):
        n = 0

        def batch_end(self, est, **kw):
            Stop.n += 1
            if Stop.n == 5:
                est.at_boundary(lambda: (_ for _ in ()).throw(KeyboardInterrupt))

    with pytest.raises(KeyboardInterrupt):
        est.fit(torch.utils.data.DataLoader(CountingIterable(), batch_size=3), epochs=2,
                event_handlers=[rec, CheckpointHandler(tmp_path, batch_period=1, epoch_period=None), Stop()])
    rest, rec = losses_recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: no replay warning
        make_estimator().fit(torch.utils.data.DataLoader(CountingIterable(), batch_size=3), epochs=2, event_handlers=[
            rec, CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, resume_from_checkpoint=True)])
    assert part[:5] + rest == full


def test_an_iterable_without_state_warns_that_it_will_be_replayed(tmp_path):
    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(6):
                yield torch.full((4,), float(i)), torch.tensor(i % 3)

    with pytest.warns(UserWarning, match="replay"):
        make_estimator().fit(torch.utils.data.DataLoader(Plain(), batch_size=2), epochs=1,
                             event_handlers=[CheckpointHandler(tmp_path)])


def test_a_replayed_iterable_resumes_at_the_right_batch(tmp_path):
    class Plain(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i in range(8):
                yield torch.full((4,), float(i)), torch.tensor(i % 3)

    def loader():
        return torch.utils.data.DataLoader(Plain(), batch_size=2)

    full, rec = losses_recorder()
    make_estimator().fit(loader(), epochs=2, event_handlers=[rec])
    est = make_estimator()
    with pytest.warns(UserWarning):
        est.fit(loader(), batches=3, event_handlers=[CheckpointHandler(tmp_path, batch_period=1, epoch_period=None)])
    rest, rec = losses_recorder()
    with pytest.warns(UserWarning) as caught:
        make_estimator().fit(loader(), epochs=2, event_handlers=[
            rec, CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, resume_from_checkpoint=True)])
    messages = [str(w.message) for w in caught]
    assert any("cannot be positioned" in m for m in messages), messages
    assert any("replaying 3 batches" in m for m in messages), messages
    # the plan differs (batches=3 vs epochs=2): the stream and position still line up
    assert rest == full[3:]


def dropout_estimator(features: int = 4) -> Estimator:
    """An estimator whose every step draws from torch's generator (dropout)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(features, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 3))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


class Seen(BatchBegin):
    """The first feature of every sample each step trained on (the sample's index, below)."""

    def __init__(self) -> None:
        self.steps: list[list[int]] = []

    def batch_begin(self, estimator, *, batch, **kwargs):
        self.steps.append(batch[0][..., 0].flatten().long().tolist())


def indexed(n: int = 20, features: int = 4) -> torch.utils.data.TensorDataset:
    """Sample i holds i in every feature: a batch says which samples it holds."""
    x = torch.arange(n, dtype=torch.float32).view(n, 1).repeat(1, features)
    return torch.utils.data.TensorDataset(x, torch.arange(n) % 3)


class EvenSampler(torch.utils.data.RandomSampler):
    """A RandomSampler subclass with an order of its own: the even indices, shuffled by torch's
    global generator (as RandomSampler itself draws)."""

    def __iter__(self):
        return (i for i in super().__iter__() if i % 2 == 0)

    def __len__(self):
        return len(self.data_source) // 2


class ReversedSampler(torch.utils.data.SequentialSampler):
    def __iter__(self):
        return iter(range(len(self.data_source) - 1, -1, -1))


@pytest.mark.parametrize("sampler_class, check", [
    (EvenSampler, lambda seen: sorted(seen) == list(range(0, 20, 2))),
    (ReversedSampler, lambda seen: seen == list(range(19, -1, -1))),
])
def test_a_sampler_subclass_keeps_its_own_order(sampler_class, check):
    dataset = indexed()
    seen = Seen()
    with pytest.warns(UserWarning, match=f"{sampler_class.__name__} is not a sampler estimatorch knows"):
        make_estimator().fit(torch.utils.data.DataLoader(dataset, batch_size=4, sampler=sampler_class(dataset)),
                             epochs=2, event_handlers=[seen])
    epochs = [sum(seen.steps[:len(seen.steps) // 2], []), sum(seen.steps[len(seen.steps) // 2:], [])]
    assert all(check(epoch) for epoch in epochs), seen.steps


def test_a_sampler_subclass_drawing_from_torch_resumes_exactly():
    dataset = indexed()

    def loader():
        return torch.utils.data.DataLoader(dataset, batch_size=4, sampler=EvenSampler(dataset))

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replay warning
        assert_resumable(lambda: dropout_estimator(), loader, epochs=2, stop_at=[1, 3, 4], quiet=True)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_batch_sampler_given_as_sampler_gives_whole_batches(num_workers):
    dataset = indexed(32, features=8)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset), 8, drop_last=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=None, sampler=sampler, num_workers=num_workers)
    direct = [b[0].shape for b in loader]
    seen = Seen()
    est = make_estimator(features=8, train_metrics=[Accuracy()])
    with pytest.warns(UserWarning, match="BatchSampler is not a sampler estimatorch knows"):
        est.fit(loader, epochs=2, event_handlers=[seen])
    assert direct == [torch.Size([8, 8])] * 4
    assert [len(step) for step in seen.steps] == [8] * 8  # every step: 8 samples
    assert all(sorted(sum(seen.steps[e * 4:e * 4 + 4], [])) == list(range(32)) for e in (0, 1))


def test_a_batch_sampler_given_as_sampler_resumes_exactly():
    dataset = indexed(32, features=4)

    def loader():
        sampler = torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset), 8, drop_last=True)
        return torch.utils.data.DataLoader(dataset, batch_size=None, sampler=sampler)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the replay warning
        assert_resumable(lambda: dropout_estimator(), loader, epochs=2, stop_at=[2, 4, 5], quiet=True)


def test_a_batch_sampler_given_as_batch_sampler_is_positioned():
    dataset = indexed(20)
    loader = torch.utils.data.DataLoader(
        dataset, batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(dataset), 4, False))
    stream = make_train_stream(loader, seed=0)
    assert stream.exact and stream.sampler_name == "ResumableRandomSampler" and stream.batches_per_epoch == 5
    whole = [b[0][:, 0].long().tolist() for b in stream.epoch_iter(1, 0)]
    assert [len(b) for b in whole] == [4] * 5 and sorted(sum(whole, [])) == list(range(20))
    assert [b[0][:, 0].long().tolist() for b in stream.epoch_iter(1, 3)] == whole[3:]
