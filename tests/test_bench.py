"""bench/ holds registered benchmarks only, and its runner runs them (CPU smoke of the sweep benchmark)."""
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"


sys.path.insert(0, str(BENCH))  # the runner imports its sibling registry.py by that name
try:
    import registry
    import run
finally:
    sys.path.remove(str(BENCH))


def test_every_bench_script_is_registered():
    scripts = {p.name for p in BENCH.glob("*.py")} - {"registry.py", "run.py"}
    assert scripts == {b.script for b in registry.BENCHMARKS.values()}
    assert all(b.path.is_file() for b in registry.BENCHMARKS.values())
    assert not [p.name for p in BENCH.iterdir() if p.suffix not in (".py", "") and p.name != "__pycache__"]


def test_unknown_benchmark_names_the_choices():
    with pytest.raises(ValueError, match="expected one of .*'kernels'"):
        registry.get_benchmark("kernel")
    with pytest.raises(SystemExit):
        run.main(["kernel"])


def test_list_names_every_benchmark(capsys):
    assert run.main(["--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines() if not line.startswith(" ")]
    assert listed == list(registry.BENCHMARKS)


def test_runner_runs_the_sweep_benchmark_and_records_the_machine(tmp_path, capsys):
    args = ["--tiny", "--device", "cpu", "--samples", "1", "--lengths", "512", "--strengths", "0,1",
            "--no-progress"]
    assert run.main(["sweep", "--out", str(tmp_path), "--", *args]) == 0
    out = capsys.readouterr().out
    res = json.loads(out[("\n" + out).rindex("\n{"):])
    assert res["rows"] == 2 and res["device"] == "cpu" and res["prompt_tokens"] > 2 * 388
    machine = json.loads((tmp_path / "sweep.machine.json").read_text())
    assert machine["benchmark"] == "sweep" and machine["command"] == ["bench/sweep.py", *args]
    assert machine["torch"] and len(machine["date_utc"]) == 10
