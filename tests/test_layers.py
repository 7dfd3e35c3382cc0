"""The package's layers, read from the sources: each module imports only from its own layer or the
layers below it, modules import each other without cycles (an import only the type checker runs,
under ``if TYPE_CHECKING:``, counts: a circle of types is a circle of ideas), and a
function-local import is only one that defers an optional or heavy dependency, with a comment
saying so.

The layers, bottom to top (docs/architecture.md draws them):

1. ``distributed``, ``rng``, the shared checks (``_checks``, ``_saved``), the batch conventions
   (``_batches``), the version;
2. ``metrics``;  3. ``samplers``;  4. ``checkpoint`` (storage only), and ``data`` (every kind of
   resumable training stream, its adapters and their registry: never the estimator, the handlers'
   contract or the handlers);
5. the handler contract (``events``: mixins, ``Handler``, the estimator's ``Protocol``, dispatch,
   the monitor rule), and the helpers the handlers share (paths, progress bars, event files);
6. ``statistics``;  7. the built-in handlers;  8. ``estimator``;
9. ``testing``, the demo, the package ``__init__`` and ``__main__``.
"""

from __future__ import annotations

import ast
import os
import pathlib
import textwrap
from typing import Optional

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "estimatorch"

_CORE = ("_paths", "_bars", "_event_files")
#: module name prefix -> layer (the longest matching prefix decides).
LAYERS: dict[str, int] = {
    "estimatorch._version": 1, "estimatorch._checks": 1, "estimatorch._schedule": 1, "estimatorch._saved": 1, "estimatorch._batches": 1,
    "estimatorch._shadow": 1, "estimatorch._model_loss": 1, "estimatorch._items": 1, "estimatorch.collate": 1, "estimatorch.distributed": 1, "estimatorch.cluster": 1,
    "estimatorch.rng": 1, "estimatorch._console": 1,
    "estimatorch.metrics": 2,
    "estimatorch.samplers": 3,
    "estimatorch.checkpoint": 4,
    "estimatorch.data": 4,
    "estimatorch.events": 5,
    **{f"estimatorch.event_handlers.{name}": 5 for name in _CORE},
    "estimatorch.statistics": 6,
    "estimatorch.event_handlers": 7,
    "estimatorch.estimator": 8,
    "estimatorch.testing": 9, "estimatorch._demo": 9, "estimatorch.__main__": 9, "estimatorch": 9,
}
#: words one of which the comment of a function-local import must hold.
DEFERRED = ("optional", "heavy")


def layer_of(module: str, layers: dict[str, int]) -> int:
    """The layer of the longest prefix of ``module`` in ``layers`` (the top package's own name
    stands for its ``__init__`` only: every other module must be placed)."""
    best = max((prefix for prefix in layers
                if module == prefix or ("." in prefix and module.startswith(prefix + "."))), key=len, default=None)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS (and docs/architecture.md)")
    return layers[best]


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _targets(node: ast.AST, module: str, is_package: bool, root: pathlib.Path) -> list[str]:
    """The package's own modules an import statement names (``from . import x`` names the module
    ``x`` when it is one)."""
    top = root.name
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name.split(".")[0] == top]
    assert isinstance(node, ast.ImportFrom)
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    if source.split(".")[0] != top:
        return []
    names = []
    for alias in node.names:
        candidate = f"{source}.{alias.name}"
        path = root.parent.joinpath(*candidate.split("."))
        names.append(candidate if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file() else source)
    return names


def _local_imports(tree: ast.Module) -> list[ast.AST]:
    found = []
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += [node for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))]
    return found


