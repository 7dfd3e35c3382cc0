"""Shared fixtures: tiny models and data that train in milliseconds."""

from __future__ import annotations

import errno
import functools
import logging
import math
import os
import signal
import socket
from typing import Any

import pytest
import torch
from torch import nn

from estimatorch import Estimator, checkpoint
from estimatorch.event_handlers import BatchBegin, BatchEnd, EpochEnd, LambdaHandler


@pytest.fixture(autouse=True, scope="session")
def _ctrl_c_reaches_the_tests():
    """Tests press Ctrl-C (``signal.raise_signal(SIGINT)``); a suite started in the background by a
    non-interactive shell inherits SIGINT ignored, and fit rightly leaves an ignored SIGINT alone."""
    saved = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, saved)


_REAL_CUDA = torch.cuda.is_available  # pytest imports conftest before it collects (skipif asks it)
_VISIBLE = os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True, scope="session")
def _cpu_by_default():
    """The suite tests the CPU paths (CI has no GPU) and the tests marked ``cuda`` test the GPU's.
    On a machine with a GPU every other test, and every fixture, runs as on one without: fits
    default to the CPU, and the subprocesses tests start (spawn, torchrun) see no GPU either."""
    if not _REAL_CUDA():
        yield
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.cuda, "is_available", lambda: False)
        patch.setenv("CUDA_VISIBLE_DEVICES", "")  # read by child processes only: CUDA is initialised here
        yield


@pytest.fixture(autouse=True)
def _gpu_for_cuda_tests(request, monkeypatch, _cpu_by_default):
    if request.node.get_closest_marker("cuda") is not None and _REAL_CUDA():
        monkeypatch.setattr(torch.cuda, "is_available", _REAL_CUDA)
        if _VISIBLE is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", _VISIBLE)
    yield


@pytest.fixture(autouse=True, scope="session")
def _ranks_from_a_forkserver():
    """``distributed.spawn``'s ranks are forks of one server per test process that imported torch
    once (stdlib multiprocessing's forkserver), not fresh interpreters: a spawned rank's seconds
    of imports, times some hundred launches, were a large part of the suite. Each rank is still
    a new process that shares nothing with the test's or an earlier run's (the server never runs
    a rank's code), with the caller's environment and working directory.
    tests/distributed/test_distributed.py tests the plain "spawn" start, the library's default."""
    from estimatorch.distributed import _spawn
    from tests import forked

    forked.forkserver()  # its preload (tests/forked.py)
    saved, _spawn._START_METHOD = _spawn._START_METHOD, "forkserver"
    yield
    _spawn._START_METHOD = saved


@pytest.fixture
def fresh_interpreter_ranks():
    """For a test of spawn itself: its ranks start as the library starts them, fresh interpreters."""
    from estimatorch.distributed import _spawn

    saved, _spawn._START_METHOD = _spawn._START_METHOD, "spawn"
    yield
    _spawn._START_METHOD = saved


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_batches(n_batches: int = 4, batch_size: int = 8, features: int = 4, classes: int = 3, seed: int = 0):
    """A list of (data, label) batches with a learnable rule."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_batches * batch_size, features, generator=g)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 1).long()
    y = y.clamp(max=classes - 1)
    return list(zip(x.split(batch_size), y.split(batch_size)))


def make_estimator(features: int = 4, classes: int = 3, lr: float = 0.1, **kwargs) -> Estimator:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, classes))
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=lr), **kwargs)


@pytest.fixture
def batches():
    return make_batches()


@pytest.fixture
def estimator():
    return make_estimator()


class Count(BatchEnd, EpochEnd):
    """Counts the batches and epochs a fit really ran (runs before every other handler)."""

    priority = -10_000

    def __init__(self) -> None:
        self.batches = 0
        self.epochs = 0

    def batch_end(self, estimator, **kwargs):
        self.batches += 1

    def epoch_end(self, estimator, **kwargs):
        self.epochs += 1


def assert_tree_equal(a: Any, b: Any, where: str = "state") -> None:
    """Tensors bitwise equal (same dtype), floats equal (nan equals nan), same structure."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_tree_equal(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_tree_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), where
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_training_state(a: Estimator, b: Estimator) -> None:
    """Model, optimizer and LR scheduler states bitwise equal."""
    assert_tree_equal(a.net.state_dict(), b.net.state_dict(), "model")
    assert_tree_equal(a.optimizer.state_dict(), b.optimizer.state_dict(), "optimizer")
    assert_tree_equal(a.lr_scheduler.state_dict(), b.lr_scheduler.state_dict(), "lr_scheduler")


