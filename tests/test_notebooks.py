"""Every notebook in notebooks/ runs top to bottom on CPU, and is stored without outputs."""
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_is_stored_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: strip outputs before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_executes(path):
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any failure
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    shows_image = [any("image/png" in out.get("data", {}) for out in cell.outputs) for cell in code]
    assert any(shows_image), f"{path.name} shows no figure"
    lost = [i for i, (cell, shown) in enumerate(zip(code, shows_image)) if "plt.show()" in cell.source and not shown]
    assert not lost, f"{path.name}: code cells {lost} call plt.show() but display no figure"
