"""The ``qedprobe`` lm-eval model (qedprobe.lmeval) on the shipped CPU checkpoint
``micro-recall-full-s1`` (arm ``full``: lambda != 0) and on a tiny random Qwen3.5 folder,
against qedprobe's own ``generate`` and a direct forward pass; end to end through
``lm_eval.simple_evaluate`` on local tasks in the shapes of fda, swde, squad_completion and a
RULER NIAH task (:mod:`lmeval_fixtures`; nothing is downloaded)."""
import runpy

import pytest
import torch

pytest.importorskip("lm_eval")

from lmeval_fixtures import MICRO, TASKS, niah_docs, write_tasks  # noqa: E402 (sets the offline switches first)

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.tasks import TaskManager  # noqa: E402
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window  # noqa: E402

from qedprobe.lmeval import ModelArgsError, QEDProbeLM, RequestError  # noqa: E402
from qedprobe.model import strength  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROMPTS = ["One of the special magic numbers for calm-lake is: 4821937. What is the special magic number for calm-lake? It is",
           "short", "The grass is green. The sky is blue. The sun is yellow. Here we go.", "x" * 50]


def _gen(context, **kwargs):
    return Instance("generate_until", {}, (context, kwargs), 0)


def _ll(context, continuation):
    return Instance("loglikelihood", {}, (context, continuation), 0)


@pytest.fixture(scope="module")
def lm():
    """float64, so batched and single-row passes agree to 1e-9 and greedy choices never flip."""
    return QEDProbeLM(pretrained=MICRO, dtype="float64", batch_size=3)


def _ids(lm, text):
    return [lm.tokenizer.bos_id, *lm.tokenizer.encode(text)]


def _direct_logprob(lm, context_ids, cont_ids):
    """``sum_i log p(cont_i | ...)`` and whether every token is the argmax, from ``model(ids)``."""
    with torch.no_grad():
        logp = lm.model(torch.tensor([context_ids + cont_ids]))[0].double().log_softmax(-1)
    rows = logp[len(context_ids) - 1:len(context_ids) - 1 + len(cont_ids)]
    target = torch.tensor(cont_ids)
    return float(rows.gather(-1, target[:, None]).sum()), bool((rows.argmax(-1) == target).all())


def test_generate_until_equals_qedprobe_generate(lm):
    until = ["\n", "7", "99"]  # one-token stops end the row early; "99" is cut from the text
    got = lm.generate_until([_gen(p, until=until, max_gen_toks=24) for p in PROMPTS])
    with torch.no_grad():
        new = lm.model.generate([_ids(lm, p) for p in PROMPTS], 24, eos_token_id=lm.tokenizer.eos_id,
                                return_type="new_tokens")
    full = [lm.tokenizer.decode(n) for n in new]
    want = [t.split("\n")[0].split("7")[0].split("99")[0] for t in full]
    assert got == want
    assert any(w != t for w, t in zip(want, full)) and any(want)  # some text was cut, some kept


def test_generate_until_default_budget_and_refusals(lm):
    (text,) = lm.generate_until([_gen("abc", until="\n\n")])
    with torch.no_grad():
        (new,) = lm.model.generate([_ids(lm, "abc")], 256, eos_token_id=lm.tokenizer.eos_id, return_type="new_tokens")
    assert text == lm.tokenizer.decode(new).split("\n\n")[0]
    with pytest.raises(ValueError, match="repetition_penalty"):
        lm.generate_until([_gen("abc", until=["\n"], repetition_penalty=1.1)])
    with pytest.raises(ValueError, match="max_gen_toks"):
        lm.generate_until([_gen("abc", until=["\n"], max_gen_toks=0)])


def test_loglikelihood_equals_direct_forward(lm):
    with torch.no_grad():
        (greedy,) = lm.model.generate([_ids(lm, PROMPTS[0])], 6, return_type="new_tokens")
    pairs = [("The grass is green.", " The sky is blue."), ("", "abc"), (PROMPTS[0], lm.tokenizer.decode(greedy)),
             ("a" * 40, "bcd"), ("What is it?", " 7")]
    got = lm.loglikelihood([_ll(c, k) for c, k in pairs])
    for (context, cont), (logp, is_greedy) in zip(pairs, got):
        ctx = _ids(lm, context) if context else [lm.tokenizer.bos_id]
        want, want_greedy = _direct_logprob(lm, ctx, lm.tokenizer.encode(cont))
        assert logp == pytest.approx(want, abs=1e-9) and is_greedy == want_greedy
    assert got[2][1] and not got[0][1]


