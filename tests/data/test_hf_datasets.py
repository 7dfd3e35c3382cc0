"""Hugging Face datasets: a map-style Dataset with a random transform, and IterableDatasets
(streamed from local json / parquet files, or from a generator) with .map, .shuffle and
set_epoch, resume bit for bit; data written by the tests into temporary directories."""

from __future__ import annotations

import json
import os
import warnings

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pyarrow as pa  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import Dataset, IterableDataset, load_dataset  # noqa: E402
from datasets.distributed import split_dataset_by_node  # noqa: E402

from estimatorch import distributed  # noqa: E402
from estimatorch.data._iterable_streams import StatefulIterableStream  # noqa: E402
from estimatorch.data._streams import make_train_stream  # noqa: E402
from estimatorch.testing import assert_resumable  # noqa: E402
from tests.conftest import losses_recorder  # noqa: E402
from tests.data.test_iterable_streams import dropout_estimator  # noqa: E402

N = 16  # samples: batches of 4, 4 per epoch
STOPS = [2, 4, 6]  # mid-epoch, an epoch's last step, mid second epoch


def augment_batch(batch):
    """with_transform's random augmentation: sample i is i in every feature plus noise."""
    i = torch.tensor(batch["i"])
    return {"input": i[:, None].float() + torch.rand(len(i), 4), "label": i % 3}


def augment(example):
    """.map's random augmentation of one example."""
    i = example["i"]
    return {"input": (torch.full((4,), float(i)) + torch.rand(4)).tolist(), "label": i % 3}


def resumes_exactly(make_data, stops=STOPS, epochs=2, replayed=False):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_resumable(dropout_estimator, make_data, epochs=epochs, stop_at=stops, quiet=True)
    said = [str(w.message) for w in caught if "shuffle buffer" in str(w.message)]
    assert bool(said) == replayed, said
    assert not [w for w in caught if "cannot be positioned" in str(w.message)]


