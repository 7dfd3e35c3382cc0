"""Sharded (FSDP2) checkpoints on object storage, 2 gloo processes against a real S3 server
(SeaweedFS): every rank uploads its part, rank 0 the marker last; a SIGTERM (with and without
``async_save``) resumes bit-identically; a directory killed before its marker is never taken for
a checkpoint and is removed at the next start; a damaged shard falls back to the previous one;
retention and the pointer; ``inspect`` and ``load_weights`` on the URL."""

from __future__ import annotations

import json

import pytest

from estimatorch import checkpoint, distributed
from estimatorch.checkpoint import _store
from estimatorch.checkpoint._sharded import MARKER, is_sharded
from estimatorch.distributed import RankFailedError
from tests.conftest import assert_tree_equal
from tests.event_handlers.sharded_fit import fit

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
s3fs = pytest.importorskip("s3fs")  # the dev requirements install it (the s3 extra)

BATCHES, PER_EPOCH = 10, 6  # 48 samples in batches of 4 on 2 ranks


def _name(step):
    return f"model-epoch{(step - 1) // PER_EPOCH}batch{step}.dcp"


def _spawn(where, handler=None, **options):
    """The sharded fit on 2 ranks into ``where`` (a local path, or an ``s3_dir``)."""
    if isinstance(where, str):
        return distributed.spawn(fit, 2, where, options, backend="gloo")
    handler = {"storage_options": where.storage_options, **(handler or {})}
    return distributed.spawn(fit, 2, where.url, {**options, "handler": handler}, backend="gloo")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Two ranks, uninterrupted, into a local directory."""
    return _spawn(str(tmp_path_factory.mktemp("reference")), batches=BATCHES, period=2)


def _same_run(got, want, since):
    for g, w in zip(got, want):
        assert g["outcome"] == "returned" and g["step"] == w["step"], g.get("message", g["outcome"])
        assert g["losses"] == w["losses"][since:]
        assert_tree_equal(g["model"], w["model"], "model")
        assert_tree_equal(g["optimizer"], w["optimizer"], "optimizer")


@pytest.mark.parametrize("async_save", [False, True])
def test_sigterm_saves_to_s3_and_the_resume_is_bit_identical(reference, s3_dir, async_save):
    handler = {"async_save": async_save}
    stopped = _spawn(s3_dir, handler, batches=BATCHES, period=3, signal_at={1: 3}, agree_every=1)
    assert [(r["outcome"], r["step"]) for r in stopped] == [("SystemExit(143)", 4)] * 2
    assert stopped[0]["files"] == [_name(3), _name(4), "model-latest"]  # the lease released
    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    assert checkpoint.read_latest(s3_dir.url, "model") == _name(4)
    names = _store.listdir(f"{s3_dir.url}/{_name(4)}")
    assert {"rank-0.pt", "rank-1.pt", "__0_0.distcp", "__1_0.distcp", "common.pt", ".metadata",
            MARKER} == set(names)
    again = _spawn(s3_dir, handler, batches=BATCHES, period=3, max_checkpoints=2, resume=True)
    _same_run(again, reference, since=4)
    assert again[0]["files"] == [_name(6), _name(9), "model-latest"]  # retention, the pointer
    assert checkpoint.read_latest(s3_dir.url, "model") == _name(9)


def test_a_kill_before_the_marker_leaves_no_checkpoint_and_the_resume_falls_back(reference, s3_dir):
    with pytest.raises(RankFailedError):  # rank 0 killed at the second save, every part but the marker up
        _spawn(s3_dir, batches=BATCHES, period=2, kill_in=("marker", 2))
    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    assert not is_sharded(f"{s3_dir.url}/{_name(4)}") and _store.isdir(f"{s3_dir.url}/{_name(4)}")
    assert checkpoint.read_latest(s3_dir.url, "model") == _name(2)
    again = _spawn(s3_dir, batches=BATCHES, period=2, max_checkpoints=2, resume=True)
    _same_run(again, reference, since=2)
    assert any(line.startswith("Removed 1 temporary file(s) or incomplete upload(s)") for line in again[0]["log"])
    assert again[0]["files"] == [_name(10), _name(8), "model-latest"]


def test_a_damaged_shard_object_falls_back_and_inspect_names_the_sharded_url(reference, s3_dir, capsys, monkeypatch):
    _spawn(s3_dir, batches=4, period=2)
    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    shard = f"{s3_dir.url}/{_name(4)}/__1_0.distcp"
    data = _store.read_bytes(shard)
    _store.write_bytes(shard, data[:len(data) // 2])
    monkeypatch.setenv("ESTIMATORCH_STORAGE_OPTIONS", json.dumps(s3_dir.storage_options))
    assert checkpoint.main(["inspect", f"{s3_dir.url}/{_name(2)}"]) == 0
    out = capsys.readouterr().out
    assert f"{s3_dir.url}/{_name(2)}: sharded checkpoint (a directory)" in out and "world size 2" in out, out
    assert "position" in out and "in shards of 2 ranks" in out, out
    assert checkpoint.main(["inspect", f"{s3_dir.url}/{_name(4)}"]) == 2
    assert "truncated" in capsys.readouterr().err
    again = _spawn(s3_dir, batches=BATCHES, period=2, resume=True)
    _same_run(again, reference, since=2)
    skipped = [line for line in again[0]["log"] if line.startswith("Skipping a checkpoint")]
    assert len(skipped) == 1 and shard in skipped[0] and "truncated" in skipped[0], again[0]["log"]
    weights = checkpoint.load_weights(f"{s3_dir.url}/model-latest", storage_options=s3_dir.storage_options)
    assert_tree_equal(dict(weights), reference[0]["model"], "weights")
