"""One rank of a sharded (FSDP2) fit with a CheckpointHandler, for the tests of sharded checkpoints:
dropout and a random augmentation, AdamW, checkpoints every ``period`` batches; it may SIGKILL
itself (``kill_at``: right after that step's boundary, its checkpoint included, or ``kill_in``:
at the n-th call of a stage of the sharded write) or raise a signal (``signal_at``: {rank: step})."""

from __future__ import annotations

import errno
import logging
import os
import signal
import threading
import time
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.tensor import DTensor

from estimatorch import CheckpointHandler, EMAHandler, Estimator, GradientUpdateHandler, StoppingHandler, distributed
from estimatorch.event_handlers import BatchBegin, BatchEnd, TrainBegin

N, BATCH, WIDTH = 48, 4, 17  # 17 rows: the shards of two ranks are uneven


class Augmented(torch.utils.data.Dataset):
    """Fixed points with noise drawn at every access (a random augmentation)."""

    def __init__(self):
        g = torch.Generator().manual_seed(5)
        self.x, self.y = torch.randn(N, 4, generator=g), torch.arange(N) % 3

    def __len__(self):
        return N

    def __getitem__(self, i):
        return self.x[i] + 0.1 * torch.randn(4), self.y[i]


class Record(BatchEnd):
    """Every step's loss (as hex: exact); kills or signals this process where asked."""

    priority = float("inf")  # after the CheckpointHandler: its boundary save comes first

    def __init__(self, kill_at=None, signal_at=None):
        self.losses, self.kill_at, self.signal_at = [], kill_at, signal_at or {}

    def batch_end(self, est, *, loss, **kw):
        self.losses.append(float(loss.detach()).hex())
        step = est.position.step + 1
        if step == self.kill_at:
            est.at_boundary(lambda: os.kill(os.getpid(), signal.SIGKILL))
        if step == self.signal_at.get(distributed.get_rank()):
            signal.raise_signal(signal.SIGTERM)


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def full_state(est) -> dict[str, Any]:
    """The model's and optimizer's state in full (gathered: a collective)."""
    model, optim = get_state_dict(est.net, est.optimizer, options=StateDictOptions(full_state_dict=True))
    return {"model": {k: v.clone() for k, v in model.items()}, "optimizer": optim}


class Scaled(nn.Sequential):
    """The layers, then a parameter of the root module itself (FSDP2 shards it with the root)."""

    def __init__(self, *layers):
        super().__init__(*layers)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 3))

    def forward(self, x):
        return super().forward(x) * self.scale


class Trajectory(TrainBegin, BatchEnd):
    """The full trainable parameters at the start and after every optimizer step (a collective
    under FSDP2), named: what a reference average is computed from."""

    priority = -1800  # after the optimizer's step (-2000), before the EMAHandler (-1500)

    def __init__(self):
        self.weights = []

    def _record(self, est):
        self.weights.append({n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                             for n, p in est.net.named_parameters()})

    def train_begin(self, est, **kw):
        self._record(est)

    def batch_end(self, est, **kw):
        if next(h for h in est.handlers if isinstance(h, GradientUpdateHandler)).stepped:
            self._record(est)


def _full(state):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone() for k, v in state.items()}


VAL = [(torch.randn(6, 4, generator=torch.Generator().manual_seed(i)), torch.arange(6) % 3) for i in range(2)]


