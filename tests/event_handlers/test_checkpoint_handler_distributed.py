"""CheckpointHandler's exports and counters under torch.distributed (2 gloo processes): only rank
0 writes, every rank agrees on the best value and the counters, and a save that would replace
another run's export fails on every rank alike (never a hang)."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint, distributed
from tests.conftest import CrashAt, fill_disk_at

pytestmark = [pytest.mark.distributed, pytest.mark.slow,
              pytest.mark.filterwarnings("ignore:.*has no saved state:UserWarning")]

EPOCHS, STEPS_PER_EPOCH = 2, 3  # 24 samples, 2 ranks, batches of 4
CRASH = 5


def _fit(model_dir, exporter, resume, crash):
    """One rank: fit with a resumable handler (prefix ``ckpt``, the best on the train loss) and,
    with ``exporter``, a best-only weights export on the same monitor."""
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.2), seed=5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.arange(24) % 3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    monitor = est.train_metrics[0]
    handlers = [CheckpointHandler(model_dir, model_prefix="ckpt", batch_period=1, max_checkpoints=None,
                                  monitor=monitor, save_best=True, resume_from_checkpoint=resume)]
    if exporter:
        handlers.append(CheckpointHandler(model_dir, monitor=monitor, save_best_only=True, save_weights_only=True))
    start = time.monotonic()
    try:
        est.fit(loader, epochs=EPOCHS, event_handlers=[*handlers, *([CrashAt(crash)] if crash else [])])
    except Exception as err:  # noqa: BLE001 - reported to the test
        return {"error": type(err).__name__, "message": str(err), "seconds": time.monotonic() - start}
    return {"error": None, "best": [h.best for h in handlers],
            "counters": [(h.current_epoch, h.current_batch) for h in handlers]}


def test_only_rank_0_writes_the_export_and_the_ranks_agree(tmp_path):
    r0, r1 = distributed.spawn(_fit, 2, str(tmp_path), True, False, 0, backend="gloo")
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    assert r0["best"] == r1["best"] and r0["best"][0] == r0["best"][1]
    steps = EPOCHS * STEPS_PER_EPOCH
    assert r0["counters"] == r1["counters"] == [(EPOCHS, steps)] * 2
    files = sorted(os.listdir(tmp_path))
    assert files.count("model-best.weights.pt") == 1 and not [f for f in files if f.startswith("model-epoch")]
    export = torch.load(tmp_path / "model-best.weights.pt", weights_only=True)
    assert all(torch.equal(export[k], v) for k, v in checkpoint.load(tmp_path / "ckpt-best.pt")["model"].items())


def test_a_resume_continues_the_export_on_every_rank(tmp_path):
    crashed = distributed.spawn(_fit, 2, str(tmp_path), True, False, CRASH, backend="gloo")
    assert all(r["error"] == "RuntimeError" for r in crashed), crashed
    r0, r1 = distributed.spawn(_fit, 2, str(tmp_path), True, True, 0, backend="gloo")
    assert r0["error"] is None and r1["error"] is None, (r0, r1)
    whole = distributed.spawn(_fit, 2, str(tmp_path / "whole"), True, False, 0, backend="gloo")
    assert r0["best"] == r1["best"] == whole[0]["best"]
    assert r0["counters"] == whole[0]["counters"]
    resumed = torch.load(tmp_path / "model-best.weights.pt", weights_only=True)
    reference = torch.load(tmp_path / "whole" / "model-best.weights.pt", weights_only=True)
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)


def test_replacing_another_runs_export_fails_on_every_rank_alike(tmp_path):
    (tmp_path / "model-best.weights.pt").write_bytes(b"another run's export")
    crashed = distributed.spawn(_fit, 2, str(tmp_path), False, False, CRASH, backend="gloo")  # no exporter
    assert all(r["error"] == "RuntimeError" for r in crashed), crashed
    start = time.monotonic()
    r0, r1 = distributed.spawn(_fit, 2, str(tmp_path), True, True, 0, backend="gloo")
    assert time.monotonic() - start < 120
    for result in (r0, r1):
        assert result["error"] == "FileExistsError" and "another run" in result["message"], result
    assert (tmp_path / "model-best.weights.pt").read_bytes() == b"another run's export"


def _fit_with_a_full_disk(model_dir, fail_on):
    """One rank: on rank 0 the write of the file named ``fail_on`` fails as on a full disk."""
    if distributed.get_rank() == 0:
        fill_disk_at(fail_on)
    return _fit(model_dir, False, False, 0)


def test_a_failed_write_on_rank_0_is_an_error_on_every_rank(tmp_path):
    start = time.monotonic()
    r0, r1 = distributed.spawn(_fit_with_a_full_disk, 2, str(tmp_path), checkpoint.checkpoint_name("ckpt", 0, 2),
                               backend="gloo")
    assert time.monotonic() - start < 120
    for result in (r0, r1):
        assert result["error"] == "OSError" and "No space left on device" in result["message"], result
    assert sorted(f for f in os.listdir(tmp_path) if f.startswith("ckpt-epoch")) == \
        [checkpoint.checkpoint_name("ckpt", 0, 1)]
