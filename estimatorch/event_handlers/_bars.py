"""What :class:`~estimatorch.event_handlers.ProgressBarHandler` draws with: tqdm text bars whose
postfix is read only at a redraw and fits the line, the Jupyter output they are drawn into, and
the console-logging detour that keeps log lines out of the bars."""

from __future__ import annotations

import functools
import itertools
import logging
import re
import sys
import threading
from typing import Any, Callable, Optional

from tqdm import tqdm
from tqdm.utils import _screen_shape_wrapper

__all__ = ["ConsoleRedirect", "NotebookDisplay", "bar", "bar_class", "fit_postfix", "short_name"]

#: the line width postfixes are fitted to when the output's width is unknown (a file, a notebook).
DEFAULT_WIDTH = 80
#: columns kept free on a line whose postfix is set now and drawn until the next epoch: the
#: elapsed and remaining times grow by two characters each past an hour.
EPOCH_SLACK = 4
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


def short_name(name: str) -> str:
    """A metric's name as a bar shows it: ``train_`` dropped (Keras's ``loss`` / ``val_loss``),
    ``accuracy`` shortened to ``acc``.

    Example:
        >>> [short_name(n) for n in ("train_loss", "train_accuracy", "val_accuracy", "val_mse")]
        ['loss', 'acc', 'val_acc', 'val_mse']
    """
    if name.startswith("train_"):
        name = name[len("train_"):]
    return name.replace("accuracy", "acc")


def fit_postfix(values: dict[str, str], room: int) -> dict[str, str]:
    """The first entries of ``values`` (with :func:`short_name` names) that fit in ``room``
    characters as tqdm shows them (``", name=value"`` each); the rest is left out.

    Example:
        >>> values = {"val_loss": "0.1234", "val_accuracy": "0.97", "train_loss": "0.1"}
        >>> fit_postfix(values, 41)
        {'val_loss': '0.1234', 'val_acc': '0.97', 'loss': '0.1'}
        >>> fit_postfix(values, 30)
        {'val_loss': '0.1234'}
    """
    shown: dict[str, str] = {}
    used = 0
    for name, value in values.items():
        short = short_name(name)
        if short in shown:  # two names shortened alike: keep the second one whole
            short = name
        cost = 2 + len(short) + 1 + len(value)
        if used + cost > room:
            break  # what is shown stays a prefix of ``values``: the first ones matter most
        shown[short] = value
        used += cost
    return shown


@functools.lru_cache(maxsize=None)
def bar_class() -> type:
    """A ``tqdm`` text bar whose postfix is read only when tqdm redraws it (on its own time
    throttle, never on other steps) and cut to what fits the line."""
    screen_shape = _screen_shape_wrapper()

    class Bar(tqdm):
        read_postfix: Optional[Callable[[], dict[str, str]]] = None
        owner_thread: Optional[int] = None

        @property
        def format_dict(self) -> dict[str, Any]:
            read = self.read_postfix
            # Not from tqdm's monitor thread: values are read where the step runs.
            if read is not None and self.n > 0 and threading.get_ident() == self.owner_thread:
                self.set_postfix(fit_postfix(read(), self.postfix_room(slack=1)), refresh=False)
            return super().format_dict

        def postfix_room(self, slack: int) -> int:
            """Characters left for the postfix on a line of the output's width (80 when it is
            unknown) with a bar of at least 10 characters, ``slack`` of them kept free."""
            layout = super().format_dict
            width = (screen_shape(self.fp)[0] if screen_shape is not None else None) or DEFAULT_WIDTH
            bare = self.format_meter(**{**layout, "postfix": None, "ncols": None})  # a 10-character bar
            return width - len(_ANSI.sub("", bare)) - slack

    return Bar


def bar(read_postfix: Optional[Callable[[], dict[str, str]]] = None, **kwargs: Any) -> Any:
    """A new :func:`bar_class` bar; ``read_postfix()`` gives its postfix values at a redraw."""
    new = bar_class()(dynamic_ncols=True, **kwargs)
    new.owner_thread = threading.get_ident()
    new.read_postfix = read_postfix
    return new


def _open_display() -> Any:
    from IPython.display import display  # optional: IPython is there in a notebook only

    return display({"text/plain": ""}, raw=True, display_id=True)


class NotebookDisplay:
    """Bars in a Jupyter notebook: one output that shows each open bar's line as plain text and
    is replaced at every redraw. A saved notebook keeps the final state as text (no widget and
    no dead ``0%|`` fallback), and log lines printed meanwhile stay apart from it."""

    def __init__(self) -> None:
        self._lines: dict[int, str] = {}  # by bar, in the order bars were opened
        self._keys = itertools.count()
        self._shown: Optional[str] = None
        self._handle = _open_display()

    def stream(self) -> "_LineStream":
        """The file one new bar writes to."""
        return _LineStream(self, next(self._keys))

    def set_line(self, key: int, text: str) -> None:
        if text:
            self._lines[key] = text  # an open bar keeps its place
        else:
            self._lines.pop(key, None)  # a bar closed with leave=False disappears
        shown = "\n".join(self._lines.values())
        if shown != self._shown:
            self._shown = shown
            self._handle.update({"text/plain": shown}, raw=True)


class _LineStream:
    """What tqdm writes one bar to: the bar's line is the text after the last carriage return
    (cursor moves and newlines, tqdm's multi-bar layout, are dropped)."""

    encoding = "utf-8"

    def __init__(self, display: NotebookDisplay, key: int):
        self._display = display
        self._key = key
        self._text = ""

    def write(self, text: str) -> int:
        part = _ANSI.sub("", text).replace("\n", "")
        self._text = part.rsplit("\r", 1)[1] if "\r" in part else self._text + part
        self._display.set_line(self._key, self._text.rstrip())
        return len(text)

    def flush(self) -> None:
        pass


def _is_console(handler: logging.Handler) -> bool:
    return (isinstance(handler, logging.StreamHandler) and not isinstance(handler, logging.FileHandler)
            and any(handler.stream is s for s in (sys.stdout, sys.stderr)))


class _BarSafe(logging.Handler):
    """Stands in for a console handler while bars are drawn: writes through ``tqdm.write`` so
    log lines go above the bars instead of through them."""

    def __init__(self, wrapped: logging.Handler, bar_type: type):
        super().__init__(wrapped.level)
        self.wrapped = wrapped
        self.bar_type = bar_type
        # stands in for the estimatorch console handler: a new Estimator must not add another
        self._estimatorch_default = getattr(wrapped, "_estimatorch_default", False)

    def filter(self, record: logging.LogRecord) -> bool:
        return bool(self.wrapped.filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bar_type.write(self.wrapped.format(record), file=self.wrapped.stream)  # type: ignore[attr-defined]
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - logging's own policy: report, never break training
            self.handleError(record)


class ConsoleRedirect:
    """Swap a logger's console handlers for :class:`_BarSafe` ones; :meth:`close` swaps back
    exactly those (other handlers, e.g. a log file added meanwhile, are left alone)."""

    def __init__(self, logger: logging.Logger, bar_type: type):
        self.logger = logger
        self.swapped: list[tuple[logging.Handler, logging.Handler]] = []
        handlers = logger.handlers
        for i, handler in enumerate(handlers):
            if _is_console(handler):
                handlers[i] = _BarSafe(handler, bar_type)  # in place: the order of handlers is kept
                self.swapped.append((handler, handlers[i]))

    def close(self) -> None:
        swapped, self.swapped = self.swapped, []
        handlers = self.logger.handlers
        for original, safe in swapped:
            for i, handler in enumerate(handlers):
                if handler is safe:
                    handlers[i] = original
