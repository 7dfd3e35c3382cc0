"""The progress mark: its counters, written as memory stores, survive a SIGKILL of the process that
wrote them; a closed mark holds the attempt's closed entry; a damaged or foreign file is no mark;
an object store's mark is a local file named by the URL."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from estimatorch.checkpoint import PARTS, ProgressMark, progress_path, read_progress
from estimatorch.checkpoint._progress import alive


def document(step=0, ended="running"):
    entry = {"attempt": 2, "started": 100.0, "resumed_from": 10, "last_step": step, "exact": False, "ended": ended,
             "reason": None, "world_size": 1, "seconds": 0.0, "times": dict.fromkeys(PARTS, 0.0), "steps_lost": 0}
    return {"run_id": "run", "attempts": [dict(entry, attempt=1, resumed_from=None, last_step=13, ended="killed"),
                                          entry], "pid": os.getpid(), "host": os.uname().nodename, "accumulation": 1}


def _write_then_die(path, steps):
    mark = ProgressMark.create(path, document(), step=10)
    mark.set("loop", 101 * 10**9)
    mark.set("save", 2 * 10**9)
    for step in range(11, steps + 1):
        mark.step(step)
    os.kill(os.getpid(), signal.SIGKILL)


def test_the_last_step_of_a_killed_writer_is_read_exactly(tmp_path):
    path = str(tmp_path / ".estimatorch-progress")
    child = multiprocessing.get_context("fork").Process(target=_write_then_die, args=(path, 13))
    child.start()
    child.join(60)
    assert child.exitcode == -signal.SIGKILL
    progress = read_progress(path)
    assert progress["live"] and progress["ledger"]["run_id"] == "run"
    first, current = progress["ledger"]["attempts"]
    assert first["last_step"] == 13 and first["ended"] == "killed"  # earlier attempts as written
    assert (current["last_step"], current["exact"], current["ended"]) == (13, True, "running")
    assert current["times"]["save"] == 2.0 and current["times"]["startup"] == pytest.approx(1.0)
    assert current["seconds"] >= current["times"]["startup"] + current["times"]["save"]
    assert not alive(dict(progress, pid=child.pid))  # its process is gone
    assert alive(dict(progress, pid=os.getpid()))


def test_a_closed_mark_holds_the_closed_entry(tmp_path):
    path = str(tmp_path / ".estimatorch-progress")
    mark = ProgressMark.create(path, document(), step=10)
    mark.step(12)
    closed = document(step=12, ended="signal")
    closed["attempts"][-1].update(reason="SIGTERM", exact=True, seconds=5.0)
    mark.close(closed)
    progress = read_progress(path)
    assert progress["ledger"]["attempts"][-1] == closed["attempts"][-1]
    assert not progress["live"]
    assert sorted(os.listdir(tmp_path)) == [".estimatorch-progress"]  # no temporary left


@pytest.mark.parametrize("content", [b"", b"not a mark", b"ESTPRG\x00\x01" + b"\x00" * 200])
def test_a_damaged_file_is_no_mark(tmp_path, content):
    path = tmp_path / ".estimatorch-progress"
    path.write_bytes(content)
    assert read_progress(str(path)) is None
    assert read_progress(str(tmp_path / "missing")) is None


def test_an_object_store_mark_is_a_local_file_named_by_the_url(tmp_path, monkeypatch):
    monkeypatch.setenv("ESTIMATORCH_PROGRESS_DIR", str(tmp_path))
    a, b = progress_path("s3://bucket/run-a"), progress_path("s3://bucket/run-b")
    assert os.path.dirname(a) == os.path.dirname(b) == str(tmp_path) and a != b
    assert progress_path("/data/run") == "/data/run/.estimatorch-progress"
    with pytest.raises(ValueError, match="a progress mark is a local file"):
        ProgressMark.create("s3://bucket/run/.estimatorch-progress", document())
