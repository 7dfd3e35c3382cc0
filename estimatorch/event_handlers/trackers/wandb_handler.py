"""WandbHandler: parameters, metric curves, the History and checkpoints in a W&B run."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Optional

from ...events import EstimatorView
from .._paths import check_output_dir, path_argument
from ._base import Outcome, Row, TrackingHandler, check_reachable, require

__all__ = ["WandbHandler"]

#: ``wandb.init`` arguments the handler decides: the run id is its state.
_OWN_ARGUMENTS = ("id", "resume", "resume_from", "fork_from")


class _WandbRun:
    """One open W&B run on rank 0."""

    def __init__(self, wandb: Any, run: Any, log_checkpoints: bool):
        self.wandb, self.run, self.log_checkpoints = wandb, run, log_checkpoints

    def send(self, rows: list[Row]) -> None:
        for row in rows:  # W&B's step is the global batch count: epoch rows carry their epoch
            values = {"epoch": row.step, **row.values} if row.on_epochs else row.values
            self.run.log(values, step=row.batch)

    def finish(self, outcome: Outcome) -> None:
        run = self.run
        try:
            with open(os.path.join(run.dir, "history.json"), "w", encoding="utf-8") as f:
                json.dump(outcome.history, f)  # files in run.dir are uploaded with the run
            if outcome.checkpoints:
                run.summary["checkpoints"] = outcome.checkpoints
            if self.log_checkpoints and outcome.checkpoints:
                artifact = self.wandb.Artifact(re.sub(r"[^\w.-]", "_", f"checkpoints-{run.id}"), type="model")
                for path in outcome.checkpoints:
                    if os.path.isdir(path):  # a sharded checkpoint: the directory, under its name
                        artifact.add_dir(path, name=os.path.basename(path))
                    else:
                        artifact.add_file(path)
                run.log_artifact(artifact)
            if outcome.preempted:
                run.mark_preempting()
        finally:
            run.finish(exit_code=outcome.exit_code)


class WandbHandler(TrackingHandler):
    """Log a fit to a Weights & Biases run: config, every metric's curve, the History, checkpoints.

    It logs what :class:`MLflowHandler` logs, on global rank 0 only: the run's parameters as
    its config; ``epoch/<metric>`` and ``epoch/lr`` at each epoch's end (with an ``epoch`` key,
    the x-axis W&B is told to use for ``epoch/*``); with ``log_interval=N``, ``batch/<train
    metric>`` and ``batch/lr`` every N batches; ``batch/<val metric>`` at every step-level
    validation's step. W&B's own step is the global batch count. At the end: ``history.json``
    (the History) among the run's files, the checkpoint paths in the summary (``checkpoints``)
    and, with ``log_checkpoints=True``, the files as a ``model`` artifact; the exit code 0, 1
    after an error, or 128 + the signal after SIGTERM (marked preempted) or Ctrl-C.

    Values are read when an epoch ends or at a ``log_interval`` boundary and handed to W&B
    (which writes in its own process) at each epoch's end. The run opens at the first step's
    end. Offline (``mode="offline"`` or ``WANDB_MODE=offline``) it is written under
    ``<dir>/wandb/offline-run-*`` for ``wandb sync``.

    **Resume continues the run.** The handler's state holds the W&B run id; a resumed fit calls
    ``wandb.init(id=..., resume="allow")`` and logs from the step after its checkpoint on. W&B
    keeps a run's steps increasing and ignores a point at a step lower than the run's current
    one, so the points the interrupted fit logged after its checkpoint stay and are not logged
    twice (offline, the resumed fit writes a second ``offline-run-*`` directory of the same id).

    Args:
        project: the W&B project. Defaults to None (``WANDB_PROJECT``, else W&B's default).
        name: the run's display name. Defaults to None (W&B picks one).
        log_interval: also log batch-level values every this many batches. Defaults to None
            (epoch-level only).
        log_checkpoints: upload the checkpoint files as an artifact too. Defaults to False.
        **init_kwargs: passed to ``wandb.init`` (``entity``, ``dir``, ``mode``, ``tags``,
            ``config``, ``settings``...), except ``id`` and ``resume``, which the handler
            manages. ``fit`` checks before any work that ``dir`` can be written, that ``mode``
            is one W&B knows, and in online mode that the W&B server is reachable.

    Example:
        >>> h = WandbHandler(project="mnist", log_interval=50, mode="offline")
        >>> h.log_interval, h.init_kwargs
        (50, {'mode': 'offline'})
    """

    def __init__(self, project: Optional[str] = None, name: Optional[str] = None,
                 log_interval: Optional[int] = None, *, log_checkpoints: bool = False, **init_kwargs: Any):
        super().__init__(log_interval, log_checkpoints)
        self._wandb = require("wandb", "wandb", "WandbHandler")
        for arg, value in (("project", project), ("name", name)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{arg} must be a non-empty str or None, got {value!r}")
        own = [key for key in _OWN_ARGUMENTS if key in init_kwargs]
        if own:
            raise ValueError(f"{own[0]} is managed by WandbHandler (its state holds the run id, and a resumed fit "
                             f"continues that run): leave it out of the wandb.init arguments")
        if init_kwargs.get("dir") is not None:
            init_kwargs["dir"] = path_argument(init_kwargs["dir"], "dir")
        self.project = project
        self.run_name = name  # (``self.name`` is the key the handler's state is saved under)
        self.init_kwargs = init_kwargs

    def _mode(self) -> str:
        settings = self.init_kwargs.get("settings")
        return (self.init_kwargs.get("mode") or getattr(settings, "mode", None) or os.environ.get("WANDB_MODE")
                or "online")

    def _check_tracker(self, estimator: EstimatorView) -> None:
        mode = self._mode()
        try:
            self._wandb.Settings(mode=mode)
        except ValueError as err:  # pydantic's ValidationError is a ValueError
            raise ValueError(f"mode must be one of W&B's modes ('online', 'offline', 'disabled'), "
                             f"got {mode!r}") from err
        directory = self.init_kwargs.get("dir") or os.environ.get("WANDB_DIR")
        if directory is not None:
            check_output_dir(directory, "dir" if self.init_kwargs.get("dir") else "dir (from WANDB_DIR)")
        if mode in ("online", "run"):
            settings = self.init_kwargs.get("settings")
            url = getattr(settings, "base_url", None) or os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
            check_reachable(url, f"the W&B server (mode={mode!r}; use mode='offline' without a network)")

    def _open_session(self, estimator: EstimatorView, params: dict[str, str]) -> _WandbRun:
        wandb = self._wandb
        kwargs = dict(self.init_kwargs)
        if kwargs.get("dir") is not None:
            os.makedirs(kwargs["dir"], exist_ok=True)
        resumed = self.run_id is not None
        if resumed:
            kwargs.update(id=self.run_id, resume="allow")
        run = wandb.init(project=self.project, name=self.run_name, **kwargs)
        run.config.update(params, allow_val_change=True)
        run.define_metric("epoch")
        run.define_metric("epoch/*", step_metric="epoch")
        self.run_id = run.id
        estimator.logger.info("W&B: %s run %s (%s)", "continuing" if resumed else "logging to", run.id,
                              run.dir)
        return _WandbRun(wandb, run, self.log_checkpoints)
