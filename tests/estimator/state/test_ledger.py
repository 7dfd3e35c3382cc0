"""The run's ledger across the attempts of one run: killed (SIGKILL after step 13, the checkpoint of
step 10 the newest), stopped by SIGTERM at step 27, then run to the end, each attempt a process of
its own. The ledger every later attempt reads, ``inspect`` and ``inspect --json`` print and the
History holds: how each ended, the steps trained again, where the time went and the goodput; the
line a resumed fit starts with says what the attempt before lost. In one process: a
``fit(resume=True)`` is an attempt too, a failed attempt is named, a Ctrl-C ends one with a
``signal``, validation (and with ``SpeedMonitor`` the data waits) are parts of its time, and a
checkpoint of an earlier version (no ledger) resumes with a ledger that starts there."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import signal

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint
from estimatorch.checkpoint import PARTS
from estimatorch.event_handlers import BatchBegin, BatchEnd
from tests import forked

BATCHES, EPOCHS = 20, 2  # 40 steps
KILL_AFTER, CHECKPOINT, TERM_AT = 13, 10, 27
_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:  # forked from a server that imported torch once: an attempt costs no imports
        _CONTEXT = forked.forkserver()
    return _CONTEXT


class Interrupt(BatchBegin, BatchEnd):
    """SIGKILL once ``kill_after`` steps are done; SIGTERM during step ``term_at``."""

    def __init__(self, kill_after=0, term_at=0):
        self.kill_after, self.term_at = kill_after, term_at

    def batch_begin(self, est, **kw):
        if est.position.step == self.kill_after:
            os.kill(os.getpid(), signal.SIGKILL)

    def batch_end(self, est, **kw):
        if est.position.step + 1 == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)


def estimator():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(BATCHES)]
    return est, data


def _attempt(model_dir, out, kill_after, term_at):
    """One attempt of the run, in a process of its own: its log lines and History.ledger to ``out``."""
    torch.set_num_threads(1)
    log = logging.FileHandler(os.path.join(out, "log.txt"))
    logging.getLogger("estimatorch").addHandler(log)
    est, data = estimator()
    handler = CheckpointHandler(model_dir, batch_period=5, max_checkpoints=None, resume_from_checkpoint=True)
    history = est.fit(data, epochs=EPOCHS, event_handlers=[handler, Interrupt(kill_after, term_at)])
    with open(os.path.join(out, "ledger.json"), "w") as f:
        json.dump(history.ledger, f)


def _run(model_dir, out, kill_after=0, term_at=0):
    os.makedirs(out, exist_ok=True)
    process = _context().Process(target=_attempt, args=(str(model_dir), str(out), kill_after, term_at))
    process.start()
    process.join(300)
    if process.exitcode is None:
        process.kill()
    return process.exitcode, (out / "log.txt").read_text()


def inspect(path, *options):
    """What ``python -m estimatorch.checkpoint inspect PATH [OPTIONS]`` prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert checkpoint.main(["inspect", str(path), *options]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def three_attempts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ledger")
    model_dir = root / "model"
    killed = _run(model_dir, root / "1", kill_after=KILL_AFTER)
    stopped = _run(model_dir, root / "2", term_at=TERM_AT)
    finished = _run(model_dir, root / "3")
    text, as_json = inspect(model_dir), json.loads(inspect(model_dir, "--json"))
    print(text, killed[1], stopped[1], finished[1], sep="\n")  # what the closing note shows
    return {"dir": model_dir, "codes": [killed[0], stopped[0], finished[0]], "logs": [killed[1], stopped[1], finished[1]],
            "history": json.loads((root / "3" / "ledger.json").read_text()), "inspect": text, "json": as_json}


def test_the_attempts_end_killed_stopped_and_finished(three_attempts):
    assert three_attempts["codes"] == [-signal.SIGKILL, 128 + signal.SIGTERM, 0]
    ledger = three_attempts["json"]["ledger"]
    attempts = ledger["attempts"]
    assert [a["ended"] for a in attempts] == ["killed", "signal", "finished"]
    assert [a["resumed_from"] for a in attempts] == [None, CHECKPOINT, TERM_AT]
    assert [a["last_step"] for a in attempts] == [KILL_AFTER, TERM_AT, EPOCHS * BATCHES]
    assert all(a["exact"] for a in attempts)  # the killed one's from its progress mark
    assert [a["steps_lost"] for a in attempts] == [KILL_AFTER - CHECKPOINT, 0, 0]
    assert ledger["steps_lost"] == KILL_AFTER - CHECKPOINT
    assert attempts[1]["reason"] == "SIGTERM" and attempts[0]["reason"] == f"no word from it after step {KILL_AFTER}"
    assert 0 < ledger["goodput"] < 1
    assert ledger["seconds_lost"] == pytest.approx(ledger["seconds"] * (1 - ledger["goodput"]))


def test_each_attempts_time_is_split_into_its_parts(three_attempts):
    for a in three_attempts["json"]["ledger"]["attempts"]:
        times = a["times"]
        assert sorted(times) == sorted(PARTS) and times["data"] is None  # no SpeedMonitor: no data split
        assert sum(v for v in times.values() if v is not None) == pytest.approx(a["seconds"], abs=1e-6)
        assert times["startup"] > 0 and times["steps"] > 0 and times["save"] > 0
        assert (times["load"] > 0) == (a["resumed_from"] is not None)
    stopped = three_attempts["json"]["ledger"]["attempts"][1]
    assert stopped["times"]["end"] > 0  # the stop's checkpoint, written in train_end (the mark tells it)


def test_the_history_gets_the_ledger_of_the_whole_run(three_attempts):
    history, saved = three_attempts["history"], three_attempts["json"]["ledger"]
    keys = ("attempt", "resumed_from", "last_step", "ended", "steps_lost")
    assert [[a[k] for k in keys] for a in history["attempts"]] == [[a[k] for k in keys] for a in saved["attempts"]]
    assert 0 < history["goodput"] < 1 and history["run_id"] == saved["run_id"]


def test_a_resumed_fit_says_what_the_last_attempt_lost(three_attempts):
    path = three_attempts["dir"]
    second, third = three_attempts["logs"][1:]
    lost = KILL_AFTER - CHECKPOINT
    assert (f"Resuming from {path / f'model-epoch0batch{CHECKPOINT}.pt'}: 0 epochs and {CHECKPOINT} batches done; "
            f"the last attempt was killed after step {KILL_AFTER}, {lost} steps to train again") in second
    assert (f"Resuming from {path / f'model-epoch1batch{TERM_AT}.pt'}: 1 epochs and {TERM_AT} batches done; "
            f"the last attempt stopped for SIGTERM after step {TERM_AT}, no step to train again") in third


def test_inspect_prints_the_ledger_as_a_table(three_attempts):
    lines = three_attempts["inspect"].splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("ledger of run "))
    rows = [line.split() for line in lines[head + 2:head + 5]]
    assert [(r[0], r[3], r[4], r[5], r[6]) for r in rows] == [
        ("1", "-", str(KILL_AFTER), "killed", str(KILL_AFTER - CHECKPOINT)), ("2", str(CHECKPOINT), str(TERM_AT),
                                                                             "signal", "0"),
        ("3", str(TERM_AT), str(EPOCHS * BATCHES), "finished", "0")]
    goodput = three_attempts["json"]["ledger"]["goodput"]
    assert any(line.startswith(f"total: {KILL_AFTER - CHECKPOINT} steps trained again;")
               and line.endswith(f"goodput {goodput:.3f}") for line in lines)


