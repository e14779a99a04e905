"""scripts/interference_tables.py: the RESULTS tables from an evaluation folder, with sweeps that
have not finished (no summary.json yet) shown as pending rather than dropped or failing."""
import json
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.fixture
def tables():
    sys.path.insert(0, str(SCRIPTS))  # the script imports its sibling results_tables by that name
    import interference_tables
    yield interference_tables
    sys.path.remove(str(SCRIPTS))


def write_summary(cell: Path, rows: list[dict]) -> None:
    cell.mkdir(parents=True)
    (cell / "summary.json").write_text(json.dumps({"rows": rows}))


def test_accuracy_table_marks_unfinished_sweeps_pending(tables, tmp_path, capsys):
    write_summary(tmp_path / "interference-gdn2-s0" / "mk4", [
        {"length": 2048, "s": 1.0, "correct": 91, "n": 100, "b": 0, "c": 0},
        {"length": 4096, "s": 1.0, "correct": 7, "n": 100, "b": 0, "c": 0}])
    (tmp_path / "interference-full-s0" / "mk4").mkdir(parents=True)  # rows so far, no summary
    tables.accuracy_tables(tmp_path, ["interference-gdn2-s0", "interference-full-s0"], ["mk4"])
    lines = capsys.readouterr().out.splitlines()
    assert "| interference-gdn2-s0 | 91 | 7 |" in lines
    assert "| interference-full-s0 | pending | pending |" in lines


def test_strength_table_rows_sum_discordant_pairs_over_lengths(tables, tmp_path, capsys):
    rows = [{"length": x, "s": s, "correct": 50 + (x == 32768 and s == -1.0) * 24, "n": 100,
             "b": 24 if (x == 32768 and s == -1.0) else 1, "c": 0}
            for x in (2048, 8192, 32768) for s in (-1.0, 0.0, 0.5, 1.0, 1.5, 2.0)]
    write_summary(tmp_path / "interference-full-s0" / "mk4", rows)
    (tmp_path / "interference-noproj-s0" / "mk4").mkdir(parents=True)
    tables.strength_table(tmp_path, ["interference-full-s0", "interference-noproj-s0"], "mk4")
    lines = capsys.readouterr().out.splitlines()
    full = next(x for x in lines if x.startswith("| interference-full-s0"))
    assert full.startswith("| interference-full-s0 | 50 / 50 / 74 | 50 / 50 / 50 |")
    assert full.endswith("| 26/0 | 3/0 | 3/0 |")
    assert "| interference-noproj-s0 | " + " | ".join(["pending"] * 9) + " |" in lines
