"""The batch conventions: the (data, label) split, inputs given to the net, device moves and
sample counts."""

from __future__ import annotations

import collections

import pytest
import torch

from estimatorch._batches import batch_size_of, call_net, split_batch, split_inputs, to_device


def test_split_batch_conventions():
    x, y, z = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    assert split_batch((x, y)) == (x, y)
    assert split_batch([x, y]) == (x, y)
    data, label = split_batch((x, y, z))
    assert data == (x, y) and label is z
    data, label = split_batch({"a": x, "label": y})
    assert data == {"a": x} and label is y
    data, label = split_batch({"a": x, "labels": y})
    assert label is y
    with pytest.raises(ValueError, match="'label'"):
        split_batch({"a": x})
    with pytest.raises(TypeError, match="BatchProcessor"):
        split_batch(x)
    with pytest.raises(TypeError, match="length 1"):
        split_batch((x,))


def test_split_inputs_conventions():
    x, y, z = torch.zeros(2), torch.ones(2), torch.full((2,), 2.0)
    assert split_inputs(x) is x
    assert split_inputs((x,)) is x and split_inputs([x]) is x
    assert split_inputs((x, y)) is x  # a pair is (data, label), as in fit and evaluate
    assert split_inputs((x, y, z)) == (x, y)
    assert split_inputs(((x, y),)) == (x, y)  # two inputs without a label
    assert split_inputs({"a": x, "labels": y}) == {"a": x}
    assert split_inputs({"a": x, "b": y}) == {"a": x, "b": y}
    assert split_inputs("text") == "text"


def test_call_net_unpacks_tuples_and_dicts():
    assert call_net(lambda a, b: a + b, (1, 2)) == 3
    assert call_net(lambda a, b: a - b, {"a": 5, "b": 2}) == 3
    assert call_net(lambda a: a * 2, 4) == 8


def test_to_device_keeps_structure_and_namedtuples():
    Pair = collections.namedtuple("Pair", "x y")
    batch = {"p": Pair(torch.zeros(1), [torch.ones(1), "s"]), "n": 3}
    moved = to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].y[1] == "s" and moved["n"] == 3
    assert moved["p"].x is batch["p"].x  # already there: not copied


def test_batch_size_of_reads_shapes():
    assert batch_size_of(torch.zeros(7, 3)) == 7
    assert batch_size_of(torch.zeros(3, 7), batch_axis=1) == 7
    assert batch_size_of((torch.zeros(5), torch.zeros(5))) == 5
    assert batch_size_of({"a": torch.zeros(4, 2)}) == 4


# -- moving batches: on CUDA through a side stream, elsewhere unchanged -----------------------------
def test_off_cuda_the_batches_move_as_before_and_no_stream_is_made(monkeypatch):
    from estimatorch import Estimator
    from estimatorch._batches import batch_mover

    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA stream or event was made for a CPU fit")

    monkeypatch.setattr(torch.cuda, "Stream", no_cuda)
    monkeypatch.setattr(torch.cuda, "Event", no_cuda)
    x, y = torch.zeros(2, 3), torch.ones(2)
    move = batch_mover(torch.device("cpu"))
    assert move([x, y])[0] is x and move({"a": x})["a"] is x
    torch.manual_seed(0)
    net = torch.nn.Linear(3, 2)
    est = Estimator(net, torch.nn.MSELoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1))
    est.fit([(torch.randn(4, 3), torch.randn(4, 2)) for _ in range(3)], epochs=1)


class _FakeStream:
    """Stands for a CUDA stream on the CPU: records what is queued on it, in order."""

    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait_event(self, event):
        self.log.append((self.name, "waits for", event.recorded_on))


def test_the_side_stream_copy_queues_the_copy_then_an_event_the_current_stream_waits_for(monkeypatch):
    import contextlib

    from estimatorch import _batches

    log, active = [], []
    current = _FakeStream(log, "current")

    class Event:
        def record(self, stream):
            self.recorded_on = stream.name
            log.append((stream.name, "records an event"))

    @contextlib.contextmanager
    def on(stream):
        active.append(stream.name)
        yield
        active.pop()

    real_to = torch.Tensor.to

    def to(self, *args, **kwargs):
        log.append((active[-1] if active else "current", "copies", kwargs.get("non_blocking")))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: _FakeStream(log, "side"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: current)
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "record_stream",
                        lambda self, stream: log.append((stream.name, "uses", tuple(self.shape))))
    meta = torch.device("meta")  # a device the CPU can "copy" to: the stream logic is the same
    move = _batches.SideStreamCopy(meta)
    moved = move((torch.zeros(4, 3), torch.zeros(4)))
    assert [t.device for t in moved] == [meta, meta]
    assert log == [("side", "copies", True), ("side", "copies", True), ("side", "records an event"),
                   ("current", "waits for", "side"), ("current", "uses", (4, 3)), ("current", "uses", (4,))]
    log.clear()
    assert move(moved)[0] is moved[0]  # already there: no stream work at all
    assert log == []
