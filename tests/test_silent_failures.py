"""Silent wrong results and lost data (issue 15): each case is refused by name or kept intact.

1. a sweep folder never mixes rows of different weights (CLI and Python API);
2. a config.json whose recurrence (arm, lambda_max) disagrees with the saved weights is refused;
3. two trainings into one folder are refused;
4. a run whose ``latest`` link is gone resumes from its newest complete checkpoint;
5. a corrupt line inside results.jsonl is refused with file and line, no good row dropped;
6. ``convert`` refuses a qedprobe checkpoint (it would reset the trained theta);
7. ``|lambda|`` beyond the documented ``LAMBDA_BOUND`` is refused under ``value_checks``, and
   the ops agree with the float64 reference up to the bound.
"""
import json
import shutil
from pathlib import Path

import pytest
import torch

from helpers import make_inputs, op_args, saved_tiny_model, tiny_model
from qedprobe import cli as commands
from qedprobe.eval import SweepError, SweepSpec, load_results, run_sweep
from qedprobe.model import QEDModel
from qedprobe import ops
from qedprobe.ops import qed_chunk_torch, qed_naive, value_checks
from qedprobe.train import TrainConfig, read_log, train

ROOT = Path(__file__).resolve().parents[1]
L = 400  # shortest usable s-niah-1 length with the byte tokenizer is 376
TINY_TRAIN = dict(model=dict(hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=8),
                  seq_len=512, batch_size=1, steps=3, warmup_steps=1, decay_steps=1, save_every=1, lr=3e-3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _sweep_cli(model, out, strengths):
    return commands.main(["sweep", "--model", str(model), "--device", "cpu", "--out", str(out), "--lengths", str(L),
                          f"--strengths={strengths}", "--samples", "1", "--no-progress", "--format", "legacy"])


# ------------------------------------------------------------------ 1. weights in the fingerprint
def test_sweep_cli_refuses_other_weights_behind_the_same_config(tmp_path, capsys):
    model = Path(saved_tiny_model(tmp_path / "m", seed=0))
    other = Path(saved_tiny_model(tmp_path / "other", seed=1))
    out = tmp_path / "run"
    assert _sweep_cli(model, out, "1") == 0
    shutil.copy(other / "model.safetensors", model / "model.safetensors")
    assert _sweep_cli(model, out, "0,1") == 2
    err = capsys.readouterr().err
    assert "different model" in err and "weights" in err
    assert {r["s"] for r in load_results(out)} == {1.0}


def test_sweep_api_refuses_other_weights_and_resumes_with_the_same(tmp_path):
    kw = dict(task="s-niah-1", task_format="legacy", lengths=[L], samples=1, progress=False)
    run_sweep(tiny_model(seed=0), SweepSpec(strengths=[1.0], **kw), out=tmp_path / "run")
    with pytest.raises(SweepError, match="weights"):
        run_sweep(tiny_model(seed=1), SweepSpec(strengths=[0.0, 1.0], **kw), out=tmp_path / "run")
    run_sweep(tiny_model(seed=0), SweepSpec(strengths=[0.0, 1.0], **kw), out=tmp_path / "run")  # same weights: resumes
    assert sorted(r["s"] for r in load_results(tmp_path / "run")) == [0.0, 1.0]


def test_sweep_folder_without_weights_hash_is_not_resumed(tmp_path):
    spec = SweepSpec(task="s-niah-1", task_format="legacy", lengths=[L], strengths=[1.0], samples=1, progress=False)
    run_sweep(tiny_model(), spec, out=tmp_path / "run")
    config_file = tmp_path / "run" / "config.json"
    config = json.loads(config_file.read_text())
    del config["model"]["weights"]  # as written before the weights were fingerprinted
    config_file.write_text(json.dumps(config))
    with pytest.raises(SweepError, match="no weights hash"):
        run_sweep(tiny_model(), spec, out=tmp_path / "run")


# ------------------------------------------------------------------ 2. recurrence in the weights file
@pytest.mark.parametrize("key, value", [("arm", "nogate"), ("arm", "noproj"), ("lambda_max", 0.5)])
def test_config_that_disagrees_with_the_weights_is_refused(tmp_path, key, value):
    folder = Path(saved_tiny_model(tmp_path / "m", arm="full"))
    config = json.loads((folder / "config.json").read_text())
    config[key] = value
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{key}.*{value}.*saved with"):
        QEDModel.from_pretrained(folder)


def test_shipped_checkpoints_without_recurrence_metadata_still_load():
    model = QEDModel.from_pretrained(ROOT / "checkpoints" / "micro-full")
    assert model.cfg.arm == "full"


# ------------------------------------------------------------------ 3./4. training folder
def test_second_training_into_a_busy_folder_is_refused(tmp_path):
    from qedprobe.folderlock import lock_folder
    held = lock_folder(tmp_path / "run")
    assert held is not None
    try:
        with pytest.raises(ValueError, match="another training"):
            train(TrainConfig.from_preset("micro", **TINY_TRAIN), tmp_path / "run")
        assert not (tmp_path / "run" / "loss.jsonl").exists()
    finally:
        held.close()


def test_resume_without_latest_uses_the_newest_complete_checkpoint(tmp_path):
    cfg = TrainConfig.from_preset("micro", **TINY_TRAIN)
    assert not train(cfg, tmp_path, until_step=2).finished
    (tmp_path / "latest").unlink()
    (tmp_path / "step-000003").mkdir()  # an incomplete checkpoint (no trainer state) is skipped
    result = train(cfg, tmp_path)
    assert result.finished and result.step == 3
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2, 3]
    assert "resumed from step-000002" in (tmp_path / "train.log").read_text()


