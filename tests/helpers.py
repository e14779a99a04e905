"""What the tests share: random op inputs, comparisons, the GPU marks, tiny models, and an
independent NumPy oracle. Test modules import from here (``tests/conftest.py`` puts this folder
on ``sys.path``), never from each other."""
import contextlib
import copy
from functools import partial

import numpy as np
import pytest
import torch

from qedprobe.lam import random_directions
from qedprobe.model import QEDConfig, QEDModel
from qedprobe.tokenizer import ByteTokenizer

F64 = torch.float64
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
PROBES = ("rho", "d", "Sd", "e")
OP_INPUTS = ("q", "k", "v", "g", "b", "w", "lam")


# --- op inputs --------------------------------------------------------------------------------

def make_inputs(B=2, T=12, H=3, K=8, V=5, *, dtype=F64, device="cpu", seed=0, gmin=1.0, gmax=0.0,
                lam_min=0.0, lam_max=0.25, lam_token=False):
    """The op's tensor inputs ``{q, k, v, g, b, w, lam}``, drawn in float64 from ``seed`` on the
    CPU (the same values on any device), then moved to ``device`` and ``dtype``.

    q, k, v ~ N(0, 1) (``[B, T, H, K]`` / ``[B, T, H, V]``); log-decay ``g`` uniform in
    ``[-gmin, -gmax]``; b, w ~ U(0, 1); ``lam`` uniform in ``[lam_min, lam_max]``, ``[H]`` or, with
    ``lam_token``, ``[B, T, H]``."""
    gen = torch.Generator().manual_seed(seed)
    r = partial(torch.randn, generator=gen, dtype=F64)
    u = partial(torch.rand, generator=gen, dtype=F64)
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, H, V), g=-(gmax + (gmin - gmax) * u(B, T, H, K)),
             b=u(B, T, H, K), w=u(B, T, H, V),
             lam=lam_min + (lam_max - lam_min) * (u(B, T, H) if lam_token else u(H)))
    return {n: t.to(device=device, dtype=dtype) for n, t in x.items()}


chunk_inputs = partial(make_inputs, T=100, H=2, K=16, V=32, device=DEVICE, gmin=0.2, lam_min=0.05, lam_max=0.45)
"""The chunk kernel's inputs (forward and backward tests): T past one 64-token chunk."""


def grouped_inputs(B=1, T=70, H=2, HV=4, K=16, V=16, *, seed=0, lam_token=False, device="cpu"):
    """float64 inputs with grouped value heads (fla's GDN-2 convention, ``HV = m * H``): ``q, k``
    ``[B, T, H, K]``, everything else per value head; log-decay uniform in ``[-0.3, 0]``."""
    gen = torch.Generator().manual_seed(seed)
    r = partial(torch.randn, generator=gen, dtype=F64)
    u = partial(torch.rand, generator=gen, dtype=F64)
    x = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V), g=-0.3 * u(B, T, HV, K),
             b=u(B, T, HV, K), w=u(B, T, HV, V),
             lam=(0.05 + 0.4 * u(B, T, HV)) if lam_token else (0.05 + 0.4 * u(HV)))
    return {n: t.to(device) for n, t in x.items()}


def expanded_naive(x, **kw):
    """The grouped-heads reference: ``qed_naive`` on ``q, k`` repeated to the value heads
    (``repeat_interleave``: value head ``j`` reads query/key head ``j // m``), so it does not use
    the ops' own grouping; autograd through the repeat sums the gradients of ``q, k`` per group."""
    from qedprobe.kernels.qed import qed_naive
    m = x["v"].shape[2] // x["q"].shape[2]
    q, k = (x[n].repeat_interleave(m, dim=2) for n in ("q", "k"))
    return qed_naive(q, k, *(x[n] for n in OP_INPUTS[2:]), **kw)


def op_args(x):
    """``x``'s tensors in the op's positional order ``q, k, v, g, b, w, lam``."""
    return tuple(x[n] for n in OP_INPUTS)


