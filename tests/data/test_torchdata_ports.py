"""torchdata's own StatefulDataLoader resume cases with ``snapshot_every_n_steps`` (its
test/stateful_dataloader/test_state_dict.py: workers' states snapshotted only every n steps, over
map-style and stateful iterable datasets) ported onto ``fit``: an uninterrupted fit against one
SIGKILLed right after the checkpoint of a step in the middle of an epoch, at an epoch's last batch
and after the first epoch, and run again (tests/data/sigkill.py), workers 0 and 2, every batch,
loss and final parameter bit for bit. fit positions the loader from its own checkpoint, so a
snapshot interval that does not divide the checkpoint's step must not matter."""

from __future__ import annotations

import pytest
from torchdata.stateful_dataloader import StatefulDataLoader

from tests.data.sigkill import assert_resumed_bitwise, sigkill_resume
from tests.data.test_iterable_streams import StatefulRange
from tests.data.test_streams_matrix import Noisy

SNAPSHOT_EVERY = 3  # divides one of the stops below (6), not the others
PER_EPOCH = 16 // 4  # 16 samples (Noisy's N and the StatefulRange), batches of 4


def loader(kind, num_workers, data_dir):
    """The fit's train_data (built in each process of a run)."""
    if kind == "map":
        return StatefulDataLoader(Noisy(), batch_size=4, shuffle=True, num_workers=num_workers,
                                  snapshot_every_n_steps=SNAPSHOT_EVERY)
    return StatefulDataLoader(StatefulRange(16, noise=True), batch_size=4, num_workers=num_workers,
                              snapshot_every_n_steps=SNAPSHOT_EVERY)


@pytest.mark.slow
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("kind", ["map", "iterable"])
def test_snapshot_every_n_steps_resumes_bitwise_after_a_sigkill(tmp_path, kind, num_workers):
    per_epoch = PER_EPOCH
    # the middle of the first epoch, its last batch, the middle of the second
    runs = sigkill_resume(f"{__name__}:loader", kind, num_workers, tmp_path, stops=[2, per_epoch, per_epoch + 2])
    assert_resumed_bitwise(runs, steps=2 * per_epoch)
    assert runs["resumed"]["warnings"] == runs["full"]["warnings"]
