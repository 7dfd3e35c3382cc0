"""The user guide (docs/), the README and the notebooks' text: every exported handler, option,
event, statistic and metric is documented; links resolve; the README's example runs and gives
the same numbers run after run; nothing points outside the repository."""

from __future__ import annotations

import ast
import functools
import inspect
import json
import pathlib
import re
import subprocess

import pytest

import estimatorch
from estimatorch import event_handlers, metrics, statistics
from estimatorch.event_handlers import EVENTS, StatefulHandler
from tests import forked

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
GUIDE = sorted(DOCS.glob("*.md"))
README = ROOT / "README.md"


def read(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8")


def exported_handlers() -> list[type]:
    return [getattr(event_handlers, name) for name in event_handlers.__all__
            if isinstance(getattr(event_handlers, name), type)
            and issubclass(getattr(event_handlers, name), StatefulHandler)
            and getattr(event_handlers, name) is not StatefulHandler]


def documented_arguments(cls: type) -> list[str]:
    """The names in the ``Args:`` section of a docstring (a line may list several)."""
    doc = inspect.getdoc(cls) or ""
    section = re.search(r"^Args:\n((?:(?: {4}.*)?\n)+)", doc + "\n", re.MULTILINE)
    names: list[str] = []
    for line in (section.group(1) if section else "").splitlines():
        entry = re.match(r" {4}(\w+(?:, \w+)*):", line)
        if entry:
            names.extend(entry.group(1).split(", "))
    return names


def section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of the same or a higher level."""
    match = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.MULTILINE)
    assert match, f"no heading {heading!r}"
    level = len(match.group(1))
    rest = text[match.end():]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.MULTILINE)
    return rest[:end.start()] if end else rest


def test_the_guide_has_its_pages_and_the_index_links_each():
    index = read(DOCS / "index.md")
    for page in GUIDE:
        if page.name != "index.md":
            assert f"({page.name})" in index or f"({page.name}#" in index, f"docs/index.md does not link {page.name}"


@pytest.mark.parametrize("cls", exported_handlers(), ids=lambda c: c.__name__)
def test_the_handler_reference_documents_every_exported_handler_and_option(cls):
    reference = read(DOCS / "handlers.md")
    text = section(reference, f"`{cls.__name__}`")
    for argument in documented_arguments(cls):
        assert f"`{argument}`" in text or (cls is event_handlers.LambdaHandler and argument in EVENTS), \
            f"docs/handlers.md: {cls.__name__} does not document its option {argument!r}"
    assert "Priority" in text and "State" in text, f"docs/handlers.md: {cls.__name__} lacks its priority or state"
    priority = cls.priority if cls is not event_handlers.LambdaHandler else 0
    shown = "+inf" if priority == float("inf") else str(int(priority))
    assert shown in text or shown in section(reference, "Handler reference").split("---")[0], cls.__name__


def test_every_exported_name_of_event_handlers_is_in_the_guide():
    guide = "".join(read(p) for p in GUIDE)
    missing = [name for name in event_handlers.__all__ if name not in guide]
    assert not missing, f"the guide never mentions {missing}"


def test_every_public_name_of_distributed_is_on_its_page():
    from estimatorch import distributed

    page = read(DOCS / "distributed.md")
    missing = [name for name in distributed.__all__ if not re.search(rf"[`.]{name}\b", page)]
    assert not missing, f"docs/distributed.md never mentions {missing}"


def _package_modules(package: pathlib.Path) -> list[pathlib.Path]:
    """Every module of the package: each ``.py`` file but a package's ``__init__.py`` that
    defines nothing (a docstring and imports), which its package's own row covers."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py" and not any(isinstance(node, (ast.FunctionDef, ast.ClassDef))
                                                  for node in ast.parse(path.read_text()).body):
            continue
        found.append(path)
    return found