def test_a_clean_end_leaves_no_progress_mark_its_checkpoint_says_it_all(three_attempts):
    assert checkpoint.PROGRESS_NAME not in os.listdir(three_attempts["dir"])  # the last finished, saved


# -- in one process --------------------------------------------------------------------------------
def test_a_fit_resumed_in_process_is_the_runs_next_attempt(caplog):
    est, data = estimator()
    first = est.fit(data, batches=7)
    second = est.fit(data, batches=12, resume=True)
    assert len(first.ledger["attempts"]) == 1 and first.ledger["attempts"][0]["ended"] == "finished"
    attempts = second.ledger["attempts"]
    assert second.ledger["run_id"] == first.ledger["run_id"]
    assert [(a["resumed_from"], a["last_step"], a["ended"], a["steps_lost"]) for a in attempts] == \
        [(None, 7, "finished", 0), (7, 12, "finished", 0)]
    assert est.fit(data, batches=3).ledger["run_id"] != first.ledger["run_id"]  # a fresh fit: a new run


class Fail(BatchEnd):
    def batch_end(self, est, **kw):
        if est.position.step + 1 == 6:
            raise RuntimeError("the data went away")


def test_a_failed_attempt_is_named_and_its_steps_past_the_checkpoint_lost(tmp_path, caplog):
    est, data = estimator()
    with pytest.raises(RuntimeError, match="the data went away"):
        est.fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=4), Fail()])
    assert checkpoint.PROGRESS_NAME in os.listdir(tmp_path)  # no checkpoint tells how it ended
    est, data = estimator()
    caplog.set_level(logging.INFO, "estimatorch")
    history = est.fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=4,
                                                                        resume_from_checkpoint=True)])
    first, second = history.ledger["attempts"]
    assert (first["ended"], first["last_step"], first["steps_lost"]) == ("failed", 5, 1)
    assert first["reason"] == "RuntimeError: the data went away"
    assert second["resumed_from"] == 4
    assert "the last attempt failed after step 5 (RuntimeError: the data went away), 1 step to train again" \
        in caplog.text


