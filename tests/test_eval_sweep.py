"""`qedprobe sweep` / `report` on a tiny model: grid, paired summary, plots, resume, errors."""
import csv
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter

import pytest

from _eval_helpers import saved_tiny_model, tiny_model
from qedprobe.eval import commands
from qedprobe.eval.sweep import ResultsStore, SweepError, load_results, run_sweep

L = 400  # shortest usable s-niah-1 length with the byte tokenizer is 376
GRID = ["--lengths", str(L), "--strengths=0,1", "--samples", "3", "--batch-size", "3", "--no-progress"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


def _sweep(model_dir, out, *extra):
    return commands.main(["sweep", "--model", model_dir, "--device", "cpu", "--out", str(out), *GRID, *extra])


def _keys(rows):
    return Counter((r["length"], r["s"], r["sample_id"]) for r in rows)


def test_cli_sweep_grid_summary_plots_and_resume(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "run"
    assert _sweep(model_dir, out) == 0
    rows = load_results(out)
    assert _keys(rows) == Counter({(L, s, i): 1 for s in (0.0, 1.0) for i in range(3)})
    for r in rows:
        assert {"length", "s", "sample_id", "correct", "prediction", "answer", "prompt_sha"} <= set(r)
        assert isinstance(r["correct"], bool) and len(r["answer"]) == 7
    # paired identity: sample i has the same prompt at every strength
    sha = {}
    for r in rows:
        sha.setdefault(r["sample_id"], set()).add(r["prompt_sha"])
    assert all(len(v) == 1 for v in sha.values())
    with open(out / "summary.csv") as fh:
        summ = list(csv.DictReader(fh))
    assert [(int(r["length"]), float(r["s"])) for r in summ] == [(L, 0.0), (L, 1.0)]
    for r in summ:
        assert int(r["n"]) == 3 and r["ci_low"] != "" and r["ci_high"] != ""
        assert int(r["n_paired"]) == 3 and r["b"] != "" and r["c"] != "" and 0 < float(r["mcnemar_p"]) <= 1
    assert json.loads((out / "summary.json").read_text())["interval"] == "wilson95"
    for png in ("acc_vs_length.png", "acc_vs_strength.png"):
        assert (out / png).stat().st_size > 1000
    # a rerun computes nothing
    from qedprobe.model import QEDModel
    calls = []
    orig = QEDModel.generate
    monkeypatch.setattr(QEDModel, "generate", lambda self, *a, **k: calls.append(1) or orig(self, *a, **k))
    before = (out / "results.jsonl").read_bytes()
    assert _sweep(model_dir, out) == 0
    assert calls == [] and (out / "results.jsonl").read_bytes() == before
    # adding a strength computes only the new rows
    assert _sweep(model_dir, out, "--strengths=0,1,2") == 0
    assert len(calls) == 1
    assert _keys(load_results(out)) == Counter({(L, s, i): 1 for s in (0.0, 1.0, 2.0) for i in range(3)})


def test_resume_after_interrupted_run_and_torn_line(tmp_path):
    model = tiny_model()
    out = tmp_path / "run"
    kw = dict(task="s-niah-1", lengths=[L], strengths=[0.0, 1.0], samples=4, batch_size=2,
              out=out, progress=False)
    run_sweep(model, "bytes", stop_after=1, **kw)          # interrupted after one generate call
    first = load_results(out)
    assert len(first) == 2
    with open(out / "results.jsonl", "a") as fh:           # a kill in the middle of a write
        fh.write('{"length": 400, "s": 1.0, "sample_id": 3, "cor')
    run_sweep(model, "bytes", **kw)
    rows = load_results(out)
    assert _keys(rows) == Counter({(L, s, i): 1 for s in (0.0, 1.0) for i in range(4)})
    assert rows[:2] == first                                # finished rows kept as they were
    text = (out / "results.jsonl").read_text()
    assert text.endswith("\n") and text.count("\n") == 8


def test_resume_after_sigkill(model_dir, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "qedprobe.eval.commands", "sweep", "--model", model_dir, "--device", "cpu",
           "--out", str(out), "--lengths", str(L), "--strengths=0,1", "--samples", "4", "--batch-size", "1",
           "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = out / "results.jsonl"
    deadline = time.time() + 90
    try:
        while time.time() < deadline and proc.poll() is None:
            if res.exists() and res.read_text().count("\n") >= 2:
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    n_before = len(load_results(out))
    assert 1 <= n_before < 8
    assert commands.main(cmd[3:]) == 0
    assert _keys(load_results(out)) == Counter({(L, s, i): 1 for s in (0.0, 1.0) for i in range(4)})


@pytest.mark.parametrize("args,msg", [
    (["--task", "nope"], "unknown task"),
    (["--tokenizer", "/nonexistent/tok"], "does not exist"),
    (["--lengths", "100"], "too short"),
    (["--strengths=0,5"], "tested range"),
    (["--layers", "7"], "outside"),
])
def test_cli_clear_errors_before_work(model_dir, tmp_path, capsys, args, msg):
    out = tmp_path / "bad"
    argv = ["sweep", "--model", model_dir, "--device", "cpu", "--out", str(out), "--samples", "2",
            "--lengths", str(L), "--no-progress", *args]
    assert commands.main(argv) == 2
    assert msg in capsys.readouterr().err
    assert not (out / "results.jsonl").exists()


def test_cli_errors_model_and_out(model_dir, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert commands.main(["sweep", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                          "--no-progress"]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert commands.main(["sweep", "--model", model_dir, "--out", str(f), "--lengths", str(L),
                          "--no-progress"]) == 2
    assert "not a folder" in capsys.readouterr().err
    bad_model = tmp_path / "badmodel"
    bad_model.mkdir()
    (bad_model / "config.json").write_text("{not json")
    assert commands.main(["sweep", "--model", str(bad_model), "--out", str(tmp_path / "o2"),
                          "--lengths", str(L), "--no-progress"]) == 2
    assert "badmodel" in capsys.readouterr().err


def test_out_folder_with_other_config_and_lock(tmp_path):
    cfg = {"samples_spec": {"task": "a"}, "intervention": {}, "model": {}}
    store = ResultsStore(tmp_path / "o", cfg)
    with pytest.raises(SweepError, match="another sweep"):
        ResultsStore(tmp_path / "o", cfg)
    store.close()
    with pytest.raises(SweepError, match="different samples_spec"):
        ResultsStore(tmp_path / "o", {**cfg, "samples_spec": {"task": "b"}})


def test_report_two_arms(tmp_path, capsys):
    runs = []
    for arm in ("gdn2", "full"):
        out = tmp_path / arm
        run_sweep(tiny_model(arm), "bytes", task="s-niah-1", lengths=[L], strengths=[1.0], samples=2,
                  out=out, progress=False, model_id=arm)
        runs.append(str(out))
    # make the arms differ on one sample so the paired table has a discordant pair
    path = tmp_path / "full" / "results.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    rows[0]["correct"] = True
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    rep = tmp_path / "rep"
    assert commands.main(["report", *runs, "--labels", "GDN-2,QED", "--out", str(rep)]) == 0
    md = capsys.readouterr().out
    assert "| length | GDN-2 | QED |" in md
    assert "| QED | 400 | 2 | 0.0 | 50.0 | 1 | 0 | 1.000 |" in md
    assert (rep / "report.png").stat().st_size > 1000 and (rep / "report.md").exists()
    rj = json.loads((rep / "report.json").read_text())
    assert rj["paired_tests"]["QED"]["400"]["b"] == 1
