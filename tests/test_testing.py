"""assert_resumable: passes for a resumable setup and names the first step where a broken one
diverges."""

from __future__ import annotations

import logging
import random

import numpy as np
import pytest
import torch
from torch import nn

from estimatorch import Estimator, rng
from estimatorch.event_handlers import BatchEnd
from estimatorch.data import TrainStream, register_adapter, unregister_adapter
from estimatorch.testing import assert_resumable, check_stream_adapter
from tests.data.test_iterable_streams import StatefulRange
from tests.conftest import make_batches, make_estimator


class Augmented(torch.utils.data.Dataset):
    def __init__(self, own_generator=False):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(30, 4, generator=g), torch.randint(0, 3, (30,), generator=g)
        # A generator of the dataset's own is not reseeded per sample (estimatorch reseeds the
        # global ones and rng.default_numpy_rng()): its draws depend on history, which
        # assert_resumable must catch.
        self.own = np.random.default_rng(0) if own_generator else None

    def __len__(self):
        return 30

    def __getitem__(self, i):
        source = self.own if self.own is not None else rng.default_numpy_rng()
        return self.x[i] + float(source.normal()) + 0.1 * torch.randn(4) + float(np.random.normal()), self.y[i]


def make():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 3))
    opt = torch.optim.Adam(net.parameters(), lr=0.01)
    return Estimator(net, nn.CrossEntropyLoss(), optimizer=opt, lr_scheduler=torch.optim.lr_scheduler.StepLR(opt, 1))


def loader(own_generator=False):
    return torch.utils.data.DataLoader(Augmented(own_generator), batch_size=8, shuffle=True)


def test_a_resumable_setup_passes():
    assert_resumable(make, loader(), epochs=3, quiet=True)  # default stop points: 1, 2, 4, 5, 6, 12


class ForgetfulDecay(BatchEnd):
    """Halves the learning rate every 3 batches, counting in an attribute it never saves."""

    def __init__(self):
        self.seen = 0

    def batch_end(self, est, **kw):
        self.seen += 1
        if self.seen % 3 == 0:
            for group in est.optimizer.param_groups:
                group["lr"] /= 2


def test_a_handler_that_does_not_save_its_counter_is_caught():
    # uninterrupted, the rate halves after step 6; resumed, the counter restarts and it does not:
    # step 7's update (parameters after it) is the first difference
    with pytest.raises(AssertionError, match=r"resumed after step 5: the parameters after step 7 differ"):
        assert_resumable(make, loader(), epochs=3, event_handlers=lambda: [ForgetfulDecay()], stop_at=[5],
                         quiet=True)


def test_data_drawn_from_a_generator_that_is_not_restored_is_caught():
    # a fresh dataset per fit: two uninterrupted runs agree, the resumed one does not
    with pytest.raises(AssertionError, match=r"^resume differs: resumed after step 2: the loss of step 3 differs"
                                             r".*two uninterrupted runs agree"):
        assert_resumable(make, lambda: loader(own_generator=True), epochs=2, stop_at=[2], quiet=True)


def test_a_setup_that_is_not_deterministic_by_itself_is_told_apart_from_a_resume_that_differs():
    # one dataset for every fit, with a generator of its own that goes on from run to run: two
    # uninterrupted runs already differ
    with pytest.raises(AssertionError, match=r"^setup not deterministic: a second uninterrupted run: the loss "
                                             r"of step 1 differs"):
        assert_resumable(make, loader(own_generator=True), epochs=2, stop_at=[2], quiet=True)

    def unseeded():
        net = nn.Linear(4, 3)  # initial weights from wherever torch's generator stands
        return Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))

    with pytest.raises(AssertionError, match=r"^setup not deterministic"):
        assert_resumable(unseeded, loader(), epochs=1, stop_at=[2], quiet=True)


def test_stop_points_outside_the_run_are_refused():
    with pytest.raises(ValueError, match="stop_at holds 99"):
        assert_resumable(make, loader(), epochs=1, stop_at=[99], quiet=True)


def test_quiet_also_keeps_the_default_progress_bar_off_the_screen(monkeypatch, capsys):
    """In a terminal or notebook fit adds a bar by default; quiet=True must keep it unseen."""
    from estimatorch.estimator._setup import handlers as fit_setup

    monkeypatch.setattr(fit_setup, "interactive", lambda: True)
    assert_resumable(make_estimator, make_batches(3), epochs=2, stop_at=[2], quiet=True)
    captured = capsys.readouterr()
    assert "epochs" not in captured.err and "batch" not in captured.err