def test_truncating_the_loss_log_says_so(tmp_path):
    cfg = TrainConfig.from_preset("micro", **{**TINY_TRAIN, "save_every": 5})

    def crash(record):
        if record["step"] == 2:
            raise KeyboardInterrupt  # steps 1 and 2 logged, neither checkpointed
    with pytest.raises(KeyboardInterrupt):
        train(cfg, tmp_path, callback=crash)
    assert [r["step"] for r in read_log(tmp_path)] == [1, 2]
    train(cfg, tmp_path, until_step=1)
    assert "dropped 2 loss.jsonl records past step 0" in (tmp_path / "train.log").read_text()
    assert [r["step"] for r in read_log(tmp_path)] == [1]


# ------------------------------------------------------------------ 5. corrupt results line
def test_corrupt_line_in_results_is_refused_by_file_and_line(tmp_path, capsys):
    spec = SweepSpec(task="s-niah-1", task_format="legacy", lengths=[L], strengths=[0.0, 1.0], samples=1,
                     progress=False)
    run_sweep(tiny_model(), spec, out=tmp_path / "run")
    path = tmp_path / "run" / "results.jsonl"
    lines = path.read_text().splitlines(keepends=True)
    assert len(lines) == 2
    path.write_text(lines[0][:10] + "\n" + lines[1])
    before = path.read_bytes()
    with pytest.raises(SweepError, match=r"results.jsonl:1: "):
        run_sweep(tiny_model(), spec, out=tmp_path / "run")
    with pytest.raises(SweepError, match=r"results.jsonl:1: "):
        load_results(tmp_path / "run")
    assert path.read_bytes() == before  # nothing cut off
    assert commands.main(["report", str(tmp_path / "run")]) == 2
    assert "results.jsonl:1:" in capsys.readouterr().err


# ------------------------------------------------------------------ 6. convert keeps trained theta
def test_convert_refuses_a_qedprobe_checkpoint(tmp_path, capsys):
    from qedprobe.cli import main
    folder = saved_tiny_model(tmp_path / "m", arm="full")
    assert main(["convert", folder, str(tmp_path / "out"), "--arm", "full"]) == 2
    err = capsys.readouterr().err
    assert "theta" in err and "qedprobe checkpoint" in err and not (tmp_path / "out").exists()


# ------------------------------------------------------------------ 7. lambda bound
def _inputs(lam, dtype=torch.float64):
    """Op inputs whose two heads have lambda ``lam`` and ``-lam``."""
    x = make_inputs(B=1, T=64, H=2, K=8, V=8, gmin=0.1)
    x["lam"] = torch.tensor([lam, -lam], dtype=torch.float64)
    return [t.to(dtype) for t in op_args(x)]


@pytest.mark.parametrize("op", [qed_chunk_torch, ops.qed_chunk])
@pytest.mark.parametrize("arm", ["full", "nogate_noproj", "noproj"])
def test_ops_agree_with_the_float64_reference_up_to_the_lambda_bound(op, arm):
    ref, _, _ = qed_naive(*_inputs(ops.LAMBDA_BOUND), arm=arm)
    out, _, _ = op(*_inputs(ops.LAMBDA_BOUND, torch.float32), arm=arm)
    assert torch.isfinite(ref).all()
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("factor", [1.01, 1e6])
def test_lambda_beyond_the_bound_is_refused_under_value_checks(factor):
    with value_checks(), pytest.raises(ValueError, match="`lam`.*LAMBDA_BOUND"):
        qed_chunk_torch(*_inputs(ops.LAMBDA_BOUND * factor, torch.float32), arm="full")
    with value_checks():
        qed_naive(*_inputs(ops.LAMBDA_BOUND), arm="full")  # the bound itself is accepted
