"""A datasets shuffle buffer resumes from the checkpoint's copy of its content: bitwise after a
SIGKILL (workers 0 and 2, two gloo ranks with split_dataset_by_node), reading the buffer from
the checkpoint instead of the epoch; a pipeline that would not resume exactly after its shuffle
is replayed, saying why."""

from __future__ import annotations

import os
import shutil
import signal
import warnings
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files only: never the Hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from datasets import IterableDataset, load_dataset  # noqa: E402

from estimatorch import CheckpointHandler  # noqa: E402
from estimatorch.data import open_stream  # noqa: E402
from estimatorch.data._hf_streams import _EpochReplayStream  # noqa: E402
from estimatorch.data._shuffle_buffer import BufferedStream, resumable_copy  # noqa: E402
from estimatorch.testing import assert_resumable  # noqa: E402
from tests import forked  # noqa: E402
from tests.data.shuffle_buffer_worker import BATCH, EPOCHS, N  # noqa: E402
from tests.data.test_hf_datasets import augment, resumes_exactly, write_shards  # noqa: E402
from tests.data.test_iterable_streams import dropout_estimator  # noqa: E402
from tests.fixtures import make_hf_buffer_checkpoint as hf_fixture  # noqa: E402

WORKER = os.path.join(os.path.dirname(__file__), "shuffle_buffer_worker.py")


# -- the buffer's order and state ------------------------------------------------------------------
def shuffled_json(directory, buffer_size=6):
    return load_dataset("json", data_files=write_shards(directory, "json", shards=4), split="train",
                        streaming=True).shuffle(seed=1, buffer_size=buffer_size)


@pytest.mark.parametrize("epoch", [0, 1])
def test_it_yields_what_datasets_buffer_yields_fed_example_by_example(tmp_path, epoch):
    ds = shuffled_json(tmp_path)
    ds.set_epoch(epoch)
    ex_iterable = ds._prepare_ex_iterable_for_iteration()
    while type(ex_iterable).__name__ != "BufferShuffledExamplesIterable":
        ex_iterable = ex_iterable.ex_iterable
    theirs = [example["i"] for _, example in iter(ex_iterable)]  # datasets' buffer, example by example
    ours = resumable_copy(shuffled_json(tmp_path))
    ours.set_epoch(epoch)
    assert [example["i"] for example in ours] == theirs and sorted(theirs) == list(range(16))


@pytest.mark.parametrize("stop", [1, 3, 5, 8, 15, 16])
def test_its_state_holds_the_buffer_and_resumes_where_it_stopped(tmp_path, stop):
    full = [e["i"] for e in resumable_copy(shuffled_json(tmp_path))]
    ds = resumable_copy(shuffled_json(tmp_path))
    it = iter(ds)
    head = [next(it)["i"] for _ in range(stop)]
    state = ds.state_dict()
    fresh = resumable_copy(shuffled_json(tmp_path))
    fresh.load_state_dict(state)
    assert head + [e["i"] for e in fresh] == full


# -- what a resume reads ---------------------------------------------------------------------------
READ = []  # each example the generator below made (workers 0: in this process)


def counted(shards):
    for s in shards:
        for j in range(64):
            READ.append(s)
            yield {"i": s * 64 + j}


def test_a_resume_reads_the_buffer_from_the_checkpoint_not_the_epoch():
    buffer_size, open_shards = 16, 2  # 8 shards of 64 examples, two read at a time into the buffer

    def loader():
        ds = IterableDataset.from_generator(counted, gen_kwargs={"shards": list(range(8))})
        ds = ds.shuffle(seed=1, buffer_size=buffer_size, max_buffer_input_shards=open_shards)
        return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=4)

    stream = open_stream(loader(), 0)
    assert isinstance(stream, BufferedStream)
    it = iter(stream.epoch_iter(0, 0))
    READ.clear()
    for _ in range(100):  # 400 of 512 examples
        next(it)
    read_to_get_there = len(READ)
    state = stream.state_dict()
    expected = next(it)
    fresh = open_stream(loader(), 0)
    fresh.load_state_dict(state)
    READ.clear()
    first = next(iter(fresh.epoch_iter(0, 100)))
    assert torch.equal(first["i"], expected["i"])
    # the buffer comes from the state; the input shards being read re-read their starts (datasets'
    # state), and refilling the buffer for the next flush reads at most half of it
    assert len(READ) <= open_shards * 64 + buffer_size // 2 < read_to_get_there


