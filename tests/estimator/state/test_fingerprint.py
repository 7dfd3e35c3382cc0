"""Every checkpoint records the fingerprint of the training state it holds, and a resume checks
the state it restored against it before the first step: a file that reads but holds other values
(a corrupted restore) is named then; a healthy resume (every resume test of the suite) passes it."""

from __future__ import annotations

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint, distributed
from estimatorch.checkpoint import CheckpointError
from tests.conftest import Count, make_batches, make_estimator

OPTIONS = dict(batch_period=3, epoch_period=None, max_checkpoints=None)


def test_a_checkpoint_records_the_fingerprint_of_its_state(tmp_path):
    est = make_estimator()
    est.fit(make_batches(n_batches=6), epochs=1, event_handlers=[CheckpointHandler(tmp_path, **OPTIONS)])
    payload = checkpoint.load(tmp_path / "model-epoch0batch6.pt")
    est.net.load_state_dict(payload["model"])
    est.optimizer.load_state_dict(payload["optimizer"])
    want = distributed.state_fingerprint(distributed.state_tensors(est.net, est.optimizer))
    assert payload["ranks"][0]["state_fingerprint"] == int(want)


def test_a_restore_that_does_not_give_back_the_saved_state_is_named_before_the_first_step(tmp_path):
    batches = make_batches(n_batches=6)
    make_estimator().fit(batches, epochs=1, event_handlers=[CheckpointHandler(tmp_path, **OPTIONS)])
    path = tmp_path / "model-epoch0batch6.pt"
    payload = checkpoint.load(path)
    name = next(iter(payload["model"]))
    payload["model"][name] = payload["model"][name].clone()
    payload["model"][name].view(-1)[0] += 1e-6  # a value changed, the file otherwise sound
    checkpoint.atomic_save(payload, str(path))
    est, count = make_estimator(), Count()
    with pytest.raises(CheckpointError, match=rf"the training state restored from {path} is not the state that was "
                                              r"saved: its fingerprint is 0x[0-9a-f]{16}, the checkpoint recorded"):
        est.fit(batches, epochs=2, event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True, **OPTIONS),
                                                   count])
    assert count.batches == 0


def test_a_file_of_an_earlier_version_has_no_fingerprint_to_check(tmp_path):
    batches = make_batches(n_batches=6)
    make_estimator().fit(batches, epochs=1, event_handlers=[CheckpointHandler(tmp_path, **OPTIONS)])
    path = tmp_path / "model-epoch0batch6.pt"
    payload = checkpoint.load(path)
    del payload["ranks"][0]["state_fingerprint"]
    name = next(iter(payload["model"]))
    payload["model"][name] = torch.zeros_like(payload["model"][name])  # nothing says it differs
    checkpoint.atomic_save(payload, str(path))
    est = make_estimator()
    est.fit(batches, epochs=2, event_handlers=[CheckpointHandler(tmp_path, resume_from_checkpoint=True, **OPTIONS)])
    assert est.position.step == 12
