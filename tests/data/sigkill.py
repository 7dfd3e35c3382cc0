"""SIGKILL-and-resume runs for the ported upstream resume tests (tests/data/test_*_ports.py).

The pattern is tests/test_docs.py's SIGKILL test (a fit that records each step's batch and loss,
checkpoints every batch and SIGKILLs itself right after the checkpoint of a chosen step, then runs
again), made cheap enough to run over many pipelines on a loaded 2-core machine:

- each fit runs in a process forked from one forkserver that imported torch, datasets, streaming
  and torchdata once (``tests/forked.py``'s ``FORKSERVER_PRELOAD``): a fresh interpreter costs
  10-15 s of imports here, a fork none;
- one killed chain per pipeline covers every stop: the fit is killed at the first stop, run again
  and killed at the second (resuming from the first), and so on, then run to the end; the steps it
  recorded across all its processes must be the uninterrupted run's, line for line.

A pipeline is named by ``"module:function"`` and an argument; ``function(argument, num_workers,
data_dir)`` builds the ``train_data`` in the child (data written by the test into ``data_dir``).
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import pathlib
import signal
import warnings
from typing import Any

import torch

from tests import forked

_CONTEXT: Any = None


def _context() -> Any:
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = forked.forkserver()  # torch, datasets, streaming and torchdata imported once
    return _CONTEXT


def _flat(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"{value.dtype}{list(value.shape)}:{value.detach().cpu().contiguous().numpy().tobytes().hex()}"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}={_flat(value[k])}" for k in sorted(value)) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_flat(v) for v in value) + "]"
    return repr(value)


def _fit(pipeline: str, argument: Any, num_workers: int, data_dir: str, workdir: str, stops: list[int],
         epochs: int) -> None:
    """One process of a run: resume from ``workdir``'s checkpoints, record each step, SIGKILL itself
    right after the checkpoint of the first stop past the steps already recorded."""
    from estimatorch import CheckpointHandler
    from estimatorch.event_handlers import BatchEnd
    from tests.data.test_iterable_streams import dropout_estimator

    torch.set_num_threads(1)
    multiprocessing.set_start_method("fork", force=True)  # DataLoader workers as in a plain Linux process
    steps_file = os.path.join(workdir, "steps.txt")
    done = len(pathlib.Path(steps_file).read_text().splitlines()) if os.path.exists(steps_file) else 0
    kill_at = next((s for s in stops if s > done), None)

    class Record(BatchEnd):
        priority = float("inf")

        def __init__(self) -> None:
            self.steps = done

        def batch_end(self, estimator: Any, *, batch: Any, loss: Any, **kwargs: Any) -> None:
            self.steps += 1
            with open(steps_file, "a") as f:
                f.write(f"{_flat(batch)} {float(loss).hex()}\n")
            if self.steps == kill_at:  # killed right after the checkpoint of this step
                estimator.at_boundary(lambda: os.kill(os.getpid(), signal.SIGKILL))

    module, function = pipeline.split(":")
    data = getattr(importlib.import_module(module), function)(argument, num_workers, data_dir)
    est = dropout_estimator()
    handlers = [Record(), CheckpointHandler(os.path.join(workdir, "ckpt"), batch_period=1, epoch_period=None,
                                            max_checkpoints=2, resume_from_checkpoint=True)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        est.fit(data, epochs=epochs, event_handlers=handlers)
    pathlib.Path(workdir, "warnings.txt").write_text("".join(f"{w.message}\n" for w in caught))
    torch.save([p.detach().clone() for p in est.net.parameters()], os.path.join(workdir, "final.pt"))


def _start(*args: Any) -> Any:
    process = _context().Process(target=_fit, args=args)
    process.start()
    return process


def _wait(process: Any) -> int:
    process.join(600)
    if process.exitcode is None:
        process.kill()
        process.join()
    return process.exitcode


def _results(workdir: pathlib.Path) -> dict[str, Any]:
    return {"steps": (workdir / "steps.txt").read_text().splitlines(),
            "params": torch.load(workdir / "final.pt", weights_only=True),
            "warnings": (workdir / "warnings.txt").read_text().splitlines()}


def sigkill_resume(pipeline: str, argument: Any, num_workers: int, root: pathlib.Path, stops: Any,
                   epochs: int = 2, beside: bool = True) -> dict[str, Any]:
    """The uninterrupted run and the chain killed after the checkpoint of each of ``stops`` (SIGKILL,
    then run again); data written once into ``root/data``. Returns both runs' steps (one line per
    step: the batch's tensors in hex and the loss), final parameters and the warnings of their
    last process. The uninterrupted run goes on beside the chain (two processes at a time), or
    before it (``beside=False``: MosaicML streaming's processes share memory by their data);
    then ``stops`` may be a function of the uninterrupted run's number of steps."""
    data_dir = root / "data"
    data_dir.mkdir(parents=True, exist_ok=True)
    full, resumed = root / "full", root / "resumed"
    full.mkdir()
    resumed.mkdir()
    uninterrupted = _start(pipeline, argument, num_workers, str(data_dir), str(full), [], epochs)
    if not beside:
        assert _wait(uninterrupted) == 0, "the uninterrupted fit failed"
    if callable(stops):
        stops = stops(len((full / "steps.txt").read_text().splitlines()))
    kills = list(stops)
    try:
        for stop in kills:
            code = _wait(_start(pipeline, argument, num_workers, str(data_dir), str(resumed), kills, epochs))
            assert code == -signal.SIGKILL, f"the fit to be killed at step {stop} ended with {code}"
        code = _wait(_start(pipeline, argument, num_workers, str(data_dir), str(resumed), kills, epochs))
        assert code == 0, f"the resumed fit ended with {code}"
    finally:
        code = _wait(uninterrupted)
    assert code == 0, f"the uninterrupted fit ended with {code}"
    return {"full": _results(full), "resumed": _results(resumed)}


def assert_resumed_bitwise(runs: dict[str, Any], steps: int) -> None:
    """Every step's batch and loss, and the final parameters, bit for bit."""
    full, resumed = runs["full"], runs["resumed"]
    assert len(full["steps"]) == steps, len(full["steps"])
    for i, (want, got) in enumerate(zip(full["steps"], resumed["steps"])):
        assert got == want, f"step {i + 1} differs after the resume"
    assert len(resumed["steps"]) == steps
    assert all(torch.equal(a, b) for a, b in zip(full["params"], resumed["params"])), "final parameters differ"
