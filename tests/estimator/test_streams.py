"""Training streams: data that can start any epoch at any batch."""

from __future__ import annotations

import warnings

import pytest
import torch

from estimatorch import CheckpointHandler
from estimatorch.estimator._streams import make_train_stream
from estimatorch.event_handlers import BatchEnd
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