def test_the_module_map_names_every_module_and_only_modules_that_exist():
    """docs/architecture.md's map of where things are: every module of the package is named by
    its path (a package whose ``__init__`` holds code, such as ``checkpoint_handler/``, by its
    directory), and every path the map names exists (a map that drifted fails)."""
    where = section(read(DOCS / "architecture.md"), "Where things are")
    named = set(re.findall(r"`(estimatorch/[\w/.]*)`", where))
    missing = []
    for path in _package_modules(ROOT / "estimatorch"):
        rel = str(path.relative_to(ROOT))
        if rel not in named and not (path.name == "__init__.py" and rel[:-len("__init__.py")] in named):
            missing.append(rel)
    assert not missing, f"docs/architecture.md's map lacks {missing}"
    gone = sorted(p for p in named if not (ROOT / p).exists())
    assert not gone, f"docs/architecture.md's map names paths that do not exist: {gone}"


def test_every_path_the_architecture_guide_names_exists():
    """Not only the map: any ``estimatorch/...`` or package-relative module path the guide
    names in backquotes is one the package has."""
    text = read(DOCS / "architecture.md")
    gone = []
    for path in set(re.findall(r"`((?:estimatorch/)?(?:estimator|checkpoint|event_handlers|events|data|samplers|"
                               r"metrics|statistics)/[\w/]+\.py)`", text)):
        full = path if path.startswith("estimatorch/") else f"estimatorch/{path}"
        if not (ROOT / full).exists():
            gone.append(path)
    assert not gone, f"docs/architecture.md names paths that do not exist: {sorted(gone)}"


def test_the_module_map_check_catches_a_missing_module(tmp_path):
    (tmp_path / "estimator").mkdir()
    (tmp_path / "estimator" / "__init__.py").write_text('"""doc"""\nfrom .x import y\n')
    (tmp_path / "estimator" / "_loop.py").write_text("")
    (tmp_path / "handler").mkdir()
    (tmp_path / "handler" / "__init__.py").write_text("class Handler:\n    pass\n")
    assert [p.relative_to(tmp_path).as_posix() for p in _package_modules(tmp_path)] == [
        "estimator/_loop.py", "handler/__init__.py"]


#: what a backquoted instance name in docs/architecture.md stands for
_INSTANCES = {"est": "Estimator", "estimator": "Estimator", "run": "Run"}


@functools.lru_cache(maxsize=None)
def _tree(source: str) -> ast.Module:
    """The parse of a module's source (the checks below read each module many times)."""
    return ast.parse(source)


