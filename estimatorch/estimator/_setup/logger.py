"""The ``estimatorch`` logger: INFO lines to stdout, written by global rank 0 only."""

from __future__ import annotations

import logging
import sys
from typing import Any

from ... import distributed

__all__ = ["MainProcessFilter", "default_logger"]


class _StdoutHandler(logging.StreamHandler):  # type: ignore[type-arg]  # not subscriptable on Python 3.10
    """Writes to whatever ``sys.stdout`` is at the time (a notebook cell, pytest's capture)."""

    @property
    def stream(self) -> Any:
        return sys.stdout

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def default_logger() -> logging.Logger:
    """The ``estimatorch`` logger: INFO to stdout, only on global rank 0, set up once."""
    logger = logging.getLogger("estimatorch")
    if not any(getattr(h, "_estimatorch_default", False) for h in logger.handlers):
        handler = _StdoutHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        handler.addFilter(MainProcessFilter())
        handler._estimatorch_default = True  # type: ignore[attr-defined]
        logger.addHandler(handler)
        if logger.level == logging.NOTSET:  # keep a level the user chose
            logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class MainProcessFilter(logging.Filter):
    """Drop log records on every rank but global rank 0 (the one place logs are rank-gated),
    except those logged with ``extra={"all_ranks": True}`` (a signal that reached one rank)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return distributed.is_main_process() or getattr(record, "all_ranks", False)
