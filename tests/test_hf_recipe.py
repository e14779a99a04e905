"""The README's qedprobe.hf recipe, and ``qedprobe sweep`` / ``eig`` on a transformers folder.

The folder is a tiny random Qwen3.5 (the multimodal ``qwen3_5`` layout of the real checkpoints,
with a one-block vision tower) written by ``save_pretrained``, plus a byte-level BPE tokenizer
with a ChatML chat template, trained here with the ``tokenizers`` library; nothing is downloaded.
"""
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="qedprobe.hf needs transformers")

from qedprobe.cli import main
from qedprobe.tasks import NOISE_TEXT, NIAHTask

from helpers import CHAT_TEMPLATE, HF_COMMON, one_thread, save_bpe_tokenizer, tiny_hf

README = Path(__file__).resolve().parents[1] / "README.md"
PLACEHOLDER = "path/to/Qwen3.5-0.8B"


def _tokenizer(folder: Path) -> None:
    save_bpe_tokenizer(folder, [NOISE_TEXT, "One of the special magic numbers for the key is: 1234567.",
                                "What is the special magic number mentioned in the provided text?"],
                       chat_template=CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory):
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration
    folder = tmp_path_factory.mktemp("qwen35")
    text = {**HF_COMMON, "vocab_size": 320, "head_dim": 16, "linear_value_head_dim": 16}
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=4, num_position_embeddings=16)
    torch.manual_seed(0)
    Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).save_pretrained(folder)
    _tokenizer(folder)
    with one_thread():
        yield folder


def _readme_recipe() -> str:
    section = README.read_text().split("## Pretrained linear-attention models from transformers", 1)[1]
    return re.search(r"```python[^\n]*\n(.*?)```", section, re.S).group(1)  # tagged check-only in README


def test_readme_recipe_runs_on_a_local_qwen35_folder(qwen_folder, capsys):
    code = _readme_recipe()
    assert PLACEHOLDER in code and len([l for l in code.splitlines()[4:] if l.strip()]) == 6  # folder + five lines
    scope = {}
    exec(compile(code.replace(PLACEHOLDER, str(qwen_folder)), "README.md", "exec"), scope)
    model, cache, ids = scope["model"], scope["cache"], scope["ids"]
    assert model.cfg.model_type == "qwen3_5_text" and model.mixer_layers == [0, 2, 3]
    assert tuple(cache["blocks.0.linear_attn.hook_e"].shape) == (1, ids.shape[1], 4)
    assert model.cfg.arm == "full" and model.cfg.lam == ((0.1,) * 4,) * 3
    assert capsys.readouterr().out.strip()  # the decoded continuation


def _length(folder) -> int:
    return NIAHTask("s-niah-1", str(folder)).min_length() + 16


def test_cli_sweep_and_eig_on_a_transformers_folder(qwen_folder, tmp_path, capsys):
    """In the legacy task format: its prompts fit the short lengths a CPU test can afford."""
    L = _length(qwen_folder)
    out = tmp_path / "sweep"
    args = ["sweep", "--model", str(qwen_folder), "--lengths", str(L), "--samples", "2", "--strengths", "0,1",
            "--qed-lambda", "0.1", "--qed-arm", "nogate", "--out", str(out), "--no-progress", "--format", "legacy"]
    assert main(args) == 0
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted((r["s"], r["sample_id"]) for r in rows) == [(0.0, 0), (0.0, 1), (1.0, 0), (1.0, 1)]
    config = json.loads((out / "config.json").read_text())
    assert config["samples_spec"]["tokenizer"] == str(qwen_folder.resolve())
    model_cfg = config["model"]["config"]
    assert model_cfg["arm"] == "nogate" and model_cfg["lam"] == [[0.1] * 4] * 3
    assert model_cfg["linear_layers"] == [0, 2, 3]
    assert main(args) == 0  # resumes: nothing recomputed
    assert len((out / "results.jsonl").read_text().splitlines()) == 4
    capsys.readouterr()

    assert main(["sweep", "--model", str(qwen_folder), "--lengths", str(L), "--samples", "2",
                 "--out", str(tmp_path / "gdn"), "--no-progress", "--format", "legacy"]) == 2
    assert "pass --qed-lambda" in capsys.readouterr().err
    assert main(["sweep", "--model", str(qwen_folder), "--lengths", str(L), "--samples", "2", "--layers", "1",
                 "--qed-lambda", "0.1", "--out", str(tmp_path / "bad"), "--no-progress", "--format", "legacy"]) == 2
    assert "linear-attention layers [0, 2, 3] only" in capsys.readouterr().err

    assert main(["eig", "--model", str(qwen_folder), "--length", str(L), "--samples", "1",
                 "--qed-lambda", "0.05", "--out", str(tmp_path / "eig"), "--no-progress", "--format", "legacy"]) == 0
    summary = json.loads((tmp_path / "eig" / "eig.json").read_text())
    assert [row["layer"] for row in summary["layers"]] == [0, 2, 3]
    assert summary["meta"]["arm"] == "full" and summary["e_recompute_maxdiff"] < 1e-5
    assert all(h["n"] == summary["tokens"] > 0 for row in summary["layers"] for h in row["heads"])