# -- what follows the shuffle ----------------------------------------------------------------------
def test_a_batched_map_after_the_shuffle_is_replayed_and_says_why(tmp_path):
    def randomise(batch):
        return {"input": [(torch.full((4,), float(i)) + torch.rand(4)).tolist() for i in batch["i"]],
                "label": [i % 3 for i in batch["i"]]}

    def data():
        ds = shuffled_json(tmp_path).map(randomise, batched=True, batch_size=3, remove_columns=["i"])
        return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=4)

    assert isinstance(open_stream(data(), 0), _EpochReplayStream)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_resumable(dropout_estimator, data, epochs=2, stop_at=[3], quiet=True)
    said = [str(w.message) for w in caught if "replays epoch" in str(w.message)]
    assert said and all("a batched .map() after the .shuffle() would not resume exactly" in m for m in said)


def test_a_map_after_the_shuffle_resumes_from_the_saved_buffer(tmp_path):
    def data():
        ds = shuffled_json(tmp_path).map(augment, remove_columns=["i"])
        return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=4)

    assert isinstance(open_stream(data(), 0), BufferedStream)
    resumes_exactly(data, stops=[1, 3, 4, 6])  # no replay said


# -- SIGKILL after a checkpoint, in a fresh process ------------------------------------------------
def _run(*args, killed=False):
    # a fresh process, without a fresh interpreter's imports (tests/forked.py; datasets preloaded)
    proc = forked.run(WORKER, args, timeout=600, preload=("datasets",))
    if killed:  # the process killed itself; a spawn launcher reports its killed ranks
        assert proc.returncode != 0, proc.stderr[-2000:]
        assert proc.returncode == -signal.SIGKILL or "--ranks" in args, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]


def _stops(per_epoch):
    return {"mid-epoch": per_epoch // 2 + 1, "epoch-last": per_epoch, "after-first-epoch": per_epoch + 2}


SETUPS = {"workers-0": (0, 1), "workers-2": (2, 1), "ranks-2": (0, 2)}  # (num_workers, ranks)


def _per_epoch(name):
    return N // SETUPS[name][1] // BATCH


@pytest.fixture(scope="module")
def killed_and_resumed(tmp_path_factory):
    """``runs(name)``: for a setup of :data:`SETUPS`, the uninterrupted run and each stop's resumed
    run (run once, two processes at a time)."""
    root = tmp_path_factory.mktemp("shuffle-buffer")
    done = {}

    def runs(name):
        if name in done:
            return done[name]
        workers, ranks = SETUPS[name]
        common = ("--workers", workers, "--ranks", ranks)

        def full():
            _run("full", "--dir", root / f"full-{name}", *common, "--out", root / f"full-{name}.pt")

        def kill_and_resume(stop):
            directory = root / f"{name}-{stop}"
            _run("kill", "--dir", directory, *common, "--at", _stops(_per_epoch(name))[stop], killed=True)
            _run("resume", "--dir", directory, *common, "--out", root / f"{name}-{stop}.pt")

        with ThreadPoolExecutor(max_workers=2) as pool:
            jobs = [pool.submit(full)] + [pool.submit(kill_and_resume, stop) for stop in _stops(_per_epoch(name))]
            for job in jobs:
                job.result()
        load = lambda p: torch.load(p, weights_only=True)  # noqa: E731
        done[name] = (load(root / f"full-{name}.pt"),
                      {stop: load(root / f"{name}-{stop}.pt") for stop in _stops(_per_epoch(name))})
        return done[name]

    return runs


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)  # a setup's 7 processes, on a loaded 2-core machine
@pytest.mark.parametrize("name", list(SETUPS))
@pytest.mark.parametrize("stop", ["mid-epoch", "epoch-last", "after-first-epoch"])
def test_a_fit_killed_after_a_checkpoint_resumes_bitwise(killed_and_resumed, name, stop):
    full, resumed = killed_and_resumed(name)
    at = _stops(_per_epoch(name))[stop]
    for rank, (whole, rest) in enumerate(zip(full, resumed[stop])):
        where = f"{name}, {stop} (step {at}), rank {rank}"
        assert len(whole["batches"]) == _per_epoch(name) * EPOCHS, where
        assert len(rest["batches"]) == len(whole["batches"]) - at, where
        for step, (a, b) in enumerate(zip(whole["batches"][at:], rest["batches"]), start=at + 1):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f"{where}: batch {step}"
        assert rest["losses"] == whole["losses"][at:], where
        assert all(torch.equal(p, q) for p, q in zip(whole["params"], rest["params"])), where
    if name == "ranks-2":  # each rank its own half of the examples (example i's input is i + noise in [0, 1))
        first, second = ({int(x) for b in r["batches"] for x in b["input"][:, 0]} for r in full)
        assert len(first) == len(second) == N // 2 and not first & second


