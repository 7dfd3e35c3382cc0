"""Checkpoints on object storage, against a real S3 server (SeaweedFS, ``tests/s3server.py``):
a fit to ``s3://`` resumed bitwise, retention and the pointer, the lease, incomplete uploads,
a failed upload, bad input at the door, ``load_weights`` and ``inspect`` on objects.
The kill tests (SIGTERM, SIGKILL mid-upload) are in tests/integration/test_object_store_kills.py."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import time

import pytest
import torch

from estimatorch import CheckpointHandler, checkpoint
from estimatorch.checkpoint import CheckpointError, _lease, _store
from estimatorch.event_handlers import BatchEnd
from tests.checkpoint import runs
from tests.conftest import Count, CrashAt, assert_tree_equal
from tests.s3server import BUCKET

s3fs = pytest.importorskip("s3fs")  # the dev requirements install it (the s3 extra)


def fs_of(where):
    return s3fs.S3FileSystem(skip_instance_cache=True, **where.storage_options)


def objects(where) -> list[str]:
    fs = fs_of(where)
    try:
        return sorted(os.path.basename(p) for p in fs.ls(where.url, detail=False))
    except FileNotFoundError:
        return []


def handler(where, **kwargs):
    kwargs = dict(dict(batch_period=1, epoch_period=None, max_checkpoints=None), **kwargs)
    return CheckpointHandler(where.url, storage_options=where.storage_options, **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The run of ``runs`` to a local directory, uninterrupted: what every resume must match."""
    return runs.fit_run(tmp_path_factory.mktemp("reference"))


# -- a fit to s3:// -----------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_fit_to_s3_writes_the_same_checkpoints_and_resumes_bitwise(reference, s3_dir, async_save):
    crashed_at = 6
    estimator, loader = runs.build()
    with pytest.raises(RuntimeError, match="crash at batch"):
        estimator.fit(loader, epochs=runs.EPOCHS, event_handlers=[handler(s3_dir, async_save=async_save),
                                                                   CrashAt(crashed_at)])
    names = [runs.name(step) for step in range(1, crashed_at)]
    assert objects(s3_dir) == sorted([*names, "model-latest"])  # the lease is gone, no temporary
    fs = fs_of(s3_dir)
    assert fs.cat(f"{s3_dir.url}/model-latest").decode().strip() == names[-1]
    for name in names:  # the same bytes' content as the local run's files
        assert_tree_equal(torch.load(io.BytesIO(fs.cat(f"{s3_dir.url}/{name}")), weights_only=True)["model"],
                          checkpoint.load(os.path.join(reference.dir, name))["model"], name)
    resumed = runs.fit_run(s3_dir.url, resume_from_checkpoint=True, storage_options=s3_dir.storage_options,
                           async_save=async_save)
    assert resumed.losses == reference.losses[crashed_at - 1:]
    assert_tree_equal(resumed.estimator.net.state_dict(), reference.estimator.net.state_dict())
    assert objects(s3_dir) == sorted([*(runs.name(s) for s in range(1, runs.STEPS + 1)), "model-latest"])


def test_retention_keeps_the_newest_and_moves_the_pointer_after_the_file(s3_dir):
    runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options, max_checkpoints=2)
    assert objects(s3_dir) == sorted([runs.name(runs.STEPS - 1), runs.name(runs.STEPS), "model-latest"])
    assert checkpoint.read_latest(s3_dir.url, "model") == runs.name(runs.STEPS)


def test_without_resume_a_prefix_holding_checkpoints_is_refused_untouched(s3_dir):
    runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options, max_checkpoints=1)
    before = {n: fs_of(s3_dir).cat(f"{s3_dir.url}/{n}") for n in objects(s3_dir)}
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options)
    assert {n: fs_of(s3_dir).cat(f"{s3_dir.url}/{n}") for n in objects(s3_dir)} == before


