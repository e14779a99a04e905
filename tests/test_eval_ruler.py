"""The ``ruler`` task format against NVIDIA RULER's own generator.

``fixtures/ruler_niah.json`` holds samples that RULER's unmodified ``niah.py`` wrote for the
byte tokenizer and the shipped prose (how: ``fixtures/make_ruler_fixtures.py``, its docstring):
our prompt, answers, counted length and scores must equal them.
"""
import json
import random
import re
from pathlib import Path

import numpy as np
import pytest

from qedprobe.tasks import ruler
from qedprobe.tasks.ruler import DEPTHS, KeyWords, RulerTask, read_essay, split_sentences
from qedprobe.tasks import (
    answer_fraction,
    default_prose_path,
    make_task,
    score,
    string_match_all,
    string_match_part,
    task_names,
)
from qedprobe.tokenizer import ByteTokenizer

FIXTURES = json.loads((Path(__file__).parent / "fixtures" / "ruler_niah.json").read_text())
CASES = FIXTURES["cases"]


def _case_id(case):
    return f"{case['task']}-{case['max_seq_length']}-seed{case['random_seed']}"


def test_fixtures_cover_every_ruler_niah_task_and_commit():
    assert {c["task"] for c in CASES} == set(ruler.RULER_TASKS)
    assert FIXTURES["ruler_commit"] == ruler.RULER_COMMIT


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_prompt_answers_budget_equal_ruler(case):
    task = make_task(case["task"])          # the default format is ruler
    n = len(case["samples"])
    for i in reversed(range(n)):            # any order: the stream is replayed
        want = case["samples"][i]
        s = task.sample(case["max_seq_length"], i, samples=n, seed=case["random_seed"])
        assert s.prompt == want["input"] + want["answer_prefix"]
        assert s.prompt.rfind(" The speci") == len(want["input"])  # RULER's cut before the model call
        assert s.answers == want["outputs"] and s.answer == want["outputs"][0]
        assert s.counted_tokens == want["length"] <= case["max_seq_length"]
        assert s.input_ids == [ByteTokenizer.BOS] + ByteTokenizer().encode(s.prompt)   # BOS not counted
        assert s.max_new_tokens == 128 and s.length == case["max_seq_length"]


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_scores_equal_ruler(case):
    for want in case["samples"]:
        refs = [want["outputs"]] * len(want["predictions"])
        assert string_match_all(want["predictions"], refs) == want["string_match_all"]
        assert string_match_part(want["predictions"], refs) == want["string_match_part"]


def test_answer_fraction_and_score():
    answers = ["1234567", "7654321", "ABC-def", "1111111"]
    assert answer_fraction(" 7654321, abc-DEF and 1234567", answers) == 0.75
    assert not score(" 7654321, abc-DEF and 1234567", answers) and score("x 1234567.", "1234567")
    assert string_match_all([" 1234567", "none"], [answers, answers]) == 12.5
    assert string_match_part([" 1234567", "none"], [answers, answers]) == 50.0
    with pytest.raises(ValueError, match="no answers"):
        answer_fraction("x", [])


def test_depths_are_rulers_forty():
    assert list(DEPTHS) == [int(x) for x in np.round(np.linspace(0, 100, num=40, endpoint=True)).astype(int)]


def test_key_words_index_like_the_sorted_set():
    """Hyphenated and space-holding words make adjective blocks interleave in RULER's sorted list."""
    adjs = ["high", "high-pitched", "high pitched", "hig", "old", "old-fashioned", "x-rated", "x", "old"]
    nouns = ["pitched-roof", "roof", "arm-rest", "arm", "rest", "A", "ñu", "roof"]
    words = sorted({f"{a}-{n}" for a in adjs for n in nouns})
    kw = KeyWords(adjs, nouns)
    assert len(kw) == len(words) and [kw[i] for i in range(len(kw))] == words
    with pytest.raises(IndexError):
        kw[len(kw)]


def _rulers_word_list(name):
    """What RULER's ``wonderwords.random_word._get_words_from_text_file(name)`` returns: the
    wonderwords asset file's lines, right-stripped."""
    from importlib.resources import files
    return [line.rstrip() for line in files("wonderwords.assets").joinpath(name).read_text().splitlines(True)]


def test_key_word_lists_are_the_ones_ruler_reads():
    adjs, nouns = _rulers_word_list("adjectivelist.txt"), _rulers_word_list("nounlist.txt")
    assert len(adjs) > len(set(adjs)) > 900 and len(nouns) > 6000  # the adjective file repeats two words
    assert ruler.wonderwords_lists() == (sorted(set(adjs)), sorted(set(nouns)))


