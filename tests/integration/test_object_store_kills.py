"""Checkpoints on object storage, interrupted: a fit writing a checkpoint to ``s3://`` after every
batch (the real SeaweedFS server of ``tests/s3server.py``) is SIGKILLed at seeded moments (from
the start of fit, around an upload, in the middle of a multipart upload) or stopped by SIGTERM;
a fresh process resumes each time and must end bit-identical to an uninterrupted run, with the
pointer naming an object that is there, no lease object and no incomplete upload left.

The chain is the one of ``test_fault_injection.py`` (each process resumes the previous trial's
prefix, then runs the next trial and is killed), with synchronous saves and ``async_save="thread"``.
Also here: the server stopped in the middle of a run.
"""

from __future__ import annotations

import collections
import json
import os
import random
import signal
import tempfile
import uuid

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import LOCK_NAME
from estimatorch.event_handlers import BatchEnd
from tests import forked
from tests.conftest import assert_tree_equal
from tests.integration.checkpoint_worker import MAX_CHECKPOINTS, STEPS, build
from tests.s3server import BUCKET, SeaweedServer

s3fs = pytest.importorskip("s3fs")  # the dev requirements install it (the s3 extra)

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")
SEED = 20261127
#: (how, how many trials): 10 kills per chain.
TRIALS = [("timer", 3), ("upload", 3), ("multipart", 2), ("sigterm", 2)]


def _run(options, *args, expect_kill):
    env = dict(os.environ, STORAGE_OPTIONS=json.dumps(options))
    proc = forked.run(WORKER, args, env=env, timeout=300)  # a fresh process, without a fresh interpreter's imports
    want = {False: 0, True: -signal.SIGKILL, "sigterm": 128 + signal.SIGTERM}[expect_kill]  # fit exits 143
    assert proc.returncode == want, f"exit {proc.returncode}, wanted {want}\n{proc.stderr[-3000:]}"
    return proc


def _trials(reference_seconds):
    rng = random.Random(SEED)
    ranges = {"upload": (1, 2 * STEPS), "multipart": (2, STEPS), "sigterm": (1, STEPS - 1)}
    trials = []
    for how, count in TRIALS:
        for _ in range(count):
            timer = how == "timer"
            trials.append((how, f"{rng.uniform(0.0, 1.1 * reference_seconds):.4f}" if timer
                           else str(rng.randint(*ranges[how]))))
    rng.shuffle(trials)
    return trials


def _listing(fs, url):
    try:
        return sorted(os.path.basename(p) for p in fs.ls(url, detail=False, refresh=True))
    except FileNotFoundError:
        return []


def _uploads(fs, url):
    prefix = url.split("/", 3)[3] + "/"
    return fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=prefix).get("Uploads", [])


