"""Elastic resume (``CheckpointHandler(..., elastic=True)``): a run saved on one world size resumes
on another with the same samples in every optimizer step; refused without the opt-in, across
elastic and non-elastic files, and when the global batch would change."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, GradientUpdateHandler, StoppingHandler, distributed
from estimatorch.checkpoint import CheckpointError
from estimatorch.estimator._state.elastic_resume import world_size_error
from estimatorch.event_handlers import BatchEnd
from estimatorch.metrics import Accuracy

N, BATCH = 48, 4  # 48 samples of 4 per micro-batch


class Record(BatchEnd):
    """Every micro-batch's loss (as hex: exact) and labels, in this process's order."""

    priority = float("inf")

    def __init__(self):
        self.losses, self.labels = [], []

    def batch_end(self, est, *, loss, label, **kw):
        self.losses.append(float(loss.detach()).hex())
        self.labels.append(label.tolist())


def _train(ckpt_dir, accumulation, resume, plan, batch_period=None):
    """One rank of an elastic fit (AdamW, dropout, no BatchNorm); its results."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), train_metrics=Accuracy(),
                    optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=11)
    g = torch.Generator().manual_seed(5)
    dataset = torch.utils.data.TensorDataset(torch.randn(N, 4, generator=g), torch.arange(N) % 3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True)
    record, stopping = Record(), StoppingHandler()
    handlers = [record, stopping, GradientUpdateHandler(accumulation_steps=accumulation),
                CheckpointHandler(ckpt_dir, batch_period=batch_period or accumulation, epoch_period=None,
                                  max_checkpoints=None, resume_from_checkpoint=resume, elastic=True)]
    history = est.fit(loader, batches=plan, event_handlers=handlers)
    return {"losses": record.losses, "labels": record.labels, "history": history.to_dict(),
            "model": {k: v.clone() for k, v in est.net.state_dict().items()}, "step": est.position.step,
            "counters": (handlers[-1].current_batch, stopping.current_batch), "ledger": history.ledger}


def _in_process(*args, **kwargs):
    """``_train`` in this process with one thread (as in the spawned ones), the setting restored."""
    threads = torch.get_num_threads()
    try:
        return _train(*args, **kwargs)
    finally:
        torch.set_num_threads(threads)


def _resume_dir(tmp_path, full_dir, name):
    """A directory holding only the checkpoint ``name`` of ``full_dir``."""
    target = tmp_path / "resume-from"
    target.mkdir()
    shutil.copy(full_dir / name, target)
    return str(target)


def _slots(per_rank, accumulation):
    """The micro-batch records of ranks ``per_rank`` in global order: step by step, rank by rank."""
    steps = len(per_rank[0]) // accumulation
    return [item for s in range(steps) for rank in per_rank for item in rank[s * accumulation:(s + 1) * accumulation]]


def _history_close(got, want):
    assert got["epoch"] == want["epoch"]
    assert got["train_accuracy"] == want["train_accuracy"]  # counts: exact
    torch.testing.assert_close(torch.tensor(got["train_loss"]), torch.tensor(want["train_loss"]),
                               rtol=1e-6, atol=0)  # sums of losses, added in another order


