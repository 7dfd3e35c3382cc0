"""``inspect.signature`` of every exported handler names the arguments its docstring documents,
although handlers pick their class in ``__new__`` to subscribe only to the events an option
needs (event_handlers/_base.py ``_InitSignature``)."""

from __future__ import annotations

import inspect
import pydoc
import re

import pytest

from estimatorch import event_handlers
from estimatorch.event_handlers import EVENTS, BatchEnd, CheckpointHandler, EpochEnd, StatefulHandler
from estimatorch.events import subscribes

HANDLERS = sorted(
    (getattr(event_handlers, name) for name in event_handlers.__all__
     if isinstance(getattr(event_handlers, name), type)
     and issubclass(getattr(event_handlers, name), StatefulHandler)
     and getattr(event_handlers, name) is not StatefulHandler),
    key=lambda cls: cls.__name__)


def documented_arguments(cls: type) -> list[str]:
    """The names in the ``Args:`` section of ``cls``'s docstring (a line may list several)."""
    doc = inspect.getdoc(cls) or ""
    section = re.search(r"^Args:\n((?:(?: {4}.*)?\n)+)", doc + "\n", re.MULTILINE)
    assert section, f"{cls.__name__} documents no Args: section"
    names: list[str] = []
    for line in section.group(1).splitlines():
        entry = re.match(r" {4}(\w+(?:, \w+)*):", line)  # argument lines are indented once
        if entry:
            names.extend(entry.group(1).split(", "))
    return names


def test_every_exported_handler_is_checked():
    assert len(HANDLERS) >= 10 and CheckpointHandler in HANDLERS


@pytest.mark.parametrize("cls", HANDLERS, ids=lambda cls: cls.__name__)
def test_the_signature_names_every_documented_argument(cls):
    parameters = inspect.signature(cls).parameters
    kinds = {p.kind for p in parameters.values()}
    assert inspect.Parameter.VAR_POSITIONAL not in kinds, f"{cls.__name__}{inspect.signature(cls)}"
    documented = documented_arguments(cls)
    assert documented
    missing = [name for name in documented if name not in parameters]
    if missing and cls is event_handlers.LambdaHandler:
        # its event functions arrive through **functions, one keyword per event
        assert inspect.Parameter.VAR_KEYWORD in kinds and set(missing) <= set(EVENTS)
        return
    assert not missing, f"{cls.__name__}{inspect.signature(cls)} lacks {missing}"


@pytest.mark.parametrize("cls", HANDLERS, ids=lambda cls: cls.__name__)
def test_help_shows_the_arguments(cls):
    first = documented_arguments(cls)[0]
    assert f"{cls.__name__}({first}" in pydoc.render_doc(cls, renderer=pydoc.plaintext).replace("*, ", "")


def test_options_choose_the_events_not_the_class():
    """Subscription is decided by the dispatcher (listens_to), so the class, isinstance and the
    signature are the same whatever the options."""
    handler = CheckpointHandler("unused-dir", batch_period=5, epoch_period=None)
    assert subscribes(handler, "batch_end") and not subscribes(handler, "epoch_end")
    assert type(handler) is CheckpointHandler
    assert isinstance(handler, BatchEnd) and isinstance(handler, EpochEnd)
    assert not hasattr(CheckpointHandler, "__new__") or CheckpointHandler.__new__ is object.__new__
    assert "model_dir" in inspect.signature(CheckpointHandler).parameters


def test_a_user_subclass_shows_its_own_arguments():
    class Mine(CheckpointHandler):
        def __init__(self, model_dir, note="x", *, period=3):
            super().__init__(model_dir, batch_period=period)
            self.note = note

    assert list(inspect.signature(Mine).parameters) == ["model_dir", "note", "period"]
    assert subscribes(Mine("unused-dir"), "batch_end")

    class Plain(StatefulHandler, EpochEnd):
        def __init__(self, target: float = 0.9):
            self.target = target

    assert str(inspect.signature(Plain)) == "(target: 'float' = 0.9)"


def test_a_handler_without_init_falls_back_to_inspects_rules():
    class Bare(StatefulHandler, EpochEnd):
        pass

    assert str(inspect.signature(Bare)) == "()"
    assert "__signature__" not in vars(StatefulHandler)  # inspect reads the classes as written