def test_key_words_on_wonderwords_lists():
    nouns = _rulers_word_list("nounlist.txt")
    adjs = _rulers_word_list("adjectivelist.txt")
    roots = {a.split("-")[0] for a in adjs if "-" in a}
    pick = sorted({a for a in adjs if "-" in a or a in roots} | set(random.Random(0).sample(adjs, 40)))
    words = sorted({f"{a}-{n}" for a in pick for n in nouns})
    kw = KeyWords(pick, nouns)
    idx = random.Random(1).sample(range(len(words)), 3000) + [0, len(words) - 1]
    assert len(kw) == len(words) and all(kw[i] == words[i] for i in idx)


def test_sentence_splitter():
    prose = " ".join(default_prose_path().read_text().split())
    assert split_sentences(prose) == re.split(r"(?<=[.!?])\s+", prose)  # punkt's result on this prose
    text = 'Mr. Smith met Dr. J. Doe at 5 p.m. today.  "Really?" she asked. Yes!  It  was, e.g. fine'
    assert split_sentences(text) == ['Mr. Smith met Dr. J. Doe at 5 p.m. today.', '"Really?"',
                                     "she asked.", "Yes!", "It  was, e.g. fine"]
    assert split_sentences("  ") == []


def test_essay_haystack_from_json_folder_or_text(tmp_path):
    text = "Alpha beta gamma. Delta epsilon zeta! Eta theta iota? Kappa lambda mu.\n"
    (tmp_path / "PaulGrahamEssays.json").write_text(json.dumps({"text": text * 3}))
    (tmp_path / "essays").mkdir()
    (tmp_path / "essays" / "b.txt").write_text("Second. ")
    (tmp_path / "essays" / "a.txt").write_text("First. ")
    (tmp_path / "plain.txt").write_text(text)
    assert read_essay(tmp_path / "PaulGrahamEssays.json") == text * 3
    assert read_essay(tmp_path / "essays") == "First. Second. "
    assert read_essay(tmp_path / "plain.txt") == text and read_essay() == default_prose_path().read_text()
    s = make_task("niah_single_2", haystack_file=tmp_path / "PaulGrahamEssays.json").sample(4096, 0, samples=1)
    assert "Delta epsilon zeta!" in s.prompt and "old mill" not in s.prompt
    (tmp_path / "bad.json").write_text("[1]")
    with pytest.raises(ValueError, match="PaulGrahamEssays.json"):
        read_essay(tmp_path / "bad.json")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(ValueError, match="not UTF-8"):
        read_essay(tmp_path / "latin1.txt")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ValueError, match="not valid JSON"):
        read_essay(tmp_path / "broken.json")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no .txt files"):
        read_essay(tmp_path / "empty")


def test_task_names_formats_and_options():
    assert task_names("ruler")[:8] == tuple(ruler.RULER_TASKS) and "s-niah-1" in task_names("ruler")
    assert task_names("legacy") == ("s-niah-1", "s-niah-2", "s-niah-3", "mk-niah")
    assert make_task("s-niah-2").name == "niah_single_2" and make_task("mk-niah").name == "niah_multikey_1"
    assert make_task("s-niah-1", format="legacy").format == "legacy"
    assert make_task("niah_multiquery").describe()["format"] == "ruler"
    with pytest.raises(ValueError, match="only the legacy format takes `num_needles`"):
        make_task("s-niah-1", num_needles=3)
    with pytest.raises(ValueError, match="unknown task format"):
        make_task("s-niah-1", format="RULER")
    with pytest.raises(ValueError, match="unknown RULER task"):
        make_task("niah_single_9")
    with pytest.raises(ValueError, match="essay tasks only"):
        make_task("niah_multikey_2", haystack_file=default_prose_path())


def test_too_short_length_is_a_clear_error():
    task = RulerTask("niah_single_1")
    assert 900 < task.min_length() <= 1022      # the fixture fits 1022 tokens in 1024
    with pytest.raises(ValueError, match="too short for RULER task niah_single_1"):
        task.sample(600, 0, samples=1)


def test_sweep_records_the_format_and_rulers_score(tmp_path):
    from helpers import tiny_model

    from qedprobe.eval import SweepSpec, load_results, run_sweep
    spec = SweepSpec(task="s-niah-1", lengths=[1024], strengths=[1.0], samples=1, progress=False, decode="answer")
    summary = run_sweep(tiny_model(), spec, out=tmp_path / "sw").summary
    spec = json.loads((tmp_path / "sw" / "config.json").read_text())["samples_spec"]
    assert spec["format"] == "ruler" and spec["task"] == "niah_single_1" and spec["max_new_tokens"] == 128
    rows = load_results(tmp_path / "sw")
    assert rows[0]["prompt_sha"] == make_task("niah_single_1").sample(1024, 0, samples=1, seed=0).sha
    for r in rows:
        assert r["format"] == "ruler" and r["answers"] == [r["answer"]] and r["prompt_tokens"] <= 1024 - 128 + 1
        assert r["score"] == answer_fraction(r["prediction"], r["answers"]) and r["correct"] == (r["score"] == 1)
    assert summary[0]["format"] == "ruler"
    assert summary[0]["score_pct"] == round(100 * sum(r["score"] for r in rows) / len(rows), 2)


