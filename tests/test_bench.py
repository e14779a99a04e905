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


def _sweep_bench(tmp_path, capsys, *args):
    assert run.main(["sweep", "--", "--tiny", "--device", "cpu", "--samples", "1", "--strengths", "0,1",
                     "--no-progress", "--out", str(tmp_path / "grid"), "--json", str(tmp_path / "sweep.json"),
                     *args]) == 0
    out = capsys.readouterr().out
    printed = json.loads(out[("\n" + out).rindex("\n{"):])
    assert json.loads((tmp_path / "sweep.json").read_text()) == printed
    return printed


def test_sweep_benchmark_resumes_and_sums_its_calls(tmp_path, capsys):
    first = _sweep_bench(tmp_path, capsys, "--lengths", "512")
    assert (first["rows"], first["calls"], first["untimed_rows"], first["full_grid"]) == (2, 1, 0, False)
    assert {"wall_s", "prefill_tokens_per_s", "decode_ms_per_step", "device", "date", "commit"} <= set(first)
    assert first["decode_ms_per_step_by_batch"].keys() == {"1"} and first["decode_steps"] == 2 * 10
    assert abs(sum(first["share"].values()) - 1) < 1e-3
    second = _sweep_bench(tmp_path, capsys, "--lengths", "512,1K")  # the 512 rows resume, 1K is new
    assert (second["rows"], second["calls"], second["untimed_rows"]) == (4, 2, 0)
    assert second["wall_s"] > first["wall_s"] and set(second["prefill_tokens_per_s_by_length"]) == {"512", "1024"}
    (tmp_path / "grid" / "bench_timing.json").unlink()  # as if the calls so far were killed before writing it
    third = _sweep_bench(tmp_path, capsys, "--lengths", "512,1K", "--budget", "16")
    assert (third["rows"], third["calls"], third["untimed_rows"], third["target_met"]) == (4, 1, 4, None)
