"""Every notebook in notebooks/ runs top to bottom in a fresh Jupyter kernel."""

from __future__ import annotations

import pathlib

import nbclient
import nbformat
import pytest

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.notebook
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path):
    notebook = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    errors = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    texts = "".join(o.get("text", "") for cell in notebook.cells for o in cell.get("outputs", []))
    assert "bit-identical to the uninterrupted run: True" in texts


def test_there_is_a_notebook():
    assert NOTEBOOKS
