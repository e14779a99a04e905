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

from helpers import saved_tiny_model, tiny_model
from qedprobe import cli as commands
from qedprobe.eval import ResultsStore, SweepError, SweepSpec, load_results, run_sweep

L = 400  # shortest usable legacy s-niah-1 length with the byte tokenizer is 376
LEGACY = ["--format", "legacy"]  # the tiny model reads short prompts; RULER's need >= ~950 bytes
GRID = ["--lengths", str(L), "--strengths=0,1", "--samples", "2", "--batch-size", "2", "--no-progress", *LEGACY]


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
    assert _keys(rows) == Counter({(L, s, i): 1 for s in (0.0, 1.0) for i in range(2)})
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
        assert int(r["n"]) == 2 and r["ci_low"] != "" and r["ci_high"] != ""
        assert int(r["n_paired"]) == 2 and r["b"] != "" and r["c"] != "" and 0 < float(r["mcnemar_p"]) <= 1
    assert json.loads((out / "summary.json").read_text())["interval"] == "wilson95"
    assert (out / "acc_vs_strength.png").stat().st_size > 1000
    assert not (out / "acc_vs_length.png").exists()           # one length: no length axis to draw
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
    assert _keys(load_results(out)) == Counter({(L, s, i): 1 for s in (0.0, 1.0, 2.0) for i in range(2)})


def test_resume_after_interrupted_run_and_torn_line(tmp_path):
    model = tiny_model()
    out = tmp_path / "run"
    spec = SweepSpec(task="s-niah-1", lengths=[L], strengths=[0.0, 1.0], samples=2, batch_size=1,
                     progress=False, task_format="legacy")
    generate = model.generate
    calls = []

    def interrupted(*a, **k):                              # interrupted after one generate call
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return generate(*a, **k)

    model.generate = interrupted
    with pytest.raises(KeyboardInterrupt):
        run_sweep(model, spec, out=out)
    del model.generate
    first = load_results(out)
    assert len(first) == 1
    with open(out / "results.jsonl", "a") as fh:           # a kill in the middle of a write
        fh.write('{"length": 400, "s": 1.0, "sample_id": 1, "cor')
    with pytest.warns(UserWarning, match="results.jsonl: its last line was incomplete .* the 1 complete rows are kept"):
        run_sweep(model, spec, out=out)
    rows = load_results(out)
    assert _keys(rows) == Counter({(L, s, i): 1 for s in (0.0, 1.0) for i in range(2)})
    assert rows[:1] == first                                # finished rows kept as they were
    text = (out / "results.jsonl").read_text()
    assert text.endswith("\n") and text.count("\n") == 4


def test_cli_ctrl_c_says_what_was_kept_in_one_line_and_a_rerun_resumes(model_dir, tmp_path, monkeypatch, capsys):
    from qedprobe.model import QEDModel
    generate, calls = QEDModel.generate, []

    def interrupted(self, *a, **k):                      # Ctrl-C during the second generate call
        if calls:
            raise KeyboardInterrupt
        calls.append(1)
        return generate(self, *a, **k)

    monkeypatch.setattr(QEDModel, "generate", interrupted)
    out = tmp_path / "run"
    assert _sweep(model_dir, out) == 130
    err = capsys.readouterr().err.strip()
    assert err == (f"qedprobe sweep: interrupted; {out} keeps 2 rows (2 from this run): run the same command "
                   "again to resume from there")
    monkeypatch.setattr(QEDModel, "generate", generate)
    with open(out / "results.jsonl", "a") as fh:           # and a kill in the middle of a write
        fh.write('{"length": 400, "s": 1.0, "sample_id": 1, "cor')
    assert _sweep(model_dir, out) == 0
    captured = capsys.readouterr()
    assert captured.err.strip() == (f"qedprobe sweep: warning: {out / 'results.jsonl'}: its last line was incomplete "
                                    "(a run was stopped while writing it): cut off, and that row is computed again; "
                                    "the 2 complete rows are kept")
    assert "2 rows computed" in captured.out