def test_a_damaged_newest_object_is_skipped_for_the_previous_one(reference, s3_dir):
    estimator, loader = runs.build()
    with pytest.raises(RuntimeError, match="crash at batch"):
        estimator.fit(loader, epochs=runs.EPOCHS, event_handlers=[handler(s3_dir), CrashAt(5)])
    fs_of(s3_dir).pipe(f"{s3_dir.url}/{runs.name(4)}", b"PK\x03\x04 truncated")
    resumed = runs.fit_run(s3_dir.url, resume_from_checkpoint=True, storage_options=s3_dir.storage_options)
    assert resumed.losses == reference.losses[3 - 1 + 1:]


# -- one writer ---------------------------------------------------------------------------------
def test_a_second_writer_is_refused_while_the_lease_is_held(s3_dir):
    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    lock = checkpoint.DirectoryLock(s3_dir.url)
    lock.acquire()
    try:
        record = json.loads(fs_of(s3_dir).cat(f"{s3_dir.url}/{checkpoint.LOCK_NAME}"))
        assert record["pid"] == os.getpid()
        other = subprocess.run([sys.executable, "-c", (
            "import sys, json; from estimatorch import checkpoint\n"
            f"checkpoint.configure_store({s3_dir.url!r}, json.loads(sys.argv[1]))\n"
            f"checkpoint.DirectoryLock({s3_dir.url!r}).acquire()"), json.dumps(s3_dir.storage_options)],
            capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert other.returncode != 0 and "is in use by another fit" in other.stderr, other.stderr[-2000:]
        assert f"pid {os.getpid()}" in other.stderr
    finally:
        lock.release()
    assert checkpoint.LOCK_NAME not in objects(s3_dir)


def test_a_lease_left_by_a_dead_process_is_taken_over(s3_dir, estimatorch_log):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    record = {"host": __import__("socket").gethostname(), "pid": int(dead.stdout), "since": "then",
              "renewed": 0.0 + __import__("time").time()}
    fs_of(s3_dir).pipe(f"{s3_dir.url}/{checkpoint.LOCK_NAME}", json.dumps(record).encode())
    runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options)
    assert any("taking over the lease" in record.getMessage() for record in estimatorch_log)
    assert checkpoint.LOCK_NAME not in objects(s3_dir)


_TAKE_OVER = """
import json, os, sys
os.environ["ESTIMATORCH_LEASE_SECONDS"] = "0.5"  # (read at import) the first writer's lease looks expired
from estimatorch import checkpoint
from estimatorch.checkpoint import _lease, _store
from estimatorch.event_handlers import BatchEnd
url = sys.argv[1]
checkpoint.configure_store(url, json.loads(sys.argv[2]))
checkpoint.DirectoryLock(url).acquire()  # taken over, not released: this writer goes on
_store.write_bytes(url + "/other-latest", b"the other writer's")
print(os.getpid())
"""


class TakeOver(BatchEnd):
    """At step ``at``: another process takes the lease over, as a second writer would once this
    fit had not renewed it for the expiry (this fit's renewals are held back by the test)."""

    def __init__(self, where, at):
        self.where, self.at, self.pid = where, at, None

    def batch_end(self, estimator, **kwargs):
        if estimator.position.step + 1 == self.at:
            time.sleep(0.6)
            other = subprocess.run([sys.executable, "-c", _TAKE_OVER, self.where.url,
                                    json.dumps(self.where.storage_options)], capture_output=True, text=True,
                                   timeout=120, env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
            assert other.returncode == 0, other.stderr[-2000:]
            self.pid = int(other.stdout)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "writer-process"])
