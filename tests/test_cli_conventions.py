"""The ``qedprobe`` command as users expect it (issue 15): defaults in every --help, negative
lists without ``=``, one-line errors (exit 2) in the CLI's words before any work, progress
and a per-layer table."""
import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import saved_tiny_model
from qedprobe import cli

L = 400  # shortest usable s-niah-1 length with the byte tokenizer is 376
TRAIN = ["train", "--preset", "micro", "--hidden", "32", "--layers", "1", "--heads", "2", "--head-dim", "8",
         "--seq-len", "512", "--batch-size", "1", "--steps", "2", "--warmup", "1", "--decay", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny") / "m")


@pytest.fixture(scope="module")
def gdn2_dir(tmp_path_factory):
    return saved_tiny_model(tmp_path_factory.mktemp("tiny") / "g", arm="gdn2")


def _one_line_error(capsys, cmd):
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"qedprobe {cmd}: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def _subparsers():
    parser = cli.build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return sub.choices


# ------------------------------------------------------------------ help and parsing
def _help_blocks(parser) -> dict:
    """Option string -> its help entry (the lines from the option to the next option)."""
    blocks, current = {}, None
    for line in parser.format_help().splitlines():
        if re.match(r"^  -", line):
            current = line.split()[0].rstrip(",")
            blocks[current] = line
        elif current is not None and line.startswith("    "):
            blocks[current] += " " + line.strip()
        else:
            current = None
    return blocks


def test_every_option_with_a_default_shows_it_in_help():
    for name, parser in _subparsers().items():
        blocks = _help_blocks(parser)
        for action in parser._actions:
            if not action.option_strings or action.default is None or action.default is False \
                    or action.default == argparse.SUPPRESS:
                continue
            entry = blocks[action.option_strings[0]]
            assert "default" in entry, f"{name}: {entry!r}"


HEAVY = ("torch", "transformer_lens", "triton")
"""What ``--help`` and usage errors must not import (seconds; the run modules import them)."""


@pytest.mark.parametrize("argv, status, shown", [
    (["--help"], 0, "train-tokenizer"),
    *[([name, "--help"], 0, f"usage: qedprobe {name}") for name in cli.COMMAND_MODULES],
    (["eig", "--model", "m", "--out", "o", "--length", "2X"], 2, "argument --length: length: '2X' is not an integer"),
    (["train", "--out", "o", "--arm", "bad"], 2, "argument --arm: invalid choice: 'bad'"),
    (["sweep", "--model", "m"], 2, "the following arguments are required: --out"),
])
def test_help_and_usage_errors_import_neither_torch_nor_transformer_lens_nor_triton(argv, status, shown):
    """Each sub-command's parser lives apart from what it runs (``qedprobe.cliutil.runs``)."""
    code = (f"import sys\nfrom qedprobe.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit as exc:\n"
            f"    print('STATUS', exc.code)\nprint('LOADED', sorted(m for m in {HEAVY!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert shown in proc.stdout + proc.stderr, proc.stderr
    assert f"STATUS {status}" in proc.stdout and "LOADED []" in proc.stdout, proc.stdout[-300:]


def test_every_option_has_a_help_text_in_plain_words():
    for name, parser in _subparsers().items():
        missing = [a.option_strings for a in parser._actions if a.option_strings and not a.help]
        assert not missing, f"{name}: options without help {missing}"
        text = parser.format_help()
        assert "``" not in text and ":mod:" not in text, f"{name}: reST in --help"
    dtype = _help_blocks(_subparsers()["sweep"])["--dtype"]
    assert dtype.count("auto") == 2 and "(default: auto)" not in dtype, dtype  # the choices, and once explained


def test_train_help_shows_each_presets_value():
    blocks = _help_blocks(_subparsers()["train"])
    for flag, shown in (("--arm", "(default: full)"), ("--seed", "(default: 0)"),
                        ("--steps", "(default: micro 200, small 1500)"), ("--lr", "(default: micro 0.003, small 0.0015)"),
                        ("--seq-len", "(default: micro 512, small 1024)"), ("--device", "(default: micro cpu, small cuda)")):
        assert shown in blocks[flag], blocks[flag]


def test_negative_strength_lists_need_no_equals_sign():
    args = cli.parse_args(["sweep", "--model", "m", "--out", "o", "--strengths", "-1,0,1"])
    assert args.strengths == "-1,0,1"
    args = cli.parse_args(["sweep", "--model", "m", "--out", "o", "--strengths", "-1.5,-0.5"])
    assert args.strengths == "-1.5,-0.5"


# ------------------------------------------------------------------ train / convert / demo
def test_train_errors_are_one_line_naming_the_flag(tmp_path, capsys):
    afile = tmp_path / "file"
    afile.write_text("x")
    assert cli.main([*TRAIN, "--out", str(afile)]) == 2
    assert "--out" in _one_line_error(capsys, "train")
    argv = [a if a != "512" else "16" for a in TRAIN]
    assert cli.main([*argv, "--out", str(tmp_path / "r")]) == 2
    assert "--seq-len" in _one_line_error(capsys, "train")
    assert cli.main([*TRAIN, "--out", str(tmp_path / "r2"), "--export", str(afile)]) == 2
    assert "--export" in _one_line_error(capsys, "train")
    assert not (tmp_path / "r2" / "loss.jsonl").exists()  # checked before training


def test_train_shows_progress_with_an_eta(tmp_path, capsys):
    assert cli.main([*TRAIN, "--out", str(tmp_path / "r"), "--print-every", "0"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"2/2 \[\d+:\d+<\d+:\d+", err), err  # tqdm: elapsed<remaining


def test_demo_and_convert_errors_are_one_line(tmp_path, capsys, model_dir):
    assert cli.main(["demo", "--tokens", "0"]) == 2
    assert "--tokens" in _one_line_error(capsys, "demo")
    afile = tmp_path / "file"
    afile.write_text("x")
    assert cli.main(["convert", model_dir, str(afile)]) == 2
    assert str(afile) in _one_line_error(capsys, "convert")


# ------------------------------------------------------------------ sweep
def _sweep(model, out, *extra):
    return cli.main(["sweep", "--model", str(model), "--device", "cpu", "--out", str(out), "--lengths", str(L),
                     "--samples", "1", "--no-progress", "--format", "legacy", *extra])


@pytest.mark.parametrize("extra, words", [
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--max-new-tokens", "-3"], "--max-new-tokens"),
    (["--strengths=0,1", "--ref-strength", "2"], "--ref-strength"),
    (["--strengths=0,5"], "--allow-extrapolation"),
    (["--haystack-file", "HAYSTACK"], "--haystack-file"),
])
def test_sweep_refuses_by_cli_flag(model_dir, tmp_path, capsys, extra, words):
    hay = tmp_path / "hay.txt"
    hay.write_text("Some prose. " * 50)
    extra = [str(hay) if a == "HAYSTACK" else a for a in extra]
    assert _sweep(model_dir, tmp_path / "o", *extra) == 2
    err = _one_line_error(capsys, "sweep")
    assert words in err and "allow_extrapolation" not in err and "max_new_tokens" not in err
    assert not (tmp_path / "o" / "results.jsonl").exists()


def test_sweep_gdn2_with_default_strengths_is_told_what_to_pass(gdn2_dir, tmp_path, capsys):
    assert _sweep(gdn2_dir, tmp_path / "o") == 2
    assert "--strengths=1" in _one_line_error(capsys, "sweep")


@pytest.mark.parametrize("content", ["Caf\xe9 au lait. ".encode("latin-1") * 40, bytes(range(256)) * 4],
                         ids=["latin-1", "binary"])
def test_sweep_undecodable_haystack_file_is_named(model_dir, tmp_path, capsys, content):
    hay = tmp_path / "hay.bin"
    hay.write_bytes(content)
    assert _sweep(model_dir, tmp_path / "o", "--task", "s-niah-2", "--haystack-file", str(hay)) == 2
    err = _one_line_error(capsys, "sweep")
    assert str(hay) in err and "UTF-8" in err


# ------------------------------------------------------------------ report and eig
def _fake_sweep(folder, seed, n=4):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"ref_strength": 1.0}))
    rows = [{"task": "s-niah-1", "length": L, "s": 1.0, "sample_id": i, "correct": i % 2 == 0,
             "prompt_sha": f"{seed}-{i}" if i else "shared"} for i in range(n)]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(folder)


