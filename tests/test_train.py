"""The trainer: WSD schedule, data mixture, optimizer groups, op check, exact resume, CLI, committed checkpoints."""
import argparse
import json
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from qedprobe.tasks import make_task
from qedprobe.model import QEDModel
from qedprobe.train import TrainConfig, TrainData, WSD, read_log, train
from qedprobe.train import opcheck, trainer
from qedprobe.cli.train import config_from_args, register
from qedprobe.train.schedule import wsd_scheduler

ROOT = Path(__file__).resolve().parents[1]
TINY = dict(model=dict(hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=8),
            seq_len=512, batch_size=2, steps=4, warmup_steps=1, decay_steps=2, save_every=2, lr=3e-3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny(**kw):
    return TrainConfig.from_preset("micro", **{**TINY, **kw})


# ------------------------------------------------------------------------------- schedule
def test_wsd_values():
    s = WSD(total_steps=10, warmup_steps=2, decay_steps=4, min_ratio=0.1)
    expected = [0.5, 1, 1, 1, 1, 1, 1.0, 0.775, 0.55, 0.325]
    assert [s(i) for i in range(10)] == pytest.approx(expected)
    assert [WSD(4, 0, 0)(i) for i in range(5)] == [1.0] * 5
    assert s(10) == pytest.approx(0.1)


@pytest.mark.parametrize("kwargs, name", [
    (dict(total_steps=0, warmup_steps=0, decay_steps=0), "total_steps"),
    (dict(total_steps=5, warmup_steps=-1, decay_steps=0), "warmup_steps"),
    (dict(total_steps=5, warmup_steps=3, decay_steps=3), "decay_steps"),
    (dict(total_steps=5, warmup_steps=1, decay_steps=1, min_ratio=2), "min_ratio"),
])
def test_wsd_refuses_bad_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        WSD(**kwargs)


def test_theta_gets_ten_times_the_rate_through_the_schedule():
    cfg = tiny(arm="full")
    model = trainer.build_model(cfg, 259)
    opt = trainer.make_optimizer(cfg, model)
    sched = wsd_scheduler(opt, WSD(cfg.steps, cfg.warmup_steps, cfg.decay_steps))
    groups = {g["name"]: g for g in opt.param_groups}
    thetas = {id(m.attn.theta) for m in model.blocks}
    assert {id(p) for p in groups["theta"]["params"]} == thetas
    assert groups["theta"]["weight_decay"] == groups["main_no_decay"]["weight_decay"] == 0.0
    assert groups["main"]["weight_decay"] == cfg.weight_decay > 0
    assert all(p.dim() >= 2 for p in groups["main"]["params"])
    assert all(p.dim() == 1 for p in groups["main_no_decay"]["params"])
    n_opt = sum(p.numel() for g in opt.param_groups for p in g["params"])
    assert n_opt == sum(p.numel() for p in model.parameters())
    for _ in range(cfg.steps):
        assert groups["theta"]["lr"] == pytest.approx(10 * groups["main"]["lr"])
        assert groups["main_no_decay"]["lr"] == groups["main"]["lr"]
        opt.step()
        sched.step()


def test_gdn2_has_no_theta_group():
    cfg = tiny(arm="gdn2")
    names = [g["name"] for g in trainer.make_optimizer(cfg, trainer.build_model(cfg, 259)).param_groups]
    assert names == ["main", "main_no_decay"]


# ------------------------------------------------------------------------------- data
def test_rows_are_deterministic_and_well_formed():
    a, b = TrainData(512, "short", seed=0), TrainData(512, "short", seed=0)
    assert a.row(7) == b.row(7)
    assert a.row(7) != a.row(8) and a.row(7) != TrainData(512, "short", seed=1).row(7)
    batch = a.rows(3, 4)
    assert batch["input_ids"].shape == batch["targets"].shape == (4, 512)
    assert torch.equal(batch["input_ids"][:, 1:], batch["targets"][:, :-1])
    assert torch.equal(batch["input_ids"][1], torch.tensor(a.row(4)[0][:-1]))
    tok = a.tokenizer
    for r in range(4):
        ids = batch["input_ids"][r]
        assert ids[0] == tok.bos_id
        answer = tok.decode(batch["targets"][r][batch["answer"][r]].tolist())
        assert re.fullmatch(r"( \d{7})+", answer), answer
        text = tok.decode(ids.tolist())
        for value in answer.split():  # the asked value is in a needle of the same row
            assert text.count(value) >= 2
    assert not (batch["answer"] & ~batch["valid"]).any()


def test_seq_len_too_short_is_refused():
    with pytest.raises(ValueError, match="seq_len"):
        TrainData(256, "short")
    with pytest.raises(ValueError, match="mixture"):
        TrainData(512, "nope")


NEEDLE_RE = re.compile(r"special magic (?:number|uuid)s? for (\S+) is: (\S+?)\.(?:\s|$)")
ASKED_RE = re.compile(r"The special magic (?:number|uuid) for (\S+) mentioned in the provided text is")


def test_training_documents_are_disjoint_from_evaluation_samples():
    evals = []
    for seed in (0, 1):
        for name, kw in (("s-niah-1", {}), ("s-niah-2", {}), ("mk-niah", {"num_needles": 2})):
            evals += make_task(name, format="legacy", **kw).samples(512, 40, seed=seed)
    eval_prompts = {s.prompt for s in evals}
    eval_pairs = {(s.key, s.answer) for s in evals}
    data = TrainData(512, "short", seed=0)
    tok, docs = data.tokenizer, []
    for r in range(120):
        ids = data.row(r)[0]
        starts = [i for i, t in enumerate(ids) if t == tok.bos_id] + [len(ids)]
        docs += [tok.decode(ids[a:b]) for a, b in zip(starts, starts[1:])]
    assert len(docs) >= 120
    train_pairs = {m for d in docs for m in NEEDLE_RE.findall(d)}
    assert len(train_pairs) >= 120
    assert not train_pairs & eval_pairs
    assert not any(d.startswith(p) for d in docs for p in eval_prompts)


# ------------------------------------------------------------------------------- optimisation
def test_two_steps_lower_the_loss_on_a_fixed_batch():
    cfg = tiny(steps=2, warmup_steps=0, decay_steps=0, lr=1e-2)
    data = TrainData(cfg.seq_len, cfg.mixture, cfg.seed)
    batch = data.rows(0, 2)
    model = trainer.build_model(cfg, 259)
    opt = trainer.make_optimizer(cfg, model)
    losses = []
    for _ in range(3):
        losses.append(trainer._step(model, batch, cfg, torch.device("cpu"), amp=False)["loss"])
        opt.step()
        opt.zero_grad()
    assert losses[2] < losses[1] < losses[0], losses


def test_bf16_autocast_step_keeps_float32_master_weights():
    """The CUDA path (autocast bf16) exercised with CPU autocast: finite loss near the float32 one,
    float32 parameters and gradients."""
    cfg = tiny()
    batch = TrainData(cfg.seq_len, cfg.mixture, cfg.seed).rows(0, 2)
    losses = {}
    for amp in (False, True):
        model = trainer.build_model(cfg, 259)
        losses[amp] = trainer._step(model, batch, cfg, torch.device("cpu"), amp=amp)["loss"]
        assert all(p.dtype == p.grad.dtype == torch.float32 for p in model.parameters())
    assert losses[True] == pytest.approx(losses[False], abs=0.05)


def test_accumulation_gives_the_gradient_of_the_whole_batch():
    grads = []
    for batch_size, accum in ((2, 1), (1, 2)):
        cfg = tiny(batch_size=batch_size, accum=accum)
        model = trainer.build_model(cfg, 259)
        trainer._step(model, TrainData(cfg.seq_len, cfg.mixture, cfg.seed).rows(0, 2), cfg,
                      torch.device("cpu"), amp=False)
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_op_check_accepts_the_reference_and_catches_a_detached_op(monkeypatch):
    cfg = trainer.build_model(tiny(), 259).cfg
    assert opcheck.backward_problem(cfg, torch.device("cpu"), torch.float32, "naive") is None

    real = opcheck.qed_attention

    def detached(*args, mode, **kwargs):
        o, s, p = real(*args, mode="naive", **kwargs)
        return o.detach(), s, p
    monkeypatch.setattr(opcheck, "qed_attention", detached)
    problem = opcheck.backward_problem(cfg, torch.device("cpu"), torch.float32, "chunk")
    assert "without a gradient graph" in problem


def test_op_check_catches_wrong_gradients(monkeypatch):
    """An op whose forward is right but whose gradients are half the reference's is refused."""
    cfg = trainer.build_model(tiny(), 259).cfg
    real = opcheck.qed_attention

    def half_grad(*args, mode, **kwargs):
        o, s, p = real(*args, mode="naive", **kwargs)
        return (o + o.detach()) / 2 if mode != opcheck.REFERENCE_MODE else o, s, p
    monkeypatch.setattr(opcheck, "qed_attention", half_grad)
    problem = opcheck.backward_problem(cfg, torch.device("cpu"), torch.float32, "chunk", tokens=80)
    assert "differ from mode 'torch'" in problem and "'q': '0.5'" in problem


def test_op_check_in_a_child_process_reports_a_crash(monkeypatch):
    """The child-process check (used on CUDA): a sound op passes, a process that dies is reported."""
    check = dict(arm="full", heads=2, head_dim=8, v_dim=8, device="cpu", dtype=torch.float32, mode="naive", tokens=20)
    assert opcheck.problem_in_child(**check) is None
    monkeypatch.setattr(opcheck, "child_command", lambda **kw: [sys.executable, "-c", "import os; os.abort()"])
    assert "crashed the check's process" in opcheck.problem_in_child(**check)


def test_op_check_child_imports_the_package_of_its_parent(tmp_path, monkeypatch):
    """A folder holding another ``qedprobe`` (a source checkout without the installed kernels) as
    the working directory must not be what the child imports."""
    (tmp_path / "qedprobe").mkdir()
    (tmp_path / "qedprobe" / "__init__.py").write_text("raise ImportError('the shadowing checkout')\n")
    monkeypatch.chdir(tmp_path)
    check = dict(arm="full", heads=2, head_dim=8, v_dim=8, device="cpu", dtype=torch.float32, mode="naive", tokens=20)
    assert opcheck.problem_in_child(**check) is None


def test_missing_backward_falls_back_with_a_warning_or_stops(tmp_path, monkeypatch):
    real = opcheck.backward_problem
    monkeypatch.setattr(trainer, "backward_problem",
                        lambda cfg, dev, dt, mode, tokens: "no backward (test)" if mode == "chunk"
                        else real(cfg, dev, dt, mode, tokens))
    cfg = tiny(steps=1, warmup_steps=0, decay_steps=0, model={**TINY["model"], "op_mode": "chunk"})
    result = train(cfg, tmp_path / "a")
    assert result.op_mode == "torch"
    assert "WARNING: no backward (test)" in (tmp_path / "a" / "train.log").read_text()
    for folder in ("final", "latest"):
        written = json.loads((tmp_path / "a" / folder / "config.json").read_text())
        assert written["op_mode"] == "chunk" and written["task_format"] == "legacy"
    cfg.op_fallback = False
    with pytest.raises(RuntimeError, match=r"cannot train on cpu: no backward \(test\)\. Allow"):
        train(cfg, tmp_path / "b")


# ------------------------------------------------------------------------------- resume
def _weights(folder):
    return load_file(str(Path(folder) / "model.safetensors"))


def test_resume_after_interruption_is_bit_identical(tmp_path):
    cfg = tiny()
    full = train(cfg, tmp_path / "full")
    assert full.finished and full.step == 4

    part = tmp_path / "part"
    assert not train(cfg, part, until_step=2).finished

    def crash(record):
        if record["step"] == 3:
            raise KeyboardInterrupt  # after step 3 was logged, before any checkpoint of it
    with pytest.raises(KeyboardInterrupt):
        train(cfg, part, callback=crash)
    assert [r["step"] for r in read_log(part)] == [1, 2, 3]
    resumed = train(cfg, part)
    assert resumed.finished

    for name in ("latest", "final"):
        a, b = _weights(tmp_path / "full" / name), _weights(part / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    drop = ("wall_s", "step_s")
    log_a = [{k: v for k, v in r.items() if k not in drop} for r in read_log(tmp_path / "full")]
    log_b = [{k: v for k, v in r.items() if k not in drop} for r in read_log(part)]
    assert [r["step"] for r in log_b] == [1, 2, 3, 4] and log_a == log_b
    assert {"loss", "answer_loss", "answer_acc", "lr", "theta_lr", "grad_norm", "lambda_mean", "tokens"} <= log_b[0].keys()
    assert sorted(p.name for p in part.glob("step-*")) == ["step-000002", "step-000004"]
    card = (part / "final" / "MODEL_CARD.md").read_text()
    assert "| steps | 4 |" in card and "final loss" in card and "niah_seed" in card
    assert full.final_loss == pytest.approx(resumed.final_loss, abs=0)


def test_resume_with_another_config_is_refused(tmp_path):
    stopped = train(tiny(steps=2, decay_steps=1), tmp_path, max_seconds=1e-9)
    assert (stopped.step, stopped.finished) == (1, False) and (tmp_path / "step-000001").is_dir()
    with pytest.raises(ValueError, match="lr: "):
        train(tiny(steps=2, decay_steps=1, lr=1e-3), tmp_path)
    (tmp_path / "step-000001").rename(tmp_path / "moved")
    with pytest.raises(ValueError, match="missing"):  # never a silent fresh start
        train(tiny(steps=2, decay_steps=1), tmp_path)


def test_theta_lr_mult_zero_holds_lambda_at_its_start(tmp_path):
    """``theta_lr_mult=0``: every other weight trains, theta (so lambda) stays bit for bit; the
    default rate moves it on the same run."""
    initial = trainer.build_model(tiny(arm="full"), 259)
    start = [m.attn.theta.detach().clone() for m in initial.blocks]
    for mult, moved in ((0.0, False), (10.0, True)):
        train(tiny(arm="full", steps=2, decay_steps=1, theta_lr_mult=mult), tmp_path / str(mult))
        model = QEDModel.from_pretrained(tmp_path / str(mult) / "final", dtype=torch.float32)
        thetas = [m.attn.theta.detach() for m in model.blocks]
        assert any(not torch.equal(t, s.to(t.dtype)) for t, s in zip(thetas, start)) == moved, (mult, thetas)
        bf16_start = initial.embeddings.weight.detach().to(torch.bfloat16).float()
        assert not torch.equal(model.embeddings.weight.detach(), bf16_start)  # the other weights train


@pytest.mark.parametrize("kw, name", [(dict(seq_len=0), "seq_len"), (dict(loss="x"), "loss"),
                                      (dict(theta_lr_mult=-1.0), "theta_lr_mult"),
                                      (dict(warmup_steps=3, decay_steps=3), "warmup_steps"),
                                      (dict(model={"hiden_size": 4}), "model")])
def test_config_refuses_bad_values(kw, name):
    with pytest.raises(ValueError, match=name):
        tiny(**kw)


# ------------------------------------------------------------------------------- CLI and checkpoints
def test_cli_flags_override_the_preset():
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["train", "--preset", "micro", "--out", "x", "--arm", "gdn2", "--seed", "1",
                              "--hidden", "48", "--steps", "100", "--no-op-fallback", "--decay-dt", "1e-4,0.1",
                              "--theta-lr-mult", "100"])
    cfg = config_from_args(args)
    assert cfg.model["decay_dt_range"] == (1e-4, 0.1) and "decay_a_range" not in cfg.model
    assert cfg.theta_lr_mult == 100 and config_from_args(parser.parse_args(["train", "--out", "x"])).theta_lr_mult == 10
    assert (cfg.arm, cfg.seed, cfg.steps, cfg.op_fallback) == ("gdn2", 1, 100, False)
    assert cfg.model["hidden_size"] == 48 and cfg.model["num_hidden_layers"] == 2
    assert args.func.__name__ == "run"


@pytest.mark.parametrize("folder", sorted(p.parent.name for p in (ROOT / "checkpoints").glob("*/config.json")))
def test_committed_checkpoints_load(folder):
    """Every folder of checkpoints/: bf16, at most 16 MB, a model card, finite logits."""
    path = ROOT / "checkpoints" / folder
    model = QEDModel.from_pretrained(path)
    assert model.embeddings.weight.dtype == torch.bfloat16
    assert (path / "MODEL_CARD.md").is_file() and (path / "model.safetensors").stat().st_size < 16e6
    assert model.cfg.task_format == "legacy" and "--format legacy" in (path / "MODEL_CARD.md").read_text()
    with torch.no_grad():
        logits = model.float()(torch.tensor([[256] + list(b"The grass is green.")]))
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("folder", ["recall-gdn2-s0", "recall-full-s1"])
def test_gpu_recall_checkpoints_retrieve_on_cpu(folder, tmp_path):
    """The shipped GPU recall models retrieve here too: S-NIAH-1 at 1K (their training length),
    three prompts, float32 on CPU through the PyTorch chunk path (100 % of 100 on the H200)."""
    from qedprobe.eval import SweepSpec, run_sweep
    model = QEDModel.from_pretrained(ROOT / "checkpoints" / folder).float()
    spec = SweepSpec(task="s-niah-1", task_format="legacy", lengths=[1024], strengths=[1.0], samples=3, seed=0,
                     progress=False)
    summary = run_sweep(model, spec, out=tmp_path / "sweep").summary
    rows = [json.loads(line) for line in (tmp_path / "sweep" / "results.jsonl").open()]
    assert len(rows) == 3 and all(r["correct"] for r in rows), [r["prediction"] for r in rows]
    assert len(summary) == 1


def test_model_card_commit_falls_back_to_the_wheel_build(monkeypatch):
    """Outside a git checkout (an installed wheel) the card's commit comes from $QEDPROBE_COMMIT."""
    from qedprobe.train import card

    def no_git(*args, **kwargs):
        raise OSError("no git")
    monkeypatch.setattr(card.subprocess, "run", no_git)
    monkeypatch.setenv("QEDPROBE_COMMIT", "abc1234")
    assert card.git_commit() == "abc1234"
    monkeypatch.delenv("QEDPROBE_COMMIT")
    assert card.git_commit() == "unknown"


def test_interference_checkpoint_matches_the_asked_key(tmp_path):
    """The shipped QED checkpoint interference-full-s0 writes the asked needle's value on MK-NIAH
    (4 needles in noise, 1K tokens, 12 prompts) far above the 1/4 of a model that copies some
    needle, and falls to that level or below when the question asks a key that no needle has
    (the foreign-key control, same prompts otherwise): it matches keys (docs/RESULTS.md, "Interference
    checkpoints")."""
    from qedprobe.eval import SweepSpec, run_sweep
    from qedprobe.tasks.control import ForeignKeyTask
    from qedprobe.tasks import NIAHTask
    folder = ROOT / "checkpoints" / "interference-full-s0"
    model = QEDModel.from_pretrained(folder, dtype=torch.float32).eval()
    accuracy = {}
    for name, kind in (("real", NIAHTask), ("control", ForeignKeyTask)):
        task = kind("mk-niah", str(folder), num_needles=4, haystack="noise")
        spec = SweepSpec(task=task, lengths=[1024], strengths=[1.0], samples=12, seed=0, batch_size=12, progress=False)
        summary = run_sweep(model, spec, out=tmp_path / name).summary
        accuracy[name] = summary[0]["accuracy"]
    assert accuracy["real"] >= 0.75 and accuracy["control"] <= 0.25, accuracy