def test_a_lease_taken_over_by_another_writer_stops_this_one_at_its_next_save(s3_dir, monkeypatch, async_save):
    monkeypatch.setattr(_lease, "RENEW_SECONDS", 3600.0)  # this fit never renews: the other takes it over
    estimator, loader = runs.build()
    take_over = TakeOver(s3_dir, at=3)
    with pytest.raises(checkpoint.LeaseLostError) as info:  # the save of step 3 comes after TakeOver's event
        # (with async_save the lease is held by this process, not the writer process: checked before handing over)
        estimator.fit(loader, epochs=runs.EPOCHS,
                      event_handlers=[handler(s3_dir, max_checkpoints=1, async_save=async_save), take_over])
    message = str(info.value)
    assert f"model_dir {s3_dir.url!r}: another writer took over its lease" in message, message
    assert f"pid {take_over.pid}" in message and "left that writer's checkpoints untouched" in message, message
    fs = fs_of(s3_dir)
    # this fit wrote nothing after the take-over (not step 3, no pointer move, no retention), nor
    # removed the other writer's lease or objects
    assert objects(s3_dir) == sorted([runs.name(2), "model-latest", "other-latest", checkpoint.LOCK_NAME])
    assert fs.cat(f"{s3_dir.url}/model-latest").decode().strip() == runs.name(2)
    assert json.loads(fs.cat(f"{s3_dir.url}/{checkpoint.LOCK_NAME}"))["pid"] == take_over.pid
    assert fs.cat(f"{s3_dir.url}/other-latest") == b"the other writer's"
    assert not checkpoint.DirectoryLock(s3_dir.url).held


def test_a_retried_renewal_that_had_landed_keeps_the_lease(s3_dir):
    """A renewal whose answer was lost and that was retried meets a 412 caused by its own write:
    the record (this holding's token) says the lease is still held."""
    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    lock = checkpoint.DirectoryLock(s3_dir.url)
    lock.acquire()
    lease = _lease.lease_of(s3_dir.url)
    try:
        path = f"{s3_dir.url}/{checkpoint.LOCK_NAME}"
        record = json.loads(_store.read_bytes(path))
        _store.write_bytes(path, json.dumps(dict(record, renewed=record["renewed"] + 1)).encode())  # it landed
        assert _store.etag_of(path) != lease.etag  # as the retry's 412 found it
        _lease.check_writer(f"{s3_dir.url}/model-latest")  # no error: still ours
        assert lock.held and lease.etag == _store.etag_of(path)
        _store.write_bytes(path, json.dumps(dict(record, token="someone-else", pid=1)).encode())
        with pytest.raises(checkpoint.LeaseLostError, match="pid 1"):
            _lease.check_writer(f"{s3_dir.url}/model-latest")
        assert not lock.held
    finally:
        lock.release()
    assert checkpoint.LOCK_NAME in objects(s3_dir)  # the other holder's lease is left alone


def test_a_dead_pid_frees_a_lease_only_in_the_holders_own_pid_namespace(monkeypatch):
    """Liveness by pid is judged only where the record's host is this one; ESTIMATORCH_LEASE_HOST
    names a PID namespace where one host name covers several (containers), so that a pid of
    another namespace is never taken for a dead one."""
    import socket

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    fresh = {"host": socket.gethostname(), "pid": int(dead.stdout), "renewed": time.time()}
    assert "is gone" in _lease._stale(fresh)
    monkeypatch.setenv("ESTIMATORCH_LEASE_HOST", "container-a")
    assert _lease._stale(fresh) is None  # another namespace's pid: alive until its lease expires
    assert _lease._stale(dict(fresh, renewed=time.time() - _lease.EXPIRES_SECONDS - 1)).startswith("a holder that")
    assert "is gone" in _lease._stale(dict(fresh, host="container-a"))


def test_incomplete_uploads_of_a_killed_writer_are_aborted_at_the_next_start(s3_dir):
    fs = fs_of(s3_dir)
    key = f"{s3_dir.url.split('/', 3)[3]}/{runs.name(1)}"
    upload = fs.call_s3("create_multipart_upload", Bucket=BUCKET, Key=key)
    fs.call_s3("upload_part", Bucket=BUCKET, Key=key, UploadId=upload["UploadId"], PartNumber=1, Body=b"x" * 1000)
    assert objects(s3_dir) == []  # never taken for a checkpoint
    runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options, resume_from_checkpoint=True)
    left = fs.call_s3("list_multipart_uploads", Bucket=BUCKET, Prefix=key).get("Uploads", [])
    assert left == []