def test_the_log_keeps_its_info_level_when_assert_resumable_runs_before_any_estimator():
    """assert_resumable puts the logger's level back afterwards: run before any Estimator had set
    the logger up, it used to put back NOTSET, silencing fit's INFO lines from then on."""
    logger = logging.getLogger("estimatorch")
    handlers, level, propagate = logger.handlers[:], logger.level, logger.propagate
    logger.handlers = [h for h in handlers if not getattr(h, "_estimatorch_default", False)]
    logger.setLevel(logging.NOTSET)  # as in a fresh process
    try:
        assert_resumable(make_estimator, make_batches(2), epochs=1, stop_at=[1], quiet=True)
        assert logger.isEnabledFor(logging.INFO)
    finally:
        logger.handlers, logger.propagate = handlers, propagate
        logger.setLevel(level)


# -- check_stream_adapter ------------------------------------------------------------------------
class _Listed:
    """Data of a kind no built-in adapter knows: a few batches of distinct values."""

    def __init__(self, n: int = 6):
        self.batches = [(torch.full((2, 4), float(i)), torch.tensor([i % 3, (i + 1) % 3])) for i in range(n)]

    def __iter__(self):
        return iter(self.batches)


class _Forgetful(_Listed):
    pass


class _Shuffled(_Listed):
    pass


class _ForgetfulStream(TrainStream):
    """Broken: ignores the position it is asked to start at."""

    def __init__(self, data, seed):
        super().__init__(seed)
        self.data, self.batches_per_epoch = data, len(data.batches)

    def epoch_iter(self, epoch, start):
        return iter(self.data.batches)


class _ShuffledStream(_ForgetfulStream):
    """Broken: its epoch's order drawn from python's global generator when the epoch starts."""

    def epoch_iter(self, epoch, start):
        order = list(range(len(self.data.batches)))
        random.shuffle(order)
        return (self.data.batches[i] for i in order[start:])


class _Drawing(_Listed):
    pass


class _DrawingStream(_ForgetfulStream):
    """Broken: right batches, but it draws from torch's global generator when an epoch starts."""

    def epoch_iter(self, epoch, start):
        torch.rand(1)
        return iter(self.data.batches[start:])


class _Adapter:
    def __init__(self, name, kind, stream):
        self.name, self.kind, self.stream = name, kind, stream

    def recognises(self, source):
        return type(source.data) is self.kind

    def open(self, source):
        return self.stream(source.data, source.seed)


@pytest.fixture
def broken_adapters():
    for name, kind, stream in (("test-forgetful", _Forgetful, _ForgetfulStream),
                               ("test-shuffled", _Shuffled, _ShuffledStream),
                               ("test-drawing", _Drawing, _DrawingStream)):
        register_adapter(_Adapter(name, kind, stream))
    yield
    for name in ("test-forgetful", "test-shuffled", "test-drawing"):
        unregister_adapter(name)


@pytest.mark.parametrize("make_data", [
    lambda workers: torch.utils.data.DataLoader(Augmented(), batch_size=8, shuffle=True, num_workers=workers),
    lambda workers: torch.utils.data.DataLoader(StatefulRange(30, noise=True), batch_size=4, num_workers=workers),
], ids=["map-loader-augmented", "stateful-iterable"])
def test_the_adapter_check_passes_the_built_in_adapters_over_workers(make_data):
    check_stream_adapter(make_data)


@pytest.mark.parametrize("kind, words", [
    (_Forgetful, r"resumed at the middle of an epoch \(epoch 0, after batch 3\) with num_workers=0: "
                 r"epoch 0's batch 3 differs from the uninterrupted read's"),
    (_Shuffled, r"resumed at the middle of an epoch \(epoch 0, after batch 3\) with num_workers=0: epoch 0's batch "),
    (_Drawing, r"resumed at the middle of an epoch \(epoch 0, after batch 3\) with num_workers=0: after epoch 0 the "
               r"generators\['torch'\] differ"),
], ids=["ignores-the-position", "draws-its-order-from-the-global-generator", "shifts-the-global-generator"])
def test_the_adapter_check_fails_a_broken_adapter_naming_where(broken_adapters, kind, words):
    with pytest.raises(AssertionError, match=words):
        check_stream_adapter(lambda workers: kind(), num_workers=(0,))


def test_the_adapter_check_names_a_wrong_batch_count_and_refuses_too_few_epochs(broken_adapters):
    class Short(_ForgetfulStream):
        def epoch_iter(self, epoch, start):
            return iter(self.data.batches[start:-1])

    register_adapter(_Adapter("test-short", _Listed, Short))
    try:
        with pytest.raises(AssertionError, match="batches_per_epoch says 6, but the first epoch yielded 5"):
            check_stream_adapter(lambda workers: _Listed(), num_workers=(0,))
    finally:
        unregister_adapter("test-short")
    with pytest.raises(ValueError, match="epochs must be an int of at least 2"):
        check_stream_adapter(lambda workers: _Listed(), epochs=1)
