"""A SIGTERM that lands while the next batch is being made (in a ``collate_fn``, a
``__getitem__``/``__iter__``, a ``datasets`` ``.map()``, or sent by a DataLoader worker) checkpoints
the boundary of the last trained step: the rerun that resumes from it trains the uninterrupted
run's batches and ends with its parameters, bit for bit, for every stream kind."""

from __future__ import annotations

import os
import signal

import pytest
import torch

from estimatorch import CheckpointHandler
from tests.conftest import assert_tree_equal, losses_recorder
from tests.estimator.stopping.test_interrupts import default_signals  # noqa: F401  (a fixture)
from tests.data.test_iterable_streams import StatefulRange, dropout_estimator

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


class Trigger:
    """Sends SIGTERM to the training process on its ``at``-th call (counted in the process that
    calls it: in a DataLoader worker, that worker's calls), then passes its argument through."""

    def __init__(self, at, fn=None):
        self.at, self.fn, self.calls = at, fn, 0

    def __call__(self, *args):
        self.calls += 1
        if self.calls == self.at:
            info = torch.utils.data.get_worker_info()
            os.kill(os.getpid() if info is None else os.getppid(), signal.SIGTERM)
        if self.fn is not None:
            return self.fn(*args)
        return args[0] if len(args) == 1 else args


def signalled_resume(tmp_path, make_data, epochs=2):
    """``make_data(trigger)`` builds the data with ``trigger`` (a :class:`Trigger`, or None for
    no signal) in place. An uninterrupted fit, one stopped by the trigger's SIGTERM (saving its
    boundary), and the rerun resuming from that checkpoint: the two halves are the whole."""
    def run(data, model_dir):
        est = dropout_estimator()
        losses, rec = losses_recorder()
        handlers = [rec] if model_dir is None else [rec, CheckpointHandler(model_dir, resume_from_checkpoint=True)]
        try:
            est.fit(data, epochs=epochs, event_handlers=handlers)
        except SystemExit as stop:
            assert stop.code == 128 + signal.SIGTERM
            assert est.interruption == "SIGTERM"
        return est, losses

    reference, full = run(make_data(None), None)
    _, first = run(make_data("signal"), tmp_path)
    assert 0 < len(first) < len(full), "the signal must stop the fit mid-run"
    resumed, rest = run(make_data(None), tmp_path)
    assert first + rest == full, f"stopped after {len(first)} steps: the resumed steps differ"
    assert_tree_equal(resumed.net.state_dict(), reference.net.state_dict())
    assert_tree_equal(resumed.optimizer.state_dict(), reference.optimizer.state_dict())


def trigger(kind, at, num_workers=0):
    """A Trigger at call ``at`` (a DataLoader worker counts its own calls, in a fresh copy each
    epoch: there the first epoch's ``at // 3``-th), or None for the run without a signal."""
    if kind != "signal":
        return None
    return Trigger(at if not num_workers else max(at // 3, 2))


# -- a stateful IterableDataset (the protocol torchdata's StatefulDataLoader follows) --------------
class SignallingRange(StatefulRange):
    """StatefulRange whose ``__iter__`` calls ``hook`` on every sample (before yielding it)."""

    def __init__(self, hook, **kwargs):
        super().__init__(**kwargs)
        self.hook = hook

    def __iter__(self):
        for sample in super().__iter__():
            if self.hook is not None:
                self.hook()
            yield sample


@pytest.mark.parametrize("where", ["collate_fn", "__iter__"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_iterable_dataset(tmp_path, default_signals, where, num_workers):  # noqa: F811
    def data(kind):
        hook = trigger(kind, 7 if where == "collate_fn" else 26, num_workers)
        dataset = SignallingRange(hook if where == "__iter__" else None, n=32, noise=True)
        collate = Trigger(0, torch.utils.data.default_collate) if hook is None or where != "collate_fn" \
            else Trigger(hook.at, torch.utils.data.default_collate)
        return torch.utils.data.DataLoader(dataset, batch_size=4, collate_fn=collate, num_workers=num_workers)

    signalled_resume(tmp_path, data)


# -- a map-style dataset ------------------------------------------------------------------------------
class Noisy(torch.utils.data.Dataset):
    def __init__(self, hook):
        self.hook = hook

    def __len__(self):
        return 32

    def __getitem__(self, i):
        if self.hook is not None:
            self.hook()
        return torch.full((4,), float(i)) + torch.rand(4), torch.tensor(i % 3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_map_style_dataset(tmp_path, default_signals, num_workers):  # noqa: F811
    def data(kind):
        return torch.utils.data.DataLoader(Noisy(trigger(kind, 26, num_workers)), batch_size=4, shuffle=True,
                                           num_workers=num_workers)

    signalled_resume(tmp_path, data)


# -- Hugging Face datasets ---------------------------------------------------------------------------
def hf_iterable(tmp_path, hook, shuffle):
    from datasets import load_dataset

    from tests.data.test_hf_datasets import augment, write_shards

    def mapped(example):
        if hook is not None:
            hook()
        return augment(example)

    ds = load_dataset("json", data_files=write_shards(tmp_path, "json"), split="train", streaming=True)
    if shuffle:
        ds = ds.shuffle(seed=1, buffer_size=6)
    return ds.map(mapped, remove_columns=["i"]).with_format("torch")


# with a shuffle buffer (an epoch replayed from its start) workers 0: its draws are in this process
@pytest.mark.parametrize("where", ["collate_fn", ".map"])
@pytest.mark.parametrize("shuffle,num_workers", [(False, 0), (False, 2), (True, 0)])
def test_a_datasets_iterable_dataset(tmp_path, default_signals, where, shuffle, num_workers):  # noqa: F811
    def data(kind):
        hook = trigger(kind, 6 if where == "collate_fn" else 22, num_workers)
        ds = hf_iterable(tmp_path / "shards", hook if where == ".map" else None, shuffle)
        collate = torch.utils.data.default_collate
        if hook is not None and where == "collate_fn":
            collate = Trigger(hook.at, collate)
        return torch.utils.data.DataLoader(ds, batch_size=4, collate_fn=collate, num_workers=num_workers)

    (tmp_path / "shards").mkdir(exist_ok=True)
    signalled_resume(tmp_path / "ckpt", data)


# -- MosaicML streaming ------------------------------------------------------------------------------
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_streaming_dataset(tmp_path, default_signals, num_workers):  # noqa: F811
    from tests.data.test_mosaic_streaming import Augmented, clean_stale_shared_memory, write_mds

    clean_stale_shared_memory()

    class Signalling(Augmented):
        hook = None

        def __getitem__(self, idx):
            if self.hook is not None:
                self.hook()
            return super().__getitem__(idx)

    remote = write_mds(tmp_path / "remote")
    locals_ = iter(range(10))

    def data(kind):
        dataset = Signalling(remote=remote, local=str(tmp_path / f"local{next(locals_)}"), shuffle=True,
                             shuffle_seed=7, batch_size=4)
        dataset.hook = trigger(kind, 14, num_workers)
        return torch.utils.data.DataLoader(dataset, batch_size=4, num_workers=num_workers)

    signalled_resume(tmp_path / "ckpt", data)