def _newest_complete(url):
    for _, _, path in reversed(checkpoint.list_checkpoints(url, "model")):
        try:
            return checkpoint.load(path)["ranks"][0]["position"]["step"]
        except checkpoint.CheckpointError:
            continue
    return 0


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_sigkill_and_sigterm_during_uploads_then_resume_bit_identically(s3_server, tmp_path, async_save):
    options = s3_server.storage_options
    checkpoint.configure_store(f"s3://{BUCKET}", options)
    fs = s3fs.S3FileSystem(skip_instance_cache=True, **options)
    # the writer thread: the upload kills patch the upload call of the training process, which the
    # writer process's uploads do not go through (test_object_store.py fits to S3 with that process)
    mode = ["--async", "thread"] if async_save else []
    out = tmp_path / "reference.pt"
    _run(options, "reference", "--out", out, *mode, expect_kill=False)
    reference = torch.load(out, weights_only=True)
    trials = _trials(reference["seconds"])
    run = f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"
    outcomes: collections.Counter = collections.Counter()
    previous = None
    for i, (how, at) in enumerate(trials + [(None, None)]):
        args = []
        if previous is not None:
            url, expected_step = previous
            args += ["--resume", url, "--out", tmp_path / f"resumed{i - 1}.pt"]
        if how is not None:
            args += ["--kill", f"{run}/trial{i}", "--how", how, "--at", at]
        _run(options, "chain", *args, *mode, expect_kill="sigterm" if how == "sigterm" else how is not None)
        if previous is not None:
            resumed = torch.load(tmp_path / f"resumed{i - 1}.pt", weights_only=True)
            where = f"trial {i - 1} ({trials[i - 1]})"
            if expected_step < STEPS:
                assert resumed["start"] == expected_step, where
                assert resumed["losses"] == reference["losses"][expected_step:], where
            for key in ("model", "optimizer"):
                assert_tree_equal(resumed[key], reference[key], f"{where} {key}")
            left = _listing(fs, url)
            assert LOCK_NAME not in left and not _uploads(fs, url), (where, left)
            assert len(checkpoint.list_checkpoints(url, "model")) == MAX_CHECKPOINTS, (where, left)
            assert checkpoint.read_latest(url, "model") in left, (where, left)
        if how is not None:
            url = f"{run}/trial{i}"
            left = _listing(fs, url)
            pointer = checkpoint.read_latest(url, "model")
            assert pointer is None or pointer in left, (how, at, pointer, left)
            if how == "multipart":
                assert _uploads(fs, url), "the killed multipart upload is left incomplete"
            outcomes[f"{how}: {'an incomplete upload' if _uploads(fs, url) else 'none incomplete'}"] += 1
            previous = (url, _newest_complete(url))
    print(f"\n{'async_save' if async_save else 'synchronous'}: {len(trials)} kills, seed {SEED}: {dict(outcomes)}")


class StopServerAt(BatchEnd):
    """Stops the S3 server at the end of step ``at`` (the save of that step then fails)."""

    def __init__(self, server, at):
        self.server, self.at, self.seen = server, at, 0

    def batch_end(self, estimator, **kwargs):
        self.seen += 1
        if self.seen == self.at:
            if getattr(estimator, "handlers", None):
                for handler in estimator.handlers:  # an async write of the previous step lands first
                    if getattr(handler, "_writer", None) is not None:
                        handler._writer.join()
            self.server.stop()


@pytest.mark.slow
def test_the_server_stopped_mid_run_fails_naming_the_url_and_a_rerun_after_restart_resumes(tmp_path):
    reference_est, loader = build()
    reference_est.fit(loader, epochs=3, event_handlers=[CheckpointHandler(tmp_path / "ref", batch_period=1,
                                                                          epoch_period=None)])
    with tempfile.TemporaryDirectory() as data:
        server = SeaweedServer(data)
        server.start()
        try:
            url = f"s3://{BUCKET}/stopped"
            est, loader = build()
            # botocore's own retries of a refused connection take seconds each: one attempt here
            options = dict(server.storage_options, config_kwargs={"retries": {"max_attempts": 1}})
            handler = CheckpointHandler(url, storage_options=options, batch_period=1,
                                        epoch_period=None, max_checkpoints=None)
            with pytest.raises(OSError) as info:
                est.fit(loader, epochs=3, event_handlers=[handler, StopServerAt(server, 3)])
            assert url in str(info.value), str(info.value)
            server.start()  # the same ports and data
            fs = s3fs.S3FileSystem(skip_instance_cache=True, **server.storage_options)
            names = _listing(fs, url)
            assert checkpoint.read_latest(url, "model") == checkpoint.checkpoint_name("model", 0, 2)
            assert [n for n in names if n.endswith(".pt")] == [checkpoint.checkpoint_name("model", 0, s)
                                                                for s in (1, 2)]
            est, loader = build()
            est.fit(loader, epochs=3, event_handlers=[CheckpointHandler(
                url, storage_options=server.storage_options, batch_period=1, epoch_period=None,
                resume_from_checkpoint=True)])
            assert_tree_equal(est.net.state_dict(), reference_est.net.state_dict())
        finally:
            server.stop()