def z_for(arm, H, K, *, seed=3, dtype=F64, device="cpu"):
    """The ``rand`` arm's fixed unit directions ``[H, K]`` (``None`` for the other arms)."""
    return random_directions(H, K, seed=seed).to(device=device, dtype=dtype) if arm == "rand" else None


def low_precision(x64, dtype):
    """``(x, ref_in)``: ``x64``'s tensors in ``dtype`` (the log-decay ``g`` in float32, as models
    pass it) and the reference inputs: the same rounded values in float64."""
    x = {n: t.to(dtype) for n, t in x64.items()}
    x["g"] = x64["g"].float()
    return x, {n: t.double() for n, t in x.items()}


# --- comparisons ------------------------------------------------------------------------------

def max_diff(a, b):
    """``max |a - b|`` in float64."""
    return (a.double() - b.double()).abs().max().item()


def rel_err(x, ref):
    """``||x - ref|| / ||ref||`` (Frobenius) in float64."""
    x, ref = x.double(), ref.double()
    return ((x - ref).norm() / ref.norm()).item()


def assert_close(name, got, ref, bound):
    """``rel_err(got, ref) < bound``, the message naming the tensor and its error (as fla's
    ``assert_close`` for low-precision kernels against a float64 reference)."""
    err = rel_err(got, ref)
    assert err < bound, f"{name}: relative error {err:.3e} >= {bound:.1e}"


def assert_outputs_close(got, ref, *, atol, rtol=0.0):
    """Two ops' ``(o, final_state, probes)``: the same parts present, each with the same dtype and
    shape and elementwise within ``atol + rtol * |ref|``."""
    (o, s, p), (ro, rs, rp) = got, ref
    torch.testing.assert_close(o, ro, rtol=rtol, atol=atol)
    assert (s is None) == (rs is None) and (p is None) == (rp is None)
    if s is not None:
        torch.testing.assert_close(s, rs, rtol=rtol, atol=atol)
    if p is not None:
        assert p.keys() == rp.keys()
        for name in p:
            torch.testing.assert_close(p[name], rp[name], rtol=rtol, atol=atol, msg=lambda m: f"probe {name}: {m}")


# --- GPU marks --------------------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU checks run the compiled kernels")
LONG_ARMS = ("full", "nogate_noproj")


def long_check(bounds):
    """``@gpu``, parametrised over ``(dtype, bound)`` in ``bounds`` and over ``arm`` in ``LONG_ARMS``."""
    def mark(test):
        test = pytest.mark.parametrize("arm", LONG_ARMS)(test)
        return gpu(pytest.mark.parametrize("dtype,bound", bounds)(test))
    return mark


# --- tiny models ------------------------------------------------------------------------------

TINY = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16,
            initializer_range=0.1)


def tiny(arm="full", seed=0, theta=1.0, **kw):
    """A 2-layer QED model (CPU, reference recurrence) with distinct per-head strengths."""
    torch.manual_seed(seed)
    model = QEDModel(QEDConfig(**{**TINY, "arm": arm, **kw}))
    with torch.no_grad():
        for block in model.blocks:
            if block.attn.theta is not None:  # distinct per-head strengths, lambda ~ 0.15 .. 0.2
                block.attn.theta.copy_(theta + torch.linspace(-0.5, 0.5, model.cfg.num_heads))
    return model.eval()


def ids(B=2, T=11, seed=1, vocab=97):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def tiny_model(arm="full", seed=0):
    """:func:`tiny` with a vocabulary that holds the byte tokenizer's ids (the eval tests)."""
    return tiny(arm, seed, vocab_size=ByteTokenizer.vocab_size)


def saved_tiny_model(folder, arm="full", seed=0):
    tiny_model(arm, seed).save_pretrained(folder)
    return str(folder)


