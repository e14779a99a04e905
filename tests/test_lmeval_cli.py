"""``qedprobe lm-eval`` (qedprobe.lmeval.run) on the local tasks of :mod:`lmeval_fixtures` and the
shipped ``micro-recall-full-s1``: a row for every (task, s, document) with the sweep's folder,
summary, plots and report; resume without recomputing; refusals; a torchrun (gloo, 2 ranks)
run equal to one process, row for row."""
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from lmeval_fixtures import FDA_DOCS, MICRO, SQUAD_DOCS, SWDE_DOCS, TASKS, write_tasks  # noqa: E402

from qedprobe.cli import main  # noqa: E402
from qedprobe.eval.report import build_report  # noqa: E402
from qedprobe.eval.store import load_results, shard_paths  # noqa: E402
from qedprobe.lmeval import run  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TESTS = Path(__file__).resolve().parent
DOCS = {"fda_local": len(FDA_DOCS), "swde_local": len(SWDE_DOCS), "squad_completion_local": len(SQUAD_DOCS),
        "niah_local": 3}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lmeval") / "tasks")


def argv(task_dir, out, strengths="0,1", tasks=",".join(TASKS), model_args=f"pretrained={MICRO},batch_size=2"):
    return ["lm-eval", "--model-args", model_args, "--tasks", tasks, "--include-path", str(task_dir),
            f"--strengths={strengths}", "--out", str(out), "--no-progress"]


def key(r):
    return r["task"], r["length"], r["s"], r["sample_id"]


