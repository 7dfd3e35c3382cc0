"""One process of the checkpoint-store integration tests (run as a script).

The run: an MLP (32 -> 512 -> 4, about 220 KB of parameters and AdamW state per checkpoint) with
dropout, AdamW and a step LR scheduler, on a shuffling DataLoader: 3 epochs of 6 batches, a
checkpoint after every batch, ``max_checkpoints=2``.

    python checkpoint_worker.py reference --out OUT
    python checkpoint_worker.py chain [--resume DIR --out OUT] [--kill DIR --how HOW --at X] [--async]
        resume DIR (if given) in this fresh process and save the result to OUT; then fit into the
        kill DIR and SIGKILL itself: HOW is "timer" (after X seconds of fit), "bytes" (once X
        bytes of checkpoints were written: inside a write), or one of "replace-checkpoint",
        "replace-pointer", "remove", "fsync" (before the X-th such call); for an object store
        (a URL DIR, its storage options as JSON in $STORAGE_OPTIONS), "upload", "multipart" or
        "sigterm" (see _arm_object_store). With --async the
        checkpoints are written in the background (``async_save=True``, the writer process, whose
        own writes the kills inside the write sequence patched here do not reach; ``--async
        thread``: the writer thread, where they land).
    python checkpoint_worker.py race --dir DIR --out OUT     (says "ready", fits at the time read from stdin)
    python checkpoint_worker.py fill --dir DIR --out OUT              (until the disk is full)
    python checkpoint_worker.py readonly --dir DIR --out OUT          (the mount turns read-only)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint
from estimatorch.checkpoint import _files, _store
from estimatorch.event_handlers import BatchBegin, BatchEnd, TrainBegin

SAMPLES, BATCH, EPOCHS, MAX_CHECKPOINTS = 48, 8, 3, 2
STEPS = EPOCHS * SAMPLES // BATCH


def build():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(32, 512), nn.ReLU(), nn.Dropout(0.2), nn.Linear(512, 4))
    optimizer = torch.optim.AdamW(net.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=optimizer, lr_scheduler=scheduler, seed=9, device="cpu")
    g = torch.Generator().manual_seed(3)
    data = torch.utils.data.TensorDataset(torch.randn(SAMPLES, 32, generator=g), torch.randint(0, 4, (SAMPLES,), generator=g))
    return est, torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=True)


class Recorder(BatchBegin, BatchEnd):
    """Each step's loss, and the step the fit started from (its resume point)."""

    priority = float("inf")

    def __init__(self):
        self.losses, self.start = [], None

    def batch_begin(self, estimator, **kwargs):
        if self.start is None:
            self.start = estimator.position.step

    def batch_end(self, estimator, *, loss, **kwargs):
        self.losses.append(float(loss.detach()).hex())


ASYNC_SAVE = False  # --async


def fit(directory, resume, extra=(), max_checkpoints=MAX_CHECKPOINTS, wait_for_start=False):
    """Fit the run; with ``wait_for_start``, once everything is built, say "ready" on stdout and
    start at the wall-clock time read from stdin."""
    est, loader = build()
    recorder = Recorder()
    options = json.loads(os.environ["STORAGE_OPTIONS"]) if checkpoint.is_url(directory) else None
    handler = CheckpointHandler(directory, batch_period=1, epoch_period=None, max_checkpoints=max_checkpoints,
                                resume_from_checkpoint=resume, async_save=ASYNC_SAVE, storage_options=options)
    if wait_for_start:
        print("ready", flush=True)
        time.sleep(max(float(sys.stdin.readline()) - time.time(), 0.0))
    started = time.monotonic()
    est.fit(loader, epochs=EPOCHS, event_handlers=[handler, recorder, *extra])
    return {"losses": recorder.losses, "start": recorder.start, "model": est.net.state_dict(),
            "optimizer": est.optimizer.state_dict(), "seconds": time.monotonic() - started}


def _die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


class TimerFromStart(TrainBegin):
    """Start the kill timer when the fit starts (not counting python's start-up)."""

    priority = -float("inf")

    def __init__(self, seconds):
        self.seconds = seconds

    def train_begin(self, estimator, **kwargs):
        threading.Timer(self.seconds, _die).start()


def _kill_on_call(owner, attr, nth, matches=lambda *a: True):
    real = getattr(owner, attr)
    calls = [0]

    def wrapper(*args, **kwargs):
        if matches(*args):
            calls[0] += 1
            if calls[0] == nth:
                _die()
        return real(*args, **kwargs)

    setattr(owner, attr, wrapper)


def _arm(how, at):
    """Arrange this process's SIGKILL; returns handlers to add to the fit."""
    if how == "timer":
        return [TimerFromStart(float(at))]
    at = int(at)
    if how == "bytes":
        written = [0]
        real_write = _files._Sink.write

        def write(self, data):
            written[0] += len(data)
            if written[0] >= at:
                _die()
            return real_write(self, data)

        _files._Sink.write = write
    elif how == "replace-checkpoint":
        _kill_on_call(os, "replace", at, lambda src, dst: str(dst).endswith(".pt"))
    elif how == "replace-pointer":
        _kill_on_call(os, "replace", at, lambda src, dst: str(dst).endswith("-latest"))
    elif how in ("remove", "fsync"):
        _kill_on_call(os, how, at)
    elif how in ("upload", "multipart", "sigterm"):
        return _arm_object_store(how, at)
    else:
        raise SystemExit(f"unknown --how {how!r}")
    return []


