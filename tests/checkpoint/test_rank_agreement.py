"""Ranks agree on the checkpoint: rank 0 chooses, every rank loads that file from its own
model_dir and checks it reads the same bytes; a rank that cannot is a clear error on every rank
within seconds, never a hang (2 gloo processes)."""

from __future__ import annotations

import os
import shutil
import time

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, distributed
from estimatorch.checkpoint import CheckpointError, checkpoint_name
from tests.conftest import LossRecorder

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

STEPS_PER_EPOCH = 3  # 24 samples, 2 ranks, batches of 4
RESUME_AT = 4


def _fit(model_dir_template, resume, catch):
    """One rank: fit 2 epochs saving every batch into ``model_dir_template`` (``{rank}`` is this
    rank). With ``catch``, an error is returned (type, message, seconds) instead of raised."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.05), seed=5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.arange(24) % 3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    recorder = LossRecorder()
    handler = CheckpointHandler(model_dir_template.format(rank=distributed.get_rank()), batch_period=1,
                                epoch_period=None, max_checkpoints=None, resume_from_checkpoint=resume)
    start = time.monotonic()
    try:
        est.fit(loader, epochs=2, event_handlers=[handler, recorder])
    except Exception as err:  # noqa: BLE001 - reported to the test
        if not catch:
            raise
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "losses": recorder.losses, "model": est.net.state_dict()}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("agree")
    results = distributed.spawn(_fit, 2, str(root / "full"), False, False, backend="gloo")
    return root / "full", results


def _name(step):
    return checkpoint_name("model", (step - 1) // STEPS_PER_EPOCH, step)


def _rank_dirs(tmp_path, full, rank1_steps, damage=False):
    for rank, steps in ((0, range(1, RESUME_AT + 1)), (1, rank1_steps)):
        directory = tmp_path / f"rank{rank}"
        directory.mkdir()
        for step in steps:
            shutil.copy(full / _name(step), directory)
    if damage:  # same name, other bytes: e.g. a copy from another run
        path = tmp_path / "rank1" / _name(RESUME_AT)
        payload = torch.load(path, weights_only=True)
        payload["model"]["0.bias"] = payload["model"]["0.bias"] + 1
        torch.save(payload, path)
    return str(tmp_path / "rank{rank}")


@pytest.mark.parametrize("case, rank1_steps, damage, words", [
    ("older", range(1, RESUME_AT), False, f"rank 1 has no {_name(RESUME_AT)} in its model_dir"),
    ("none", (), False, f"rank 1 has no {_name(RESUME_AT)} in its model_dir"),
    ("other-bytes", range(1, RESUME_AT + 1), True, "rank 1 reads other bytes"),
], ids=["rank1-sees-an-older-file", "rank1-sees-none", "rank1-reads-other-bytes"])
def test_a_rank_that_cannot_read_rank_0s_choice_is_a_clear_error_on_every_rank(reference, tmp_path, case,
                                                                                rank1_steps, damage, words):
    template = _rank_dirs(tmp_path, reference[0], rank1_steps, damage)
    start = time.monotonic()
    r0, r1 = distributed.spawn(_fit, 2, template, True, True, backend="gloo")
    assert time.monotonic() - start < 60
    for result in (r0, r1):
        assert result["error"] == "CheckpointError" and words in result["message"], result
        assert "shared by all nodes" in result["message"] and result["seconds"] < 60
    assert r0["message"].startswith("rank 1 cannot resume: ")
    assert sorted(os.listdir(tmp_path / "rank0")) == sorted(_name(s) for s in range(1, RESUME_AT + 1))


def test_the_failing_rank_is_named_by_spawn(reference, tmp_path):
    template = _rank_dirs(tmp_path, reference[0], ())
    start = time.monotonic()
    with pytest.raises(distributed.RankFailedError, match=r"rank \d of 2 raised CheckpointError: .*rank 1") as info:
        distributed.spawn(_fit, 2, template, True, False, backend="gloo")
    assert time.monotonic() - start < 60
    assert isinstance(info.value.exception, CheckpointError)


def test_node_local_copies_of_the_same_files_resume_bit_identically(reference, tmp_path):
    full, (want0, want1) = reference
    template = _rank_dirs(tmp_path, full, range(1, RESUME_AT + 1))
    got0, got1 = distributed.spawn(_fit, 2, template, True, False, backend="gloo")
    for want, got in ((want0, got0), (want1, got1)):
        assert got["losses"] == want["losses"][RESUME_AT:]
        for key in want["model"]:
            assert torch.equal(want["model"][key], got["model"][key])
    assert sorted(os.listdir(tmp_path / "rank1")) == sorted(_name(s) for s in range(1, RESUME_AT + 1))  # only rank 0 writes
