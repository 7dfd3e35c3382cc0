"""estimatorch.checkpoint._files: write errors name the file and the OS reason and leave nothing
behind, orphaned temporaries are recognised by their exact pattern, model_dir is checked."""

from __future__ import annotations

import errno
import io
import os

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint
from tests.checkpoint.runs import build, fit_run, name
from tests.conftest import Count, make_batches, make_estimator


# -- write errors -----------------------------------------------------------------------------------
class _Full(io.RawIOBase):
    """A file on a disk with ``room`` bytes left."""

    def __init__(self, room: int):
        self.room = room

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return len(data)


def test_torch_hides_the_os_error_of_a_full_disk():
    """The premise: torch.save reports only its own 'unexpected pos'."""
    with pytest.raises(RuntimeError, match="unexpected pos"):
        torch.save({"x": torch.zeros(10_000)}, _Full(1000))


def _saving_into_full_disk(room: int):
    def writer(obj, f):  # the real torch.save, through the sink atomic_save hands it, onto a full disk
        sink_file = f.file
        f.file = io.BufferedWriter(_Full(room), buffer_size=64)
        try:
            torch.save(obj, f)
        finally:
            f.file = sink_file
    return writer


def test_a_full_disk_is_an_os_error_naming_the_file_and_leaves_the_previous_file(tmp_path):
    path = tmp_path / "model-epoch0batch1.pt"
    checkpoint.atomic_save({"weight": torch.zeros(4)}, path)
    before = path.read_bytes()
    with pytest.raises(OSError) as info:
        checkpoint.atomic_save({"weight": torch.ones(10_000)}, path, writer=_saving_into_full_disk(2000))
    assert info.value.errno == errno.ENOSPC
    assert str(path) in str(info.value) and "No space left on device" in str(info.value)
    assert "unexpected pos" not in str(info.value)
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


@pytest.mark.parametrize("failing, code", [("fsync", errno.EIO), ("replace", errno.EROFS), ("open", errno.EROFS)])
def test_os_errors_at_every_step_name_the_file_and_leave_no_temporary(tmp_path, monkeypatch, failing, code):
    path = tmp_path / "model-epoch0batch1.pt"
    checkpoint.atomic_save({"weight": torch.zeros(4)}, path)
    before = path.read_bytes()
    real = {"fsync": os.fsync, "replace": os.replace, "open": os.open}[failing]

    def fail(*args, **kwargs):
        if failing == "open" and not str(args[0]).endswith(".tmp"):
            return real(*args, **kwargs)
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, failing, fail)
    with pytest.raises(OSError) as info:
        checkpoint.atomic_save({"weight": torch.ones(8)}, path)
    monkeypatch.undo()
    assert info.value.errno == code and repr(str(path)) in str(info.value) and os.strerror(code) in str(info.value)
    assert path.read_bytes() == before and os.listdir(tmp_path) == [path.name]


def test_a_failed_save_during_fit_keeps_earlier_checkpoints_and_pointer(tmp_path, monkeypatch):
    fails_at = 3
    real = os.fsync

    def fsync(fd):
        if os.path.basename(os.readlink(f"/proc/self/fd/{fd}")).startswith(f".{name(fails_at)}."):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(fd)

    if not os.path.exists("/proc/self/fd"):
        pytest.skip("needs /proc/self/fd to tell which file is being synced")
    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(OSError, match=f"cannot write .*{name(fails_at)}.*Input/output error") as info:
        fit_run(tmp_path, max_checkpoints=None)
    assert info.value.errno == errno.EIO
    monkeypatch.undo()
    # no temporary, no lock; the progress mark of the failed attempt, for the run's ledger
    assert sorted(os.listdir(tmp_path)) == sorted([name(1), name(2), "model-latest", checkpoint.PROGRESS_NAME])
    assert open(tmp_path / "model-latest").read().strip() == name(2)
    for step in (1, 2):
        checkpoint.load(tmp_path / name(step))


# -- orphaned temporaries ---------------------------------------------------------------------------
ORPHANS = [".model-epoch0batch3.pt.0123456789ab.tmp", ".model-best.pt.abcdefabcdef.tmp",
           ".model-latest.000000000000.tmp", ".other-epoch2batch9.pt.0a0a0a0a0a0a.tmp",
           ".model-epoch0batch3.weights.pt.0123456789ab.tmp", ".model-best.weights.pt.abcdefabcdef.tmp"]