def test_cli_tables_restate_the_sweep_mark_the_reference_and_say_what_was_reused(model_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert _sweep(model_dir, out) == 0
    lines = capsys.readouterr().out.splitlines()[-7:]
    assert lines[0] == "m (arm full), s-niah-1 (legacy, noise haystack), 2 prompts per cell, seed 0"
    assert lines[1] == "| length | s | n | accuracy | 95% CI | b | c | McNemar p |"  # no RULER column: legacy
    assert lines[4].startswith(f"| {L} | 1 | 2 |") and lines[4].endswith("| ref | ref | ref |")
    assert lines[5].startswith("b: prompts right at s and wrong at the reference s = 1; c: wrong at s")
    assert "4 rows computed" in lines[6]
    assert _sweep(model_dir, out) == 0
    assert f"reused the 4 rows already in {out}: nothing to compute" in capsys.readouterr().out


def test_resume_after_sigkill(model_dir, tmp_path):
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "qedprobe.cli", "sweep", "--model", model_dir, "--device", "cpu",
           "--out", str(out), "--lengths", str(L), "--strengths=0,1", "--samples", "2", "--batch-size", "1",
           "--no-progress", *LEGACY]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    res = out / "results.jsonl"
    deadline = time.time() + 90
    try:
        while time.time() < deadline and proc.poll() is None:
            if res.exists() and res.read_text().count("\n") >= 1:
                break
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    n_before = len(load_results(out))
    assert 1 <= n_before < 4
    assert commands.main(cmd[3:]) == 0
    assert _keys(load_results(out)) == Counter({(L, s, i): 1 for s in (0.0, 1.0) for i in range(2)})


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
            "--lengths", str(L), "--no-progress", *LEGACY, *args]
    assert commands.main(argv) == 2
    assert msg in capsys.readouterr().err
    assert not (out / "results.jsonl").exists()