# --- tiny transformers models (qedprobe.hf) ----------------------------------------------------
# Built by transformers itself, nothing downloaded: hidden size 64, 4 decoder layers (linear
# attention at 0, 2, 3 and softmax attention at 1, so a layer's index differs from its rank among
# the linear ones); GDN families with grouped value heads (2 q/k heads, 4 value heads), KDA
# families with 4 heads of 16. ``initializer_range`` 0.1: transformers' 0.02 makes a tiny model's
# recurrence contribute almost nothing; likewise decay rates ``exp(A_log)`` in [0.02, 0.3] and the
# KDA safe gates' lower bound -0.5 (their defaults decay the state by e^-10 per token or so: the
# state, and with it the erase term, would be gone after one token).

HF_VOCAB = 160
HF_LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
HF_INDEXED = ["linear_attention", "indexed_attention", "linear_attention", "linear_attention"]
HF_BASE = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, initializer_range=0.1, layer_types=HF_LAYERS)
HF_COMMON = dict(HF_BASE, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4,
                 linear_key_head_dim=16)
HF_KDA = dict(HF_BASE, num_key_value_heads=4, linear_num_heads=4, linear_head_dim=16, pad_token_id=0,
              bos_token_id=None, eos_token_id=None)
HF_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
HF_MLA = dict(kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
              moe_intermediate_size=32, num_experts_per_tok=2)
HF_FAMILIES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "qwen4_exp", "lara_mini", "kimi_linear",
               "bailing_hybrid", "glm5_next")
HF_KDA_FAMILIES = ("kimi_linear", "bailing_hybrid", "glm5_next")


def _hf_config(family: str, vocab_size: int):
    """The tiny transformers config of ``family`` (transformers' own config class)."""
    import transformers as tr
    common, kda = dict(HF_COMMON, vocab_size=vocab_size), dict(HF_KDA, vocab_size=vocab_size)
    gdn = dict(common, head_dim=16, linear_value_head_dim=16)
    qsa = dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4)
    glm_text = dict(kda, layer_types=HF_INDEXED, kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16,
                    v_head_dim=16, n_routed_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
                    index_n_heads=2, index_head_dim=16, index_topk=16, linear_lower_bound=-0.5)
    glm_vision = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
                      projection_intermediate_size=32, patch_size=4, image_size=16)
    return {
        "qwen3_5": lambda: tr.Qwen3_5TextConfig(**gdn),
        "qwen3_5_moe": lambda: tr.Qwen3_5MoeTextConfig(**gdn, **HF_MOE),
        "qwen3_next": lambda: tr.Qwen3NextConfig(**gdn, **HF_MOE),
        # OLMo-Hybrid: V = 2K and beta in (0, 2) (linear_allow_neg_eigval, its default).
        "olmo_hybrid": lambda: tr.OlmoHybridConfig(**common, linear_value_head_dim=32, pad_token_id=0,
                                                   eos_token_id=None),
        "qwen4_exp": lambda: tr.Qwen4ExpTextConfig(**dict(gdn, layer_types=HF_INDEXED), **HF_MOE, hc_lowrank=8, **qsa),
        "lara_mini": lambda: tr.LaraMiniConfig(**gdn),
        "kimi_linear": lambda: tr.KimiLinearConfig(**kda, **HF_MLA, num_local_experts=4),
        "bailing_hybrid": lambda: tr.BailingHybridConfig(**kda, **HF_MLA, head_dim=16, num_local_experts=4, n_group=1,
                                                         topk_group=1, first_k_dense_replace=1, num_mtp_layers=0,
                                                         kda_lower_bound=-0.5),
        # GLM-5-Next exists only as an image-text model: its text model inside Glm5NextForConditionalGeneration.
        "glm5_next": lambda: tr.Glm5NextConfig(text_config=tr.Glm5NextTextConfig(**glm_text).to_dict(),
                                               vision_config=glm_vision),
    }[family]()


_HF_BUILT = {}


