"""The interference recipe: multi-query MK-NIAH rows, key-dependent tokens and their loss weight,
the trained BPE tokenizer shipped beside a model, and the foreign-key control."""
import argparse
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from qedprobe.cli.evaluation import register as register_eval
from qedprobe.cli.evaluation_run import tokenizer_spec
from qedprobe.tasks.control import ForeignKeyTask, ask_key, query_line
from qedprobe.tasks import NIAHTask
from qedprobe.tokenizer import load_tokenizer
from qedprobe.train import TrainConfig, TrainData, train
from qedprobe.train.bpe import SPECIAL, train_tokenizer
from qedprobe.cli.train import config_from_args, register as register_train
from qedprobe.train.data import key_tokens
from qedprobe.train.mixtures import Component
from qedprobe.train.trainer import token_weights

NEEDLE_RE = re.compile(r"special magic numbers? for (\S+) is: (\d+)\.")
QUERY_RE = re.compile(r"The special magic number for (\S+) mentioned in the provided text is (\d+)\.")


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """A small BPE (600 ids) trained on 6 rows of the interference mixture's text."""
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(out, mixture="interference", vocab_size=600, seq_len=8192, rows=6)
    return str(out)


# ------------------------------------------------------------------------------- tokenizer
def test_trained_bpe_round_trips_splits_digits_and_names_its_special_tokens(bpe):
    tok = load_tokenizer(bpe)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (0, 1, 2, 600)
    text = "One of the special magic numbers for amber-anchor is: 7054321.\nThe sky is blue."
    ids = tok.encode(text)
    assert tok.decode(ids) == text and len(ids) < len(text) / 2
    assert [tok.decode([i]) for i in tok.encode(" 7054321.")] == [" ", "7", "0", "5", "4", "3", "2", "1", "."]
    from tokenizers import Tokenizer  # the bare file gives the same ids as the transformers path
    raw = Tokenizer.from_file(str(Path(bpe) / "tokenizer.json"))
    assert raw.encode(text, add_special_tokens=False).ids == ids
    assert [raw.token_to_id(t) for t in SPECIAL] == [0, 1, 2]
    assert tok.decode([0, *ids, 1, 2]) == text  # special ids are dropped


def test_train_tokenizer_refuses_a_vocabulary_without_room_for_the_bytes(tmp_path):
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(tmp_path, mixture="short", vocab_size=100, seq_len=1024, rows=1)


# ------------------------------------------------------------------------------- rows
def common_prefix(a: str, b: str) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_interference_rows_ask_every_needle_once_and_mark_the_key_dependent_digits(bpe):
    data = TrainData(512, "interference-micro", seed=0, tokenizer=bpe)
    tok, docs = data.tokenizer, 0
    for r in range(6):
        ids, answer, key = data.row(r)
        assert len(ids) == len(answer) == len(key) == 513
        end = ids.index(tok.pad_id) if tok.pad_id in ids else len(ids)
        starts = [i for i, t in enumerate(ids) if t == tok.bos_id] + [end]
        for a, b in zip(starts, starts[1:]):
            text = tok.decode(ids[a:b])
            needles = dict(NEEDLE_RE.findall(text))
            asked = QUERY_RE.findall(text)
            if len(needles) < 2:
                continue
            docs += 1
            assert sorted(k for k, _ in asked) == sorted(needles), text  # every needle asked once
            assert all(needles[k] == v for k, v in asked)
            answers = tok.decode([t for t, m in zip(ids[a:b], answer[a:b]) if m]).split()
            assert answers == [v for _, v in asked]
            # key-dependent digits of each answer: those written while another needle's value still agrees
            want = sum(1 + max(common_prefix(v, w) for w in needles.values() if w != v) for _, v in asked)
            assert sum(key[a:b]) == want
            assert not any(k and not m for k, m in zip(key[a:b], answer[a:b]))
    assert docs >= 6