NOT_OURS = [".model-epoch0batch3.pt.xyz.tmp", ".notes.txt.0123456789ab.tmp", "model-epoch0batch3.pt.0123456789ab.tmp",
            ".model-epoch0batch3.pt.0123456789ab.tmp.bak", ".model-epoch0batch3.pt.0123456789AB.tmp", "keep.tmp",
            ".model-best.weights.pth.0123456789ab.tmp"]


def test_remove_orphan_temporaries_removes_only_the_library_pattern(tmp_path):
    for file in ORPHANS + NOT_OURS:
        (tmp_path / file).write_bytes(b"x")
    assert sorted(checkpoint.remove_orphan_temporaries(tmp_path)) == sorted(ORPHANS)
    assert sorted(os.listdir(tmp_path)) == sorted(NOT_OURS)


def test_a_temporary_being_written_is_not_an_orphan(tmp_path):
    seen = []

    def writer(obj, f):
        seen.append(sorted(os.listdir(tmp_path)))
        checkpoint.remove_orphan_temporaries(tmp_path)  # e.g. another handler cleaning up meanwhile
        seen.append(sorted(os.listdir(tmp_path)))
        torch.save(obj, f)

    checkpoint.atomic_save({"x": torch.zeros(1)}, tmp_path / "model-epoch0batch1.pt", writer=writer)
    assert seen[0] == seen[1] and len(seen[0]) == 1 and seen[0][0].endswith(".tmp")
    assert os.listdir(tmp_path) == ["model-epoch0batch1.pt"]


def test_fit_removes_orphans_at_start_and_after_each_save(tmp_path):
    for file in ORPHANS + NOT_OURS:
        (tmp_path / file).write_bytes(b"x")
    seen_at_first_batch = []

    class DropOrphan(Count):
        """Leaves a fresh orphan during step 2 (as a writer killed there would)."""

        def batch_end(self, estimator, **kwargs):
            super().batch_end(estimator, **kwargs)
            if self.batches == 1:
                seen_at_first_batch.extend(n for n in os.listdir(tmp_path) if n in ORPHANS)
            if self.batches == 2:
                (tmp_path / ".model-epoch0batch7.pt.fedcba987654.tmp").write_bytes(b"partial")

    estimator = make_estimator()
    estimator.fit(make_batches(), epochs=1, event_handlers=[
        DropOrphan(), CheckpointHandler(tmp_path, batch_period=1, epoch_period=None, resume_from_checkpoint=True)])
    assert seen_at_first_batch == []  # gone at fit start
    left = set(os.listdir(tmp_path))
    assert set(NOT_OURS) <= left and not left & set(ORPHANS)
    assert ".model-epoch0batch7.pt.fedcba987654.tmp" not in left  # gone after the next save


# -- model_dir -------------------------------------------------------------------------------------
def _bad_dirs(tmp_path):
    (tmp_path / "a-file").write_text("x")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    return {
        "file": (tmp_path / "a-file", "is a file"),
        "dangling-symlink": (tmp_path / "dangling", "which does not exist"),
        "dev-null": ("/dev/null", "is a device, not a directory"),
        "under-a-file": (tmp_path / "a-file" / "sub", "cannot be created: "),
    }


@pytest.mark.parametrize("case", ["file", "dangling-symlink", "dev-null", "under-a-file"])
def test_a_bad_model_dir_is_a_value_error_at_fit_start_naming_the_argument_and_path(tmp_path, case):
    path, words = _bad_dirs(tmp_path)[case]
    before = sorted(os.listdir(tmp_path))
    estimator, loader = build()
    count = Count()
    with pytest.raises(ValueError) as info:
        estimator.fit(loader, epochs=1, event_handlers=[count, CheckpointHandler(path, batch_period=1)])
    assert f"model_dir {str(path)!r}" in str(info.value) and words in str(info.value)
    assert count.batches == 0 and sorted(os.listdir(tmp_path)) == before


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root may write anywhere: "
                    "a read-only mount is tested in tests/integration/test_disk_errors.py instead")
def test_a_model_dir_that_is_not_writable_is_refused_at_fit_start(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    estimator, loader = build()
    try:
        with pytest.raises(ValueError, match="model_dir .* is a directory this process cannot write in"):
            estimator.fit(loader, epochs=1, event_handlers=[CheckpointHandler(locked, batch_period=1)])
        with pytest.raises(ValueError, match="cannot be created: this process cannot write in"):
            estimator.fit(loader, epochs=1, event_handlers=[CheckpointHandler(locked / "sub", batch_period=1)])
    finally:
        locked.chmod(0o700)