def tiny_hf(family: str, seed: int = 0, vocab_size: int = HF_VOCAB):
    """A tiny random model of ``family`` (one of :data:`HF_FAMILIES`), eval mode, float32: a copy
    of one built once per process (transformers' ``from_config`` is slow on a busy machine)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    key = (family, seed, vocab_size)
    if key not in _HF_BUILT:
        torch.manual_seed(seed)
        auto = AutoModelForImageTextToText if family == "glm5_next" else AutoModelForCausalLM
        model = auto.from_config(_hf_config(family, vocab_size)).eval()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("A_log"):
                    param.copy_(torch.empty_like(param).uniform_(0.02, 0.3).log())
        _HF_BUILT[key] = model
    return copy.deepcopy(_HF_BUILT[key])


def hf_torch_reference(model):
    """Context: transformers' own PyTorch recurrence for ``model``'s (unadapted) layers, not the
    fla kernels transformers picks when fla is installed."""
    from qedprobe.hf import transformers_torch_path
    return transformers_torch_path(model.config.model_type)


@contextlib.contextmanager
def one_thread():
    """One torch thread while the block runs (tiny models run faster so on a loaded 2-core machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def hf_ids(n: int = 2, t: int = 24, seed: int = 1) -> torch.Tensor:
    """Token ids ``[n, t]`` for :func:`tiny_hf` models."""
    return torch.randint(2, HF_VOCAB, (n, t), generator=torch.Generator().manual_seed(seed))


# --- a tiny Hugging Face tokenizer folder --------------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
"""A ChatML template (Qwen's layout) for :func:`save_bpe_tokenizer`."""


def save_bpe_tokenizer(folder, texts, *, chat_template: str | None = None, bos: bool = False) -> None:
    """A byte-level BPE tokenizer (300 ids, trained on ``texts`` with the ``tokenizers`` library,
    nothing downloaded) saved in ``folder`` by transformers' ``save_pretrained``: EOS
    ``<|endoftext|>`` (also the BOS with ``bos``), the ChatML tokens, and ``chat_template``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    chatml = ["<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", *chatml],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>",
                                   bos_token="<|endoftext|>" if bos else None, additional_special_tokens=chatml)
    fast.chat_template = chat_template
    fast.save_pretrained(folder)


# --- an independent oracle --------------------------------------------------------------------

def _unit(x):
    return x / np.sqrt(x @ x + 1e-6)


def _direction(arm, q, k, b, z):
    P = np.eye(len(k)) - np.outer(k, k)
    return {
        "gdn2": np.zeros_like(q),
        "nogate_noproj": q,
        "nogate": P @ q,
        "full": P @ np.diag(b) @ q,
        "rand": P @ np.diag(b) @ z if z is not None else None,
        "noproj": np.diag(b) @ q,
    }[arm]


def independent_qed(q, k, v, g, b, w, lam, arm, z=None, scale=None, state=None):
    """QED in float64 NumPy from the paper's matrix form, the oracle of ``qed_naive``.

    Per token: ``S_t = M_t D_t S_{t-1} + k_t (w_t v_t)^T`` with ``M_t = I - k_t a_t^T``,
    ``D_t = Diag(exp g_t)`` and ``o_t = S_t^T (scale q_t)``; directions use the explicit projector
    ``P_t = I - k_t k_t^T``. One sequence: q, k, g, b ``[T, H, K]``; v, w ``[T, H, V]``; lam
    ``[T, H]``; z ``[H, K]``; state ``[H, K, V]``."""
    T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    S = np.zeros((H, K, V)) if state is None else state.copy()
    o = np.zeros((T, H, V))
    for t in range(T):
        for h in range(H):
            qh, kh = _unit(q[t, h]), _unit(k[t, h])
            d = _direction(arm, qh, kh, b[t, h], None if z is None else z[h])
            a = b[t, h] * kh + lam[t, h] * d
            M = np.eye(K) - np.outer(kh, a)
            S[h] = M @ np.diag(np.exp(g[t, h])) @ S[h] + np.outer(kh, w[t, h] * v[t, h])
            o[t, h] = S[h].T @ (scale * qh)
    return o, S
