"""Every notebook in notebooks/ runs top to bottom on CPU, is stored without outputs, opens with
no warning, and every number of its "What we found" cell is one its executed cells printed."""
import math
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))

NUMBER = re.compile(r"(?:(?<=^)|(?<=[\s(\[{=:,/]))([-+]?)(\d[\d,]*(?:\.\d+)?(?:e[-+]?\d+)?)(?!\w)")
NOT_A_FINDING = re.compile(r"eq\. \d+(-\d+)?|\d+(st|nd|rd|th)\b|\d+(\.\d+)?[KMB]\b")
"""Equation numbers, ordinals and sizes (1K tokens, 340M parameters): settings, not findings."""


def numbers(text: str) -> list[tuple[float, int | None, int | None, bool]]:
    """Each number of ``text`` as ``(value, decimals, significant digits, percent)``: decimals
    for a plain number, significant digits for one in e-notation; ``9,563`` is 9563; a number
    followed by ``%`` (or a range ``25-39 %``) is a percentage."""
    text = NOT_A_FINDING.sub(" ", text)
    found = []
    for m in NUMBER.finditer(text):
        sign, body = m.groups()
        body = body.replace(",", "") if re.fullmatch(r"\d{1,3}(,\d{3})+(\.\d+)?", body) else body.split(",")[0]
        percent = re.match(r"(-[\d.]+)?\s?%", text[m.end():]) is not None
        mantissa = body.split("e")[0]
        decimals = None if "e" in body else len(mantissa.partition(".")[2])
        digits = len(mantissa.replace(".", "").lstrip("0")) if "e" in body else None
        found.append((float(("-" if sign == "-" else "") + body), decimals, digits, percent))
    return found


def shown_as(claim, printed: list[float]) -> bool:
    """Whether the written number ``claim`` is one of ``printed`` rounded as it is written (a
    percentage also as the printed fraction)."""
    value, decimals, digits, percent = claim
    candidates = [value] + ([value / 100] if percent else [])
    for target in candidates:
        scale = 1 if target == value else 100
        if decimals is not None:
            tol = 0.5 * 10 ** -decimals / scale + 1e-12
        else:
            tol = 0.5 * 10 ** (math.floor(math.log10(abs(target))) - digits + 1) * 1.0001
        if any(abs(x - target) <= tol for x in printed):
            return True
    return False


def findings_not_printed(nb) -> list[str]:
    """The numbers of the "What we found" cell that no executed output and no code cell shows."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    outputs = "\n".join(o.get("text", "") or o.get("data", {}).get("text/plain", "") for c in code for o in c.outputs)
    printed = [n[0] for n in numbers(outputs + "\n" + "\n".join(c.source for c in code))]
    found = [c.source for c in nb.cells if c.cell_type == "markdown" and c.source.startswith("## What we found")]
    assert len(found) == 1, "each notebook ends with one '## What we found' cell"
    return [f"{n[0]:g}" for n in numbers(found[0]) if not shown_as(n, printed)]


def test_there_are_notebooks():
    assert len(NOTEBOOKS) >= 1


def test_the_findings_check_catches_a_changed_number():
    cell = nbformat.v4.new_code_cell("x = 8")
    cell.outputs = [nbformat.v4.new_output("stream", text="mean -0.0057 nats; 9563.1 tokens; 0.391 of lambda; 3.74e-07\n")]
    nb = nbformat.v4.new_notebook(cells=[cell, nbformat.v4.new_markdown_cell(
        "## What we found\n\n-0.0057 nats, 9,563 tokens, 39 % of it, 3.7e-7 at most, 8 prompts")])
    assert findings_not_printed(nb) == []
    nb.cells[1].source = "## What we found\n\n+0.0057 nats, 9,564 tokens, 38 % of it, 3.8e-7, 9 prompts"
    assert findings_not_printed(nb) == ["0.0057", "9564", "38", "3.8e-07", "9"]


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
    warned = [i for i, cell in enumerate(code) for out in cell.outputs if "Warning" in out.get("text", "")]
    assert not warned, f"{path.name}: code cells {warned} print a warning"
    assert findings_not_printed(nb) == [], f"{path.name}: 'What we found' numbers no cell printed"