# -- a checkpoint of the replay era ----------------------------------------------------------------
def test_a_checkpoint_written_while_the_epoch_was_replayed_resumes_its_epoch_as_it_would_have(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    shutil.copy(os.path.join(hf_fixture.FIXTURE_DIR, "model-epoch0batch5.pt"), ckpt)
    recorded = torch.load(os.path.join(hf_fixture.FIXTURE_DIR, "batches.pt"), weights_only=True)
    est, data = hf_fixture.build(str(tmp_path))
    rest = hf_fixture.Recorder()
    with pytest.warns(UserWarning, match="written without the buffer's content"):
        est.fit(data, epochs=hf_fixture.EPOCHS, event_handlers=[
            rest, CheckpointHandler(str(ckpt), batch_period=1, epoch_period=None, resume_from_checkpoint=True)])
    per_epoch = len(recorded) // hf_fixture.EPOCHS
    assert len(rest.batches) == len(recorded) - hf_fixture.STEP
    for step, (a, b) in enumerate(zip(recorded[hf_fixture.STEP:per_epoch], rest.batches), start=hf_fixture.STEP + 1):
        assert all(torch.equal(a[k], b[k]) for k in a), f"batch {step}"
    # the next epoch is the resumable buffer's, whose checkpoints hold the buffer
    saved = torch.load(sorted(ckpt.glob("model-epoch1*.pt"))[-1], weights_only=True)
    assert "buffered" in saved["ranks"][0]["data"]


# -- with workers: the buffer's state sent with one batch in every buffer's worth --------------------
def buffered_json_loader(directory, persistent=False):
    """64 examples in 4 json shards (2 per worker), buffers of 8, batches of 2: a worker sends
    its state with its batches 1, 5, 9 and 13 of 16 (8 // 2 = 4 batches apart)."""
    files = []
    for s in range(4):
        path = directory / f"part{s}.jsonl"
        path.write_text("".join(f'{{"i": {i}}}\n' for i in range(s, 64, 4)))
        files.append(str(path))

    def data():
        ds = load_dataset("json", data_files=files, split="train", streaming=True)
        ds = ds.shuffle(seed=1, buffer_size=8).map(augment, remove_columns=["i"])
        return torch.utils.data.DataLoader(ds.with_format("torch"), batch_size=2, num_workers=2,
                                           persistent_workers=persistent)

    return data


def test_behind_workers_one_batch_in_a_buffers_worth_carries_the_buffer(tmp_path):
    data = buffered_json_loader(tmp_path)
    stream = open_stream(data(), 0)
    sent = {0: [], 1: []}
    made = {0: 0, 1: 0}
    for _, meta in stream.inner.loader:
        if not meta["end"]:
            made[meta["worker"]] = meta["batches"]
            if "state" in meta:
                sent[meta["worker"]].append(meta["batches"])
    assert made == {0: 16, 1: 16} and sent == {0: [1, 5, 9, 13], 1: [1, 5, 9, 13]}
    # worker 0 trained (stop + 1) // 2 batches, worker 1 stop // 2: 10 at a state, 7 and 36 between two
    for stop, since in [(10, [0, 0]), (7, [3, 2]), (36, [1, 1])]:
        stream = open_stream(data(), 0)
        it = (batch for epoch in range(2) for batch in stream.epoch_iter(epoch, 0))
        for _ in range(stop):
            next(it)
        assert [w["since"] for w in stream.state_dict()["buffered"]["workers"]] == since, stop
    resumes_exactly(data, stops=[7, 10, 36])


def test_behind_persistent_workers_a_resume_between_two_states_continues_into_the_next_epoch(tmp_path):
    # 7: between two states; 32: the epoch's last batch, whose end record brings the state
    resumes_exactly(buffered_json_loader(tmp_path, persistent=True), stops=[7, 32, 36])


# -- the number of workers: judged with the fingerprint, before anything is restored ---------------
def buffered_json_loader_of(directory, num_workers):
    data = buffered_json_loader(directory)

    def rebuilt():
        loader = data()
        return torch.utils.data.DataLoader(loader.dataset, batch_size=2, num_workers=num_workers)

    return rebuilt


@pytest.mark.parametrize("saved, now", [(2, 0), (0, 2)])
def test_a_checkpoint_holding_the_buffer_refuses_another_num_workers_at_its_fingerprint(tmp_path, saved, now):
    dropout_estimator().fit(buffered_json_loader_of(tmp_path, saved)(), batches=3,
                            event_handlers=[CheckpointHandler(tmp_path / "ckpt", batch_period=1, epoch_period=None)])
    snapshot = torch.load(sorted((tmp_path / "ckpt").glob("*.pt"))[-1], weights_only=True)
    fingerprint = snapshot["ranks"][0]["fingerprint"]
    assert fingerprint["buffer_workers"] == saved and "num_workers" not in snapshot["ranks"][0]["data"]
    stream = open_stream(buffered_json_loader_of(tmp_path, now)(), 0)
    refusal = rf"ran in {saved} DataLoader worker\(s\) and this DataLoader has num_workers={now}.*" \
              rf"Resume with num_workers={saved}"
    with pytest.raises(ValueError, match=refusal):  # the stream's one judge, asked before load_state_dict
        stream.check_fingerprint(fingerprint, "the checkpoint")
    open_stream(buffered_json_loader_of(tmp_path, saved)(), 0).check_fingerprint(fingerprint, "the checkpoint")
    with pytest.raises(ValueError, match=refusal):
        dropout_estimator().fit(buffered_json_loader_of(tmp_path, now)(), epochs=1, event_handlers=[
            CheckpointHandler(tmp_path / "ckpt", batch_period=1, epoch_period=None, resume_from_checkpoint=True)])


def test_a_checkpoint_of_the_replay_resumes_on_any_num_workers():
    stream = open_stream(torch.utils.data.DataLoader(
        IterableDataset.from_generator(lambda: ({"i": i} for i in range(8))).shuffle(seed=1, buffer_size=4),
        batch_size=2, num_workers=2), 0)
    assert isinstance(stream, BufferedStream)
    earlier = stream.earlier.fingerprint()  # what the replay wrote: no number of workers in it
    assert "buffer_workers" not in earlier
    stream.check_fingerprint(earlier, "the checkpoint")


# -- what the buffer holds: numpy values, bytes, PIL images ------------------------------------------
def image_rows(unsaveable=False):
    """64 rows as an image dataset's generator yields them: numpy rows and scalars, bytes, a PIL
    image, nested; or a value no checkpoint can hold (a set)."""
    from PIL import Image

    for i in range(64):
        pixels = np.full((2, 2, 3), i * 3 % 256, dtype=np.uint8)
        row = {"x": np.arange(4, dtype=np.float32) * (i % 7), "n": np.int64(i), "raw": bytes([i, 255 - i]),
               "meta": {"img": Image.fromarray(pixels), "tags": [np.float32(i / 8), "t"]}}
        if unsaveable:
            row["odd"] = {i}
        yield row


def image_collate(rows):
    inputs = torch.stack([torch.from_numpy(r["x"]) + float(r["n"] % 5) + r["raw"][1] / 255.0
                          + float(np.asarray(r["meta"]["img"]).mean()) / 256.0 + float(r["meta"]["tags"][0])
                          for r in rows])
    return inputs, torch.tensor([int(r["n"]) % 3 for r in rows])


def image_loader(num_workers, unsaveable=False):
    def data():
        ds = IterableDataset.from_generator(image_rows, gen_kwargs={"unsaveable": unsaveable})
        ds = ds.shuffle(seed=1, buffer_size=16)
        return torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=image_collate, num_workers=num_workers)

    return data


