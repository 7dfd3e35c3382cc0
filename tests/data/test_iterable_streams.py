"""An IterableDataset with state_dict/load_state_dict resumes exactly: in the training process,
behind DataLoader workers, with a partial last batch."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator
from estimatorch.data import open_stream
from estimatorch.data._iterable_streams import StatefulIterableStream
from estimatorch.testing import assert_resumable
from tests.conftest import Count, losses_recorder


class StatefulRange(torch.utils.data.IterableDataset):
    """Samples 0..n-1 (sample i holds i in every feature), each worker its share (i % workers);
    the position is updated before a sample is yielded, and once run to its end the state reads
    "start of the next pass". ``noise``: each sample draws from torch's global generator."""

    def __init__(self, n: int = 30, features: int = 4, noise: bool = False):
        self.n, self.features, self.noise = n, features, noise
        self.pos = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        mine = range(info.id, self.n, info.num_workers) if info is not None else range(self.n)
        while self.pos < len(mine):
            i = mine[self.pos]
            self.pos += 1
            x = torch.full((self.features,), float(i))
            yield (x + torch.rand(self.features) if self.noise else x), torch.tensor(i % 3)
        self.pos = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = state["pos"]


def dropout_estimator() -> Estimator:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.3), nn.ReLU(), nn.Linear(8, 3))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))


def loader_of(n: int = 32, noise: bool = True, **kwargs):
    return lambda: torch.utils.data.DataLoader(StatefulRange(n, noise=noise), batch_size=4, **kwargs)


def resumable(data, stops, epochs=2):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # exact: no replay warning
        assert_resumable(dropout_estimator, data, epochs=epochs, stop_at=stops, quiet=True)


def test_a_mid_epoch_resume_draws_what_the_uninterrupted_run_draws():
    # creating the loader's iterator must not draw from torch's generator at another point
    resumable(loader_of(32), [3, 5])


def test_a_checkpoint_at_a_partial_last_batch_resumes_into_the_next_epoch():
    count = Count()
    dropout_estimator().fit(loader_of(30)(), epochs=2, event_handlers=[count])
    assert count.batches == 16
    resumable(loader_of(30), [7, 8, 9, 16])


@pytest.mark.parametrize("persistent", [False, True])
def test_a_stateful_dataset_behind_workers_resumes_exactly(persistent):
    data = loader_of(30, num_workers=2, persistent_workers=persistent)
    seen = []
    dropout_estimator().fit(data(), epochs=1, event_handlers=[count := Count()])
    for x, _ in data():
        seen += x[:, 0].floor().long().tolist()
    assert count.batches == 8 and sorted(seen) == list(range(30))
    resumable(data, [1, 2, 5, 8, 9, 12])


def test_a_stateful_dataset_behind_workers_refuses_another_num_workers(tmp_path):
    est = dropout_estimator()
    est.fit(loader_of(30, num_workers=2)(), batches=3,
            event_handlers=[CheckpointHandler(tmp_path, batch_period=1, epoch_period=None)])
    with pytest.raises(ValueError, match=r"ran in 2 DataLoader worker\(s\) and this DataLoader has "
                                         r"num_workers=3.*Resume with num_workers=2"):
        dropout_estimator().fit(loader_of(30, num_workers=3)(), epochs=1, event_handlers=[
            CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, resume_from_checkpoint=True)])


def test_a_worker_init_fn_reaches_the_dataset():
    def init(worker_id):
        torch.utils.data.get_worker_info().dataset.n = 8  # the PyTorch docs' way to configure a worker

    stream = open_stream(torch.utils.data.DataLoader(StatefulRange(30), batch_size=2, num_workers=2,
                                                           worker_init_fn=init), seed=0)
    seen = sorted(sum((b[0][:, 0].long().tolist() for b in stream.epoch_iter(0, 0)), []))
    assert seen == list(range(8))


def test_an_iterable_dataset_given_to_fit_directly_resumes_exactly():
    class Batches(StatefulRange):
        def __iter__(self):
            for x, y in super().__iter__():
                yield x.repeat(2, 1), y.repeat(2)

    full, rec = losses_recorder()
    dropout_estimator().fit(Batches(6, noise=True), epochs=2, event_handlers=[rec])
    assert len(full) == 12
    resumable(lambda: Batches(6, noise=True), [2, 6, 7])


@pytest.mark.parametrize("saved, now", [(0, 2), (2, 0)])
def test_a_stateful_dataset_between_the_training_process_and_workers_is_refused(tmp_path, saved, now):
    dropout_estimator().fit(loader_of(30, num_workers=saved)(), batches=3,
                            event_handlers=[CheckpointHandler(tmp_path, batch_period=1, epoch_period=None)])
    with pytest.raises(ValueError, match=rf"ran in {saved} DataLoader worker\(s\) and this DataLoader has "
                                         rf"num_workers={now}.*Resume with num_workers={saved}"):
        dropout_estimator().fit(loader_of(30, num_workers=now)(), epochs=1, event_handlers=[
            CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, resume_from_checkpoint=True)])


