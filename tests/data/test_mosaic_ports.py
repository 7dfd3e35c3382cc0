"""MosaicML streaming's own resume cases (tests/test_streaming.py's mid-epoch resumption over mixed
Streams with ``proportion`` / ``repeat`` / ``choose``, tests/test_shuffle.py's shuffle algorithms)
ported onto ``fit``: an uninterrupted fit against one SIGKILLed right after the checkpoint of a step
in the middle of an epoch, at an epoch's last batch and after the first epoch, and run again
(tests/data/sigkill.py), every batch, loss and final parameter bit for bit. MDS shards written by
the test. streaming 0.13 has py1e (its default), py1br, py1s, py2s and naive (no py1b).

Each case runs at one worker count, the cases together covering workers 0 and 2 for the mixing
and for the shuffles (a case is ~5 processes of a streaming fit: too slow to run all at both)."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.data.sigkill import assert_resumed_bitwise, sigkill_resume
from tests.data.test_mosaic_streaming import Augmented, write_mds

from streaming.base import Stream, StreamingDataLoader  # noqa: E402  (imported by test_mosaic_streaming)
from streaming.base.util import clean_stale_shared_memory  # noqa: E402

# mixing: two streams of 20 and 12 samples; shuffles: one stream of 30 (batches of 4)
CASES = [("proportion", "py1e", 0), ("proportion", "py1e", 2), ("repeat", "py1br", 2), ("choose", "py1s", 0),
         ("single", "py1br", 2), ("single", "py1s", 2), ("single", "py2s", 0), ("single", "naive", 2)]


def write(data_dir):
    """The MDS shards, written once per test (a marker file says they are complete)."""
    done = os.path.join(data_dir, "written")
    if not os.path.exists(done):
        write_mds(os.path.join(data_dir, "a"), n=20)
        write_mds(os.path.join(data_dir, "b"), n=12)
        write_mds(os.path.join(data_dir, "c"), n=30)
        open(done, "w").close()


def loader(case, num_workers, data_dir):
    """The fit's train_data (built in each process of a run, with a local cache of its own)."""
    mixing, algo = case
    write(data_dir)
    clean_stale_shared_memory()  # what a SIGKILLed process of the run left behind
    local = tempfile.mkdtemp(prefix="mds-port-")
    kwargs = dict(shuffle=True, shuffle_seed=7, shuffle_algo=algo, shuffle_block_size=8, batch_size=4)
    if mixing == "single":
        dataset = Augmented(remote=os.path.join(data_dir, "c"), local=local, **kwargs)
    else:
        weights = {"proportion": [{"proportion": 0.25}, {"proportion": 0.75}],
                   "repeat": [{"repeat": 0.5}, {"repeat": 2}],
                   "choose": [{"choose": 14}, {"choose": 10}]}[mixing]
        streams = [Stream(remote=os.path.join(data_dir, name), local=os.path.join(local, name), **w)
                   for name, w in zip("ab", weights)]
        dataset = Augmented(streams=streams, epoch_size=28 if mixing == "proportion" else None, **kwargs)
    return StreamingDataLoader(dataset, batch_size=4, num_workers=num_workers)


@pytest.mark.slow
@pytest.mark.parametrize("mixing,algo,num_workers", CASES)
def test_an_upstream_resume_case_resumes_bitwise_after_a_sigkill(tmp_path, mixing, algo, num_workers):
    write(str(tmp_path / "data"))  # no dataset in this process: streaming's shared memory is per data
    per_epoch = []

    def stops(steps):  # the middle of the first epoch, its last batch, the middle of the second
        per_epoch.append(steps // 2)
        return [2, steps // 2, steps // 2 + 2]

    runs = sigkill_resume(f"{__name__}:loader", (mixing, algo), num_workers, tmp_path, stops=stops, beside=False)
    assert per_epoch[0] >= 4, per_epoch
    assert_resumed_bitwise(runs, steps=2 * per_epoch[0])
    # exact: positioned from its own state (streaming's numpy warnings aside, which differ per process)
    assert not [w for w in runs["resumed"]["warnings"] if "replay" in w or "cannot be positioned" in w]