def fit(ckpt_dir: str, options: dict[str, Any]) -> dict[str, Any]:
    """One rank of the fit; ``options``: resume, batches, accumulation, elastic, period,
    max_checkpoints, kill_at, signal_at, agree_every, kill_in (stage, n), strategy, handler (extra kwargs),
    scribble (background writes held until the next step has scribbled over the parameters),
    slow_write (seconds each background write waits first), full_disk (rank 0's own file of the
    n-th save fails as on a full disk), ema (EMAHandler's kwargs: its trained weights come back as
    ``raw``, the net then holding the average), val (validate every epoch), scaled (a parameter on
    the root module), trajectory (the weights after every step, as ``trajectory``), plain_first
    (the same fit without ema first, in these processes: its losses as ``plain_losses``)."""
    plain = None
    if options.get("plain_first"):
        plain = fit(ckpt_dir + "-plain" if ckpt_dir else "",
                    {**options, "ema": None, "trajectory": False, "plain_first": False})["losses"]
    torch.manual_seed(0)
    torch.set_num_threads(1)
    if options.get("kill_in"):
        arm(*options["kill_in"])
    if options.get("scribble") or options.get("slow_write"):
        hold_writes(options.get("slow_write"), options.get("batches", 10))
    if options.get("full_disk"):
        fill_rank_file_at(options["full_disk"])
    layers = (nn.Linear(4, WIDTH), nn.ReLU(), nn.Dropout(0.3), nn.Linear(WIDTH, 3))
    net = Scaled(*layers) if options.get("scaled") else nn.Sequential(*layers)
    est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.AdamW(net.parameters(), lr=0.01), seed=11,
                    strategy=options.get("strategy", "fsdp"))
    if options.get("agree_every"):
        est.agree_every = options["agree_every"]
    lines = Lines()
    est.logger.addHandler(lines)
    loader = torch.utils.data.DataLoader(Augmented(), batch_size=BATCH, shuffle=True)
    accumulation = options.get("accumulation", 1)
    record = Record(options.get("kill_at"), options.get("signal_at"))
    handlers = [record, StoppingHandler(), GradientUpdateHandler(accumulation_steps=accumulation)]
    if ckpt_dir:
        handlers.append(CheckpointHandler(
            ckpt_dir, batch_period=options.get("period", accumulation), epoch_period=None,
            max_checkpoints=options.get("max_checkpoints"), resume_from_checkpoint=options.get("resume", False),
            elastic=options.get("elastic", False), **options.get("handler", {})))
    scribble = Scribble(handlers[-1]) if options.get("scribble") else None
    ema = EMAHandler(**options["ema"]) if options.get("ema") is not None else None
    trajectory = Trajectory() if options.get("trajectory") else None
    extra = [h for h in (scribble, ema, trajectory) if h is not None]
    history = None
    try:
        history = est.fit(loader, VAL if options.get("val") else None, batches=options.get("batches", 10),
                          event_handlers=handlers + extra)
        outcome = "returned"
    except SystemExit as exit:
        outcome = f"SystemExit({exit.code})"
    except OSError as err:
        return {"outcome": "OSError", "errno": err.errno, "message": str(err), "step": est.position.step,
                "files": _listing(ckpt_dir)}
    averaged = {}
    if ema is not None:
        averaged = {"raw": _full(ema.raw_state_dict()), "updates": ema.updates,
                    "local_numel": sum((w.to_local() if isinstance(w, DTensor) else w).numel()
                                       for w in ema.state_dict()["weights"].values()),
                    "history": history.to_dict() if history is not None else None}
    return {"outcome": outcome, "step": est.position.step, "losses": record.losses, **full_state(est),
            "log": lines.messages, "files": _listing(ckpt_dir) if ckpt_dir else [],
            "states": scribble.states if scribble else None, "scribbled": scribble.scribbled if scribble else 0,
            "trajectory": trajectory.weights if trajectory else None, "plain_losses": plain, **averaged}


def _listing(ckpt_dir: str) -> list[str]:
    """The names in the checkpoint directory (at a URL, the objects and prefixes right under it)."""
    from estimatorch.checkpoint import _store

    return sorted(_store.listdir(ckpt_dir))


# -- background writes ----------------------------------------------------------------------------
_GO = threading.Event()


def hold_writes(seconds=None, last=None) -> None:
    """Background writes of sharded checkpoints wait first: ``seconds``, or (None) until the next
    step's :class:`Scribble` lets them go (but the write of step ``last``, with no step after it)."""
    from estimatorch.checkpoint import _sharded

    real = _sharded.write_sharded

    def held(state, rank_state, path, *args, **kwargs):
        if threading.current_thread() is not threading.main_thread() \
                and not os.fspath(path).endswith(f"batch{last}.dcp"):
            if seconds is not None:
                time.sleep(seconds)
            else:
                assert _GO.wait(60), "never released"
                _GO.clear()
        return real(state, rank_state, path, *args, **kwargs)

    _sharded.write_sharded = held
    from estimatorch.checkpoint import _sharded_run

    _sharded_run.write_sharded = held


