"""torch.distributed on CPU (gloo, two ranks launched by the real ``torchrun`` CLI, i.e.
``python -m torch.distributed.run``): sharded sweeps equal one-process sweeps row for row and
resume with another number of ranks, also after a rank is killed; sharded eig equals one-process
eig; DDP training steps equal one-process steps on the same global batch."""
import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from _dist_worker import EIG, train_config
from helpers import saved_tiny_model, tiny_model
from safetensors.torch import load_file

from qedprobe import cli as commands
from qedprobe.eval.report import build_report
from qedprobe.eval.eig import EigAccumulator, run_eig, task_batches
from qedprobe.eval.plan import plan_batches
from qedprobe.eval.store import load_results, shard_paths
from qedprobe.hooks import RunningStats
from qedprobe.train import read_log, train

TESTS = Path(__file__).resolve().parent
L = 400
GRID = ["--device", "cpu", "--lengths", str(L), "--samples", "8", "--batch-size", "2", "--no-progress",
        "--format", "legacy"]  # the tiny model reads short prompts; RULER's need >= ~950 bytes


def torchrun(*args, nproc=2, wait=True):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=TESTS, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if not wait:
        return proc
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out


def sweep_argv(model, out, strengths="0,1"):
    return ["sweep", "--model", model, "--out", str(out), f"--strengths={strengths}", *GRID]


def key(r):
    return r["length"], r["s"], r["sample_id"]


