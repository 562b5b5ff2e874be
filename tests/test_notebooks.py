"""Every notebook runs top to bottom (at the small sizes it is written with), and every cell
that makes a figure shows it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    paths = (str(path.parents[1]), os.environ.get("PYTHONPATH"))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    book = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    code = [c for c in book.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    figure_cells = [c for c in code if "fig = " in c.source or "fig, ax = " in c.source]
    assert figure_cells, "each notebook draws at least one figure"
    for cell in figure_cells:
        images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        assert len(images) == 1, f"this cell should show its figure once:\n{cell.source}"