def _package_index(root: pathlib.Path) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The package's modules by their last name (``_loop`` -> ``estimatorch.estimator._loop``)
    and its classes by name (``Run`` -> the modules defining one)."""
    modules: dict[str, list[str]] = {}
    classes: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        dotted = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules.setdefault(dotted.split(".")[-1], []).append(dotted)
        for node in _tree(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(dotted)
    return modules, classes


def _class_members(root: pathlib.Path, module: str, name: str) -> set[str]:
    """What class ``name`` of ``module`` (under ``root``) declares, inherits from the package's
    classes, or sets on ``self``, read from the source."""
    path = root.parent.joinpath(*module.split("."))
    path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
    members: set[str] = set()
    for node in _tree(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            for item in ast.walk(node):
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    members.update(t.id for t in item.targets if isinstance(t, ast.Name))
                if isinstance(item, (ast.Assign, ast.AnnAssign)):
                    for target in item.targets if isinstance(item, ast.Assign) else [item.target]:
                        for element in ast.walk(target):
                            if isinstance(element, ast.Attribute) and isinstance(element.value, ast.Name) \
                                    and element.value.id == "self":
                                members.add(element.attr)
            _, classes = _package_index(root)
            for base in node.bases:
                base_name = base.id if isinstance(base, ast.Name) else base.attr if isinstance(base, ast.Attribute) else ""
                for other in classes.get(base_name, [])[:1]:
                    members |= _class_members(root, other, base_name)
    return members


def dotted_names_missing(text: str, root: pathlib.Path) -> list[str]:
    """The backquoted ``module.name``, ``Class.member`` and ``est.member`` names of ``text``
    (``data/_streams.open_stream``, ``_loop.run_loop``, ``distributed.spawn``,
    ``StopAgreement.restore``, ``est.check_payload()``) that name nothing the package under
    ``root`` has. A head that is neither a module nor a class of the package (``os.path.join``)
    is not checked; of ``a.b.c`` only ``a.b``."""
    modules, classes = _package_index(root)
    missing = []
    for head, member in re.findall(r"`((?:estimatorch[./])?[A-Za-z_][\w/]*)\.([A-Za-z_]\w*)[\w.]*(?:\(\))?`", text):
        head = head.replace("/", ".")
        head = head[len("estimatorch."):] if head.startswith("estimatorch.") else head
        if member == "py" or head == "estimatorch":
            continue  # a file's name (``_loop.py``), or one of the package's own names
        candidates = [] if head in _INSTANCES else \
            [m for m in modules.get(head.split(".")[-1], []) if m.endswith("." + head)]
        if candidates:
            found = False
            for module in candidates:
                path = root.parent.joinpath(*module.split("."))
                path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
                tree = _tree(path.read_text(encoding="utf-8"))
                names = {t.id for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
                         for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                         if isinstance(t, ast.Name)}
                names |= {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
                names |= {alias.asname or alias.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                          for alias in n.names}
                sub = path.parent / member if path.name == "__init__.py" else None
                found = found or member in names or (sub is not None and (sub.with_suffix(".py").is_file()
                                                                          or (sub / "__init__.py").is_file()))
            if not found:
                missing.append(f"{head}.{member}")
            continue
        cls = _INSTANCES.get(head, head)
        if "." not in head and cls in classes:
            if not any(member in _class_members(root, module, cls) for module in classes[cls]):
                missing.append(f"{head}.{member}")
    return missing


def test_the_architecture_guide_names_only_functions_that_exist():
    """Each ``module.function`` (``_loop.run_loop``), ``Class.member`` (``StopAgreement.restore``)
    and ``est.member`` docs/architecture.md names in backquotes is one the package has."""
    assert dotted_names_missing(read(DOCS / "architecture.md"), ROOT / "estimatorch") == []


def test_the_dotted_names_check_catches_a_name_that_is_gone(tmp_path):
    root = tmp_path / "estimatorch"
    (root / "data").mkdir(parents=True)
    (root / "__init__.py").write_text("")
    (root / "data" / "__init__.py").write_text("from ._streams import open_stream\n")
    (root / "data" / "_streams.py").write_text("def open_stream():\n    pass\n")
    (root / "run.py").write_text("class Base:\n    def restore(self):\n        pass\n\n\n"
                                 "class Run(Base):\n    pos: int\n\n    def __init__(self):\n        self.stage = 0\n")
    text = ("`data/_streams.open_stream`, `data.open_stream`, `_streams.make_train_stream`, `Run.pos`, "
            "`run.stage`, `Run.restore()`, `run.gone`, `Run.gone`, `os.path.join`, `estimatorch.json`, `_loop.py`")
    assert dotted_names_missing(text, root) == ["_streams.make_train_stream", "run.gone", "Run.gone"]


def drawn_layers(text: str) -> dict[str, int]:
    """The modules (dotted, under ``estimatorch``) of the layer table in docs/architecture.md's
    "Layers" section, each with its layer."""
    drawn: dict[str, int] = {}
    for layer, names in re.findall(r"^\| (\d+) \| ([^|]*) \|", section(text, "Layers"), re.MULTILINE):
        for name in re.findall(r"`([\w.]+)`", names):
            drawn["estimatorch" if name == "estimatorch" else f"estimatorch.{name}"] = int(layer)
    return drawn


def test_the_layer_table_places_every_module_as_the_layer_test_does():
    """The guide's layers and the ones tests/test_layers.py enforces are the same table."""
    from tests.test_layers import LAYERS

    assert drawn_layers(read(DOCS / "architecture.md")) == LAYERS
    assert drawn_layers("## Layers\n\n| 4 | `checkpoint` `data` | x |\n| 9 | `estimatorch` | y |\n") == {
        "estimatorch.checkpoint": 4, "estimatorch.data": 4, "estimatorch": 9}