def check_package(root: pathlib.Path, layers: dict[str, int]) -> list[str]:
    """Every breach of the rules in the sources under ``root``, in words."""
    problems: list[str] = []
    graph: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        source = path.read_text()
        tree = ast.parse(source)
        lines = source.splitlines()
        local = {id(node) for node in _local_imports(tree)}
        mine = layer_of(module, layers)
        graph.setdefault(module, set())
        for node in ast.walk(tree):  # imports under ``if TYPE_CHECKING:`` included
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            targets = sorted(set(_targets(node, module, path.name == "__init__.py", root)))
            where = f"{path.relative_to(root.parent)}:{node.lineno}"
            if id(node) in local:
                comment = " ".join(lines[node.lineno - 2:node.lineno]).lower()
                if targets:
                    problems.append(f"{where}: function-local import of {', '.join(targets)} (import it at the top)")
                elif "#" not in comment or not any(word in comment for word in DEFERRED):
                    problems.append(f"{where}: function-local import without a comment saying what optional or "
                                    "heavy dependency it defers")
                continue
            for target in targets:
                if layer_of(target, layers) > mine:
                    problems.append(f"{where}: {module} (layer {mine}) imports {target} "
                                    f"(layer {layer_of(target, layers)}), up the layers")
                graph[module].update(_imported(target, module, root.name))
    cycle = _cycle(graph)
    if cycle:
        problems.append("an import cycle: " + " -> ".join(cycle))
    return problems


def _imported(target: str, module: str, top: str) -> set[str]:
    """What importing ``target`` from ``module`` runs: ``target`` and, before it, the ``__init__``
    of each package above it, but the top package and those ``module`` is already inside; and
    ``target`` itself when it is one of those packages (a module naming its own package's
    ``__init__``, for its types say, depends on what that ``__init__`` imports: often itself)."""
    parts = target.split(".")
    run = {".".join(parts[:i]) for i in range(2, len(parts) + 1)} | {target}
    inside = {module} | {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1)}
    return run - (inside - {target}) - {top}


def _cycle(graph: dict[str, set[str]]) -> Optional[list[str]]:
    """One cycle of ``graph`` (module -> the modules it imports at the top), if any."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> Optional[list[str]]:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_the_package_keeps_its_layers():
    assert check_package(PACKAGE, LAYERS) == []


def test_every_module_is_on_the_architecture_map():
    """A new module belongs to a layer the docs describe."""
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path, PACKAGE), LAYERS)


# -- the checker catches what it is for ------------------------------------------------------------
def _write(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / "estimatorch" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text))
    return root / "estimatorch"


_TOY_LAYERS = {"estimatorch.rng": 1, "estimatorch.checkpoint": 4, "estimatorch.estimator": 8, "estimatorch": 9}


@pytest.mark.parametrize("files, expected", [
    ({"__init__.py": "", "rng.py": "", "checkpoint/__init__.py": "from .. import rng\n",
      "estimator/__init__.py": "from ..checkpoint import x\n"}, []),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "",
      "checkpoint/__init__.py": "from ..estimator import thing\n"}, ["up the layers"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "",
      "checkpoint/__init__.py": "import estimatorch.estimator\n"}, ["up the layers"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "",
      "checkpoint/__init__.py": "def f():\n    from ..estimator import thing\n"}, ["function-local import of"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "", "checkpoint/__init__.py":
      "def f():\n    import matplotlib\n"}, ["without a comment"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "", "checkpoint/__init__.py":
      "def f():\n    import matplotlib  # optional: the plot extra\n"}, []),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "",
      "checkpoint/__init__.py": "from . import a\n", "checkpoint/a.py": "from . import b\n",
      "checkpoint/b.py": "from . import a\n"}, ["an import cycle"]),
    ({"__init__.py": "", "rng.py": "", "checkpoint/__init__.py": "from ..estimator import low\n",
      "estimator/__init__.py": "from . import high\n", "estimator/low.py": "",
      "estimator/high.py": "from ..checkpoint import x\n"}, ["up the layers", "an import cycle"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "",
      "checkpoint/__init__.py": "from . import a\n", "checkpoint/a.py": "from . import b\n",
      "checkpoint/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:  # typing only\n    from . import a\n"},
     ["an import cycle"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "", "checkpoint/__init__.py":
      "import typing\nif typing.TYPE_CHECKING:\n    from ..estimator import Estimator\n"}, ["up the layers"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "", "checkpoint/__init__.py": "from .a import Thing\n",
      "checkpoint/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:  # typing only\n    from . import Thing\n"},
     ["an import cycle: estimatorch.checkpoint -> estimatorch.checkpoint.a -> estimatorch.checkpoint"]),
    ({"__init__.py": "", "rng.py": "", "estimator/__init__.py": "", "checkpoint/__init__.py": "",
      "checkpoint/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:  # typing only\n    from . import b\n",
      "checkpoint/b.py": ""}, []),
], ids=["clean", "upward-from", "upward-import", "local-own", "local-uncommented", "local-commented", "cycle",
        "cycle-through-a-package-init", "cycle-under-type-checking", "upward-under-type-checking",
        "own-package-under-type-checking", "sibling-under-type-checking"])
def test_the_checker_reports_each_breach(tmp_path, files, expected):
    problems = check_package(_write(tmp_path, files), _TOY_LAYERS)
    assert len(problems) == len(expected), problems
    for problem, words in zip(problems, expected):
        assert words in problem, problem


def test_the_checker_finds_a_cycle_that_only_a_package_init_closes(tmp_path):
    """Each import keeps to the layers, but importing the core module of a package first runs the
    package's ``__init__``, which imports a module above the importer: the circle that made the
    statistics depend on the order of the package's imports."""
    root = _write(tmp_path, {"__init__.py": "", "h/__init__.py": "from . import core, meter\n", "h/core.py": "",
                             "h/meter.py": "from ..s import base\n", "s/__init__.py": "",
                             "s/base.py": "from ..h import core\n"})
    problems = check_package(root, {"estimatorch.h.core": 5, "estimatorch.s": 6, "estimatorch.h": 7,
                                    "estimatorch": 9})
    assert len(problems) == 1 and "an import cycle" in problems[0], problems
    assert "estimatorch.h -> estimatorch.h.meter -> estimatorch.s.base -> estimatorch.h" in problems[0]


