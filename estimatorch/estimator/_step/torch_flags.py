"""torch's process-wide algorithm flags for the duration of a fit (``deterministic``,
``cudnn_benchmark``), restored afterwards.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ['torch_flags']


@contextlib.contextmanager
def torch_flags(deterministic: bool, cudnn_benchmark: bool, cpu: bool = False) -> Iterator[None]:
    """torch's process-wide algorithm flags for the duration of a fit, restored afterwards.

    ``deterministic``: deterministic algorithms and cuDNN, and, when the net trains on the CPU
    (``cpu``), one intra-op thread: a CPU kernel splits its work (a matrix product's sums, a
    reduction) by the thread count, which torch takes at start-up from the CPUs the process may
    run on, so the same script gives other bits where it starts with other CPUs.
    """
    saved = (torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    threads = torch.get_num_threads()
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.deterministic = True
        if cpu and threads != 1:
            torch.set_num_threads(1)
    torch.backends.cudnn.benchmark = cudnn_benchmark
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[2], saved[3]
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