def rows_on_disk(folder):
    """Every row line of every shard (duplicates included)."""
    return [json.loads(line) for p in shard_paths(folder) for line in p.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """The one-process sweep: rows by key, and its summary.csv."""
    out = tmp_path_factory.mktemp("single") / "sweep"
    assert commands.main(sweep_argv(model_dir, out)) == 0
    rows = {key(r): r for r in load_results(out)}
    assert len(rows) == 16
    return rows, (out / "summary.csv").read_text()


def test_sharded_sweep_resumes_a_one_process_folder_and_equals_it(model_dir, reference, tmp_path):
    out = tmp_path / "sweep"
    assert commands.main(sweep_argv(model_dir, out, "1")) == 0          # one process, s = 1 only
    torchrun("-m", "qedprobe.cli", *sweep_argv(model_dir, out))          # two ranks add s = 0
    on_disk = rows_on_disk(out)
    assert Counter(map(key, on_disk)) == Counter(dict.fromkeys(reference[0], 1))
    assert {key(r): r for r in on_disk} == reference[0]                   # same predictions, every field
    assert len(rows_on_disk(out)) > len((out / "results.jsonl").read_text().splitlines())  # rank 1 wrote too
    assert (out / "summary.csv").read_text() == reference[1]
    assert "; 8 |" in build_report([str(out)], s=1.0)                     # report reads every shard


def _rank_pid(parent: int, rank: int) -> int | None:
    """The pid of torchrun worker ``rank`` (a child of the launcher with RANK=rank)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            env = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(stat.parent.name)
    return None


def test_killed_rank_loses_only_its_unfinished_rows(model_dir, reference, tmp_path):
    out = tmp_path / "sweep"
    proc = torchrun("-m", "qedprobe.cli", *sweep_argv(model_dir, out), wait=False)
    shard = out / "results.rank1.jsonl"
    deadline = time.time() + 120
    try:
        while time.time() < deadline and proc.poll() is None:
            if shard.exists() and shard.read_text().count("\n") >= 2:   # rank 1's first generate call
                pid = _rank_pid(proc.pid, 1)
                if pid is not None:
                    os.kill(pid, signal.SIGKILL)
                    break
            time.sleep(0.02)
        proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode != 0                                          # torchrun saw the dead rank
    before = rows_on_disk(out)
    assert 2 <= len(before) < 16 and all(reference[0][key(r)] == r for r in before)
    assert commands.main(sweep_argv(model_dir, out)) == 0                # resume in one process
    after = rows_on_disk(out)
    assert Counter(map(key, after)) == Counter(dict.fromkeys(reference[0], 1))
    assert {key(r): r for r in after} == reference[0]
    assert (out / "summary.csv").read_text() == reference[1]


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    """One torchrun of tests/_dist_worker.py: eig, refusals, DDP training (see its docstring)."""
    out = tmp_path_factory.mktemp("worker")
    for name in ("other", "locked"):
        (out / name).mkdir()
        (out / name / "config.json").write_text(json.dumps({"samples_spec": {"seed": 0 if name == "other" else 1},
                                                            "intervention": {}, "model": {}}))
    with open(out / "locked" / ".lock.rank1", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        torchrun("_dist_worker.py", str(out))
    return out


def test_sharded_eig_equals_one_process_eig(worker):
    single = run_eig(tiny_model(), task_batches(**EIG))
    ref = single.arrays()
    got = np.load(worker / "eig" / "eig.npz")
    assert set(got.files) == set(ref)
    for name in ref:
        if name.startswith(("hist_", "count_", "n_", "min_", "max_", "edges_", "layers")):
            assert np.array_equal(got[name], ref[name]), name                  # exact: counts, extremes
        else:
            np.testing.assert_allclose(got[name], ref[name], rtol=1e-12, atol=1e-12, err_msg=name)
    assert json.loads((worker / "eig" / "eig.json").read_text())["tokens"] == single.tokens


def test_every_rank_refuses_a_folder_one_rank_cannot_use(worker):
    for r in (0, 1):
        assert "different samples_spec" in (worker / f"other.{r}").read_text()
    assert "another sweep is writing" in (worker / "locked.1").read_text()
    assert "rank 1: another sweep is writing" in (worker / "locked.0").read_text()


def _weights(run, step):
    return load_file(str(run / f"step-{step:06d}" / "model.safetensors"))


def test_ddp_steps_equal_one_process_steps_and_resume_with_one_rank(worker, tmp_path):
    torch.set_num_threads(1)
    single = tmp_path / "single"
    train(train_config(), single)
    resumed = worker / "train_resume"
    assert train(train_config(), resumed).step == 2                       # resumed with N = 1
    ref_log = read_log(single)
    for run in (worker / "train", resumed):
        log = read_log(run)
        assert [r["step"] for r in log] == [1, 2]
        for a, b in zip(log, ref_log):
            for k in ("loss", "answer_loss", "answer_acc", "grad_norm", "lambda_mean"):   # grad_norm: the gradient
                assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (run.name, k)
            assert a["tokens"] == b["tokens"]
        for step in (1, 2):
            ref, got = _weights(single, step), _weights(run, step)
            for name, w in ref.items():
                torch.testing.assert_close(got[name], w, rtol=1e-5, atol=1e-5, msg=f"{run.name} {name} step {step}")
    assert (worker / "train" / "final" / "model.safetensors").is_file()


def test_running_stats_merge_equals_one_pass():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=gen, dtype=torch.float64) * 3 + 1
    x[5, 1] = float("nan")
    x[7, 2] = float("inf")
    edges = torch.linspace(-2, 4, 7)
    whole, a, b = RunningStats(3, edges), RunningStats(3, edges), RunningStats(3, edges)
    whole.update(x)
    a.update(x[:13])
    b.update(x[13:])
    a.merge(b)
    assert torch.equal(a.count, whole.count) and a.count.tolist() == [50, 49, 49]
    assert torch.equal(a.counts, whole.counts) and torch.equal(a.min, whole.min) and torch.equal(a.max, whole.max)
    finite = [x[:, h][torch.isfinite(x[:, h])] for h in range(3)]
    torch.testing.assert_close(a.mean, torch.stack([f.mean() for f in finite]), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(a.var, torch.stack([f.var(unbiased=False) for f in finite]), rtol=1e-13, atol=1e-13)
    assert whole.counts[1, -1] == 1 + (x[:, 1] >= 4).sum()                    # NaN in the overflow bin
    empty = RunningStats(3, edges)
    assert torch.equal(empty.merge(whole).mean, whole.mean)
    with pytest.raises(ValueError, match="same heads and bin edges"):
        a.merge(RunningStats(3))


def test_eig_accumulator_merge_refuses_another_shape():
    with pytest.raises(ValueError, match="same layers"):
        EigAccumulator(2, 2, 4).merge(EigAccumulator(2, 2, 8))


def test_plan_batches_keep_one_process_packing():
    """Batches are planned from the rows still missing, the same whoever runs them."""
    done = {(L, 0.0, i) for i in range(5)}
    batches = plan_batches(done, [L, 512], [0.0, 1.0], 5, lambda length: 2 if length == L else 4)
    assert [(b.length, b.sample_ids, b.todo) for b in batches] == [
        (L, [0, 1], [(1.0, [0, 1])]), (L, [2, 3], [(1.0, [2, 3])]), (L, [4], [(1.0, [4])]),
        (512, [0, 1, 2, 3], [(0.0, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])]), (512, [4], [(0.0, [4]), (1.0, [4])])]
