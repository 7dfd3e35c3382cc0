"""Two gloo ranks agree on stops and signals without a blocking collective per step.

With ``agree_every=1`` (an exchange after every step): a stop asked on every rank at step k stops
both at k, one asked on some ranks (or a signal reaching one rank) at k + 1; SIGTERM on one rank
checkpoints the agreed step and both resume bit-identically; a checkpoint taken while the
agreement is in flight resumes to the same stop. With ``agree_every=3`` (exchanges after steps 3,
6, 9): a request waits for the next exchange and stops both one step after it, the plan's end
stops at once, and a checkpoint holding a request in the outbox or in flight resumes to the same
stop. Gloo's default is every 16 steps. (The per-step collective count is in
tests/test_sync_count.py.)"""

from __future__ import annotations

import logging
import os
import shutil
import signal

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, StoppingHandler, checkpoint, distributed
from estimatorch.event_handlers import BatchEnd
from tests.conftest import Count, assert_tree_equal

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

PER_EPOCH = 5  # 43 samples, batch 5, 2 ranks: 22 samples per rank


class AskStop(BatchEnd):
    """Returns True during step ``steps[rank]`` (1-based) on that rank."""

    def __init__(self, steps):
        self.steps = steps

    def batch_end(self, est, **kw):
        return est.position.step + 1 == self.steps.get(distributed.get_rank())


class SignalOn(BatchEnd):
    """Sends ``signame`` to this process during step ``steps[rank]`` on that rank."""

    def __init__(self, signame, steps):
        self.signame, self.steps = signame, steps

    def batch_end(self, est, **kw):
        if est.position.step + 1 == self.steps.get(distributed.get_rank()):
            signal.raise_signal(getattr(signal, self.signame))


class _LogLines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def _estimator():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=11)
    g = torch.Generator().manual_seed(5)
    dataset = torch.utils.data.TensorDataset(torch.randn(43, 4, generator=g), torch.arange(43) % 3)
    return est, torch.utils.data.DataLoader(dataset, batch_size=5, shuffle=True)


def _fit(kind, arg, ckpt_dir=None, resume=False, period=1, every=1):
    signal.signal(signal.SIGINT, signal.default_int_handler)  # spawned from a background job: SIGINT ignored
    est, loader = _estimator()
    est.agree_every = every
    lines = _LogLines()
    est.logger.addHandler(lines)
    count = Count()
    handlers = [count]
    if kind == "ask":
        handlers.append(AskStop(arg))
    elif kind == "max_batch":
        handlers.append(StoppingHandler(max_batch=arg))
    elif kind in ("SIGINT", "SIGTERM"):
        handlers.append(SignalOn(kind, arg))
    if ckpt_dir is not None:
        handlers.append(CheckpointHandler(ckpt_dir, batch_period=period, epoch_period=None, max_checkpoints=None,
                                          resume_from_checkpoint=resume))
    try:
        est.fit(loader, epochs=2, event_handlers=handlers)
        outcome = "returned"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    except SystemExit as exit:
        outcome = f"SystemExit({exit.code})"
    pos = est.position
    return {"outcome": outcome, "step": pos.step, "phase": pos.phase, "batches": count.batches, "every": every,
            "interruption": est.interruption, "log": lines.messages, "model": est.net.state_dict(), "optimizer": est.optimizer.state_dict()}


@pytest.mark.parametrize("kind, arg, step", [
    ("ask", {1: 3}, 4),  # rank-local: one step later
    ("ask", {0: 3, 1: 3}, 3),  # the same on every rank: at that step
    ("ask", {0: 3, 1: 2}, 3),  # rank 1's request of step 2 is agreed at step 3
    ("max_batch", 3, 3),  # StoppingHandler decides on counters: rank-identical
    ("ask", {0: PER_EPOCH}, PER_EPOCH),  # asked at the epoch's last step: after its end, not later
])
def test_a_stop_stops_every_rank_at_the_same_step(kind, arg, step):
    r0, r1 = distributed.spawn(_fit, 2, kind, arg, backend="gloo")
    for r in (r0, r1):  # a stop at a batch runs the epoch's end: the fit ends there
        assert (r["outcome"], r["step"], r["batches"], r["phase"]) == ("returned", step, step, "epoch_end")
    assert_tree_equal(r0["model"], r1["model"])


@pytest.mark.parametrize("signame, outcome", [("SIGINT", "KeyboardInterrupt"), ("SIGTERM", "SystemExit(143)")])
def test_a_signal_reaching_one_rank_stops_both_one_step_later(signame, outcome):
    r0, r1 = distributed.spawn(_fit, 2, signame, {1: 3}, backend="gloo")
    for r in (r0, r1):
        assert (r["outcome"], r["step"], r["interruption"]) == (outcome, 4, signame)
    ended = [line for line in r0["log"] if "interrupted after" in line]  # every rank is at train_end: reduced
    assert len(ended) == 1 and "train_loss" in ended[0] and "not reduced" not in ended[0], r0["log"]


def test_signals_reaching_the_ranks_at_different_steps_stop_both_at_the_first_agreed_one():
    r0, r1 = distributed.spawn(_fit, 2, "SIGTERM", {0: 3, 1: 6}, backend="gloo")
    assert r0["step"] == r1["step"] == 4 and r0["outcome"] == r1["outcome"] == "SystemExit(143)"