def test_the_checker_names_a_module_in_no_layer(tmp_path):
    root = _write(tmp_path, {"__init__.py": "", "stray.py": ""})
    with pytest.raises(KeyError, match="estimatorch.stray is in no layer"):
        check_package(root, {"estimatorch.rng": 1, "estimatorch": 9})


def test_upward_import_in_the_real_package_is_caught(tmp_path):
    """The real package with one upward import added (the checkpoint store importing the
    estimator) fails the check."""
    copy = tmp_path / "estimatorch"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    store = copy / "checkpoint" / "_format.py"
    store.write_text(store.read_text() + "\nfrom ..estimator import Estimator\n")
    problems = check_package(copy, LAYERS)
    assert any("estimatorch.checkpoint._format (layer 4) imports estimatorch.estimator (layer 8)" in p
               for p in problems), problems
    assert os.path.isfile(PACKAGE / "checkpoint" / "_format.py")


def test_a_circle_only_the_type_checker_sees_in_the_real_package_is_caught(tmp_path):
    """The real package with the data layer's old circle put back (``_elastic`` naming
    ``_streams``' stream class for its types, while ``_streams`` builds on ``_elastic``) fails."""
    copy = tmp_path / "estimatorch"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    elastic = copy / "data" / "_elastic.py"
    elastic.write_text(elastic.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:  # typing only\n"
                       "    from ._streams import MapLoaderAdapter\n")
    problems = check_package(copy, LAYERS)
    assert any("an import cycle" in p and "estimatorch.data._elastic" in p and "estimatorch.data._streams" in p
               for p in problems), problems


def test_a_circle_through_ones_own_package_in_the_real_package_is_caught(tmp_path):
    """The real package with the checkpoint handler's old circle put back (its writes naming the
    handler for their types from the package's ``__init__``, which imports the writes) fails."""
    copy = tmp_path / "estimatorch"
    for path in PACKAGE.rglob("*.py"):
        target = copy / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    writes = copy / "event_handlers" / "checkpoint_handler" / "_writes.py"
    writes.write_text(writes.read_text() + "\nfrom typing import TYPE_CHECKING\n\nif TYPE_CHECKING:  # typing only\n"
                      "    from . import CheckpointHandler\n")
    problems = check_package(copy, LAYERS)
    assert [p for p in problems if "an import cycle" in p] == [
        "an import cycle: estimatorch.event_handlers.checkpoint_handler -> "
        "estimatorch.event_handlers.checkpoint_handler._writes -> estimatorch.event_handlers.checkpoint_handler"], \
        problems


