"""Every notebook runs top to bottom (at the small sizes it is written with), and every cell
that makes a figure shows it."""

from __future__ import annotations

from pathlib import Path

import pytest

import checkpoint_ad

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).parents[1] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 3


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    """As `jupyter notebook notebooks/` runs it: in notebooks/, with the installed package and
    nothing on PYTHONPATH (a notebook importing the repository's bench/ would fail here)."""
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.delenv("PYTHONPATH", raising=False)
    book = nbformat.read(path, as_version=4)
    where = nbformat.v4.new_code_cell("import checkpoint_ad\nprint(checkpoint_ad.__file__)")
    book.cells.insert(0, where)
    client = nbclient.NotebookClient(book, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    imported = where.outputs[0]["text"] if where.outputs else ""
    assert str(Path(checkpoint_ad.__file__)) in imported, (
        f"the notebook's kernel imports another checkpoint_ad ({imported.strip()}) than the "
        f"tests ({checkpoint_ad.__file__}): install this checkout, pip install -e '.[dev]'")
    book.cells.remove(where)
    code = [c for c in book.cells if c.cell_type == "code"]
    errors = [o for c in code for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors
    figure_cells = [c for c in code if "fig = " in c.source or "fig, ax = " in c.source]
    assert figure_cells, "each notebook draws at least one figure"
    for cell in figure_cells:
        images = [o for o in cell.get("outputs", []) if "image/png" in o.get("data", {})]
        assert len(images) == 1, f"this cell should show its figure once:\n{cell.source}"
