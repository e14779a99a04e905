"""scripts/strength_targets.py on the measured strength sweeps of two shipped strong-lambda models
(docs/results/gpu-2026-12-06-strong/summary.csv): the verdicts RESULTS reports and the figure."""
import csv
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUMMARY = ROOT / "docs" / "results" / "gpu-2026-12-06-strong" / "summary.csv"
NUMBERS = ("length", "s", "n", "correct", "accuracy", "ci_low", "ci_high", "b", "c", "mcnemar_p")


def sweep_rows(model: str, cell: str) -> list[dict]:
    """One sweep's summary rows, as ``qedprobe sweep`` writes them into summary.json."""
    rows = [r for r in csv.DictReader(SUMMARY.open()) if r["model"] == model and r["cell"] == cell]
    out = []
    for r in rows:
        row = {k: float(r[k]) for k in NUMBERS}
        row.update(length=int(row["length"]), n=int(row["n"]), correct=int(row["correct"]), b=int(row["b"]),
                   c=int(row["c"]))
        out.append(row)
    return out


def test_targets_and_figure_of_two_measured_models(tmp_path):
    """strong-full-lm1.0-s0 meets both targets (95 % at 2K; 85 -> 2 % at 16K, s = 2); noproj-s1
    misses both (85 % at 2K; flat). The figure is drawn from the mk4-all sweeps."""
    for model in ("strong-full-lm1.0-s0", "strong-noproj-lm1.0-s1"):
        for cell in ("mk4-all", "mk4-decode"):
            folder = tmp_path / model / cell
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps({"rows": sweep_rows(model, cell)}))
    figure = tmp_path / "strength.png"
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "strength_targets.py"), str(tmp_path),
                          "--figure", str(figure)], capture_output=True, text=True, check=True).stdout
    assert ("* strong-full-lm1.0-s0: s = 1 at 2048 (mk4-all) 95 % (>= 90 %); some s >= 20 points from s = 1 "
            "with p < 0.001: yes") in out
    assert ("* strong-noproj-lm1.0-s1: s = 1 at 2048 (mk4-all) 85 % (< 90 %); some s >= 20 points from s = 1 "
            "with p < 0.001: no") in out
    assert "| strong-full-lm1.0-s0 | mk4-all | 16384 | 85 | 2 | -83 | 0 / 83 | 2.1e-25 |" in out
    assert "| strong-full-lm1.0-s0 | mk4-decode | 16384 | 85 |" in out
    assert figure.stat().st_size > 20_000


def test_figure_needs_the_cell(tmp_path):
    """--figure with no model holding the asked cell names the cell instead of drawing nothing."""
    (tmp_path / "m" / "mk8-all").mkdir(parents=True)
    (tmp_path / "m" / "mk8-all" / "summary.json").write_text(json.dumps({"rows": sweep_rows(
        "strong-full-lm1.0-s0", "mk8-all")}))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "strength_targets.py"), str(tmp_path),
                           "--figure", str(tmp_path / "f.png")], capture_output=True, text=True)
    assert done.returncode != 0 and "mk4-all/summary.json" in done.stderr