# -- on several processes -----------------------------------------------------------------------
@pytest.mark.distributed
@pytest.mark.slow
def test_two_ranks_resume_on_one_with_accumulation_bit_identically(tmp_path):
    """2 ranks x batch 4 -> 1 rank x batch 4 x accumulation 2: the same 8 samples per optimizer
    step, each micro-batch with the same dropout; DDP's mean of two gradients and the mean of
    two accumulated ones are the same floating point numbers (one addition, a division by 2)."""
    full = tmp_path / "full"
    reference = distributed.spawn(_train, 2, str(full), 1, False, 10, backend="gloo")
    k = 3  # mid first epoch (6 steps per epoch): the epoch's metric accumulators are combined
    resumed = _in_process(_resume_dir(tmp_path, full, f"model-epoch0batch{k}.pt"), 2, True, 20)
    for key, want in reference[0]["model"].items():
        assert torch.equal(resumed["model"][key], want), key
    assert resumed["losses"] == _slots([r["losses"] for r in reference], 1)[2 * k:]
    assert resumed["labels"] == _slots([r["labels"] for r in reference], 1)[2 * k:]
    assert resumed["step"] == 20 and resumed["counters"] == (20, 20)  # batches of this topology
    _history_close(resumed["history"], reference[0]["history"])
    # the run's ledger goes on, its steps counted in this topology's batches like the position
    # (the attempt that wrote the file left no progress mark here: counted to that checkpoint)
    first, second = resumed["ledger"]["attempts"]
    assert resumed["ledger"]["run_id"] == reference[0]["ledger"]["run_id"]
    assert (first["world_size"], first["last_step"], first["exact"], first["ended"]) == (2, 2 * k, False, "killed")
    assert (second["world_size"], second["resumed_from"], second["last_step"], second["ended"]) == \
        (1, 2 * k, 20, "finished")


@pytest.mark.distributed
@pytest.mark.slow
def test_one_rank_with_accumulation_resumes_on_two(tmp_path):
    full = tmp_path / "full"
    reference = _in_process(str(full), 2, False, 20)
    k = 8  # 4 optimizer steps, mid first epoch
    resumed = distributed.spawn(_train, 2, _resume_dir(tmp_path, full, f"model-epoch0batch{k}.pt"), 1, True, 10,
                                backend="gloo")
    assert resumed[0]["losses"] + resumed[1]["losses"]  # ranks trained
    assert _slots([r["losses"] for r in resumed], 1) == reference["losses"][k:]
    for key, want in reference["model"].items():
        # exact here too: (g0 + g1) / 2 == g0 / 2 + g1 / 2 in floating point (see the module notes)
        assert torch.equal(resumed[0]["model"][key], want), key
        assert torch.equal(resumed[1]["model"][key], want), key
    assert [r["step"] for r in resumed] == [10, 10] and resumed[0]["counters"] == (10, 10)
    for r in resumed:
        _history_close(r["history"], reference["history"])


@pytest.mark.distributed
@pytest.mark.slow
def test_four_ranks_resume_on_two_with_accumulation_within_rounding(tmp_path):
    """4 ranks -> 2 ranks x accumulation 2: the same samples and dropout per micro-batch; the sum
    of four gradients is added in another order (gloo's four-way sum against two two-way sums),
    so parameters agree to float32 rounding, not bit for bit."""
    full = tmp_path / "full"
    reference = distributed.spawn(_train, 4, str(full), 1, False, 5, backend="gloo")
    k = 2  # of 3 steps per epoch
    resumed = distributed.spawn(_train, 2, _resume_dir(tmp_path, full, f"model-epoch0batch{k}.pt"), 2, True, 10,
                                backend="gloo")
    assert _slots([r["losses"] for r in resumed], 2)[:2 * 2] == _slots([r["losses"] for r in reference], 1)[4 * k:4 * k + 4]
    assert _slots([r["labels"] for r in resumed], 2) == _slots([r["labels"] for r in reference], 1)[4 * k:]
    for key, want in reference[0]["model"].items():
        torch.testing.assert_close(resumed[0]["model"][key], want, rtol=1e-6, atol=1e-7)  # measured: <= 3e-8
        assert torch.equal(resumed[0]["model"][key], resumed[1]["model"][key])
    assert resumed[0]["counters"] == (10, 10)


def _refused(ckpt_dir, accumulation):
    try:
        _train(ckpt_dir, accumulation, True, 10, batch_period=1)
    except Exception as err:  # noqa: BLE001 - the message is the result
        return f"{type(err).__name__}: {err}"
    return None