def rows_on_disk(folder):
    return [json.loads(line) for p in shard_paths(folder) for line in p.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def reference(task_dir, tmp_path_factory):
    """One process, s in {0, 1}: the rows by key."""
    out = tmp_path_factory.mktemp("single") / "run"
    assert main(argv(task_dir, out)) == 0
    return out, {key(r): r for r in load_results(out)}


def test_a_row_for_every_task_strength_and_document(reference, capsys):
    out, rows = reference
    want = {(t, 1024 if t == "niah_local" else None, s, i) for t, n in DOCS.items() for s in (0.0, 1.0) for i in range(n)}
    assert set(rows) == want and len(rows_on_disk(out)) == len(want)
    niah = [r for r in rows.values() if r["task"] == "niah_local"]
    assert all(r["score"] == r["metrics"]["1024"] and r["correct"] == (r["score"] == 1) for r in niah)
    assert any(r["correct"] for r in niah)  # the micro model retrieves some needles at 1K
    for r in rows.values():
        if r["task"] != "niah_local":
            assert r["score"] == r["metrics"]["contains"] and isinstance(r["response"], str) and r["target"]
    summary = json.loads((out / "summary.json").read_text())["rows"]
    cells = {(c["task"], c["length"], c["s"]): c for c in summary}
    assert set(cells) == {(t, L, s) for t, L, s, _ in want}
    for (t, L, s), c in cells.items():
        mine = [r for r in rows.values() if (r["task"], r["length"], r["s"]) == (t, L, s)]
        assert c["n"] == len(mine) and c["correct"] == sum(r["correct"] for r in mine)
        base = {r["sample_id"]: r["correct"] for r in rows.values() if (r["task"], r["length"], r["s"]) == (t, L, 1.0)}
        assert c["b"] == sum(r["correct"] and not base[r["sample_id"]] for r in mine)
        assert c["c"] == sum(base[r["sample_id"]] and not r["correct"] for r in mine)
    assert (out / "acc_vs_strength.png").is_file()
    assert not (out / "acc_vs_length.png").exists()  # one length (1K): no length axis to draw
    md = build_report([out])  # one table row per task (and length), at s = 1
    right = [r["correct"] for k, r in rows.items() if k[0] == "niah_local" and k[2] == 1.0]
    assert f"| niah_local 1K | {100 * sum(right) / len(right):.1f} [" in md and "| fda_local | " in md


def test_rerun_resumes_without_recomputing(reference, task_dir, tmp_path, monkeypatch):
    out, tasks = tmp_path / "run", "fda_local,niah_local"
    assert main(argv(task_dir, out, strengths="1", tasks=tasks)) == 0
    calls = []
    real = run.evaluate
    monkeypatch.setattr(run, "evaluate", lambda *a, **k: calls.append(k["samples"]) or real(*a, **k))
    assert main(argv(task_dir, out, strengths="0,1", tasks=tasks)) == 0    # adds s = 0 only
    assert all(len(ids) <= 2 for s in calls for ids in s.values())       # chunks of batch_size documents
    assert sum(len(ids) for s in calls for ids in s.values()) == DOCS["fda_local"] + DOCS["niah_local"]
    on_disk = rows_on_disk(out)
    want = {k: r for k, r in reference[1].items() if k[0] in tasks.split(",")}
    assert Counter(map(key, on_disk)) == Counter(dict.fromkeys(want, 1))
    assert {key(r): r for r in on_disk} == want                          # the rows of one uninterrupted run
    calls.clear()
    assert main(argv(task_dir, out, strengths="0,1", tasks=tasks)) == 0
    assert calls == [] and len(rows_on_disk(out)) == len(on_disk)


@pytest.mark.parametrize("change, words", [
    (dict(model_args=f"pretrained={MICRO},batch_size=2,dtype=float64"), "different model"),
    (dict(tasks="niah_local"), "different samples_spec"),
])
def test_a_changed_configuration_or_model_is_refused(reference, task_dir, change, words, capsys):
    out, _ = reference
    assert main(argv(task_dir, out, **change)) == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize("extra, words", [
    (["--model-args", f"pretrained={MICRO},strength=2"], "--model-args strength"),
    (["--model-args", f"pretrained={MICRO},phase=both"], "phase"),
    (["--tasks", "no_such_task"], "--tasks"),
    (["--strengths=0,0.5"], "--ref-strength"),
    (["--strengths=0,7"], "--strengths"),
    (["--limit", "0"], "--limit"),
    (["--metadata", "[1]"], "--metadata"),
    (["--batch-size", "3"], "--batch-size and --model-args batch_size"),
    (["--dtype", "int8"], "dtype"),
    (["--threads", "0"], "--threads"),
    (["--model-args", f"pretrained={MICRO},max_length=64"], "exceeds max_length=64"),
])
def test_bad_flags_are_refused_in_one_line(task_dir, tmp_path, extra, words, capsys):
    assert main(argv(task_dir, tmp_path / "x") + extra) == 2
    lines = capsys.readouterr().err.strip().splitlines()  # lm-eval's own log lines come first, if any
    errors = [i for i, line in enumerate(lines) if line.startswith("qedprobe lm-eval: error:")]
    assert errors == [len(lines) - 1] and words in lines[-1]


def test_torchrun_two_ranks_equal_one_process(reference, task_dir, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "qedprobe.cli",
           *argv(task_dir, out, model_args=f"pretrained={MICRO}"), "--device", "cpu", "--batch-size", "2"]
    proc = subprocess.run(cmd, cwd=TESTS, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(shard_paths(out)) == 2
    on_disk = rows_on_disk(out)
    assert Counter(map(key, on_disk)) == Counter(dict.fromkeys(reference[1], 1))
    assert {key(r): r for r in on_disk} == reference[1]
    assert (out / "summary.csv").read_text() == (reference[0] / "summary.csv").read_text()


def _logged(doc_id, metrics, *, doc=None, filt="none", resp="x"):
    """A sample as lm-eval's ``evaluate`` logs it."""
    return {"doc_id": doc_id, "doc": doc or {}, "metrics": list(metrics), **metrics, "filter": filt,
            "filtered_resps": [resp], "target": "y", "doc_hash": "d", "prompt_hash": "p"}


def test_sample_rows_pick_the_metric_length_and_filter():
    ruler = run.sample_rows("niah", 0.5, [_logged(0, {"4096": -1.0, "1024": 0.5}, doc={"max_length": 1024})])
    assert [(r["task"], r["length"], r["score"], r["correct"]) for r in ruler] == [("niah", 1024, 0.5, False)]
    two = [_logged(3, {"exact_match": 1.0}, filt="strict"), _logged(3, {"exact_match": 0.0}, filt="flexible")]
    rows = run.sample_rows("gsm", 1.0, two)
    assert [(r["task"], r["sample_id"], r["correct"], r["prompt_sha"]) for r in rows] == \
        [("gsm/strict", 3, True, "p"), ("gsm/flexible", 3, False, "p")]
    mc = run.sample_rows("mc", 1.0, [_logged(0, {"acc": 0.0, "acc_norm": 1.0})], metric="acc_norm")
    assert mc[0]["score"] == 1.0 and mc[0]["metrics"] == {"acc": 0.0, "acc_norm": 1.0}
    with pytest.raises(run.SweepError, match="--metric f1: task mc reports acc, acc_norm"):
        run.sample_rows("mc", 1.0, [_logged(0, {"acc": 0.0, "acc_norm": 1.0})], metric="f1")
    with pytest.raises(run.SweepError, match="word_perplexity .* not a number"):
        run.sample_rows("wikitext", 1.0, [_logged(0, {"word_perplexity": (-3.5, 2)})])