def test_key_tokens_of_single_and_shared_prefixes():
    tok = load_tokenizer("bytes")
    ids = tok.encode(" 1234")
    assert key_tokens(tok, ids, ["1234"]) == [False] * 5  # one value: nothing to choose
    assert key_tokens(tok, ids, ["1234", "5678"]) == [False, True, False, False, False]
    assert key_tokens(tok, ids, ["1234", "1299", "1239"]) == [False, True, True, True, True]


def test_multi_query_components_are_mk_niah_only():
    with pytest.raises(ValueError, match="queries"):
        Component("s-niah-1", 1.0, queries="all")
    with pytest.raises(ValueError, match="queries"):
        Component("mk-niah", 1.0, "noise", (2, 4), queries="some")


def test_key_weight_weighs_only_key_dependent_answer_tokens():
    batch = {"valid": torch.tensor([[True, True, True, False]]), "answer": torch.tensor([[False, True, True, False]]),
             "key": torch.tensor([[False, True, False, False]])}
    cfg = TrainConfig.from_preset("micro", loss="answer", key_weight=8.0)
    assert token_weights(batch, cfg).tolist() == [[0.0, 8.0, 1.0, 0.0]]
    cfg = TrainConfig.from_preset("micro", loss="all", key_weight=8.0)
    assert token_weights(batch, cfg).tolist() == [[1.0, 8.0, 1.0, 0.0]]
    assert token_weights(batch, TrainConfig.from_preset("micro", loss="all")).tolist() == [[1.0, 1.0, 1.0, 0.0]]
    with pytest.raises(ValueError, match="key_weight"):
        TrainConfig.from_preset("micro", key_weight=0)


# ------------------------------------------------------------------------------- CLI, export
def test_train_flags_and_the_tokenizer_shipped_with_the_model(bpe, tmp_path):
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    register_train(sub)
    register_eval(sub)
    args = parser.parse_args(["train", "--preset", "micro", "--out", str(tmp_path / "run"), "--tokenizer", bpe,
                              "--lambda-max", "1.0", "--key-weight", "8", "--mixture", "short",
                              "--hidden", "16", "--layers", "1", "--head-dim", "8",
                              "--steps", "2", "--warmup", "0", "--decay", "1", "--batch-size", "1"])
    cfg = config_from_args(args)
    assert (cfg.tokenizer, cfg.key_weight, cfg.model["lambda_max"]) == (bpe, 8.0, 1.0)
    result = train(cfg, tmp_path / "run", export_dir=tmp_path / "model")
    assert result.finished and (tmp_path / "model" / "tokenizer.json").is_file()
    assert load_tokenizer(str(tmp_path / "model")).encode("blue sky") == load_tokenizer(bpe).encode("blue sky")
    sweep = parser.parse_args(["sweep", "--model", str(tmp_path / "model"), "--out", "x"])
    assert tokenizer_spec(sweep) == str(tmp_path / "model")  # read from the model folder
    assert tokenizer_spec(parser.parse_args(["sweep", "--model", str(tmp_path / "run"), "--out", "x"])) == "bytes"


# ------------------------------------------------------------------------------- foreign-key control
@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_foreign_key_control_asks_a_key_no_needle_has(tokenizer, bpe):
    tok = bpe if tokenizer == "bpe" else "bytes"
    real_task = NIAHTask("mk-niah", tok, num_needles=4, haystack="noise")
    control = ForeignKeyTask("mk-niah", tok, num_needles=4, haystack="noise")
    for i in range(4):
        real, ctrl = real_task.sample(1024, i, samples=4), control.sample(1024, i, samples=4)
        assert ctrl.key not in {k for k, _, _ in real.needles}
        assert (ctrl.answer, ctrl.needles, ctrl.depth) == (real.answer, real.needles, real.depth)
        head, line = real.prompt.rsplit("\n", 1)
        assert ctrl.prompt == f"{head}\n{line.replace(real.key, ctrl.key)}" and line.count(real.key) == 2
        assert ctrl.input_ids == [real_task.tokenizer.bos_id] + real_task.tokenizer.encode(ctrl.prompt)
    assert control.describe() == {**real_task.describe(), "control": "foreign-key"}
    assert ask_key(real_task, real, real.key) == real  # asking its own key changes nothing
    with pytest.raises(ValueError, match="mk-niah"):
        ForeignKeyTask("s-niah-1")
    with pytest.raises(ValueError, match="asked key"):
        query_line(dataclasses.replace(real, key="nope"), "x")