def test_cli_sweep_and_eig_on_a_kda_image_text_folder(tmp_path, capsys):
    """A GLM-5-Next folder (Kimi Delta Attention; transformers builds it only as an image-text
    model): `sweep` with QED injected and `eig` read it as they read a Qwen3.5 folder."""
    folder = tmp_path / "glm5"
    tiny_hf("glm5_next", vocab_size=320).save_pretrained(folder)
    _tokenizer(folder)
    L = _length(folder)
    args = ["--model", str(folder), "--samples", "1", "--qed-lambda", "0.1", "--no-progress", "--format", "legacy"]
    with one_thread():
        assert main(["sweep", *args, "--lengths", str(L), "--strengths", "0,1", "--out", str(tmp_path / "s")]) == 0
        assert main(["eig", *args, "--length", str(L), "--out", str(tmp_path / "eig")]) == 0
    rows = [json.loads(line) for line in (tmp_path / "s" / "results.jsonl").read_text().splitlines()]
    assert sorted(r["s"] for r in rows) == [0.0, 1.0]
    config = json.loads((tmp_path / "s" / "config.json").read_text())["model"]["config"]
    assert config["model_type"] == "glm5_next_text" and config["lam"] == [[0.1] * 4] * 3
    summary = json.loads((tmp_path / "eig" / "eig.json").read_text())
    assert [row["layer"] for row in summary["layers"]] == [0, 2, 3] and summary["e_recompute_maxdiff"] < 1e-5


def test_cli_chat_template_on_a_transformers_folder(qwen_folder, tmp_path, capsys):
    """--chat-template feeds RULER's prompt in the folder's own template; off by default; refused
    where it cannot apply."""
    from qedprobe.tasks import make_task
    chat = make_task("niah_single_1", str(qwen_folder), chat_template=True)
    L = chat.min_length() + 16
    out = tmp_path / "chat"
    base = ["sweep", "--model", str(qwen_folder), "--task", "niah_single_1", "--lengths", str(L), "--samples", "1",
            "--strengths", "1", "--no-progress", "--batch-size", "1"]
    args = base + ["--out", str(out)]
    assert main(args + ["--chat-template"]) == 0
    (row,) = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    sample = chat.sample(L, 0, samples=1, seed=0)
    assert sample.prompt.startswith("<|im_start|>user\n") and row["prompt_sha"] == sample.sha
    spec = json.loads((out / "config.json").read_text())["samples_spec"]
    assert spec["chat_template_sha256"] == chat.describe()["chat_template_sha256"]
    capsys.readouterr()
    assert main(args) == 2  # the same folder without the template: other prompts, refused
    assert "samples_spec" in capsys.readouterr().err
    for extra, message in ((["--tokenizer", "bytes"], "--chat-template: tokenizer 'bytes' has no chat template"),
                           (["--format", "legacy"], "--chat-template applies to --format ruler")):
        assert main([*base, "--out", str(tmp_path / "bad"), *extra, "--chat-template"]) == 2
        assert message in capsys.readouterr().err
    text = tmp_path / "text.txt"
    text.write_text(NOISE_TEXT * 4)
    assert main(["eig", "--model", str(qwen_folder), "--text", str(text), "--length", "64", "--chat-template",
                 "--out", str(tmp_path / "eig"), "--no-progress"]) == 2
    assert "--chat-template applies to task prompts (--task), not to --text" in capsys.readouterr().err
    assert main(["eig", "--model", str(qwen_folder), "--task", "niah_single_1", "--length", str(L), "--samples", "1",
                 "--chat-template", "--out", str(tmp_path / "eig"), "--no-progress"]) == 0
    assert json.loads((tmp_path / "eig" / "eig.json").read_text())["meta"]["chat_template"] is True


def test_cli_qed_lambda_above_a_trained_heads_range_needs_allow_extrapolation(qwen_folder, tmp_path, capsys):
    L = _length(qwen_folder)
    common = ["--model", str(qwen_folder), "--qed-lambda", "0.5", "--no-progress", "--format", "legacy"]
    assert main(["sweep", *common, "--lengths", str(L), "--samples", "1", "--strengths", "1",
                 "--out", str(tmp_path / "sweep")]) == 2
    err = capsys.readouterr().err
    assert "--qed-lambda must lie in [0, 0.25]" in err and "pass --allow-extrapolation" in err
    assert "inject_qed" not in err and "`lam`" not in err
    assert main(["eig", *common, "--length", str(L), "--samples", "1", "--allow-extrapolation",
                 "--out", str(tmp_path / "eig")]) == 0
    meta = json.loads((tmp_path / "eig" / "eig.json").read_text())["meta"]
    assert meta["qed_lambda"] == 0.5 and meta["qed_arm"] == "full" and meta["arm"] == "full"
