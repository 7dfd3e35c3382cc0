"""The notebooks in notebooks/: each runs top to bottom in a fresh Jupyter kernel without an error
(their own asserts check what they claim), and the committed files hold their outputs, small and
in plain text or PNG, so that they read on GitHub.

After editing a notebook, refresh its committed outputs with ``make notebooks`` (which runs
``python -m tests.test_notebooks [NAME ...]``): it executes them in a temporary directory, as the
test does, and writes them back with their outputs.
"""

from __future__ import annotations

import ast
import base64
import os
import pathlib
import re
import sys
import tempfile
import time
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
#: the guided tour, in order (the README and docs/index.md link to each).
TOUR = ["01_quickstart", "02_custom_handlers", "03_resume_and_reproducibility", "04_statistics_and_tensorboard",
        "05_distributed"]
#: what the outputs of one notebook may weigh: text (logs, prints, bars) and each PNG plot.
MAX_TEXT_BYTES = 16_000
MAX_PNG_BYTES = 80_000
WIDGET = "application/vnd.jupyter.widget-view+json"


def execute(path: pathlib.Path, workdir: str) -> Any:
    """Run the notebook at ``path`` in a new kernel whose working directory is ``workdir`` and
    which imports this checkout's estimatorch; return it with its outputs. A cell that raises
    fails the run (``nbclient.exceptions.CellExecutionError`` names the cell and the error)."""
    import nbclient
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3", record_timing=False,
                                     resources={"metadata": {"path": workdir}})
    if "coalesce_streams" in client.trait_names():  # nbclient >= 0.10: one output per stream run
        client.coalesce_streams = True
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    client.execute(env=env)
    return notebook


def outputs(notebook: Any) -> list[dict]:
    return [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.get("outputs", [])]


def check_outputs(notebook: Any, name: str) -> tuple[int, list[int]]:
    """Plain text and PNG only, no error, no widget, no carriage-return frames, small; returns
    the bytes of text outputs and of each PNG."""
    text_bytes, pngs = 0, []
    for output in outputs(notebook):
        assert output["output_type"] != "error", f"{name}: {output.get('ename')}: {output.get('evalue')}"
        data = output.get("data", {})
        assert WIDGET not in data, f"{name} holds a widget, whose saved fallback text is stale"
        text = output.get("text", "") + data.get("text/plain", "")
        assert not re.search("\r(?!\n)", text), f"{name} holds raw progress-bar frames: {text[:200]!r}"
        text_bytes += len(text.encode("utf-8"))
        if "image/png" in data:
            pngs.append(len(base64.b64decode(data["image/png"])))
            assert pngs[-1] <= MAX_PNG_BYTES, f"{name}: a {pngs[-1]}-byte PNG"
    assert text_bytes <= MAX_TEXT_BYTES, f"{name}: {text_bytes} bytes of text outputs"
    return text_bytes, pngs


def test_the_tour_is_there_in_order():
    assert [p.stem for p in NOTEBOOKS] == TOUR


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_notebooks_hold_small_plain_outputs(path):
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code and all(cell.execution_count is not None for cell in code), f"{path.name} was not run: make notebooks"
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))  # top to bottom, once
    assert sum(bool(cell.outputs) for cell in code) >= len(code) // 2, f"{path.name} was saved without outputs"
    check_outputs(notebook, path.name)


def _notebook_imports(path: pathlib.Path) -> set[str]:
    """The top-level modules a notebook's code cells import."""
    import nbformat

    modules = set()
    for cell in nbformat.read(path, as_version=4).cells:
        if cell.cell_type != "code":
            continue
        source = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Import):
                modules.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules.add(node.module.split(".")[0])
    return modules


def _requirement_names(text: str) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", line.strip(), maxsplit=1)[0].lower()
            for line in text.splitlines() if line.strip() and not line.strip().startswith("#")}


def test_the_notebooks_extra_holds_what_the_notebooks_import():
    """``pip install -e ".[notebooks]"`` once left notebook 04 without mlflow."""
    import configparser
    from importlib.metadata import packages_distributions

    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    installed = _requirement_names(setup["options"]["install_requires"])
    installed |= _requirement_names(setup["options.extras_require"]["notebooks"])
    distributions = packages_distributions()
    missing = {}
    for path in NOTEBOOKS:
        for module in _notebook_imports(path) - set(sys.stdlib_module_names) - {"estimatorch"}:
            names = {d.lower() for d in distributions.get(module, [])}
            if names and not names & installed:  # no distribution: a module the notebook writes itself
                missing.setdefault(path.name, []).append(f"{module} ({', '.join(sorted(names))})")
    assert not missing, f"the notebooks extra in setup.cfg lacks: {missing}"


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    notebook = execute(path, str(tmp_path))
    check_outputs(notebook, path.name)


def refresh(names: list[str]) -> None:
    """Execute the named notebooks (all by default) and write them back with their outputs."""
    import nbformat

    paths = [ROOT / "notebooks" / f"{n}.ipynb" for n in names] if names else NOTEBOOKS
    for path in paths:
        start = time.monotonic()
        with tempfile.TemporaryDirectory() as workdir:
            notebook = execute(path, workdir)
        seconds = time.monotonic() - start
        text_bytes, pngs = check_outputs(notebook, path.name)
        nbformat.write(notebook, path)
        print(f"{path.name}: ran in {seconds:.0f} s; outputs: {text_bytes} bytes of text, {len(pngs)} PNG "
              f"({sum(pngs)} bytes); file {path.stat().st_size} bytes", file=sys.stderr)


if __name__ == "__main__":
    refresh(sys.argv[1:])