# -- a failed upload ----------------------------------------------------------------------------
@pytest.mark.parametrize("async_save", [False, "thread"], ids=["sync", "thread"])  # (the patch is this process's)
def test_a_failed_upload_keeps_the_previous_checkpoint_and_pointer_and_names_the_url(s3_dir, monkeypatch,
                                                                                   async_save):
    real = _store.write_bytes

    def failing(url, data):
        if url.endswith(runs.name(3)):
            raise OSError(5, f"cannot write {url!r}: the store went away")
        real(url, data)

    monkeypatch.setattr(_store, "write_bytes", failing)
    estimator, loader = runs.build()
    with pytest.raises(OSError, match=f"{s3_dir.url}/{runs.name(3)}"):
        estimator.fit(loader, epochs=runs.EPOCHS, event_handlers=[handler(s3_dir, async_save=async_save)])
    assert runs.name(1) in objects(s3_dir) and runs.name(2) in objects(s3_dir)
    assert runs.name(3) not in objects(s3_dir)
    assert checkpoint.read_latest(s3_dir.url, "model") == runs.name(2)


def test_transient_errors_are_retried_with_a_bound(s3_dir, monkeypatch):
    calls = []
    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    fs, _ = _store.filesystem(s3_dir.url + "/x")  # the instance every call gets (fsspec caches it)
    real = fs.pipe_file

    def flaky(path, data, **kwargs):
        calls.append(path)
        if len(calls) < _store.ATTEMPTS:
            raise ConnectionResetError("reset by peer")
        return real(path, data, **kwargs)

    def down(path, data, **kwargs):
        calls.append(path)
        raise TimeoutError("no answer")

    monkeypatch.setattr(_store, "_BACKOFF", 0.0)
    monkeypatch.setattr(fs, "pipe_file", flaky)
    _store.write_bytes(s3_dir.url + "/x", b"1")
    assert len(calls) == _store.ATTEMPTS and fs_of(s3_dir).cat(s3_dir.url + "/x") == b"1"
    calls.clear()
    monkeypatch.setattr(fs, "pipe_file", down)
    with pytest.raises(OSError, match=f"cannot upload '{s3_dir.url}/y' after {_store.ATTEMPTS} attempts"):
        _store.write_bytes(s3_dir.url + "/y", b"1")
    assert len(calls) == _store.ATTEMPTS and objects(s3_dir) == ["x"]


# -- bad input at the door ----------------------------------------------------------------------
def _bad(s3_dir, which):
    options = dict(s3_dir.storage_options)
    if which == "protocol":
        return "nosuchproto://bucket/run", None
    if which == "bucket":
        return "s3://no-such-bucket-here/run", options
    if which == "credentials":
        return s3_dir.url, dict(options, secret="wrong")
    return s3_dir.url, dict(options, client_kwargs={"endpoint_url": "http://127.0.0.1:9"})


@pytest.mark.parametrize("which, words", [
    ("protocol", "unknown protocol 'nosuchproto'"),
    ("bucket", "the bucket 'no-such-bucket-here' does not exist"),
    ("credentials", "refused the credentials"),
    ("endpoint", "cannot reach the store"),
])
def test_bad_input_is_an_error_naming_model_dir_before_any_step(s3_dir, which, words):
    url, options = _bad(s3_dir, which)
    estimator, loader = runs.build()
    count = Count()
    with pytest.raises(ValueError) as info:
        estimator.fit(loader, epochs=1, event_handlers=[
            CheckpointHandler(url, storage_options=options, batch_period=1), count])
    assert f"model_dir {url!r}" in str(info.value) and words in str(info.value), str(info.value)
    assert count.batches == 0
    assert objects(s3_dir) == []