def test_a_checkpoint_without_a_ledger_starts_one_at_the_attempt_resuming_it(tmp_path):
    est, data = estimator()
    est.fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=5, epoch_period=None)])
    path = tmp_path / "model-epoch0batch10.pt"
    payload = checkpoint.load(path)
    for snapshot in payload["ranks"]:  # as an earlier version wrote it
        del snapshot["ledger"], snapshot["state_fingerprint"]
    os.remove(tmp_path / "model-epoch0batch20.pt"), os.remove(tmp_path / "model-epoch0batch15.pt")
    checkpoint.atomic_save(payload, str(path))
    os.remove(tmp_path / "model-latest")
    est, data = estimator()
    history = est.fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=5, epoch_period=None,
                                                                        resume_from_checkpoint=True)])
    (only,) = history.ledger["attempts"]
    assert (only["attempt"], only["resumed_from"], only["last_step"]) == (1, 10, 20)
    out = inspect(tmp_path / "model-epoch0batch10.pt", "--json")
    assert json.loads(out)["ledger"] is None
    shutil.rmtree(tmp_path)


def test_validation_and_with_speed_monitor_the_data_waits_are_parts_of_the_time():
    from estimatorch import SpeedMonitor

    est, data = estimator()
    history = est.fit(data, val_data=data[:4], epochs=2, event_handlers=[SpeedMonitor()])
    (attempt,) = history.ledger["attempts"]
    times = attempt["times"]
    assert times["validation"] > 0 and times["data"] is not None and times["data"] >= 0
    assert sum(times.values()) == pytest.approx(attempt["seconds"], abs=1e-6)
    assert history.goodput == history.ledger["goodput"] and 0 < history.goodput < 1
    est, data = estimator()
    assert est.fit(data, epochs=1).ledger["attempts"][0]["times"]["data"] is None  # not measured without it


class CtrlC(BatchEnd):
    def batch_end(self, est, **kw):
        if est.position.step + 1 == 7:
            signal.raise_signal(signal.SIGINT)


def test_a_ctrl_c_is_a_signal_ending_its_boundary_saved_nothing_to_train_again(tmp_path):
    saved = signal.signal(signal.SIGINT, signal.default_int_handler)  # Python's default: fit installs its own
    try:
        est, data = estimator()
        with pytest.raises(KeyboardInterrupt):
            est.fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=4), CtrlC()])
    finally:
        signal.signal(signal.SIGINT, saved)
    est, data = estimator()
    history = est.fit(data, epochs=1, event_handlers=[CheckpointHandler(tmp_path, batch_period=4,
                                                                        resume_from_checkpoint=True)])
    first, second = history.ledger["attempts"]
    assert (first["ended"], first["reason"], first["last_step"], first["steps_lost"]) == ("signal", "SIGINT", 7, 0)
    assert (second["resumed_from"], second["ended"]) == (7, "finished")