# -- map-style -----------------------------------------------------------------------------------
@pytest.mark.parametrize("how", ["with_transform", "set_transform"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_style_dataset_with_a_random_transform_resumes_exactly(how, num_workers):
    def data():
        ds = Dataset.from_dict({"i": list(range(N))})
        if how == "with_transform":
            ds = ds.with_transform(augment_batch)
        else:
            ds.set_transform(augment_batch)
        return torch.utils.data.DataLoader(ds, batch_size=4, shuffle=True, num_workers=num_workers)

    resumes_exactly(data)


# -- iterable --------------------------------------------------------------------------------------
def write_shards(directory, kind, shards=2):
    """N samples in ``shards`` files (sample i in file i % shards)."""
    paths = []
    for s in range(shards):
        rows = list(range(s, N, shards))
        if kind == "json":
            path = directory / f"part{s}.jsonl"
            path.write_text("".join(json.dumps({"i": i}) + "\n" for i in rows))
        else:
            path = directory / f"part{s}.parquet"
            pq.write_table(pa.table({"i": rows}), path)
        paths.append(str(path))
    return paths


def generate(shards):
    for s in shards:
        yield from ({"i": i} for i in range(s, N, 2))


def iterable(directory, kind, shuffle, rank=None):
    if kind == "generator":
        ds = IterableDataset.from_generator(generate, gen_kwargs={"shards": [0, 1]})
    else:
        ds = load_dataset(kind, data_files=write_shards(directory, kind), split="train", streaming=True)
    if shuffle:  # before the random .map: datasets runs what is before a shuffle in threads
        ds = ds.shuffle(seed=1, buffer_size=6)
    ds = ds.map(augment, remove_columns=["i"])
    if rank is not None:
        ds = split_dataset_by_node(ds, rank=rank, world_size=2)
    return ds.with_format("torch")


# parquet with .shuffle() is left out: datasets sleeps 5 s whenever it shuts the threads reading
# parquet shards down (config.SLEEP_TIME_ON_THREADS_SHUTDOWN), at every epoch and every replay
CASES = [("json", False, 0), ("json", False, 2), ("json", True, 0), ("json", True, 2),
         ("parquet", False, 0), ("parquet", False, 2), ("generator", False, 2), ("generator", True, 0)]


@pytest.mark.parametrize("kind,shuffle,num_workers", CASES)
def test_an_iterable_dataset_resumes_exactly(tmp_path, kind, shuffle, num_workers):
    def data():
        return torch.utils.data.DataLoader(iterable(tmp_path, kind, shuffle), batch_size=4, num_workers=num_workers)

    # with a shuffle buffer: replayed from the epoch's start (said); without: from its own state
    resumes_exactly(data, replayed=shuffle)


def test_without_a_shuffle_buffer_its_own_state_positions_it(tmp_path):
    stream = make_train_stream(torch.utils.data.DataLoader(iterable(tmp_path, "json", False), batch_size=4), 0)
    assert isinstance(stream, StatefulIterableStream)


def test_a_random_map_before_the_shuffle_is_named_at_fit_start(tmp_path):
    source = load_dataset("json", data_files=write_shards(tmp_path, "json"), split="train", streaming=True)
    before = source.map(augment, remove_columns=["i"]).shuffle(seed=1, buffer_size=6).with_format("torch")
    after = source.shuffle(seed=1, buffer_size=6).map(augment, remove_columns=["i"]).with_format("torch")
    with pytest.warns(UserWarning, match=r"has a \.map\(\) \(or \.filter\(\)\) before its \.shuffle\(\)"):
        make_train_stream(before, 0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*before its .shuffle.*")
        make_train_stream(after, 0)


def labels_by_epoch(data, epochs=2):
    seen = []

    class Labels(losses_recorder()[1].__class__):
        def batch_end(self, estimator, *, label, **kwargs):
            seen.append(label.tolist())

    dropout_estimator().fit(data, epochs=epochs, event_handlers=[Labels()])
    per_epoch = len(seen) // epochs
    return [sum(seen[e * per_epoch:(e + 1) * per_epoch], []) for e in range(epochs)]


def test_set_epoch_reshuffles_every_epoch(tmp_path):
    first, second = labels_by_epoch(torch.utils.data.DataLoader(iterable(tmp_path, "json", True), batch_size=4))
    assert first != second and sorted(first) == sorted(second)


def test_the_buffer_lost_by_its_own_state_would_change_the_data(tmp_path):
    """Why a buffered pipeline is replayed: datasets' own resume refills the buffer afresh."""
    ds = iterable(tmp_path, "json", True).map(lambda e: e)  # deterministic: compare the labels only
    ds.set_epoch(0)
    full = [int(e["label"]) for e in ds]
    it = iter(ds)
    head = [int(next(it)["label"]) for _ in range(6)]
    state = ds.state_dict()
    ds.load_state_dict(state)
    rest = [int(e["label"]) for e in ds]
    assert head == full[:6] and head + rest != full


# -- DDP: split_dataset_by_node on 2 gloo ranks -----------------------------------------------------
def _ddp_fit(directory, kind, shuffle, mode, stop):
    from estimatorch import CheckpointHandler
    from estimatorch.event_handlers import BatchEnd

    torch.set_num_threads(1)
    rank = distributed.get_rank()
    losses, rec = losses_recorder()

    class Crash(BatchEnd):
        seen = 0

        def batch_end(self, estimator, **kwargs):
            self.seen += 1
            if self.seen == stop:
                estimator.at_boundary(self.crash)

        def crash(self):
            raise RuntimeError("crash")

    ckpt = os.path.join(directory, f"ckpt-{kind}-{shuffle}-{stop}")
    handlers = [rec]
    if mode != "full":
        handlers.append(CheckpointHandler(ckpt, batch_period=stop, epoch_period=None,
                                          resume_from_checkpoint=mode == "resume"))
    if mode == "crash":
        handlers.append(Crash())
    est = dropout_estimator()
    data = torch.utils.data.DataLoader(iterable(directory / str(rank), kind, shuffle, rank=rank), batch_size=2)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(data, epochs=2, event_handlers=handlers)
    except RuntimeError as err:
        if str(err) != "crash":
            raise
    return {"losses": losses, "params": [p.detach().clone() for p in est.net.parameters()]}


def _ddp_cases(directory, cases):
    out = []
    for kind, shuffle, stops in cases:
        full = _ddp_fit(directory, kind, shuffle, "full", 0)
        for stop in stops:
            _ddp_fit(directory, kind, shuffle, "crash", stop)
            resumed = _ddp_fit(directory, kind, shuffle, "resume", stop)
            out.append((kind, shuffle, stop, full, resumed))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_split_by_node_on_two_ranks_resumes_exactly(tmp_path):
    # 8 samples per rank, batches of 2: 4 per epoch
    for rank in (0, 1):
        (tmp_path / str(rank)).mkdir()
    cases = [("json", False, [2, 5]), ("json", True, [2, 4, 6])]
    ranks = distributed.spawn(_ddp_cases, 2, tmp_path, cases, backend="gloo")
    for results in ranks:
        for kind, shuffle, stop, full, resumed in results:
            where = (kind, shuffle, stop)
            assert len(full["losses"]) == 8, where
            assert resumed["losses"] == full["losses"][stop:], where
            assert all(torch.equal(a, b) for a, b in zip(full["params"], resumed["params"])), where
    assert ranks[0][0][3]["losses"] != ranks[1][0][3]["losses"]  # each rank its own half
