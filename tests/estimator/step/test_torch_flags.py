"""What fit sets up around the loop: torch's process-wide flags during a fit."""

from __future__ import annotations

import torch
from torch import nn

from estimatorch import Estimator
from estimatorch.event_handlers import BatchEnd


class Threads(BatchEnd):
    def __init__(self) -> None:
        self.seen: list[int] = []

    def batch_end(self, estimator, **kwargs):
        self.seen.append(torch.get_num_threads())


def thread_sensitive(deterministic: bool) -> tuple[Estimator, list]:
    """A net whose matrix products split their sums by the thread count (256 hidden units over
    256 samples: with 1 and with 2 threads the parameters differ in their last bits here)."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)) for _ in range(3)]
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                    deterministic=deterministic)
    return est, batches


def test_deterministic_on_the_cpu_trains_on_one_thread_and_puts_the_count_back():
    torch.set_num_threads(2)  # the test session runs on one (conftest); put back there
    est, batches = thread_sensitive(deterministic=True)
    threads = Threads()
    est.fit(batches, epochs=1, event_handlers=[threads])
    assert threads.seen == [1, 1, 1]
    assert torch.get_num_threads() == 2
    est.deterministic = False
    threads.seen.clear()
    est.fit(batches, epochs=1, event_handlers=[threads])
    assert threads.seen == [2, 2, 2]


def test_deterministic_gives_the_same_bits_whatever_thread_count_the_process_started_with():
    results = []
    for start in (2, 1, 2):
        torch.set_num_threads(start)
        est, batches = thread_sensitive(deterministic=True)
        est.fit(batches, epochs=1)
        results.append([p.detach().clone() for p in est.net.parameters()])
    for other in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], other))