def test_the_data_page_maps_every_module_of_the_data_layer():
    """docs/data.md's module map of ``estimatorch.data`` names each of its modules."""
    where = section(read(DOCS / "data.md"), "The data layer (`estimatorch.data`)")
    missing = [m.name for m in sorted((ROOT / "estimatorch" / "data").glob("*.py")) if f"| `{m.name}` |" not in where]
    assert not missing, f"docs/data.md's map of estimatorch.data lacks {missing}"


def test_the_loop_page_lists_every_event_and_its_mixin():
    loop = read(DOCS / "loop.md")
    for event, mixin in EVENTS.items():
        assert re.search(rf"\| `{event}` \| `{mixin.__name__}` \|", loop), f"docs/loop.md lacks {event}"


def test_every_statistic_and_metric_is_documented():
    reference, metrics_page = read(DOCS / "handlers.md"), read(DOCS / "metrics.md")
    for name in statistics.__all__:
        assert f"`{name}" in reference, f"docs/handlers.md never mentions statistics.{name}"
    for name in metrics.__all__:
        if isinstance(getattr(metrics, name), type):
            assert f"`{name}" in metrics_page, f"docs/metrics.md never mentions metrics.{name}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _markdown_sources() -> list[tuple[pathlib.Path, str]]:
    sources = [(p, read(p)) for p in [README, *GUIDE]]
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(read(notebook))["cells"]
        sources.append((notebook, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")))
    return sources


@pytest.mark.parametrize("path, text", _markdown_sources(), ids=lambda v: v.name if isinstance(v, pathlib.Path) else "")
def test_relative_links_and_anchors_resolve(path, text):
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # links inside code are not links
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: outside the repository
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{path.name} links to {target}, which does not exist"
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", read(linked), re.MULTILINE)
            assert anchor in {_slug(h) for h in headings}, f"{path.name} links to {target}: no such heading"


def test_docs_are_self_contained():
    """No pointer outside the repository; the names of the projects the code follows are
    explained where they appear (docs/architecture.md's glossary), and nowhere else."""
    for path in [README, *GUIDE]:
        text = read(path)
        for outside in ("../shared", "DESIGN.md", "/work/", "never touched"):
            assert outside not in text, f"{path.name} mentions {outside!r}"
        if path.name not in ("architecture.md", "performance.md"):
            for name in ("Helios", "QuantLab", "Determined"):
                assert name not in text, f"{path.name} mentions {name!r}, explained only in architecture.md"
    glossary = section(read(DOCS / "architecture.md"), "Names you will meet in the code")
    for name in ("Helios", "Determined", "QuantLab", "Gluon"):
        assert f"**{name}" in glossary


def test_the_readme_starts_with_the_two_commands_and_installs_honestly():
    text = read(README)
    first_block = re.search(r"```(\w*)\n(.*?)```", text, re.DOTALL)
    language, commands = first_block.groups()
    assert language == "bash" and "make demo" in commands and "make test" in commands
    assert "not on PyPI yet" in section(text, "Install")
    lines = [line for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL) for line in block.splitlines()]
    assert not any(re.match(r"pip install estimatorch\b", line) for line in lines)
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        assert f"notebooks/{notebook.name}" in text, f"the README does not link {notebook.name}"
    assert "docs/index.md" in text


def _readme_example() -> str:
    return re.search(r"## A first example\n\n```python\n(.*?)```", read(README), re.DOTALL).group(1)


def _run_example(workdir: pathlib.Path) -> list[str]:
    """The example's two printed results (not the log lines before them, whose timings vary)."""
    script = workdir / "example.py"
    script.write_text(_readme_example(), encoding="utf-8")
    proc = forked.run(str(script), [], cwd=str(workdir), timeout=300)  # as `python example.py`, without its imports
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()[-2:]


@pytest.mark.slow
def test_the_readme_example_gives_the_same_numbers_run_after_run(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    results = _run_example(first)
    assert len(results) == 2 and results[0].startswith("[") and "val_accuracy" in results[1]
    assert float(results[1].split("'val_accuracy': ")[1].rstrip("}")) > 0.5  # it learns
    assert _run_example(second) == results  # a fresh run in a fresh directory: the same numbers
    assert _run_example(first) == results  # run again where it finished: resumes, the same numbers
    assert any(p.suffix == ".pt" for p in (first / "checkpoints").iterdir())


def _guide_handler() -> type:
    """The complete handler of docs/writing-handlers.md, run from the page's own code."""
    code = re.search(r"```python\n(.*?)```", section(read(DOCS / "writing-handlers.md"), "A complete handler"),
                     re.DOTALL)
    assert code, "no code under 'A complete handler'"
    namespace: dict = {"__name__": "writing_handlers_example"}
    exec(compile(code.group(1), "docs/writing-handlers.md", "exec"), namespace)  # noqa: S102 - our own page
    return namespace["LossLog"]


def test_the_complete_handler_of_the_guide_takes_part_through_public_hooks_only(tmp_path):
    """The page's handler is refused before any work by its check_fit, is not called per batch
    without a period, lists the checkpoint a SIGTERM's stop wrote, continues its counters on a
    resume, and declares the counter an elastic resume scales."""
    import signal

    from estimatorch import CheckpointHandler, LambdaHandler
    from estimatorch.estimator._state.elastic_resume import batch_counters
    from estimatorch.events import subscribes
    from tests.conftest import make_batches, make_estimator

    LossLog = _guide_handler()
    assert batch_counters(LossLog(str(tmp_path / "x.txt"))) == ["batches"]
    assert not subscribes(LossLog(str(tmp_path / "x.txt"), every=None), "batch_end")
    steps = []
    with pytest.raises(ValueError, match="is in no existing directory"):
        make_estimator().fit(make_batches(4), epochs=1, event_handlers=[
            LossLog(str(tmp_path / "missing" / "loss.txt")),
            LambdaHandler(batch_end=lambda est, **kw: steps.append(1))])
    assert steps == []  # refused before any step

    log, ckpt = tmp_path / "loss.txt", tmp_path / "ckpt"
    sigterm = LambdaHandler(batch_end=lambda est, **kw: signal.raise_signal(signal.SIGTERM), once=6)
    with pytest.raises(SystemExit):
        make_estimator().fit(make_batches(4), epochs=3, event_handlers=[
            LossLog(str(log), every=2), CheckpointHandler(ckpt, resume_from_checkpoint=True), sigterm])
    lines = log.read_text().splitlines()
    assert [line.split()[0] for line in lines[:-1]] == ["2", "4", "6"]
    assert lines[-1] == f"# resume from {ckpt / 'model-epoch1batch6.pt'}"
    resumed = LossLog(str(log), every=2)
    make_estimator().fit(make_batches(4), epochs=3, event_handlers=[
        resumed, CheckpointHandler(ckpt, resume_from_checkpoint=True)])
    assert (resumed.batches, resumed.lines) == (12, 6)  # 6 before the stop, continued from the checkpoint
    assert [line.split()[0] for line in log.read_text().splitlines()[4:-1]] == ["8", "10", "12"]


# -- the data guide's own adapter ------------------------------------------------------------------
def _write_jsonl_shards(directory: pathlib.Path) -> None:
    """Three shards of 7, 5 and 9 examples (4 features, 3 classes), written by the test."""
    import torch

    directory.mkdir()
    g = torch.Generator().manual_seed(0)
    for i, count in enumerate((7, 5, 9)):
        x = torch.randn(count, 4, generator=g)
        lines = [json.dumps({"x": row.tolist(), "y": int(row[0] > 0) + int(row[1] > 1)}) for row in x]
        (directory / f"part-{i}.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _guide_adapter(workdir: pathlib.Path) -> pathlib.Path:
    """The complete adapter of docs/data.md, written as a module ``jsonl_adapter`` in ``workdir``."""
    code = re.search(r"```python\n(.*?)```", section(read(DOCS / "data.md"), "A data source of your own"), re.DOTALL)
    assert code, "no code under 'A data source of your own'"
    path = workdir / "jsonl_adapter.py"
    path.write_text(code.group(1), encoding="utf-8")
    return path


def test_the_data_guides_adapter_passes_the_conformance_check(tmp_path):
    import importlib.util

    from estimatorch.data import registered_adapters, unregister_adapter
    from estimatorch.testing import check_stream_adapter

    _write_jsonl_shards(tmp_path / "shards")
    spec = importlib.util.spec_from_file_location("jsonl_adapter", _guide_adapter(tmp_path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # registers the page's adapter
    try:
        assert registered_adapters()[0] == ("jsonl-shards", 0)
        check_stream_adapter(lambda workers: module.JsonlShards(tmp_path / "shards", 4, seed=1, num_workers=workers))
        with pytest.raises(ValueError, match="train_data holds no .jsonl shard"):
            from estimatorch.data import open_stream
            open_stream(module.JsonlShards(tmp_path, 4), 0)
    finally:
        unregister_adapter("jsonl-shards")


_TRAIN = """
import os, signal, sys
import torch
from torch import nn
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import jsonl_adapter
from estimatorch import CheckpointHandler, Estimator
from estimatorch.event_handlers import BatchEnd

workdir, workers, kill_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])

class Record(BatchEnd):
    priority = float("inf")
    def __init__(self):
        self.steps = 0
    def batch_end(self, estimator, *, batch, loss, **kwargs):
        self.steps += 1
        x, y = batch
        with open(os.path.join(workdir, "steps.txt"), "a") as f:
            f.write(f"{x.numpy().tobytes().hex()} {y.tolist()} {float(loss).hex()}\\n")
        if self.steps == kill_at:  # killed right after the checkpoint of this step
            estimator.at_boundary(lambda: os.kill(os.getpid(), signal.SIGKILL))

torch.manual_seed(0)
net = nn.Sequential(nn.Linear(4, 16), nn.Dropout(0.3), nn.ReLU(), nn.Linear(16, 3))
est = Estimator(net, nn.CrossEntropyLoss(), optimizer=torch.optim.Adam(net.parameters(), lr=0.01))
shards = jsonl_adapter.JsonlShards(os.path.join(workdir, "..", "shards"), 4, seed=1, num_workers=workers)
est.fit(shards, epochs=3, event_handlers=[Record(), CheckpointHandler(os.path.join(workdir, "ckpt"), batch_period=1,
                                                                     resume_from_checkpoint=True)])
torch.save(est.net.state_dict(), os.path.join(workdir, "final.pt"))
"""


def _train(workdir: pathlib.Path, workers: int, kill_at: int) -> subprocess.CompletedProcess:
    """``python train.py WORKDIR WORKERS KILL_AT``, forked from tests/forked.py's server."""
    return forked.run(str(workdir.parent / "train.py"), [workdir, workers, kill_at], timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("workers, kill_at", [(0, 6), (2, 3), (2, 8)],
                         ids=["workers0-an-epochs-last-batch", "workers2-mid-epoch", "workers2-second-epoch"])
def test_the_data_guides_adapter_resumes_after_a_sigkill_bit_for_bit(tmp_path, workers, kill_at):
    """The page's code in a fit SIGKILLed right after a checkpoint and run again, against an
    uninterrupted fit: the same batches, losses and final parameters, bit for bit (21 examples in
    batches of 4: 6 batches an epoch)."""
    import torch

    _write_jsonl_shards(tmp_path / "shards")
    _guide_adapter(tmp_path)
    (tmp_path / "train.py").write_text(_TRAIN, encoding="utf-8")
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    full.mkdir()
    resumed.mkdir()
    done = _train(full, workers, 0)
    assert done.returncode == 0, done.stderr[-2000:]
    killed = _train(resumed, workers, kill_at)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert len((resumed / "steps.txt").read_text().splitlines()) == kill_at
    again = _train(resumed, workers, 0)
    assert again.returncode == 0, again.stderr[-2000:]
    steps = (full / "steps.txt").read_text().splitlines()
    assert len(steps) == 18 and (resumed / "steps.txt").read_text().splitlines() == steps
    want, got = (torch.load(d / "final.pt", weights_only=True) for d in (full, resumed))
    assert all(torch.equal(want[k], got[k]) for k in want) and set(want) == set(got)