def test_storage_options_with_a_local_path_are_refused(tmp_path):
    with pytest.raises(ValueError, match="storage_options are for an object store URL"):
        CheckpointHandler(tmp_path, storage_options={"key": "x"})


def test_a_file_url_is_a_plain_path(tmp_path):
    run = runs.fit_run(f"file://{tmp_path}")
    assert run.handler.model_dir == str(tmp_path)
    assert runs.name(runs.STEPS) in os.listdir(tmp_path)


# -- load_weights, inspect ----------------------------------------------------------------------
def test_load_weights_and_inspect_read_objects(reference, s3_dir, capsys, monkeypatch):
    runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options, max_checkpoints=2, extra=[
        CheckpointHandler(s3_dir.url, storage_options=s3_dir.storage_options, epoch_period=None,
                          batch_period=runs.STEPS, save_weights_only=True)])
    newest = checkpoint.load(os.path.join(reference.dir, runs.name(runs.STEPS)))["model"]
    for path in (s3_dir.url, f"{s3_dir.url}/model-latest", f"{s3_dir.url}/{runs.name(runs.STEPS)}",
                 f"{s3_dir.url}/{checkpoint.weights_name('model', runs.EPOCHS - 1, runs.STEPS)}"):
        assert_tree_equal(checkpoint.load_weights(path, storage_options=s3_dir.storage_options), newest, path)
    capsys.readouterr()
    pairs = [f"{key}={json.dumps(value)}" for key, value in s3_dir.storage_options.items()]
    flags = [word for pair in pairs for word in ("--storage-option", pair)]
    code = checkpoint.main(["inspect", f"{s3_dir.url}/model-latest", *flags])
    out, err = capsys.readouterr()
    assert (code, err) == (0, "")
    assert out.splitlines()[0] == f"{s3_dir.url}/{runs.name(runs.STEPS)} ({s3_dir.url}/model-latest points to it)"
    monkeypatch.setenv("ESTIMATORCH_STORAGE_OPTIONS", json.dumps(s3_dir.storage_options))
    code = checkpoint.main(["inspect", f"{s3_dir.url}/{runs.name(runs.STEPS - 1)}"])
    out, err = capsys.readouterr()
    assert code == 0 and out.startswith(f"{s3_dir.url}/{runs.name(runs.STEPS - 1)}: checkpoint, format")


def test_inspect_names_a_damaged_run_state_in_an_object(s3_dir, capsys, monkeypatch):
    runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options, max_checkpoints=1)
    url = f"{s3_dir.url}/{runs.name(runs.STEPS)}"
    payload = torch.load(io.BytesIO(fs_of(s3_dir).cat(url)), weights_only=True)
    del payload["ranks"][0]["data"]
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    fs_of(s3_dir).pipe(url, buffer.getvalue())
    monkeypatch.setenv("ESTIMATORCH_STORAGE_OPTIONS", json.dumps(s3_dir.storage_options))
    capsys.readouterr()
    code = checkpoint.main(["inspect", url])
    out, err = capsys.readouterr()
    assert code == 2 and "the snapshot of rank 0 is missing 'data'" in err and url in err


@pytest.mark.parametrize("mib", [16, 120], ids=["one-put", "multipart"])
def test_an_upload_streams_from_the_serialized_buffer_without_a_second_copy(s3_dir, mib):
    import tracemalloc

    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    buffer = io.BytesIO()
    buffer.write(bytes(range(256)) * (mib << 12))
    url = f"{s3_dir.url}/big"
    _store.listdir(s3_dir.url)  # the client made before measuring
    tracemalloc.start()
    try:
        _store.write_bytes(url, buffer.getbuffer())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < (mib << 20) // 4, f"{peak / 2**20:.1f} MiB allocated to upload {mib} MiB"
    assert _store.read_bytes(url) == buffer.getvalue()


