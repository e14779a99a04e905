"""The legacy NIAH format: determinism, one needle at the requested depth, token budget, pairing
(RULER's format: tests/test_eval_ruler.py)."""
import re

import pytest

from qedprobe import tasks
from qedprobe.tasks import NOISE_TEXT, TASKS, NIAHTask, score
from qedprobe.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

NEEDLE_RE = re.compile(r"One of the special magic (numbers|uuids) for ([a-z]+-[a-z]+) is: ([0-9a-f-]+)\.")
UUID_RE = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory):
    """A tiny byte-level BPE trained here on the shipped prose (no download)."""
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from qedprobe.tasks import default_prose_path
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tr = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>", "<unk>"],
                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    folder = tmp_path_factory.mktemp("hftok")
    path = folder / "train.txt"
    path.write_text(default_prose_path().read_text())
    tok.train([str(path)], tr)
    tok.save(str(folder / "tokenizer.json"))
    return load_tokenizer(str(folder))


def make_task(name, tokenizer="bytes", **kwargs):
    return tasks.make_task(name, tokenizer, format="legacy", **kwargs)


def _haystack(sample):
    intro, hay, question = sample.prompt.split("\n")
    return hay


def test_byte_tokenizer_roundtrip():
    t = ByteTokenizer()
    ids = t.encode("héllo 1234567")
    assert max(ids) < 256 and t.decode(ids + [t.EOS, t.PAD]) == "héllo 1234567"
    assert t.vocab_size == 259 and t.bos_id == 256 and t.eos_id == 257


def test_hf_tokenizer_folder_missing_is_clear_error(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))


@pytest.mark.parametrize("name", TASKS)
def test_determinism_and_seed(name):
    a = make_task(name).sample(600, 3, samples=7, seed=0)
    b = make_task(name).sample(600, 3, samples=7, seed=0)   # a fresh generator, same sample
    assert a.input_ids == b.input_ids and a.answer == b.answer and a.prompt == b.prompt
    c = make_task(name).sample(600, 3, samples=7, seed=1)
    assert c.answer != a.answer
    # order of generation does not matter
    t = make_task(name)
    t.sample(900, 5, samples=7, seed=0)
    assert t.sample(600, 3, samples=7, seed=0).input_ids == a.input_ids


@pytest.mark.parametrize("name", ["s-niah-1", "s-niah-2", "s-niah-3"])
@pytest.mark.parametrize("length", [500, 1000, 3000])
def test_exactly_one_needle_at_depth(name, length):
    t = make_task(name)
    n = 9
    for s in t.samples(length, n, seed=0):
        hay = _haystack(s)
        found = NEEDLE_RE.findall(hay)
        assert len(found) == 1, found
        kind, key, value = found[0]
        assert key == s.key and value == s.answer
        assert s.depth == pytest.approx(s.sample_id / (n - 1))
        pos = NEEDLE_RE.search(hay).start()
        other = NEEDLE_RE.sub("", hay)
        # needle sits at a sentence boundary within one sentence of the requested depth
        longest = max(len(x) for x in t._sentences) + 2
        assert abs(pos - s.depth * len(other)) <= longest
        assert s.prompt.endswith(f"for {s.key} mentioned in the provided text is")
        assert f"What is the special magic {'uuid' if name == 's-niah-3' else 'number'} for {s.key}" in s.prompt
        if name == "s-niah-3":
            assert UUID_RE.match(value)
        else:
            assert re.fullmatch(r"[1-9][0-9]{6}", value)


def test_noise_haystack_is_ruler_noise():
    s = make_task("s-niah-1").sample(2000, 0, samples=1)
    hay = NEEDLE_RE.sub("", _haystack(s)).strip()
    assert hay.startswith(NOISE_TEXT)
    assert set(x.strip() for x in re.split(r"(?<=\.)\s+", hay) if x.strip()) <= \
        set(x.strip() + "" for x in re.split(r"(?<=\.)\s+", NOISE_TEXT))


def test_prose_haystack_from_file(tmp_path):
    f = tmp_path / "hay.txt"
    f.write_text("Alpha beta gamma. Delta epsilon zeta! Eta theta iota? Kappa lambda mu.\n")
    s = NIAHTask("s-niah-2", haystack_file=f).sample(800, 0, samples=2)
    hay = NEEDLE_RE.sub("", _haystack(s))
    assert "Delta epsilon zeta!" in hay and "grass" not in hay
    with pytest.raises(ValueError, match="one needle"):
        NIAHTask("s-niah-1", num_needles=3)


@pytest.mark.parametrize("haystack", ["prose", "noise"])
def test_mk_niah_needles(haystack):
    t = make_task("mk-niah", num_needles=4, haystack=haystack)
    assert t.haystack == haystack and make_task("mk-niah").haystack == "prose"
    for s in t.samples(1500, 5, seed=2):
        assert ("grass is green" in s.prompt) == (haystack == "noise")
        found = NEEDLE_RE.findall(_haystack(s))
        assert len(found) == 4
        keys = [k for _, k, _ in found]
        assert len(set(keys)) == 4 and len({v for _, _, v in found}) == 4
        assert dict((k, v) for _, k, v in found)[s.key] == s.answer
        assert s.prompt.count(f"for {s.key}") == 3  # needle, question, answer prefix


@pytest.mark.parametrize("tokname", ["bytes", "hf"])
@pytest.mark.parametrize("name", TASKS)
def test_token_length_within_budget(name, tokname, hf_tok):
    tok = ByteTokenizer() if tokname == "bytes" else hf_tok
    t = make_task(name, tok)
    for length in (700, 1024, 4096):
        for s in t.samples(length, 6, seed=0):
            assert s.input_ids == ([tok.bos_id] if tok.bos_id is not None else []) + tok.encode(s.prompt)
            assert len(s.input_ids) + s.max_new_tokens <= length
            # at most about one sentence (plus needles re-tokenised) shorter than the budget
            longest = max(len(tok.encode(" " + x)) for x in t._sentences)
            assert len(s.input_ids) + s.max_new_tokens >= length - longest - 8


def test_too_short_length_is_clear_error():
    with pytest.raises(ValueError, match="too short"):
        make_task("s-niah-1").sample(100, 0, samples=1)


def test_paired_identity_across_strengths():
    """The generator has no strength input: every strength of a sweep reads sample (L, i) from
    the same call; the sweep test checks the recorded prompt fingerprints too."""
    t = make_task("s-niah-1")
    first = [t.sample(1024, i, samples=4).sha for i in range(4)]
    again = [make_task("s-niah-1").sample(1024, i, samples=4).sha for i in reversed(range(4))][::-1]
    assert first == again and len(set(first)) == 4


def test_score_is_substring_case_insensitive():
    assert score(" 1234567. The", "1234567")
    assert not score(" 123456", "1234567")
    assert score("ABCDEF12-...", "abcdef12")


def test_hf_tokenizer_class(hf_tok):
    assert isinstance(hf_tok, HFTokenizer)
    ids = hf_tok.encode("The special magic number is 1234567.")
    assert hf_tok.decode(ids) == "The special magic number is 1234567."


@pytest.mark.parametrize("needles", [2, 8])
def test_min_length_fits_every_sample(needles):
    """min_length() bounds every sample (keys vary in length): the trainer packs documents of it."""
    task = make_task("mk-niah", load_tokenizer("bytes"), haystack="noise", num_needles=needles)
    length = task.min_length()
    for i in range(400):
        assert len(task.sample(length, i, samples=400, seed=-1).input_ids) <= length
