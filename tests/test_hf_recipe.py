"""The README's qedprobe.hf recipe, and ``qedprobe sweep`` / ``eig`` on a transformers folder.

The folder is a tiny random Qwen3.5 (the multimodal ``qwen3_5`` layout of the real checkpoints,
with a one-block vision tower) written by ``save_pretrained``, plus a byte-level BPE tokenizer
trained here with the ``tokenizers`` library; nothing is downloaded.
"""
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="qedprobe.hf needs transformers")

from qedprobe.cli import main
from qedprobe.eval.tasks import NOISE_TEXT, NIAHTask

from helpers import HF_COMMON, one_thread

README = Path(__file__).resolve().parents[1] / "README.md"
PLACEHOLDER = "path/to/Qwen3.5-0.8B"


def _tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([NOISE_TEXT, "One of the special magic numbers for the key is: 1234567.",
                             "What is the special magic number mentioned in the provided text?"], trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(folder)


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
    section = README.read_text().split("## Pretrained Gated DeltaNet models", 1)[1]
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
