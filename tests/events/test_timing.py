"""StepTimes' bookkeeping of the CUDA events of each step, with events that stand in for CUDA's
(this machine has none; tests/event_handlers/test_speed_monitor.py runs the real ones on a GPU)."""

from __future__ import annotations

from estimatorch.events import timing
from estimatorch.events.timing import StepTimes


class Event:
    """Records the 'time' a step is given; done once the 'device' has passed it."""

    device_at = 0.0  # how far the stand-in device has run (ms)

    def __init__(self):
        self.at = None
        self.waited = 0

    def record(self, at):
        self.at = at

    def query(self):
        return self.at <= Event.device_at

    def synchronize(self):
        self.waited += 1
        Event.device_at = max(Event.device_at, self.at)

    def elapsed_time(self, end):
        return end.at - self.at


def _times(monkeypatch, steps, device_at=0.0):
    times = StepTimes(events=True)
    monkeypatch.setattr(timing.torch.cuda, "Event", lambda enable_timing: Event())
    Event.device_at = device_at
    made = []
    for i in range(steps):
        times.steps += 1
        start, end = times.event(), times.event()
        start.record(10.0 * i)
        end.record(10.0 * i + 4.0)  # each step: 4 ms on the device
        times.add_device_step(start, end)
        made += [start, end]
    return times, made


def test_only_finished_steps_are_read_without_waiting(monkeypatch):
    times, _ = _times(monkeypatch, 5)
    Event.device_at = 25.0  # steps 0, 1 and 2 (ending at 4, 14, 24) are done
    split = times.split()
    assert split.device_steps == 3 and split.device == 0.012
    assert split.per_step()["device"] == 0.004  # per finished step, not per step taken


def test_waiting_reads_every_step_with_one_synchronisation(monkeypatch):
    times, made = _times(monkeypatch, 5)
    split = times.split(wait=True)
    assert split.device_steps == 5 and split.device == 0.02
    assert sum(e.waited for e in made) == 1  # the last step's end event only


def test_read_events_are_reused_and_the_loop_drains_every_64_steps(monkeypatch):
    times, made = _times(monkeypatch, timing.DRAIN * 3, device_at=1e9)  # the device keeps up
    assert len(times._pending) == 0  # drained at 64, 128 and 192 steps
    assert len({id(e) for e in made}) == 2 * timing.DRAIN  # events made for the first 64 steps, then reused
    assert times.device_steps == 3 * timing.DRAIN