#: what the data layer may never import, however (typing only, in a function).
_ABOVE_DATA = ("estimatorch.estimator", "estimatorch.events", "estimatorch.event_handlers", "estimatorch.statistics",
               "estimatorch.testing")


def data_layer_imports_above(root: pathlib.Path) -> list[str]:
    """``module:line target`` for every import in ``root``'s ``data`` package of a module of the
    estimator, the handlers' contract, the handlers, the statistics or ``testing``."""
    found: list[tuple[str, int, str]] = []
    for path in sorted((root / "data").rglob("*.py")):
        module = module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in _targets(node, module, path.name == "__init__.py", root):
                    if any(target == above or target.startswith(above + ".") for above in _ABOVE_DATA):
                        found.append((module, node.lineno, target))
    return [f"{module}:{line} {target}" for module, line, target in sorted(found)]


def test_the_data_layer_never_imports_the_estimator_or_the_handlers(tmp_path):
    assert data_layer_imports_above(PACKAGE) == []
    root = _write(tmp_path, {"__init__.py": "", "data/__init__.py": "", "data/_x.py":
                             "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..events import declared\n"
                             "from ..estimator import _plan\n", "estimator/__init__.py": "",
                             "estimator/_plan.py": "", "events/__init__.py": ""})
    assert data_layer_imports_above(root) == ["estimatorch.data._x:3 estimatorch.events",
                                              "estimatorch.data._x:4 estimatorch.estimator._plan"]


def _owner(name: str) -> Optional[str]:
    """Who may use the dotted ``name``: None when no part of it is private (``_x``), else the
    package it belongs to (the top package for a private module of its own, such as
    ``_checks``; else the sub-package or top-level module, such as ``estimator`` or ``rng``)."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:1] if i == 1 else parts[:2])
    return None


def private_names(root: pathlib.Path) -> list[str]:
    """``module:line name`` for every ``_``-prefixed name a module takes from another package,
    by import or as an attribute of a module it imported."""
    problems: list[str] = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        tree = ast.parse(path.read_text())
        bound: dict[str, str] = {}
        used: list[tuple[int, str]] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                source = _import_source(node, module, path.name == "__init__.py")
                if source.split(".")[0] != root.name:
                    continue
                for alias in node.names:
                    bound[alias.asname or alias.name] = f"{source}.{alias.name}"
                    used.append((node.lineno, f"{source}.{alias.name}"))
            elif isinstance(node, ast.Import):
                used += [(node.lineno, alias.name) for alias in node.names if alias.name.split(".")[0] == root.name]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
                used.append((node.lineno, f"{bound[node.value.id]}.{node.attr}"))
        for line, name in sorted(set(used)):
            owner = _owner(name)
            if owner is not None and not (module == owner or module.startswith(owner + ".")):
                problems.append(f"{module}:{line} uses {name}, private to {owner}")
    return problems


def _import_source(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_module_uses_a_private_name_of_another_package():
    """What a package keeps private (``_``-prefixed modules, functions, classes) is used inside
    it only: the estimator reaches the handlers through the public contract (``events``), not
    through the handlers' private modules."""
    assert private_names(PACKAGE) == []


@pytest.mark.parametrize("files, expected", [
    ({"__init__.py": "", "_checks.py": "", "rng.py": "def _seed(): pass\n",
      "estimator/__init__.py": "from .._checks import x\nfrom . import _own\n", "estimator/_own.py": ""}, []),
    ({"__init__.py": "", "event_handlers/__init__.py": "", "event_handlers/_dispatch.py": "",
      "estimator/__init__.py": "from ..event_handlers._dispatch import Dispatch\n"},
     ["estimatorch.event_handlers._dispatch.Dispatch, private to estimatorch.event_handlers"]),
    ({"__init__.py": "", "rng.py": "", "samplers/__init__.py": "from .. import rng\nrng._check_seed(1)\n"},
     ["estimatorch.rng._check_seed, private to estimatorch.rng"]),
    ({"__init__.py": "", "metrics/__init__.py": "", "metrics/base.py": "",
      "metrics/loss.py": "from .base import _ratio\n"}, []),
], ids=["shared-and-own", "another-package-module", "another-module-attribute", "same-package"])
def test_the_private_name_check_reports_each_breach(tmp_path, files, expected):
    problems = private_names(_write(tmp_path, files))
    assert len(problems) == len(expected), problems
    for problem, words in zip(problems, expected):
        assert words in problem, problem