def test_init_starts_a_run_from_a_model_folder_of_the_same_config(tmp_path):
    from qedprobe.train.trainer import build_model
    cfg = TrainConfig.from_preset("micro", model=dict(hidden_size=16, num_hidden_layers=1, head_dim=8), seed=3)
    first = build_model(cfg, 259)
    first.save_pretrained(tmp_path / "stage1")
    second = build_model(dataclasses.replace(cfg, seed=4, init=str(tmp_path / "stage1")), 259)
    fresh = build_model(dataclasses.replace(cfg, seed=4), 259)
    for (name, a), b, c in zip(first.state_dict().items(), second.state_dict().values(), fresh.state_dict().values()):
        assert torch.equal(a, b) and b.dtype == torch.float32, name
    assert not all(torch.equal(a, c) for a, c in zip(first.state_dict().values(), fresh.state_dict().values()))
    saved = json.loads((tmp_path / "stage1" / "config.json").read_text())
    saved["task_format"] = None  # what an earlier stage was trained on may differ
    (tmp_path / "stage1" / "config.json").write_text(json.dumps(saved))
    build_model(dataclasses.replace(cfg, init=str(tmp_path / "stage1")), 259)
    with pytest.raises(ValueError, match="hidden_size"):
        wider = {**cfg.model, "hidden_size": 32}
        build_model(dataclasses.replace(cfg, model=wider, init=str(tmp_path / "stage1")), 259)
    with pytest.raises(ValueError, match="init"):
        build_model(dataclasses.replace(cfg, init=str(tmp_path / "nowhere")), 259)


def test_sweep_refuses_the_control_outside_mk_niah(tmp_path, capsys):
    from qedprobe import cli
    argv = ["sweep", "--model", str(tmp_path), "--out", str(tmp_path / "o"), "--control", "foreign-key"]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "--control foreign-key needs --format legacy --task mk-niah" in err and len(err.strip().splitlines()) == 1


def test_random_queries_draw_needles_with_replacement(monkeypatch):
    """queries='random': as many queries as needles, each a needle of the document, repeats
    allowed (no elimination shortcut), answers and key-dependent digits as for 'all'."""
    from qedprobe.train import data as data_mod
    monkeypatch.setitem(data_mod.MIXTURES, "test-random", (Component("mk-niah", 1.0, "noise", (3, 3), "random"),))
    data = TrainData(1280, "test-random", seed=0, tokenizer="bytes")
    tok, repeats, docs = data.tokenizer, 0, 0
    for r in range(8):
        ids, answer, key = data.row(r)
        end = ids.index(tok.pad_id) if tok.pad_id in ids else len(ids)
        starts = [i for i, t in enumerate(ids) if t == tok.bos_id] + [end]
        for a, b in zip(starts, starts[1:]):
            text = tok.decode(ids[a:b])
            needles, asked = dict(NEEDLE_RE.findall(text)), QUERY_RE.findall(text)
            docs += 1
            assert len(needles) == len(asked) == 3 and all(needles[k] == v for k, v in asked)
            repeats += len({k for k, _ in asked}) < 3
            want = sum(1 + max(common_prefix(v, w) for w in needles.values() if w != v) for _, v in asked)
            assert sum(key[a:b]) == want
    assert docs >= 8 and repeats >= 1
