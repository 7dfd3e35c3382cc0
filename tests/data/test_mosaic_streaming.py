"""MosaicML streaming: a StreamingDataset over MDS shards written by the test, shuffled, with a
random __getitem__, through a DataLoader and a StreamingDataLoader, resumes bit for bit; on one
process and on 2 gloo ranks."""

from __future__ import annotations

import itertools
import os
import tempfile
import warnings

import importlib.util
import sys

import pytest
import torch


def _import_streaming_without_torchvision() -> None:
    """streaming's package ``__init__`` imports its torchvision datasets (``streaming.vision``),
    and torchvision's PyPI wheel needs a CUDA build of torch: the dev requirements pin the CPU
    one and leave torchvision out. Where it cannot be imported, the package is registered
    without running that ``__init__``; ``streaming.base`` (StreamingDataset, StreamingDataLoader,
    MDSWriter: all that is used here) is then imported as it is, unchanged."""
    if "streaming" in sys.modules or importlib.util.find_spec("torchvision") is not None:
        return
    spec = importlib.util.find_spec("streaming")
    assert spec is not None and spec.submodule_search_locations, "mosaicml-streaming is not installed"
    package = importlib.util.module_from_spec(spec)
    sys.modules["streaming"] = package


_import_streaming_without_torchvision()

from streaming.base import MDSWriter, StreamingDataLoader, StreamingDataset  # noqa: E402
from streaming.base.util import clean_stale_shared_memory  # noqa: E402

from estimatorch import distributed  # noqa: E402
from estimatorch.testing import assert_resumable  # noqa: E402
from tests.conftest import losses_recorder  # noqa: E402
from tests.data.test_iterable_streams import dropout_estimator  # noqa: E402

N = 30  # samples: batches of 4, 8 per epoch (the last one partial)
_LOCALS = itertools.count()


class Augmented(StreamingDataset):
    """Sample i: i in every feature plus noise from torch's generator (random augmentation)."""

    def __getitem__(self, idx):
        i = int(super().__getitem__(idx)["i"])
        return torch.full((4,), float(i)) + torch.rand(4), torch.tensor(i % 3)


def write_mds(directory, n=N):
    with MDSWriter(out=str(directory), columns={"i": "int"}, size_limit=120) as out:
        for i in range(n):
            out.write({"i": i})
    return str(directory)


def streamed(remote, loader=torch.utils.data.DataLoader, batch_size=4, num_workers=0, local=None):
    """A fresh StreamingDataset each call (a local cache of its own: two live datasets may not
    share one), read from ``remote``, the directory the shards were written to."""
    local = local or tempfile.mkdtemp(prefix=f"mds-local-{next(_LOCALS)}-")
    dataset = Augmented(remote=remote, local=local, shuffle=True, shuffle_seed=7, batch_size=batch_size)
    return loader(dataset, batch_size=batch_size, num_workers=num_workers)


@pytest.fixture(autouse=True)
def _clean_shared_memory():
    clean_stale_shared_memory()
    yield
    clean_stale_shared_memory()


def samples_of(data, epochs=1):
    seen = []
    for epoch in range(epochs):
        for x, _ in data:
            seen += x[:, 0].floor().long().tolist()
    return seen


@pytest.mark.parametrize("loader", [torch.utils.data.DataLoader, StreamingDataLoader])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_streaming_dataset_resumes_exactly(tmp_path, loader, num_workers):
    remote = write_mds(tmp_path / "mds")
    got, rec = losses_recorder()
    labels = []

    class Inputs(type(rec)):
        def batch_end(self, estimator, *, batch, **kwargs):
            labels.extend(batch[0][:, 0].floor().long().tolist())

    dropout_estimator().fit(streamed(remote, loader, num_workers=num_workers), epochs=2, event_handlers=[Inputs()])
    first, second = labels[:N], labels[N:]
    assert sorted(first) == sorted(second) == list(range(N)) and first != second  # shuffled, per epoch
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*(replay|cannot be positioned).*")
        assert_resumable(dropout_estimator, lambda: streamed(remote, loader, num_workers=num_workers), epochs=2,
                         stop_at=[3, 8, 11], quiet=True)


def test_the_loader_and_dataset_batch_sizes_must_agree_with_workers(tmp_path):
    remote = write_mds(tmp_path / "mds")
    data = streamed(remote, num_workers=2)
    data = torch.utils.data.DataLoader(data.dataset, batch_size=3, num_workers=2)
    with pytest.raises(ValueError, match="StreamingDataset has batch_size=4 and its DataLoader batch_size=3"):
        dropout_estimator().fit(data, epochs=1)


# -- 2 gloo ranks ------------------------------------------------------------------------------------
def _ddp(directory, remote, stops):
    from estimatorch import CheckpointHandler
    from estimatorch.event_handlers import BatchEnd

    os.environ["LOCAL_WORLD_SIZE"] = "2"  # what torchrun sets: streaming reads its world from it
    torch.set_num_threads(1)

    class Crash(BatchEnd):
        def __init__(self, stop):
            self.stop, self.seen = stop, 0

        def batch_end(self, estimator, **kwargs):
            self.seen += 1
            if self.seen == self.stop:
                estimator.at_boundary(self.crash)

        def crash(self):
            raise RuntimeError("crash")

    def fit(handlers):
        losses, rec = losses_recorder()
        est = dropout_estimator()
        # a local cache per call, the same on both ranks (the ranks of a node share it)
        # num_workers=0: with DataLoader workers on 2 ranks, streaming itself takes 30-60 s to its
        # first batch of every epoch on a 2-core machine (the ranks' workers waiting on each other)
        data = streamed(remote, num_workers=0, local=os.path.join(directory, f"local{next(_LOCALS)}"))
        try:
            est.fit(data, epochs=2, event_handlers=[rec, *handlers])
        except RuntimeError as err:
            if str(err) != "crash":
                raise
        finally:
            del data
        return {"losses": losses, "params": [p.detach().clone() for p in est.net.parameters()]}

    full = fit([])
    out = []
    for stop in stops:
        ckpt = os.path.join(directory, f"ckpt{stop}")
        fit([CheckpointHandler(ckpt, batch_period=stop, epoch_period=None), Crash(stop)])
        out.append((stop, full, fit([CheckpointHandler(ckpt, batch_period=stop, epoch_period=None,
                                                       resume_from_checkpoint=True)])))
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_resume_exactly(tmp_path):
    remote = write_mds(tmp_path / "mds")
    ranks = distributed.spawn(_ddp, 2, str(tmp_path), remote, [2, 4, 5], backend="gloo")
    for results in ranks:
        for stop, full, resumed in results:
            assert len(full["losses"]) == 8, stop  # 15 samples per rank: 4 batches per epoch
            assert resumed["losses"] == full["losses"][stop:], stop
            assert all(torch.equal(a, b) for a, b in zip(full["params"], resumed["params"])), stop
    assert ranks[0][0][1]["losses"] != ranks[1][0][1]["losses"]


def test_another_world_size_is_refused_at_fit_start(tmp_path):
    from estimatorch import CheckpointHandler

    data = streamed(write_mds(tmp_path / "mds"))
    with pytest.raises(ValueError, match="elastic=True lays the samples .* got train_data that is a MosaicML StreamingDataset"):
        dropout_estimator().fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path / "ckpt", elastic=True)])