def test_format_versions_and_inspect_read_an_objects_header_not_the_whole_of_it(s3_dir, capsys, monkeypatch):
    runs.fit_run(s3_dir.url, storage_options=s3_dir.storage_options, max_checkpoints=2)
    fs = fs_of(s3_dir)
    newest = f"{s3_dir.url}/{runs.name(runs.STEPS)}"
    damaged = f"{s3_dir.url}/{runs.name(runs.STEPS - 1)}"
    whole = fs.cat(damaged)
    fs.pipe(damaged, whole[:len(whole) // 2])
    real = _store.read_bytes

    def no_whole_checkpoint(url):
        assert not url.endswith(".pt"), f"{url} was downloaded whole"
        return real(url)

    monkeypatch.setattr(_store, "read_bytes", no_whole_checkpoint)
    assert checkpoint.format_versions(s3_dir.url, "model") == {damaged: None, newest: checkpoint.FORMAT_VERSION}
    monkeypatch.setenv("ESTIMATORCH_STORAGE_OPTIONS", json.dumps(s3_dir.storage_options))
    capsys.readouterr()
    assert checkpoint.main(["inspect", f"{s3_dir.url}/model-latest"]) == 0
    out = capsys.readouterr().out
    model = runs.build()[0].net.state_dict()  # shapes and dtypes read from the header alone
    sizes = f"model {len(model)} tensors, {sum(t.numel() for t in model.values())} values (float32)"
    assert f"{newest}: checkpoint, format {checkpoint.FORMAT_VERSION}" in out and sizes in out, out
    assert "position" in out, out
    assert checkpoint.main(["inspect", damaged]) == 2
    assert "truncated or damaged" in capsys.readouterr().err


def test_local_paths_never_import_fsspec(tmp_path):
    code = f"""
import sys
from tests.checkpoint import runs
from estimatorch import checkpoint
runs.fit_run({str(tmp_path)!r}, max_checkpoints=2)
checkpoint.load_weights({str(tmp_path)!r})
checkpoint.main(["inspect", {str(tmp_path / "model-latest")!r}])
assert "fsspec" not in sys.modules and "s3fs" not in sys.modules, "fsspec was imported"
print("no fsspec")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0 and "no fsspec" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("url, words", [("nosuchproto://b/run", "unknown protocol 'nosuchproto'"),
                                        ("s3://no-such-bucket-here/run", "no such file or directory")])
def test_load_weights_and_inspect_of_a_bad_url_are_clear_errors(s3_dir, capsys, monkeypatch, url, words):
    with pytest.raises((ValueError, FileNotFoundError)) as info:
        checkpoint.load_weights(url, storage_options=s3_dir.storage_options)
    assert url in str(info.value) and words in str(info.value), str(info.value)
    monkeypatch.setenv("ESTIMATORCH_STORAGE_OPTIONS", json.dumps(s3_dir.storage_options))
    capsys.readouterr()
    code = checkpoint.main(["inspect", url])
    out, err = capsys.readouterr()
    assert code == 2 and err.startswith("error: ") and url in err and out == "", err


def test_sharded_checkpoints_go_to_object_storage_as_directories_and_resume_bitwise(reference, s3_dir):
    """(In one process, ``sharded=True``; 2 ranks of a sharded net: test_object_store_sharded.py.)"""
    crashed_at = 4
    estimator, loader = runs.build()
    with pytest.raises(RuntimeError, match="crash at batch"):
        estimator.fit(loader, epochs=runs.EPOCHS, event_handlers=[handler(s3_dir, sharded=True, max_checkpoints=2),
                                                                   CrashAt(crashed_at)])
    names = [runs.name(step).replace(".pt", ".dcp") for step in (crashed_at - 2, crashed_at - 1)]
    assert objects(s3_dir) == sorted([*names, "model-latest"])
    assert "estimatorch.json" in [os.path.basename(p) for p in fs_of(s3_dir).ls(f"{s3_dir.url}/{names[-1]}")]
    resumed = runs.fit_run(s3_dir.url, resume_from_checkpoint=True, storage_options=s3_dir.storage_options,
                           sharded=True)
    assert resumed.losses == reference.losses[crashed_at - 1:]
    assert_tree_equal(resumed.estimator.net.state_dict(), reference.estimator.net.state_dict())
    weights = checkpoint.load_weights(s3_dir.url, storage_options=s3_dir.storage_options)
    assert_tree_equal(dict(weights), reference.estimator.net.state_dict())


def test_a_sharded_directory_on_s3_round_trips_and_its_metadata_runs_no_code(s3_dir, tmp_path, monkeypatch):
    from tests.checkpoint.test_sharded import _Boom, load_plain, save_plain

    checkpoint.configure_store(s3_dir.url, s3_dir.storage_options)
    url = f"{s3_dir.url}/model-epoch0batch2.dcp"
    net, _ = save_plain(url)
    assert sorted(objects_under(s3_dir, "model-epoch0batch2.dcp")) == [
        ".metadata", "__0_0.distcp", "common.pt", "estimatorch.json", "rank-0.pt"]
    loaded, _, rank_state = load_plain(url)
    assert_tree_equal(loaded.state_dict(), net.state_dict()) and rank_state["step"] == 2
    with pytest.raises(FileExistsError, match="never overwritten"):
        save_plain(url)
    fs_of(s3_dir).pipe(f"{url}/.metadata", pickle.dumps(_Boom()))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CheckpointError, match="posix.system is not part of a checkpoint's metadata"):
        load_plain(url)
    with pytest.raises(CheckpointError):
        checkpoint.load_weights(url, storage_options=s3_dir.storage_options)
    assert not (tmp_path / "pwned").exists()


def objects_under(where, name) -> list[str]:
    return [os.path.basename(p) for p in fs_of(where).ls(f"{where.url}/{name}", detail=False)]


def test_another_fsspec_protocol_works_alike(reference):
    """fsspec's in-memory filesystem: no conditional writes (the lease falls back to look-then-write)."""
    url = f"memory://estimatorch-{os.getpid()}/run"
    estimator, loader = runs.build()
    with pytest.raises(RuntimeError, match="crash at batch"):
        estimator.fit(loader, epochs=runs.EPOCHS, event_handlers=[
            CheckpointHandler(url, batch_period=1, epoch_period=None, max_checkpoints=2), CrashAt(6)])
    assert checkpoint.read_latest(url, "model") == runs.name(5)
    resumed = runs.fit_run(url, resume_from_checkpoint=True, max_checkpoints=2)
    assert resumed.losses == reference.losses[5:]
    assert_tree_equal(checkpoint.load_weights(url), checkpoint.load(os.path.join(reference.dir, runs.name(8)))["model"])


def test_the_checkpoints_announced_to_trackers_are_named_by_their_url():
    """``checkpoint_saved`` names objects by URL (a tracker's tag, an artifact), never as a path
    made absolute under the working directory."""
    from estimatorch.events import CheckpointSaved

    class Recorder(CheckpointSaved):
        def __init__(self):
            self.written, self.removed = [], []

        def checkpoint_saved(self, estimator, *, written, removed, **kwargs):
            self.written += written
            self.removed += removed

    url = f"memory://estimatorch-{os.getpid()}/announced"
    estimator, loader = runs.build()
    recorder = Recorder()
    estimator.fit(loader, epochs=runs.EPOCHS, event_handlers=[
        CheckpointHandler(url, batch_period=1, epoch_period=None, max_checkpoints=2), recorder])
    assert recorder.written == [f"{url}/{runs.name(step)}" for step in range(1, runs.STEPS + 1)]
    assert recorder.removed == [f"{url}/{runs.name(step)}" for step in range(1, runs.STEPS - 1)]