def estimator_typed_any(root: pathlib.Path) -> list[str]:
    """``module:line function`` for every parameter that holds the estimator (``estimator``,
    ``est``) typed ``Any``, anywhere in the package."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
                if any(arg.arg in ("estimator", "est") and arg.annotation is not None
                       and ast.unparse(arg.annotation).strip("'\"") == "Any" for arg in args):
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name}")
    return found


def test_nothing_types_the_estimator_as_any():
    """The loop's helpers take ``FitEstimator``, the handlers ``EstimatorView``, a checkpoint
    store ``ResumableFit``, a batch processor ``StepEstimator``: ``estimator: Any`` nowhere, so
    mypy checks every read across each seam."""
    assert estimator_typed_any(PACKAGE) == []


def test_the_any_check_reports_an_estimator_typed_any(tmp_path):
    (tmp_path / "estimatorch").mkdir()
    (tmp_path / "estimatorch" / "_x.py").write_text(
        "from typing import Any\n\ndef f(a: int, estimator: Any) -> None:\n    pass\n\n"
        "def g(*, est: Any) -> None:\n    pass\n\ndef h(estimator: 'Any') -> None:\n    pass\n")
    assert estimator_typed_any(tmp_path / "estimatorch") == ["estimatorch/_x.py:3 f", "estimatorch/_x.py:6 g",
                                                             "estimatorch/_x.py:9 h"]


# -- every read across a seam is a declared member -------------------------------------------------
#: the names the package's code gives the estimator it is handed
ESTIMATOR_NAMES = ("estimator", "est")


def _attribute_reads(tree: ast.AST) -> list[tuple[int, ast.expr, str]]:
    """``(line, object, name)`` for every ``getattr(object, "name", ...)`` and
    ``hasattr(object, "name")`` with a literal name: a read the type checker cannot see."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) \
                and isinstance(node.args[1].value, str):
            found.append((node.lineno, node.args[0], node.args[1].value))
    return found


def _is_the_estimator(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ESTIMATOR_NAMES) or \
        (isinstance(node, ast.Attribute) and node.attr in ESTIMATOR_NAMES)