def test_report_baseline_out_of_range_names_the_valid_range(tmp_path, capsys):
    a, b = _fake_sweep(tmp_path / "a", 0), _fake_sweep(tmp_path / "b", 0)
    assert cli.main(["report", a, b, "--baseline", "5"]) == 2
    err = _one_line_error(capsys, "report")
    assert "--baseline" in err and "0..1" in err


def test_report_warns_when_sweeps_share_few_prompts(tmp_path, capsys):
    a, b = _fake_sweep(tmp_path / "a", 0), _fake_sweep(tmp_path / "b", 1)
    assert cli.main(["report", a, b]) == 0
    err = capsys.readouterr().err
    assert "warning" in err and "1 of 4" in err
    c = _fake_sweep(tmp_path / "c", 0)
    assert cli.main(["report", a, c]) == 0
    assert "warning" not in capsys.readouterr().err


def test_eig_prints_a_per_layer_table(model_dir, tmp_path, capsys):
    torch.set_num_threads(1)
    txt = tmp_path / "t.txt"
    txt.write_text("Some text to read. " * 5)
    assert cli.main(["eig", "--model", model_dir, "--device", "cpu", "--text", str(txt), "--length", "32",
                     "--samples", "1", "--out", str(tmp_path / "e"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "e" / "eig.json").read_text())
    rows = [line for line in out.splitlines() if re.match(r"\| \d+ \|", line)]
    assert [int(r.split("|")[1]) for r in rows] == [0, 1]
    e_min = min(h["e"]["min"] for h in summary["layers"][0]["heads"])
    assert f"{e_min:.4f}" in rows[0]


def test_sweep_and_eig_take_a_thread_count(model_dir, tmp_path, capsys):
    before = torch.get_num_threads()
    txt = tmp_path / "t.txt"
    txt.write_text("Some text to read. " * 5)
    try:
        torch.set_num_threads(2)
        assert cli.main(["eig", "--model", model_dir, "--device", "cpu", "--text", str(txt), "--length", "32",
                         "--samples", "1", "--out", str(tmp_path / "e"), "--no-progress", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    capsys.readouterr()
    assert _sweep(model_dir, tmp_path / "o", "--threads", "0") == 2
    assert "--threads must be >= 1, got 0" in _one_line_error(capsys, "sweep")


# ------------------------------------------------------------------ messages that name the flag (issue 43)
@pytest.mark.parametrize("extra, words", [
    (["--task", "s-niah-2", "--haystack-file", "/nonexistent/hay.txt"],
     "--haystack-file '/nonexistent/hay.txt': No such file or directory"),
    (["--seed", "-1"], "--seed must be an int >= 0, got -1: negative seeds draw the training prompts"),
])
def test_sweep_names_the_flag_of_a_missing_file_and_a_training_seed(model_dir, tmp_path, capsys, extra, words):
    assert _sweep(model_dir, tmp_path / "o", *extra) == 2
    assert words in _one_line_error(capsys, "sweep")


def test_ruler_format_with_a_legacy_option_names_the_flag(model_dir, tmp_path, capsys):
    assert cli.main(["sweep", "--model", str(model_dir), "--out", str(tmp_path / "o"), "--task", "mk-niah",
                     "--num-needles", "8", "--lengths", "1K", "--samples", "1"]) == 2
    err = _one_line_error(capsys, "sweep")
    assert "only the legacy format takes --num-needles" in err and "num_needles" not in err


def test_eig_refuses_a_training_seed_and_leaves_no_empty_out_behind(model_dir, tmp_path, capsys):
    txt = tmp_path / "t.txt"
    txt.write_text("Some text to read. " * 5)
    eig = ["eig", "--device", "cpu", "--text", str(txt), "--length", "32", "--samples", "1", "--no-progress"]
    assert cli.main([*eig, "--model", model_dir, "--seed", "-1", "--out", str(tmp_path / "e1")]) == 2
    assert "--seed must be an int >= 0" in _one_line_error(capsys, "eig")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((Path(model_dir) / "config.json").read_text())  # no weights
    assert cli.main([*eig, "--model", str(broken), "--out", str(tmp_path / "e2")]) == 2
    assert "cannot load the model" in _one_line_error(capsys, "eig")
    assert not (tmp_path / "e2").exists()


def test_a_config_that_disagrees_with_its_weights_is_reported_first(tmp_path, capsys):
    folder = Path(saved_tiny_model(tmp_path / "m", arm="full"))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "arm": "gdn2"}))
    assert _sweep(folder, tmp_path / "o") == 2  # default strengths: a gdn2 config alone would refuse them
    err = _one_line_error(capsys, "sweep")
    assert "arm='gdn2'" in err and "saved with arm='full'" in err and "--strengths" not in err


def test_train_small_preset_on_a_cpu_machine_says_the_preset_chose_cuda(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["train", "--out", str(tmp_path / "r")]) == 2
    err = _one_line_error(capsys, "train")
    assert "--preset small trains on CUDA" in err and "--device cpu" in err and "is 'cuda'" not in err


def test_report_out_that_cannot_be_written_names_the_flag(tmp_path, capsys, monkeypatch):
    a, b = _fake_sweep(tmp_path / "a", 0), _fake_sweep(tmp_path / "b", 0)
    afile = tmp_path / "file"
    afile.write_text("x")
    assert cli.main(["report", a, b, "--out", str(afile)]) == 2
    assert f"--out {str(afile)!r} exists and is not a folder" in _one_line_error(capsys, "report")
    import os

    def refused(path, *args, **kwargs):  # a folder the file system refuses (as /sys/x, even for root)
        raise PermissionError(1, "Operation not permitted", str(path))

    monkeypatch.setattr(os, "mkdir", refused)
    assert cli.main(["report", a, b, "--out", str(tmp_path / "r")]) == 2
    err = _one_line_error(capsys, "report")
    assert f"--out {str(tmp_path / 'r')!r}: Operation not permitted" in err and "Errno" not in err