def test_the_buffer_encodes_what_datasets_yields_and_gives_it_back():
    from PIL import Image

    from estimatorch.data._shuffle_buffer import decode, encode

    row = next(image_rows())
    held = encode(row)
    torch.save(held, os.devnull)  # plain values and tensors: what a checkpoint takes
    back = decode(held)
    assert back["x"].dtype == np.float32 and np.array_equal(back["x"], row["x"])
    assert type(back["n"]) is np.int64 and back["n"] == row["n"] and back["raw"] == row["raw"]
    assert isinstance(back["meta"]["img"], Image.Image) and back["meta"]["img"].tobytes() == row["meta"]["img"].tobytes()
    assert type(back["meta"]["tags"][0]) is np.float32 and back["meta"]["tags"][1] == "t"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_buffer_of_numpy_rows_bytes_and_images_resumes_bitwise(num_workers):
    data = image_loader(num_workers)
    assert isinstance(open_stream(data(), 0), BufferedStream)
    resumes_exactly(data, stops=[3, 9, 16, 20])  # no replay said


def test_a_value_no_checkpoint_can_hold_replays_the_epoch_naming_its_type():
    data = image_loader(0, unsaveable=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert_resumable(dropout_estimator, data, epochs=2, stop_at=[3, 9], quiet=True)
    said = [str(w.message) for w in caught if "shuffle buffer holds a set" in str(w.message)]
    assert said and "a resume replays its epoch" in said[0]