@pytest.fixture
def estimatorch_log():
    """The records of the ``estimatorch`` logger, DEBUG and up (it does not propagate to the root
    logger, so ``caplog`` does not see them)."""
    records: list[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logger = logging.getLogger("estimatorch")
    handler = Collect(level=logging.DEBUG)
    logger.addHandler(handler)
    yield records
    logger.removeHandler(handler)


class LossRecorder(BatchEnd):
    """Every step's loss as the exact hex of its float."""

    def __init__(self) -> None:
        self.losses: list[str] = []

    def batch_end(self, estimator: Any, *, loss: torch.Tensor, **kwargs: Any) -> None:
        self.losses.append(float(loss.detach()).hex())


def losses_recorder() -> tuple[list[str], LossRecorder]:
    """``(losses, handler)``: the list the handler fills with every step's loss."""
    recorder = LossRecorder()
    return recorder.losses, recorder


class CrashAt(BatchBegin):
    """Raise when batch ``n`` (1-based, over the run) begins: a process that dies there."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def batch_begin(self, estimator: Any, **kwargs: Any) -> None:
        self.seen += 1
        if self.seen == self.n:
            raise RuntimeError(f"crash at batch {self.n}")


class CtrlC(BatchEnd):
    """Presses Ctrl-C during step ``at`` (counted from this handler's first batch): fit stops at
    that step's end."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def batch_end(self, estimator: Any, **kwargs: Any) -> None:
        self.seen += 1
        if self.seen == self.at:
            signal.raise_signal(signal.SIGINT)


def ctrl_c_at(step: int) -> Any:
    """Interrupt at the end of ``step`` of the fit as a user's Ctrl-C would (fit stops at that
    boundary)."""
    return LambdaHandler(batch_end=lambda est, **kw: signal.raise_signal(signal.SIGINT), once=step)


class ScriptedValLoss:
    """A validation loss that returns the next of ``values`` at each evaluation (one batch each):
    build its estimator with :func:`without_sanity_pass`, since fit's sanity pass would take one."""

    def __init__(self, values: list[float]):
        self.values, self.calls = values, 0

    def __call__(self, pred: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        value = self.values[self.calls]
        self.calls += 1
        return torch.tensor(value)


def without_sanity_pass(estimator: Estimator) -> Estimator:
    """``estimator`` whose every ``fit`` skips the sanity pass (``num_sanity_val_steps=0``): for a
    val loss that counts its calls, as :class:`ScriptedValLoss` does."""
    estimator.fit = functools.partial(estimator.fit, num_sanity_val_steps=0)  # type: ignore[method-assign]
    return estimator


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on (for "unreachable" servers)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fill_disk_at(name: str) -> None:
    """In this process, from now on, ``checkpoint.atomic_save`` of the file called ``name`` fails
    as on a full disk (ENOSPC, naming the file); other files are written."""
    real = checkpoint.atomic_save

    def full_disk(obj, path, **kwargs):
        if os.path.basename(path) == name:
            raise OSError(errno.ENOSPC, f"cannot write {path!r}: No space left on device")
        real(obj, path, **kwargs)

    checkpoint.atomic_save = full_disk


from tests.s3server import s3_dir, s3_server  # noqa: E402,F401 - the object-storage tests' S3 server


class OpaqueMetric:
    """A metric-like object (update/compute/reset) that does not say its update is capturable
    (as a torchmetrics one): it keeps MetricHandler out of a captured step's graph."""

    name = "opaque"

    def update(self, preds, target):
        pass

    def compute(self):
        return 0.0

    def reset(self):
        pass