def test_sigterm_on_one_rank_checkpoints_the_agreed_step_and_both_resume_bit_identically(tmp_path):
    reference = distributed.spawn(_fit, 2, "none", None, backend="gloo")
    ckpt = tmp_path / "ckpt"
    stopped = distributed.spawn(_fit, 2, "SIGTERM", {1: 3}, str(ckpt), False, 3, backend="gloo")
    assert [r["step"] for r in stopped] == [4, 4]
    # (and the progress mark: the stopped attempt's entry, with its train_end, for the run's ledger)
    assert sorted(os.listdir(ckpt)) == [checkpoint.PROGRESS_NAME, "model-epoch0batch3.pt", "model-epoch0batch4.pt",
                                        "model-latest"]
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    shutil.copy(ckpt / "model-epoch0batch4.pt", resume_dir)  # written in train_end (every 3 batches: 3, 6...)
    resumed = distributed.spawn(_fit, 2, "none", None, str(resume_dir), True, backend="gloo")
    for want, got in zip(reference, resumed):
        assert got["outcome"] == "returned" and got["step"] == want["step"] == 2 * PER_EPOCH
        assert got["batches"] == 2 * PER_EPOCH - 4
        assert_tree_equal(got["model"], want["model"], "model")
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")


def test_a_checkpoint_taken_while_the_agreement_is_in_flight_resumes_to_the_same_stop(tmp_path):
    """Rank 1 asks to stop during step 3: both stop at step 4. The checkpoint of step 3 holds
    rank 1's request in flight, so a run resumed from it stops at step 4 as well."""
    ckpt = tmp_path / "ckpt"
    first = distributed.spawn(_fit, 2, "ask", {1: 3}, str(ckpt), backend="gloo")
    assert [r["step"] for r in first] == [4, 4]
    payload = torch.load(ckpt / "model-epoch0batch3.pt", weights_only=True)
    assert [snapshot["pending_stop"] for snapshot in payload["ranks"]] == [False, True]
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    shutil.copy(ckpt / "model-epoch0batch3.pt", resume_dir)
    resumed = distributed.spawn(_fit, 2, "none", None, str(resume_dir), True, backend="gloo")
    for want, got in zip(first, resumed):
        assert (got["step"], got["batches"], got["phase"]) == (4, 1, "epoch_end")
        assert_tree_equal(got["model"], want["model"], "model")
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")
    assert sorted(os.listdir(resume_dir))[-2:] == ["model-epoch0batch4.pt", "model-latest"]


# -- agree_every=3: exchanges after steps 3, 6 and 9 (epochs end after steps 5 and 10) ------------

@pytest.mark.parametrize("kind, arg, step", [
    ("ask", {1: 1}, 4),  # waits in the outbox for step 3's exchange, read at step 4
    ("ask", {0: 2, 1: 2}, 4),  # on every rank, but not at an exchanging step: the same
    ("ask", {0: 3, 1: 3}, 3),  # on every rank at an exchanging step: at that step
    ("ask", {1: 3}, 4),  # rank-local at an exchanging step: one step later
    ("ask", {1: 4}, PER_EPOCH),  # the epoch's end agrees what waits in the outbox
    ("ask", {0: 6, 1: 6}, 6),  # the schedule counts steps over the run: step 6 is the second epoch's first
    ("max_batch", 2, 2),  # StoppingHandler (so the plan's end) needs no exchange
    ("SIGTERM", {1: 1}, 4),
])
def test_with_agree_every_a_request_stops_every_rank_one_step_after_the_next_exchange(kind, arg, step):
    r0, r1 = distributed.spawn(_fit, 2, kind, arg, None, False, 1, 3, backend="gloo")
    outcome = "SystemExit(143)" if kind == "SIGTERM" else "returned"
    for r in (r0, r1):
        assert (r["outcome"], r["step"], r["batches"]) == (outcome, step, step)
    assert_tree_equal(r0["model"], r1["model"])


def test_gloo_agrees_every_16_steps_by_default():
    """A rank-local request at step 1 of a 10-step fit waits for the first epoch's end."""
    r0, r1 = distributed.spawn(_fit, 2, "ask", {1: 1}, None, False, 1, None, backend="gloo")
    assert (r0["step"], r1["step"]) == (PER_EPOCH, PER_EPOCH)


@pytest.mark.parametrize("boundary", [2, 3])  # the request in the outbox / in the exchange in flight
def test_with_agree_every_a_checkpoint_holding_a_request_resumes_to_the_same_stop(tmp_path, boundary):
    """Rank 1 asks to stop during step 1: both stop at step 4. The checkpoints of steps 2 and 3
    hold the request (in the outbox, in the exchange started after step 3), so a run resumed from
    either stops at step 4 as well."""
    ckpt = tmp_path / "ckpt"
    first = distributed.spawn(_fit, 2, "ask", {1: 1}, str(ckpt), False, 1, 3, backend="gloo")
    assert [r["step"] for r in first] == [4, 4]
    name = f"model-epoch0batch{boundary}.pt"
    payload = torch.load(ckpt / name, weights_only=True)
    assert [snapshot["pending_stop"] for snapshot in payload["ranks"]] == [False, True]
    resume_dir = tmp_path / "resume"
    resume_dir.mkdir()
    shutil.copy(ckpt / name, resume_dir)
    resumed = distributed.spawn(_fit, 2, "none", None, str(resume_dir), True, 1, 3, backend="gloo")
    for want, got in zip(first, resumed):
        assert (got["step"], got["batches"], got["phase"]) == (4, 4 - boundary, "epoch_end")
        assert_tree_equal(got["model"], want["model"], "model")
        assert_tree_equal(got["optimizer"], want["optimizer"], "optimizer")