def _arm_object_store(how, at):
    """Kills of a fit to an object store (``STORAGE_OPTIONS`` in the environment): "upload" at a
    seeded moment (0-20 ms) from the start of the ``at``-th upload (before, during or after its
    request); "multipart" as s3fs's multipart upload of the ``at``-th checkpoint is under way
    (one part sent, never completed); "sigterm" at the end of step ``at`` (fit saves that
    boundary and ends; the process is killed after)."""
    at = int(at)
    if how == "sigterm":
        class Term(BatchEnd):
            seen = 0

            def batch_end(self, estimator, **kwargs):
                self.seen += 1
                if self.seen == at:
                    os.kill(os.getpid(), signal.SIGTERM)

        return [Term()]
    real, calls = _store.write_bytes, [0]

    def write_bytes(url, data):
        calls[0] += how == "upload" or url.endswith(".pt")  # "multipart": the at-th checkpoint
        if calls[0] == at and how == "upload":
            threading.Timer(random.Random(at).uniform(0.0, 0.02), _die).start()
        elif calls[0] == at and how == "multipart":
            fs, key = _store.filesystem(url)
            bucket, name, _ = fs.split_path(key)
            upload = fs.call_s3("create_multipart_upload", Bucket=bucket, Key=name)
            fs.call_s3("upload_part", Bucket=bucket, Key=name, UploadId=upload["UploadId"], PartNumber=1,
                       Body=bytes(data[:len(data) // 2]))  # (data: the serialized buffer, a memoryview)
            _die()
        return real(url, data)

    _store.write_bytes = write_bytes
    return []


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["reference", "chain", "race", "fill", "readonly"])
    parser.add_argument("--resume")
    parser.add_argument("--out")
    parser.add_argument("--kill")
    parser.add_argument("--how")
    parser.add_argument("--at")
    parser.add_argument("--dir")
    parser.add_argument("--async", dest="async_save", nargs="?", const=True, default=False, choices=[True, "thread"],
                        type=lambda value: value if value == "thread" else True)
    args = parser.parse_args()
    global ASYNC_SAVE
    ASYNC_SAVE = args.async_save
    torch.set_num_threads(1)
    if args.mode == "reference":
        torch.save(fit(args.out + ".dir", resume=False), args.out)
    elif args.mode == "chain":
        if args.resume:
            result = fit(args.resume, resume=True)
            torch.save(result, args.out)
        if args.kill:
            fit(args.kill, resume=False, extra=_arm(args.how, args.at))
            _die()  # the kill came after the end of the fit: die all the same
    elif args.mode == "race":
        class Slow(BatchEnd):  # the fit lasts well beyond any start-up jitter (CUDA initialisation...)
            def batch_end(self, estimator, **kwargs):
                time.sleep(0.1)

        try:
            result = {"outcome": "trained", **fit(args.dir, resume=False, extra=[Slow()], wait_for_start=True)}
        except Exception as err:  # noqa: BLE001 - reported to the test
            result = {"outcome": type(err).__name__, "message": str(err)}
        torch.save(result, args.out)
    elif args.mode == "fill":
        report = {}
        try:
            fit(args.dir, resume=False, max_checkpoints=None)
            report["error"] = None
        except OSError as err:
            report.update(error=type(err).__name__, errno=err.errno, message=str(err))
        report["files"] = sorted(os.listdir(args.dir))
        report["latest"] = _files.read_latest(args.dir, "model")
        report["loadable"] = {}
        for _, _, path in checkpoint.list_checkpoints(args.dir, "model"):
            try:
                report["loadable"][os.path.basename(path)] = checkpoint.load(path)["ranks"][0]["position"]["step"]
            except checkpoint.CheckpointError as err:
                report["loadable"][os.path.basename(path)] = str(err)
        with open(args.out, "w") as f:
            json.dump(report, f)
    elif args.mode == "readonly":
        class TurnReadOnly(BatchEnd):
            seen = 0

            def batch_end(self, estimator, **kwargs):
                self.seen += 1
                if self.seen == 2:  # during the second step: its checkpoint is the first to fail
                    for handler in estimator.handlers:  # (with --async: once the first one is written)
                        if getattr(handler, "_writer", None) is not None:
                            handler._writer.join()
                    # a read-only bind mount over it (a remount of the tmpfs itself is refused while
                    # the lock file is open for writing): from here on, paths in it are read-only
                    subprocess.run(["mount", "--bind", args.dir, args.dir], check=True)
                    subprocess.run(["mount", "-o", "remount,ro,bind", args.dir], check=True)

        report = {}
        try:
            fit(args.dir, resume=False, extra=[TurnReadOnly()], max_checkpoints=None)
        except OSError as err:
            report.update(error=type(err).__name__, errno=err.errno, message=str(err))
        report["files"] = sorted(os.listdir(args.dir))
        report["latest"] = _files.read_latest(args.dir, "model")
        try:
            fit(os.path.join(args.dir, "new"), resume=False)
        except ValueError as err:
            report["at_start"] = str(err)
        with open(args.out, "w") as f:
            json.dump(report, f)
    sys.stdout.flush()
    sys.stderr.flush()


if __name__ == "__main__":
    main()