def test_loglikelihood_rolling_equals_direct_forward():
    text = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
    req = Instance("loglikelihood_rolling", {}, (text,), 0)
    whole = QEDProbeLM(pretrained=MICRO, dtype="float64")
    tokens = whole.tokenizer.encode(text)
    (got,) = whole.loglikelihood_rolling([req])
    assert got == pytest.approx(_direct_logprob(whole, [whole.tokenizer.bos_id], tokens)[0], abs=1e-9)
    windowed = QEDProbeLM(pretrained=MICRO, dtype="float64", max_length=16, batch_size=4)
    want = sum(_direct_logprob(windowed, list(ctx), list(cont))[0] for ctx, cont in map(
        make_disjoint_window, get_rolling_token_windows(tokens, windowed.tokenizer.bos_id, 16, 1)))
    assert windowed.loglikelihood_rolling([req])[0] == pytest.approx(want, abs=1e-9)
    assert abs(want - got) > 1e-3  # the windows forget: a different number


def test_strength_rescales_lambda(lm):
    """s = 1 is the model as it is; s = 2 changes the scores and the text, as strength(model, 2) does."""
    assert float(lm.model.blocks[0].attn.lam().detach().abs().min()) > 0
    pairs = [_ll("The grass is green.", " The sky is blue."), _ll(PROMPTS[0], " 4821937")]
    gens = [_gen(p, until=["\n"], max_gen_toks=32) for p in PROMPTS]
    try:
        lm.set_strength(None)
        plain, plain_text = lm.loglikelihood(pairs), lm.generate_until(gens)
        lm.set_strength(1)
        assert lm.loglikelihood(pairs) == plain and lm.generate_until(gens) == plain_text
        lm.set_strength(2)
        doubled, doubled_text = lm.loglikelihood(pairs), lm.generate_until(gens)
    finally:
        lm.set_strength(None)
    assert all(abs(a[0] - b[0]) > 1e-4 for a, b in zip(doubled, plain))
    assert doubled_text != plain_text
    with strength(lm.model, 2.0):
        want = _direct_logprob(lm, _ids(lm, "The grass is green."), lm.tokenizer.encode(" The sky is blue."))[0]
    assert doubled[0][0] == pytest.approx(want, abs=1e-9)


@pytest.mark.parametrize("kwargs, name", [
    (dict(strength="strong"), "strength"), (dict(strength=5.0), "strength"), (dict(phase="both"), "phase"),
    (dict(layers="a;b"), "layers"), (dict(layers="7"), "layers"), (dict(heads=-1), "heads"),
    (dict(dtype="int8"), "dtype"), (dict(batch_size=0), "batch_size"), (dict(batch_size="auto"), "batch_size"),
    (dict(max_length=-1), "max_length"), (dict(qed_lambda=0.1), "qed_lambda"), (dict(qed_arm="gdn2"), "qed_arm"),
    (dict(device="gpu0"), "device"), (dict(tokenizer="/no/such/folder"), "tokenizer"), (dict(colour=1), "colour"),
    (dict(pretrained="/no/such/model"), "pretrained"), (dict(pretrained=None), "pretrained"),
])
def test_bad_model_args_are_refused_by_name(kwargs, name):
    with pytest.raises(ModelArgsError, match=name):
        QEDProbeLM(**{"pretrained": MICRO, **kwargs})


def test_a_request_over_max_length_is_refused_not_truncated():
    lm = QEDProbeLM(pretrained=MICRO, max_length=16)
    assert lm.generate_until([_gen("x" * 7, until=["\n"], max_gen_toks=8)])  # BOS + 7 + 8 = 16 fits
    with pytest.raises(RequestError, match="max_length=16"):
        lm.generate_until([_gen("x" * 8, until=["\n"], max_gen_toks=8)])
    with pytest.raises(RequestError, match="max_length=16"):
        lm.loglikelihood([_ll("x" * 15, "yz")])


