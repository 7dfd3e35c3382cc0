"""Checkpoints on object storage under torch.distributed (2 gloo processes, DDP): rank 0 uploads,
every rank resumes from the object rank 0 chose (the same bytes, read from the store), and the
resumed run ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from estimatorch import CheckpointHandler, Estimator, checkpoint, distributed
from tests.conftest import CrashAt

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
s3fs = pytest.importorskip("s3fs")  # the dev requirements install it (the s3 extra)

EPOCHS, CRASH = 2, 5  # 24 samples, 2 ranks, batches of 4: 3 steps per epoch


def _fit(model_dir, options, resume, crash):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Dropout(0.2), nn.Linear(8, 3))
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.05), seed=5)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.arange(24) % 3)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    handler = CheckpointHandler(model_dir, batch_period=1, epoch_period=None, max_checkpoints=2,
                                resume_from_checkpoint=resume, storage_options=options)
    try:
        est.fit(loader, epochs=EPOCHS, event_handlers=[handler, *([CrashAt(crash)] if crash else [])])
    except RuntimeError as err:
        return {"error": str(err)}
    return {"error": None, "model": {k: v.clone() for k, v in checkpoint.model_state(est.net).items()},
            "step": est.position.step}


def test_ddp_to_s3_interrupted_and_resumed_bit_identically(s3_dir, tmp_path):
    whole = distributed.spawn(_fit, 2, str(tmp_path / "whole"), None, False, 0, backend="gloo")
    crashed = distributed.spawn(_fit, 2, s3_dir.url, s3_dir.storage_options, False, CRASH, backend="gloo")
    assert all(r["error"] == f"crash at batch {CRASH}" for r in crashed), crashed
    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    assert checkpoint.read_latest(s3_dir.url, "model") == checkpoint.checkpoint_name("model", 1, CRASH - 1)
    resumed = distributed.spawn(_fit, 2, s3_dir.url, s3_dir.storage_options, True, 0, backend="gloo")
    for rank in (0, 1):
        assert resumed[rank]["error"] is None, resumed[rank]
        for key, value in whole[rank]["model"].items():
            assert torch.equal(resumed[rank]["model"][key], value), (rank, key)
    names = [name for _, _, name in checkpoint.list_checkpoints(s3_dir.url, "model")]
    assert [n.rsplit("/", 1)[1] for n in names] == [checkpoint.checkpoint_name("model", 1, 5),
                                                     checkpoint.checkpoint_name("model", 1, 6)]