def estimator_reads_by_name(root: pathlib.Path) -> list[str]:
    """``module:line getattr(estimator, 'name')`` for every read of the estimator by a literal
    name, anywhere in the package: each seam is a ``Protocol`` (``EstimatorView``,
    ``StepEstimator``, ``FitEstimator``, ``ResumableFit``), and a member read by name is one mypy
    never checks against it (or one the seam does not declare)."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, obj, name in _attribute_reads(ast.parse(path.read_text())):
            if _is_the_estimator(obj):
                found.append(f"{module_name(path, root)}:{line} getattr({ast.unparse(obj)}, {name!r})")
    return found


def handler_declarations(handler_module: pathlib.Path) -> set[str]:
    """The public names class ``Handler`` of ``handler_module`` declares (values, properties,
    methods): what the loop may read of a handler, through ``events.declared``."""
    for node in ast.parse(handler_module.read_text()).body:
        if isinstance(node, ast.ClassDef) and node.name == "Handler":
            names = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    names.update(t.id for t in item.targets if isinstance(t, ast.Name))
            return {name for name in names if not name.startswith("_")}
    raise AssertionError(f"no class Handler in {handler_module}")


def declarations_read_by_name(root: pathlib.Path, layers: dict[str, int]) -> list[str]:
    """``module:line getattr(x, 'name')`` for every read of a ``Handler`` declaration by name
    (``getattr``, ``hasattr``) in a module above the contract (layer 5 and up) but ``events/``
    itself: elsewhere a declaration is read with ``events.declared``, which gives a handler of
    the mixins alone the default ``Handler`` declares."""
    names = handler_declarations(root / "events" / "handler.py")
    contract = f"{root.name}.events"
    found = []
    for path in sorted(root.rglob("*.py")):
        module = module_name(path, root)
        if module == contract or module.startswith(contract + ".") or layer_of(module, layers) < 5:
            continue
        for line, obj, name in _attribute_reads(ast.parse(path.read_text())):
            if name in names:
                found.append(f"{module}:{line} getattr({ast.unparse(obj)}, {name!r})")
    return found


def test_nothing_reads_the_estimator_by_a_literal_name():
    assert estimator_reads_by_name(PACKAGE) == []


def test_nothing_but_the_contract_reads_a_handler_declaration_by_name():
    assert declarations_read_by_name(PACKAGE, LAYERS) == []


def test_the_seam_checks_report_each_breach(tmp_path):
    root = _write(tmp_path, {
        "__init__.py": "", "rng.py": "getattr(est, 'seed')\n",
        "events/__init__.py": "", "events/handler.py": (
            "class Handler:\n    priority: float = 0\n    shared_state = False\n    _hidden = 1\n"
            "    def stop_limits(self):\n        pass\n    @property\n    def resumes_run(self):\n        return False\n"),
        "events/dispatch.py": "getattr(handler, 'priority', 0)\n",
        "estimator/__init__.py": "", "estimator/_loop.py": (
            "getattr(estimator, 'strategy', None)\nhasattr(self.estimator, 'cuda_graphs')\ngetattr(estimator, name)\n"
            "getattr(h, 'shared_state', False)\ngetattr(h, 'stop_limits')\nhasattr(h, 'resumes_run')\n"
            "getattr(h, '_hidden')\ngetattr(metric, 'capturable', False)\n")})
    layers = {"estimatorch.rng": 1, "estimatorch.events": 5, "estimatorch.estimator": 8, "estimatorch": 9}
    assert estimator_reads_by_name(root) == ["estimatorch.estimator._loop:1 getattr(estimator, 'strategy')",
                                             "estimatorch.estimator._loop:2 getattr(self.estimator, 'cuda_graphs')",
                                             "estimatorch.rng:1 getattr(est, 'seed')"]
    assert handler_declarations(root / "events" / "handler.py") == {"priority", "shared_state", "stop_limits",
                                                                     "resumes_run"}
    assert declarations_read_by_name(root, layers) == ["estimatorch.estimator._loop:4 getattr(h, 'shared_state')",
                                                        "estimatorch.estimator._loop:5 getattr(h, 'stop_limits')",
                                                        "estimatorch.estimator._loop:6 getattr(h, 'resumes_run')"]


def undeclared_capabilities(root: pathlib.Path) -> list[str]:
    """``module:line name`` for every ``declared(handler, "name")`` in the package whose name
    ``Handler`` does not declare (a capability the loop reads that no contract names)."""
    names = handler_declarations(root / "events" / "handler.py")
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "declared" \
                    and len(node.args) == 2 and isinstance(node.args[1], ast.Constant) \
                    and node.args[1].value not in names:
                found.append(f"{module_name(path, root)}:{node.lineno} {node.args[1].value}")
    return found


def test_every_capability_the_loop_reads_is_declared_on_the_handler(tmp_path):
    """What the loop asks of a handler beyond the events (``evaluation_handlers`` among them) is
    a member of ``Handler``: a handler of the mixins alone gets each default from ``declared``."""
    assert undeclared_capabilities(PACKAGE) == []
    assert "evaluation_handlers" in handler_declarations(PACKAGE / "events" / "handler.py")
    root = _write(tmp_path, {"__init__.py": "", "events/__init__.py": "",
                             "events/handler.py": "class Handler:\n    priority = 0\n",
                             "_loop.py": "declared(h, 'priority')\ndeclared(h, 'companions')\n"})
    assert undeclared_capabilities(root) == ["estimatorch._loop:2 companions"]