def test_strength_on_gdn2_is_refused(tmp_path):
    from helpers import saved_tiny_model
    folder = saved_tiny_model(tmp_path / "gdn2", arm="gdn2")
    assert QEDProbeLM(pretrained=folder, strength=1).strength == 1.0
    with pytest.raises(ModelArgsError, match="gdn2"):
        QEDProbeLM(pretrained=folder, strength=0.5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the compiled fast path and CUDA-graph decode steps")
def test_gpu_fast_path_answers_as_the_plain_path():
    """On CUDA a QEDModel runs the fast path; ``eager=true`` the plain one: the same greedy answers
    on the prompts the checkpoint was trained for, scores to float32 rounding."""
    docs = niah_docs(4)
    fast = QEDProbeLM(pretrained=MICRO, device="cuda", dtype="float32", batch_size=4)
    plain = QEDProbeLM(pretrained=MICRO, device="cuda", dtype="float32", batch_size=4, eager=True)
    assert fast.fast and not plain.fast
    gens = [_gen(d["input"], until=["\n"], max_gen_toks=12) for d in docs]
    assert fast.generate_until(gens) == plain.generate_until(gens)
    pairs = [_ll(d["input"], " " + d["outputs"][0]) for d in docs]
    for a, b in zip(fast.loglikelihood(pairs), plain.loglikelihood(pairs)):
        assert a[0] == pytest.approx(b[0], rel=1e-3, abs=1e-3) and a[1] == b[1]


def _tiny_qwen35_folder(folder):
    """A tiny random Qwen3.5 (tests/helpers' shape, vocabulary widened to the BPE tokenizer's
    300 ids) with its tokenizer, saved as a transformers folder."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    from helpers import HF_COMMON, save_bpe_tokenizer
    torch.manual_seed(0)
    cfg = Qwen3_5TextConfig(**{**HF_COMMON, "vocab_size": 320}, head_dim=16, linear_value_head_dim=16)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    save_bpe_tokenizer(folder, PROMPTS * 4)
    return str(folder)


def test_transformers_folder_with_qed_lambda(tmp_path):
    folder = _tiny_qwen35_folder(tmp_path / "qwen")
    lm = QEDProbeLM(pretrained=folder, qed_lambda=0.2, batch_size=2)
    assert lm.model.cfg.arm == "full" and lm.max_length == 32768 and lm.tokenizer.bos_id is None
    pairs = [("The grass is green.", " The sky is blue."), (PROMPTS[0], " 4821937"), ("x" * 20, "xx")]
    got = lm.loglikelihood([_ll(c, k) for c, k in pairs])
    tok = lm.tokenizer
    for (context, cont), (logp, _) in zip(pairs, got):
        assert logp == pytest.approx(_direct_logprob(lm, tok.encode(context), tok.encode(cont))[0], abs=1e-4)
    texts = lm.generate_until([_gen(p, until=["\n"], max_gen_toks=8) for p in PROMPTS])
    with torch.no_grad():
        new = lm.model.generate([tok.encode(p) for p in PROMPTS], 8, eos_token_id=tok.eos_id, return_type="new_tokens")
    assert texts == [tok.decode(n).split("\n")[0] for n in new]
    lm.set_strength(2.0)
    assert all(abs(a[0] - b[0]) > 1e-5 for a, b in zip(lm.loglikelihood([_ll(c, k) for c, k in pairs]), got))


def test_simple_evaluate_on_local_tasks(tmp_path):
    """fda / swde / squad_completion (lm-eval's own task classes on local rows) and a RULER-shaped
    NIAH task, end to end: every document logged, each metric recomputed from the response."""
    from lm_eval.tasks.fda.task import contains_score
    from lm_eval.tasks.ruler.common_utils import postprocess_pred, string_match_all
    tm = TaskManager(include_path=str(write_tasks(tmp_path / "tasks")), include_defaults=False)
    out = lm_eval.simple_evaluate(model="qedprobe", model_args=f"pretrained={MICRO},batch_size=4,strength=0.5",
                                  tasks=TASKS, task_manager=tm, bootstrap_iters=0, log_samples=True)
    assert sorted(out["results"]) == sorted(TASKS) and out["config"]["strength"] == 0.5
    for task, samples in out["samples"].items():
        assert [s["doc_id"] for s in samples] == list(range(len(samples))) and samples
        for s in samples:
            (resp,) = s["filtered_resps"]
            if task == "niah_local":
                assert s["1024"] == string_match_all(postprocess_pred([resp]), [s["target"]])
            else:
                assert s["contains"] == contains_score(resp, [s["target"]])
                assert s["arguments"][0][1]["until"] in (["\n"], ["\n\n"])
    assert out["results"]["niah_local"]["1024,none"] > 0  # the micro model retrieves needles at 1K


def test_python_m_qedprobe_lmeval_is_lm_evals_cli_with_the_model(monkeypatch):
    import lm_eval.__main__ as lm_main
    from lm_eval.api.registry import get_model
    seen = []
    monkeypatch.setattr(lm_main, "cli_evaluate", lambda: seen.append(get_model("qedprobe")))
    runpy.run_module("qedprobe.lmeval", run_name="__main__")
    assert seen == [QEDProbeLM]