# -- a state sent with every N batches (snapshot_every) ---------------------------------------------
def snapshot_stream(every: int) -> StatefulIterableStream:
    loader = torch.utils.data.DataLoader(StatefulRange(40, noise=True), batch_size=2, num_workers=2)
    return StatefulIterableStream(loader.dataset, loader, seed=0, snapshot_every=every)


def states_sent(stream: StatefulIterableStream) -> list[int]:
    """Per worker, the ordinals (1-based) of its batches that carried its dataset's state."""
    sent: list[list[int]] = [[], []]
    for _, meta in stream.loader:
        if not meta["end"] and "state" in meta:
            sent[meta["worker"]].append(meta["batches"])
    return sent


@pytest.mark.parametrize("every", [1, 3])
def test_workers_send_their_state_with_their_first_batch_and_every_nth(every):
    # 20 samples per worker in batches of 2: 10 batches each
    assert states_sent(snapshot_stream(every)) == [list(range(1, 11, every))] * 2


def test_a_resume_between_two_states_remakes_the_batches_since_the_last_one():
    def epoch(stream, start=0):
        return [x for x, _ in stream.epoch_iter(0, start)]

    full = epoch(snapshot_stream(3))
    assert torch.equal(torch.cat(full), torch.cat(epoch(snapshot_stream(1))))  # the same batches
    # worker 0 made (stop + 1) // 2 of them, worker 1 stop // 2; states sent with batches 1, 4, 7...
    for stop, since in [(2, [0, 0]), (8, [0, 0]), (7, [0, 2]), (11, [2, 1])]:
        stream = snapshot_stream(3)
        it = iter(stream.epoch_iter(0, 0))
        for _ in range(stop):
            next(it)
        state = stream.state_dict()
        assert [w["since"] for w in state["workers"]] == since, stop
        fresh = snapshot_stream(3)
        fresh.load_state_dict(state)
        rest = epoch(fresh, stop)
        assert len(rest) == len(full) - stop and all(torch.equal(a, b) for a, b in zip(rest, full[stop:])), stop


def test_a_worker_state_saved_before_snapshots_resumes():
    stream = snapshot_stream(1)
    it = iter(stream.epoch_iter(0, 0))
    full = [x for x, _ in snapshot_stream(1).epoch_iter(0, 0)]
    for _ in range(5):
        next(it)
    state = stream.state_dict()
    for w in state["workers"]:
        del w["since"]  # written before snapshots: each worker's state is the one after its last batch
    fresh = snapshot_stream(1)
    fresh.load_state_dict(state)
    assert all(torch.equal(a, b) for (a, _), b in zip(fresh.epoch_iter(0, 5), full[5:], strict=True))


def test_a_worker_state_with_more_batches_since_than_made_is_refused():
    stream = snapshot_stream(3)
    state = {"workers": [{"state": None, "batches": 2, "ended": False, "since": 3},
                         {"state": None, "batches": 2, "ended": False, "since": 1}], "last": 1}
    with pytest.raises(ValueError, match=r"since each worker's state, \[3, 1\], must lie between 0 and its "
                                         r"batches made, \[2, 2\]"):
        stream.load_state_dict(state)


# -- a signal's stop between recording a batch and handing it out ----------------------------------
@pytest.mark.parametrize("every", [1, 3])
def test_a_stop_raised_after_a_batch_is_recorded_but_before_it_is_handed_out_leaves_the_state_of_the_boundary(
        every, monkeypatch):
    full = [x for x, _ in snapshot_stream(every).epoch_iter(0, 0)]
    stream = snapshot_stream(every)
    it = iter(stream.epoch_iter(0, 0))
    for _ in range(5):
        next(it)
    boundary = stream.state_dict()  # after 5 batches trained
    record = stream._record

    def record_then_signal(worker, meta):
        record(worker, meta)  # the batch's state is recorded, then the signal's stop is raised
        raise KeyboardInterrupt

    monkeypatch.setattr(stream, "_record", record_then_signal)
    with pytest.raises(KeyboardInterrupt):
        next(it)
    assert stream.state_dict() == boundary  # the 6th batch was not handed out: not counted
    fresh = snapshot_stream(every)
    fresh.load_state_dict(stream.state_dict())
    assert all(torch.equal(a, b) for (a, _), b in zip(fresh.epoch_iter(0, 5), full[5:], strict=True))