def test_summary_and_report_give_partial_credit_in_percent(tmp_path, capsys):
    from qedprobe import cli as commands
    from qedprobe.eval import summarize
    rows = [{"task": "niah_multivalue", "format": "ruler", "length": 4096, "s": 1.0, "sample_id": i,
             "correct": sc == 1.0, "score": sc, "prompt_sha": f"p{i}"} for i, sc in enumerate([1.0, 0.5, 0.25, 0.0])]
    (row,) = summarize(rows)
    assert row["score_pct"] == 43.75 and row["accuracy"] == 0.25 and row["format"] == "ruler"
    legacy = [{"length": 512, "s": 1.0, "sample_id": i, "correct": c} for i, c in enumerate([True, False])]
    assert summarize(legacy)[0]["score_pct"] == 50.0 and summarize(legacy)[0]["format"] == "legacy"
    (tmp_path / "mv").mkdir()
    (tmp_path / "mv" / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert commands.main(["report", str(tmp_path / "mv")]) == 0
    md = capsys.readouterr().out
    assert "RULER score %" in md and "| 4K | 43.75 |" in md and "| 4K | 25.0 [" in md


def test_cli_notes_a_format_other_than_the_models(tmp_path, capsys):
    from helpers import saved_tiny_model
    from qedprobe import cli as commands
    from qedprobe.model import QEDConfig
    model = saved_tiny_model(tmp_path / "m")
    cfg = QEDConfig.load(tmp_path / "m" / "config.json")
    cfg.task_format = "legacy"
    cfg.save(tmp_path / "m" / "config.json")
    argv = ["sweep", "--model", model, "--out", str(tmp_path / "o"), "--lengths", "1024", "--layers", "7",
            "--no-progress"]
    assert commands.main(argv) == 2                    # stopped by --layers, after the note
    err = capsys.readouterr().err
    assert "trained on the legacy format, this sweep uses --format ruler" in err and "--layers" in err
    assert commands.main([*argv, "--format", "legacy", "--lengths", "400"]) == 2
    assert "trained on" not in capsys.readouterr().err


# --- the tokenizer's chat template (off by default) -----------------------------------------------

@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """``(with a ChatML template, without one)``: local BPE tokenizer folders, both with a BOS."""
    from helpers import CHAT_TEMPLATE, save_bpe_tokenizer
    texts = [ruler.NOISE, "One of the special magic numbers for the key is: 1234567."]
    chat, plain = tmp_path_factory.mktemp("chat_tok"), tmp_path_factory.mktemp("plain_tok")
    save_bpe_tokenizer(chat, texts, chat_template=CHAT_TEMPLATE, bos=True)
    save_bpe_tokenizer(plain, texts, bos=True)
    return chat, plain


def test_chat_template_wraps_the_task_text_and_counts_its_tokens(tokenizers):
    from transformers import AutoTokenizer
    folder = tokenizers[0]
    hf = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    raw, chat = make_task("niah_single_1", folder), make_task("niah_single_1", folder, chat_template=True)
    length = chat.min_length() + 120
    r, c = raw.sample(length, 1, samples=2), chat.sample(length, 1, samples=2)
    assert "<|im_start|>" not in r.prompt and r.input_ids[0] == hf.bos_token_id  # default: RULER's raw prompt
    head, user_end = "<|im_start|>user\n", c.prompt.index("<|im_end|>")
    user, prefix = c.prompt[len(head):user_end], f" The special magic number for {c.key} mentioned in the provided text is"
    assert user.startswith("A special magic number is hidden within") and user.endswith("mentioned in the provided text?")
    assert f"for {c.key} is: {c.answer}." in user
    messages = [{"role": "user", "content": user}]
    assert c.prompt == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + prefix
    template_ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert c.input_ids == template_ids + hf.encode(prefix, add_special_tokens=False)  # no BOS of ours
    assert c.input_ids[0] == hf.convert_tokens_to_ids("<|im_start|>")
    assert c.counted_tokens == len(c.input_ids) + 128 <= length  # the template's tokens count
    assert "chat_template_sha256" in chat.describe() and "chat_template_sha256" not in raw.describe()


def test_chat_template_is_refused_without_one(tokenizers):
    for tok in ("bytes", tokenizers[1]):
        with pytest.raises(ValueError, match=r"`chat_template`: tokenizer .* has no chat template"):
            make_task("niah_single_2", tok, chat_template=True)
    with pytest.raises(ValueError, match="`chat_template` applies to the ruler format"):
        make_task("s-niah-1", tokenizers[0], format="legacy", chat_template=True)
    with pytest.raises(ValueError, match="`chat_template` must be True or False"):
        make_task("niah_single_1", tokenizers[0], chat_template="chatml")
