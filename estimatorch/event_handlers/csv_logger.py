"""CSVLoggerHandler: a CSV row per epoch, written while training runs (Keras' ``CSVLogger``)."""

from __future__ import annotations

import csv
import os
from typing import Any, Optional, Union

from .. import distributed
from .._checks import check_bool, check_positive_int, check_state_keys, warn_user
from ..events import EpochEnd, EstimatorView, StatefulHandler, TrainBegin, TrainEnd
from ..metrics.base import metric_name
from ._paths import check_output_file, path_argument
from .lr_scheduler import epoch_learning_rates, learning_rate_names

__all__ = ["CSVLoggerHandler"]


def _columns(estimator: EstimatorView) -> list[str]:
    metrics = [metric_name(m) for m in list(estimator.train_metrics) + list(estimator.val_metrics)]
    return ["epoch", *metrics, *learning_rate_names(len(estimator.optimizer.param_groups))]


def _first_line(path: str) -> str:
    with open(path, encoding="utf-8", newline="") as f:
        return f.readline().rstrip("\r\n")


class CSVLoggerHandler(StatefulHandler, TrainBegin, EpochEnd, TrainEnd):
    """Write one CSV row per epoch while training runs: the epoch, every train and val metric,
    and the learning rate.

    Columns: ``epoch`` (1-based), every train metric, every val metric (empty in epochs that
    did not validate), and ``lr`` (``lr_group<i>`` per param group with several): the values
    ``History`` records, in full precision. The header is written to a new or empty file. Each
    row is written and flushed at its epoch's end (the file is closed in between), so the file
    can be read while training runs. Only global rank 0 writes; every rank computes the values
    (a collective under ``torch.distributed``). The path is logged at the start of ``fit``.

    A resumed run (``fit(..., resume=True)`` or a ``CheckpointHandler`` resume) continues the
    same file: it first cuts the file back to the resume point, deleting rows written after the
    checkpoint, so no epoch shows twice. The state holds the number of rows this run wrote and
    the file's length after them (counters and a position, never a path: the file is always
    ``path``). Runs last (priority +inf), with the other loggers.

    Args:
        path: the CSV file. Its directory is created if missing. ``fit`` checks before any
            work that it can be written.
        separator: the field separator, one character. Defaults to ``","``.
        append: add this fit's rows after the file's existing content (the existing header
            must name the same columns). False refuses to start when the file exists, unless
            this fit resumes the run that wrote it: nothing saved is overwritten (Keras'
            ``CSVLogger`` would overwrite it). Defaults to False.

    Example:
        >>> import os, tempfile
        >>> h = CSVLoggerHandler(os.path.join(tempfile.mkdtemp(), "log.csv"), separator=";")
        >>> h.separator, h.append, h.rows
        (';', False, 0)
    """

    priority = float("inf")
    state_attributes = ("rows", "size")

    def __init__(self, path: Union[str, "os.PathLike[str]"], separator: str = ",", append: bool = False):
        self.path = path_argument(path, "path")
        if not isinstance(separator, str) or len(separator) != 1 or separator in "\r\n\"":
            raise ValueError(f"separator must be one character (not a quote or a line break), got {separator!r}")
        check_bool(append, "append")
        self.separator = separator
        self.append = append
        #: the rows (epochs) this run has written
        self.rows = 0
        #: the file's length in bytes after this run's last row (before its first: the length
        #: it found), on rank 0
        self.size = 0
        self._columns: list[str] = []
        self._active = False

    # -- checks ----------------------------------------------------------------------------
    def check_fit(self, estimator: EstimatorView, resume: bool) -> None:
        """Before any work: the file can be written and, when appending, holds these columns."""
        if not distributed.is_main_process():
            return
        check_output_file(self.path, "path")
        if self.append and os.path.isfile(self.path) and os.path.getsize(self.path) > 0:
            header = _first_line(self.path)
            wanted = self.separator.join(_columns(estimator))
            if header != wanted:
                raise ValueError(f"path {self.path!r} starts with the header {header!r}, not this fit's "
                                 f"columns {wanted!r}: append to a file of the same columns, or choose "
                                 "another path")

    # -- events ----------------------------------------------------------------------------
    def train_begin(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self.rows = 0
        self._columns = _columns(estimator)
        self._active = distributed.is_main_process()
        if not self._active:
            self.size = 0
            return
        exists = os.path.isfile(self.path)
        if exists and not self.append and not estimator.resume_pending:
            raise FileExistsError(f"path {self.path!r} already exists: pass append=True to add this fit's rows "
                                  "to it, or choose another path (nothing is overwritten)")
        self.size = os.path.getsize(self.path) if exists else 0
        estimator.logger.info("CSV log: %s", self.path)

    def epoch_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        values = {metric_name(m): float(m.compute()) for m in estimator.train_metrics}  # every rank: a collective
        if estimator.validated:
            values.update((metric_name(m), float(m.compute())) for m in estimator.val_metrics)
        values.update(epoch_learning_rates(estimator))
        self.rows += 1
        if not self._active:
            return
        values["epoch"] = estimator.position.epoch + 1
        row = [_cell(values.get(column)) for column in self._columns]
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(self.path, "a", encoding="utf-8", newline="") as f:
            writer = csv.writer(f, delimiter=self.separator, lineterminator="\n")
            if f.tell() == 0:
                writer.writerow(self._columns)
            writer.writerow(row)
            f.flush()
            self.size = f.tell()

    def train_end(self, estimator: EstimatorView, **kwargs: Any) -> None:
        self._active = False  # a state loaded outside fit never touches the file

    # -- state -----------------------------------------------------------------------------
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved counts; on rank 0 during ``fit``, cut ``path`` back to the saved
        length (the rows written after the resume point go)."""
        check_state_keys(state, self.state_attributes, self.name)
        rows = check_positive_int(state["rows"], f"state of {self.name}: rows", minimum=0)
        size = check_positive_int(state["size"], f"state of {self.name}: size", minimum=0)
        if self._active:
            size = self._truncate(size)
        self.rows, self.size = rows, size

    def _truncate(self, size: int) -> int:
        """Cut the file to ``size`` bytes; return the size it has now."""
        if not os.path.isfile(self.path):
            if size:
                warn_user(f"CSVLoggerHandler: path {self.path!r} is gone; the resumed run starts it again without "
                          "the rows written before the resume point")
            return 0
        actual = os.path.getsize(self.path)
        if actual < size or (size and _byte_at(self.path, size - 1) != b"\n"):
            raise ValueError(f"cannot resume the CSV log: path {self.path!r} ({actual} bytes) does not hold the "
                             f"{size} bytes this run had written at the resume point; choose another path")
        if actual > size:
            os.truncate(self.path, size)
        return size


def _byte_at(path: str, offset: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(1)


def _cell(value: Optional[float]) -> Any:
    """A CSV cell: empty for a value not computed in this epoch, else the number (in full)."""
    return "" if value is None else value