class Scribble(BatchBegin, BatchEnd):
    """Every rank: the full model at every step's end (what its boundary's checkpoint must hold);
    at the start of a step while a background write is held, this rank's shards set to 1234.5
    in place, the write let go and waited for, then the shards put back."""

    priority = float("inf")

    def __init__(self, handler):
        self.handler, self.states, self.scribbled = handler, {}, 0

    def batch_end(self, est, **kw):
        self.states[est.position.step + 1] = {k: v.full_tensor().clone() for k, v in est.net.state_dict().items()}

    def batch_begin(self, est, **kw):
        writer = self.handler._writer
        if not writer.busy:
            return
        saved = [(p, p.detach().to_local().clone()) for p in est.net.parameters()]
        with torch.no_grad():
            for p, _ in saved:
                p.to_local().fill_(1234.5)
        _GO.set()
        writer.join()
        self.scribbled += 1
        with torch.no_grad():
            for p, value in saved:
                p.to_local().copy_(value)


def fill_rank_file_at(n: int) -> None:
    """On rank 0, its own file of the ``n``-th sharded save fails as on a full disk."""
    if distributed.get_rank() != 0:
        return
    from estimatorch.checkpoint import _sharded

    real, count = _sharded.atomic_save, {"n": 0}

    def full_disk(obj, path, **kwargs):
        if os.path.basename(path) == "rank-0.pt":
            count["n"] += 1
            if count["n"] == n:
                raise OSError(errno.ENOSPC, f"cannot write {path!r}: No space left on device")
        real(obj, path, **kwargs)

    _sharded.atomic_save = full_disk


# -- kills inside the write sequence ---------------------------------------------------------------
def arm(stage: str, n: int) -> None:
    """SIGKILL this process at the ``n``-th time it reaches ``stage`` of a sharded checkpoint's
    write (rank 0 only: the other ranks are left waiting and the launcher ends them):

    - ``"shards"``: DCP has written this rank's shard files, not its metadata;
    - ``"rank-file"``: before this rank's own file is written;
    - ``"marker"``: every file but the marker is written;
    - ``"rename"``: the directory is complete under its temporary name;
    - ``"pointer"``: the directory has its name, the pointer still names the previous one;
    - ``"prune"``: retention has renamed an old directory away, not yet removed it.
    """
    if distributed.get_rank() != 0:
        return
    import shutil

    import torch.distributed.checkpoint as dcp

    from estimatorch.checkpoint import _files, _sharded

    count = {"n": 0}

    def hit() -> None:
        count["n"] += 1
        if count["n"] == n:
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(owner, name, when):
        original = getattr(owner, name)

        def patched(*args, **kwargs):
            if when(*args, **kwargs):
                hit()
            return original(*args, **kwargs)

        setattr(owner, name, patched)

    if stage == "shards":
        wrap(dcp.FileSystemWriter, "finish", lambda *a, **k: True)
    elif stage == "rank-file":
        wrap(_sharded, "atomic_save", lambda obj, path, **k: os.path.basename(path) == "rank-0.pt")
    elif stage == "marker":
        wrap(_sharded, "atomic_save", lambda obj, path, **k: os.path.basename(path) == _sharded.MARKER)
    elif stage == "rename":
        wrap(_sharded.os, "rename", lambda src, dst: str(dst).endswith(".dcp"))
    elif stage == "pointer":
        wrap(_files, "atomic_save", lambda obj, path, **k: str(path).endswith("-latest"))
    elif stage == "prune":
        wrap(shutil, "rmtree", lambda path, *a, **k: str(path).endswith(".tmp") and ".dcp." in str(path))
    else:
        raise ValueError(f"unknown stage {stage!r}")
