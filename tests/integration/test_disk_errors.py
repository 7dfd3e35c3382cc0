"""Real disk errors, in a small tmpfs mounted inside a private user and mount namespace (``unshare
--user --map-root-user --mount``, no privileges needed where the kernel allows user namespaces;
skipped with the reason where it does not): a full disk (ENOSPC) and a filesystem that turns
read-only (EROFS) during a fit; each with synchronous saves and with ``async_save=True`` (the
error of a background write comes at the next save, the same error with the same files kept)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys

import pytest

WORKER = os.path.join(os.path.dirname(__file__), "checkpoint_worker.py")


def _in_tmpfs(tmp_path, size, mode, async_save=False):
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no unshare command: cannot mount a private tmpfs")
    mount_point, out = tmp_path / "mnt", tmp_path / "report.json"
    mount_point.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    script = (f'mount -t tmpfs -o size={size} tmpfs "$1" || exit 77\n'
              f'exec "$2" "$3" {mode} --dir "$1" --out "$4"{" --async" if async_save else ""}')
    proc = subprocess.run([unshare, "--user", "--map-root-user", "--mount", "sh", "-c", script, "sh",
                           str(mount_point), sys.executable, WORKER, str(out)],
                          capture_output=True, text=True, env=env, timeout=300)
    if proc.returncode == 77 or (proc.returncode != 0 and not out.exists() and "unshare" in proc.stderr):
        pytest.skip(f"cannot mount a tmpfs in a user namespace here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_full_disk_names_the_file_and_the_reason_and_keeps_what_was_saved(tmp_path, async_save):
    report = _in_tmpfs(tmp_path, "1m", "fill", async_save)
    assert report["error"] == "OSError" and report["errno"] == errno.ENOSPC, report
    assert "No space left on device" in report["message"] and "unexpected pos" not in report["message"]
    failed = report["message"].split("'")[1]  # cannot write '<path>': ...
    assert os.path.basename(failed).startswith("model-epoch"), report["message"]
    loadable = report["loadable"]
    assert loadable and all(isinstance(step, int) for step in loadable.values()), report  # every file complete
    assert not [n for n in report["files"] if n.endswith(".tmp")], report["files"]
    assert report["latest"] in report["files"] and loadable[report["latest"]] == max(loadable.values())
    assert os.path.basename(failed) not in report["files"]


@pytest.mark.slow
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_filesystem_turning_read_only_names_the_file_and_model_dir_is_refused_at_start(tmp_path, async_save):
    report = _in_tmpfs(tmp_path, "64m", "readonly", async_save)
    assert report["error"] == "OSError" and report["errno"] == errno.EROFS, report
    assert "model-epoch0batch2.pt" in report["message"] and "Read-only file system" in report["message"]
    assert [n for n in report["files"] if n.endswith(".pt")] == ["model-epoch0batch1.pt"], report["files"]
    assert report["latest"] == "model-epoch0batch1.pt"
    assert "model_dir" in report["at_start"] and "cannot be created" in report["at_start"] \
        and "cannot write in" in report["at_start"], report["at_start"]