def test_cli_errors_model_and_out(model_dir, tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert commands.main(["sweep", "--model", str(tmp_path / "none"), "--out", str(tmp_path / "o"),
                          "--no-progress", *LEGACY]) == 2
    assert "not a folder" in capsys.readouterr().err
    assert commands.main(["sweep", "--model", model_dir, "--out", str(f), "--lengths", str(L),
                          "--no-progress", *LEGACY]) == 2
    assert "not a folder" in capsys.readouterr().err
    bad_model = tmp_path / "badmodel"
    bad_model.mkdir()
    (bad_model / "config.json").write_text("{not json")
    assert commands.main(["sweep", "--model", str(bad_model), "--out", str(tmp_path / "o2"),
                          "--lengths", str(L), "--no-progress", *LEGACY]) == 2
    assert "badmodel" in capsys.readouterr().err


def test_gdn2_model_refuses_strengths_other_than_one(tmp_path, capsys):
    gdn2 = saved_tiny_model(tmp_path / "g", arm="gdn2")
    assert commands.main(["sweep", "--model", gdn2, "--out", str(tmp_path / "o"), "--lengths", str(L),
                          "--strengths=0,1", "--no-progress", *LEGACY]) == 2
    assert "gdn2" in capsys.readouterr().err and not (tmp_path / "o" / "results.jsonl").exists()
    with pytest.raises(SweepError, match="gdn2"):
        run_sweep(tiny_model("gdn2"), SweepSpec(lengths=[L], strengths=[0.5], samples=1, progress=False,
                                                task_format="legacy"), out=tmp_path / "p")


def test_out_folder_with_other_config_and_lock(tmp_path):
    cfg = {"samples_spec": {"task": "a"}, "intervention": {}, "model": {"pair": (0.5, 2.0)}}
    store = ResultsStore(tmp_path / "o", cfg)
    with pytest.raises(SweepError, match="another sweep"):
        ResultsStore(tmp_path / "o", cfg)
    assert not (tmp_path / "o" / "config.json").exists()   # nothing written before the first row
    store.append([{"length": 8, "s": 1.0, "sample_id": 0, "correct": True}])
    store.close()
    ResultsStore(tmp_path / "o", cfg).close()  # a tuple stored as a JSON list is the same config
    with pytest.raises(SweepError, match="different samples_spec"):
        ResultsStore(tmp_path / "o", {**cfg, "samples_spec": {"task": "b"}})


def test_moved_checkpoint_resumes_and_other_weights_are_refused(tmp_path):
    """The model's path may change when its weights hash does not (a moved checkpoint: warned,
    the new path recorded); the same path with other weights is refused."""
    model = {"id": "/a/ckpt", "config": {"arm": "full"}, "dtype": "float32", "weights": "ab" * 32}
    cfg = {"samples_spec": {"task": "a"}, "intervention": {}, "model": model}
    store = ResultsStore(tmp_path / "o", cfg)
    store.append([{"length": 8, "s": 1.0, "sample_id": 0, "correct": True}])
    store.close()
    moved = {**cfg, "model": {**model, "id": "/b/ckpt"}}
    with pytest.warns(UserWarning, match="same weights"):
        store = ResultsStore(tmp_path / "o", moved)
    assert [r["sample_id"] for r in store.rows] == [0]  # the row written from the old path is kept
    store.append([{"length": 8, "s": 1.0, "sample_id": 1, "correct": False}])
    store.close()
    assert json.loads((tmp_path / "o" / "config.json").read_text())["model"]["id"] == "/b/ckpt"
    with pytest.raises(SweepError, match=r"different model \(weights differ\)"):
        ResultsStore(tmp_path / "o", {**moved, "model": {**model, "id": "/b/ckpt", "weights": "cd" * 32}})
    with pytest.raises(SweepError, match=r"different model \(config, id differ\)"):
        ResultsStore(tmp_path / "o", {**cfg, "model": {**model, "config": {"arm": "gdn2"}}})


def _write_sweep(folder, correct, sha_prefix="p", strengths=(1.0,)):
    folder.mkdir(parents=True)
    rows = [{"task": "s-niah-1", "length": 1024, "s": s, "sample_id": i, "correct": c, "prediction": "",
             "answer": "1234567", "prompt_sha": f"{sha_prefix}{i}"}
            for s in strengths for i, c in enumerate(correct)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "config.json").write_text(json.dumps({"ref_strength": 1.0}))
    return str(folder)


def test_report_two_arms_paired(tmp_path, capsys):
    base = [True] * 6 + [False] * 4        # GDN-2: 60%
    qed = [False] + [True] * 9             # QED: 90%; b = 4 (QED only), c = 1 (GDN-2 only)
    runs = [_write_sweep(tmp_path / "gdn2", base), _write_sweep(tmp_path / "qed", qed, strengths=(0.0, 1.0)),
            _write_sweep(tmp_path / "other", qed, sha_prefix="x")]
    rep = tmp_path / "rep"
    assert commands.main(["report", *runs, "--labels", "GDN-2,QED,other-data", "--out", str(rep)]) == 0
    md = capsys.readouterr().out
    assert "| length | GDN-2 | QED | other-data |" in md
    assert "| 1K | 60.0 [31.3, 83.2]; 10 | 90.0 [59.6, 98.2]; 10 |" in md
    assert "| QED | 1K | 10 | 60.0 | 90.0 | 4 | 1 | 0.375 |" in md      # 2 * (1 + 5) / 32
    assert "| other-data | - | 0 | - | - | - | - | no shared prompts |" in md
    assert "**QED**: accuracy % by strength s" in md
    assert (rep / "report.png").stat().st_size > 1000 and (rep / "report.md").read_text().strip() == md.strip()
    rj = json.loads((rep / "report.json").read_text())
    assert rj["paired_tests"]["QED"]["1024"] == {"n_paired": 10, "unmatched": 0, "acc_a": 0.9, "acc_b": 0.6,
                                                 "b": 4, "c": 1, "p": 0.375}
    assert rj["paired_tests"]["other-data"]["1024"]["unmatched"] == 10
    assert commands.main(["report", str(tmp_path / "nope")]) == 2


def test_summary_table_prints_every_cell_with_paired_columns():
    from qedprobe.cli.evaluation_run import summary_table

    rows = [dict(length=512, s=1.0, n=20, accuracy=0.5, ci_low=0.3, ci_high=0.7, score_pct=50.0, b=0, c=0,
                 mcnemar_p=1.0),
            dict(length=512, s=2.0, n=20, accuracy=0.75, ci_low=0.53, ci_high=0.89, score_pct=81.25, b=6, c=1,
                 mcnemar_p=0.125),
            dict(length=512, s=0.0, n=20, accuracy=0.5, ci_low=0.3, ci_high=0.7, score_pct=50.0, b=None, c=None,
                 mcnemar_p=None)]
    for r in rows:
        r.update(format="ruler", ref_s=1.0)
    lines = summary_table(rows).splitlines()
    assert len(lines) == 6
    assert lines[2] == "| 512 | 1 | 20 | 0.500 | 0.300-0.700 | 50.00 | ref | ref | ref |"
    assert lines[3] == "| 512 | 2 | 20 | 0.750 | 0.530-0.890 | 81.25 | 6 | 1 | 0.125 |"
    assert lines[4].endswith("| - | - | - |")
    assert lines[5].startswith("b: prompts right at s and wrong at the reference s = 1")


def test_plots_leave_the_matplotlib_backend_alone(tmp_path):
    """Writing the sweep figures must not switch a notebook's backend (inline figures would vanish)."""
    import matplotlib
    from qedprobe.eval.plots import plot_summary
    before = matplotlib.get_backend()
    matplotlib.use("svg")
    try:
        row = {"length": 512, "s": 1.0, "n": 4, "correct": 2, "accuracy": 0.5, "ci_low": 0.15, "ci_high": 0.85}
        paths = plot_summary([row, {**row, "s": 0.0}], tmp_path)
        assert matplotlib.get_backend() == "svg"
        assert all(p.stat().st_size > 1000 for p in paths)
    finally:
        matplotlib.use(before)