@pytest.mark.distributed
@pytest.mark.slow
def test_a_checkpoint_in_the_middle_of_an_accumulation_window_resumes_on_its_world_size_only(tmp_path):
    full = tmp_path / "full"
    _in_process(str(full), 2, False, 4, batch_period=1)
    errors = distributed.spawn(_refused, 2, _resume_dir(tmp_path, full, "model-epoch0batch3.pt"), 1, backend="gloo")
    assert all(e is not None and "middle of an accumulation window" in e for e in errors), errors


# -- refusals in one process ----------------------------------------------------------------------
def test_elastic_must_be_a_bool(tmp_path):
    with pytest.raises(TypeError, match="elastic must be a bool, got 'yes'"):
        CheckpointHandler(str(tmp_path), elastic="yes")


def _fit(ckpt_dir, accumulation=1, resume=False, elastic=True, batches=2, batch_size=4):
    torch.manual_seed(0)
    net = nn.Linear(4, 3)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1), seed=3)
    dataset = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.arange(16) % 3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True)
    handler = CheckpointHandler(ckpt_dir, batch_period=1, resume_from_checkpoint=resume, elastic=elastic)
    est.fit(loader, batches=batches, event_handlers=[handler, GradientUpdateHandler(accumulation_steps=accumulation)])
    return est


def test_an_elastic_checkpoint_is_refused_without_elastic(tmp_path):
    _fit(str(tmp_path))
    with pytest.raises(ValueError, match=r"written by a fit with CheckpointHandler\(\.\.\., elastic=True\).*"
                                         "resume with elastic=True"):
        _fit(str(tmp_path), resume=True, elastic=False, batches=4)


def test_a_checkpoint_without_elastic_is_refused_with_it(tmp_path):
    _fit(str(tmp_path), elastic=False)
    with pytest.raises(CheckpointError, match="written by a fit without CheckpointHandler.*elastic=True"):
        _fit(str(tmp_path), resume=True, elastic=True, batches=4)


def test_a_different_global_batch_is_refused(tmp_path):
    _fit(str(tmp_path), accumulation=2, batches=2)
    with pytest.raises(CheckpointError, match=r"global batch would change \(saved 4 samples x 2 micro-batches per "
                                              r"optimizer step, now 4 samples x 1 micro-batches"):
        _fit(str(tmp_path), accumulation=1, resume=True, batches=4)


def test_another_batch_size_is_refused_even_with_the_same_global_batch(tmp_path):
    _fit(str(tmp_path), accumulation=2, batches=2)  # 4 samples x 2 micro-batches
    with pytest.raises(CheckpointError, match=r"batch_size would change \(saved 4, now 8\)"):
        _fit(str(tmp_path), accumulation=1, resume=True, batches=4, batch_size=8)  # 8 x 1: the same 8 samples


def test_an_elastic_file_of_another_world_size_names_the_opt_in_without_it():
    payload = {"world_size": 2, "ranks": [{"fingerprint": {"layout": "elastic"}}] * 2}
    message = str(world_size_error("model-epoch0batch4.pt", payload))
    assert "written by 2 processes of an elastic run; this run has 1: pass CheckpointHandler(..., elastic=True)" \
        in message
    plain = str(world_size_error("model-epoch0batch4.pt", {"world_size": 1, "ranks": [{"fingerprint": {}}]}))
    assert "written by 1 process;" in plain and "resume with the same world size" in plain


def test_an_elastic_run_resumes_on_its_own_world_size_exactly(tmp_path):
    full, part = tmp_path / "full", tmp_path / "part"
    reference = _fit(str(full), accumulation=2, batches=8)
    _fit(str(part), accumulation=2, batches=5)  # stops in the middle of a window: resumed as such
    resumed = _fit(str(part), accumulation=2, resume=True, batches=8)
    for want, got in zip(reference.net.parameters(), resumed.net.parameters()):
        assert torch.equal(want, got)
