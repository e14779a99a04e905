"""qedprobe.hf on tiny random transformers models of every supported family (CPU, nothing
downloaded): the nine model types of transformers 5.25 with a delta-rule layer (helpers.HF_FAMILIES).

The reference is the unmodified transformers model on transformers' own PyTorch recurrence
(``torch_chunk_gated_delta_rule`` / ``chunk_kimi_delta_attention`` and their recurrent forms),
forced with ``transformers_torch_path``: with fla installed (as in CI) transformers would
otherwise call fla's kernels. An adapted layer with nothing hooked and lambda 0 calls that same
function (free when off: bit-equal); with a hook (``OP_PATH``) or lambda injected it runs
qedprobe's op (on CPU: the PyTorch chunk path for prompts, the token loop for decode steps), a
different algorithm, equal to float32 rounding. The GPU tests (``-k gpu``, skipped without CUDA)
check the Triton path at T = 4096, a device_map over cuda:0 and the CPU, and that an injected,
hooked model never waits for the GPU in qedprobe's code.
"""
import importlib
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers", reason="qedprobe.hf needs transformers")

from qedprobe.hf import SUPPORTED, UnsupportedModelError, adapt, inject_qed
from qedprobe.hf.cache import HFActivationCache
from qedprobe.hf.families import modeling_module_name, routed_functions
from qedprobe.hf.folder import folder_config, is_transformers_folder
from qedprobe.hooks import DirectionReplacement, ProbeRecorder
from qedprobe.kernels.qed import qed_naive
from qedprobe.lam import random_directions
from qedprobe.model import LambdaScale, hook_name, strength
from qedprobe.model.hooked import MIXER_HOOKS

from helpers import HF_FAMILIES, HF_KDA_FAMILIES, HF_VOCAB, hf_ids, hf_torch_reference, tiny_hf

F32 = dict(rtol=1e-5, atol=5e-5)  # float32 rounding of two chunk algorithms over 24 tokens
NEW = 16
OP_PATH = [(lambda name: name.endswith("hook_o"), lambda o, hook: None)]
"""An observing hook on every layer's output: each layer runs qedprobe's op, not its own function."""


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _reference(model, ids, prompt):
    with torch.no_grad(), hf_torch_reference(model):
        logits = model(ids).logits
        gen = model.generate(prompt, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    return logits, gen


@pytest.mark.parametrize("family", HF_FAMILIES)
def test_lambda_zero_matches_transformers_forward_and_generate(family):
    """qedprobe's op (forced in every layer by an observing hook) equals transformers' PyTorch
    recurrence to float32 rounding, for a prefill and for 16 greedy decode steps, in all of
    which the hooks fire; with no hook the layers run the model's own function: bit for bit."""
    hf = tiny_hf(family)
    ids, prompt = hf_ids(), hf_ids(t=8, seed=2)
    ref_logits, ref_gen = _reference(hf, ids, prompt)
    model = adapt(hf)
    assert model.hf_model is hf and model.mixer_layers == [0, 2, 3]
    torch.testing.assert_close(model.run_with_hooks(ids, fwd_hooks=OP_PATH), ref_logits, **F32)
    assert torch.equal(model(ids), ref_logits)  # free when off: the model's own function
    shapes = []
    record = (lambda name: name == "blocks.2.linear_attn.hook_o", lambda o, hook: shapes.append(tuple(o.shape[:3])))
    with torch.no_grad(), model.hooks(fwd_hooks=[*OP_PATH, record]):
        gen = hf.generate(prompt, max_new_tokens=NEW, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
        assert torch.equal(model.generate(prompt, NEW), ref_gen.sequences)  # tensor in: prompt + new tokens
    assert shapes[:NEW] == [(2, 8, 4)] + [(2, 1, 4)] * (NEW - 1)  # qedprobe ran the prefill and every step
    assert torch.equal(gen.sequences, ref_gen.sequences)
    for step, ref in zip(gen.logits, ref_gen.logits, strict=True):
        torch.testing.assert_close(step, ref, **F32)
    hf.generation_config.repetition_penalty, hf.generation_config.do_sample = 50.0, True  # not used by generate
    assert model.generate(prompt, NEW, return_type="new_tokens") == ref_gen.sequences[:, 8:].tolist()


def _own_function_calls(monkeypatch, family: str) -> list:
    """Record every call of the model's own recurrence functions (what the routes call for a
    layer that runs natively): a list of ``(function name, kwargs)``."""
    calls = []
    module = importlib.import_module(modeling_module_name(family))
    for name in routed_functions(family):
        route = getattr(module, name)

        def spy(*args, _original=route.original, _name=name, **kwargs):
            calls.append((_name, kwargs))
            return _original(*args, **kwargs)
        monkeypatch.setattr(route, "original", spy)
    return calls


@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_probe_shapes_and_erase_eigenvalue(family, monkeypatch):
    """Every hook has its family's documented shape; b, w and g are what the layer hands its
    recurrence function (beta, beta, g); e is 1 - beta ||k_hat||^2 exactly (lambda 0)."""
    model = adapt(tiny_hf(family))
    ids = hf_ids()
    B, T = ids.shape
    Hv, K, V = 4, 16, model.cfg.head_v_dim
    calls = _own_function_calls(monkeypatch, family)
    model(ids)
    own = calls[1][1]  # layer 2's call
    _, cache = model.run_with_cache(ids, names_filter=lambda name: name.startswith("blocks.2."))  # layer 0: native
    names = ("q", "k", "v", "b", "w", "g", "lambda", "d", "rho", "Sd", "e", "o")
    p = {n: cache[f"blocks.2.linear_attn.hook_{n}"] for n in names}
    kda = family in HF_KDA_FAMILIES
    shapes = {"q": (B, T, Hv, K), "k": (B, T, Hv, K), "v": (B, T, Hv, V), "b": (B, T, Hv), "w": (B, T, Hv),
              "g": (B, T, Hv, K) if kda else (B, T, Hv), "lambda": (Hv,), "d": (B, T, Hv, K),
              "rho": (B, T, Hv), "Sd": (B, T, Hv, V), "e": (B, T, Hv), "o": (B, T, Hv, V)}
    assert {n: tuple(t.shape) for n, t in p.items()} == shapes
    if not kda:  # value heads 0,1 read key head 0; 2,3 key head 1
        assert torch.equal(p["q"][:, :, 0], p["q"][:, :, 1]) and torch.equal(p["k"][:, :, 2], p["k"][:, :, 3])
    assert not torch.equal(p["k"][:, :, 1], p["k"][:, :, 2])
    assert torch.equal(p["b"], own["beta"]) and torch.equal(p["w"], own["beta"]) and torch.equal(p["g"], own["g"])
    kk = (p["k"].double() ** 2).sum(-1)
    e, beta = p["e"].double(), own["beta"].double()
    torch.testing.assert_close(e, 1 - beta * kk / (kk + 1e-6), rtol=0, atol=1e-6)  # ||k_hat||^2 = kk / (kk + eps)
    assert float((e - (1 - beta)).abs().max()) > 1e-5  # the epsilon is visible: e is not 1 - beta
    assert torch.equal(p["lambda"], torch.zeros(Hv)) and not p["d"].any()
    assert float(beta.max()) < (2 if family == "olmo_hybrid" else 1) and float(e.min()) > -1  # e in (-1, 1)


@torch.no_grad()
def test_cache_shorthand_and_hook_names_on_a_hybrid_model():
    """Hook points are what hook_name builds over the linear-attention layers [0, 2, 3]; the
    cache's shorthand reaches them, and layer 1 (softmax attention) has none."""
    model = adapt(tiny_hf("qwen3_5"))
    expected = {hook_name(n, l, "linear_attn") for l in (0, 2, 3) for n in MIXER_HOOKS}
    assert set(model.hook_dict) == expected
    _, cache = model.run_with_cache(hf_ids(t=8))
    assert isinstance(cache, HFActivationCache)
    full = lambda n, l: cache.cache_dict[f"blocks.{l}.linear_attn.hook_{n}"]  # noqa: E731
    assert cache["e", 0] is full("e", 0) and cache["q", 2] is full("q", 2) and cache["o", 3] is full("o", 3)
    assert cache["sd", 2] is full("Sd", 2) and cache["lambda", 3, "linear_attn"] is full("lambda", 3)
    assert cache["e", -1] is full("e", 3) and cache["blocks.0.linear_attn.hook_rho"] is full("rho", 0)
    assert torch.equal(cache.stack_activation("e"), torch.stack([full("e", l) for l in (0, 2, 3)]))
    assert torch.equal(cache.stack_activation("rho", layer=3), torch.stack([full("rho", 0), full("rho", 2)]))
    with pytest.raises(KeyError, match=r"no cached activation 'blocks.1.linear_attn.hook_e'.*'linear_attn.hook_e'"):
        cache["e", 1]
    for helper in ("decompose_resid", "accumulated_resid", "logit_attrs", "stack_head_results"):
        with pytest.raises(ValueError, match=f"ActivationCache.{helper}: .*output_hidden_states"):
            getattr(cache, helper)()


@torch.no_grad()
def test_grouped_heads_reach_the_op_natively_unless_q_k_or_d_are_hooked(monkeypatch):
    import qedprobe.model.recurrence as recurrence
    heads = []

    def spy(q, *args, **kwargs):
        heads.append(q.shape[2])
        return qed_attention(q, *args, **kwargs)
    qed_attention = recurrence.qed_attention
    monkeypatch.setattr(recurrence, "qed_attention", spy)
    model = adapt(tiny_hf("qwen3_5"))
    ids = hf_ids(t=8)
    plain = model.run_with_hooks(ids, fwd_hooks=OP_PATH)
    assert heads == [2, 2, 2]  # 2 q/k heads for 4 value heads
    for name in ("hook_q", "hook_k", "hook_d"):
        heads.clear()
        hooked = model.run_with_hooks(ids, fwd_hooks=[*OP_PATH, (f"blocks.0.linear_attn.{name}", lambda x, hook: None)])
        assert heads == [4, 2, 2]
        torch.testing.assert_close(hooked, plain, rtol=0, atol=1e-5)


@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_zeroing_b_changes_the_output(family):
    model = adapt(tiny_hf(family))
    ids = hf_ids()
    logits, cache = model.run_with_cache(ids)
    zero_b = [("blocks.2.linear_attn.hook_b", lambda b, hook: torch.zeros_like(b))]
    with model.hooks(fwd_hooks=zero_b):
        _, hooked_cache = model.run_with_cache(ids)
        hooked = model(ids)
    assert torch.equal(hooked_cache["blocks.0.linear_attn.hook_o"], cache["blocks.0.linear_attn.hook_o"])
    o, o_hooked = cache["blocks.2.linear_attn.hook_o"], hooked_cache["blocks.2.linear_attn.hook_o"]
    assert float((o_hooked - o).abs().max()) > 1e-3 * float(o.abs().max())
    assert float((hooked - logits).abs().max()) > 1e-3  # (the gated RMSNorm rescales o per token)
    # the hook is gone after the block: the model's own function again (float32 rounding apart)
    torch.testing.assert_close(model(ids), logits, **F32)


@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_injected_lambda_changes_the_output_and_strength_zero_restores_it(family):
    model = adapt(tiny_hf(family))
    ids = hf_ids()
    native = model(ids)
    base = model.run_with_hooks(ids, fwd_hooks=OP_PATH)
    inject_qed(model, 0.2, arm="full")
    assert model.cfg.arm == "full" and model.cfg.lam == ((0.2,) * 4,) * 3
    logits, cache = model.run_with_cache(ids)
    assert float((logits - base).abs().max()) > 1e-3
    with torch.no_grad(), strength(model, 0.0):
        torch.testing.assert_close(model(ids), base, rtol=0, atol=1e-6)
    with strength(model, 1.5, layers=[2], heads=[2]):
        assert cache["blocks.2.linear_attn.hook_lambda"].tolist() == pytest.approx([0.2] * 4)
        lam = model.run_with_cache(ids)[1]["blocks.2.linear_attn.hook_lambda"]
        assert lam.tolist() == pytest.approx([0.2, 0.2, 0.3, 0.2])
    # e = 1 - a.k_hat, a = beta k_hat + lam d; the projected direction leaves only the epsilon's part
    c = {n: cache[f"blocks.0.linear_attn.hook_{n}"].double() for n in ("k", "b", "d", "e")}
    k_hat = c["k"] / torch.sqrt((c["k"] ** 2).sum(-1, keepdim=True) + 1e-6)
    gdn2_e = 1 - c["b"] * (k_hat ** 2).sum(-1)
    torch.testing.assert_close(c["e"], gdn2_e - 0.2 * (c["d"] * k_hat).sum(-1), rtol=0, atol=1e-6)
    assert float((c["e"] - gdn2_e).abs().max()) < 1e-4 < float((c["d"] ** 2).sum(-1).sqrt().max())
    inject_qed(model, 0.0, arm="full")
    assert torch.equal(model(ids), native)


@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_free_when_off_calls_the_models_own_function_until_hooked_or_injected(family, monkeypatch):
    """A layer with no hook and lambda 0 calls the model's own function (the route's original);
    a hook on one of its hook points, or an injected lambda, switches that layer alone to
    qedprobe's op."""
    import qedprobe.model.recurrence as recurrence
    ours = []
    op = recurrence.qed_attention
    monkeypatch.setattr(recurrence, "qed_attention", lambda *a, **kw: ours.append(1) or op(*a, **kw))
    model = adapt(tiny_hf(family))
    own = _own_function_calls(monkeypatch, family)
    ids = hf_ids(t=8)
    model(ids)
    assert (len(own), len(ours)) == (3, 0)
    model.run_with_hooks(ids, fwd_hooks=[("blocks.2.linear_attn.hook_e", lambda e, hook: None)])
    assert (len(own), len(ours)) == (3 + 2, 1)
    inject_qed(model, 0.1, layers=[3])
    model(ids)
    assert (len(own), len(ours)) == (5 + 2, 2)
    with strength(model, 0.0):  # lambda still injected: qedprobe's op, multiplied by 0
        model(ids)
    assert (len(own), len(ours)) == (7 + 2, 3)
    inject_qed(model, 0.0)
    model.generate([[5, 6, 7]], 3)
    assert (len(own), len(ours)) == (9 + 3 * 3, 3)  # a prefill and two decode steps, all native


@torch.no_grad()
def test_an_adapted_layer_carries_module_hooks_only_while_it_does_not_run_natively(monkeypatch):
    """Nothing hooked or injected: the transformers layers have no forward hooks at all (their
    forward is the same call as unadapted). A hook or an injection attaches a layer's two; removing
    it detaches them, also from inside that layer's forward (once the forward has ended, with no
    layer left active: the next hooked pass runs qedprobe's op in that layer alone) and after an
    exception out of it. A hook put with torch's ``register_forward_hook`` attaches them too and
    fires; removed by its handle (which calls nothing back), the layer runs natively at its next
    forward and detaches them."""
    import qedprobe.model.recurrence as recurrence
    ours = []
    op = recurrence.qed_attention
    monkeypatch.setattr(recurrence, "qed_attention", lambda *a, **kw: ours.append(1) or op(*a, **kw))
    model = adapt(tiny_hf("qwen3_5"))
    layers = {l: model.recurrence(l).switch.module for l in model.mixer_layers}
    ids = hf_ids(t=8)

    def hooked_layers():
        counts = {l: len(m._forward_pre_hooks) + len(m._forward_hooks) for l, m in layers.items()}
        assert set(counts.values()) <= {0, 2}, counts
        return [l for l, n in counts.items() if n]

    assert hooked_layers() == []
    e2 = model.hook_dict["blocks.2.linear_attn.hook_e"]
    e2.add_hook(lambda e, hook: None)
    assert hooked_layers() == [2]
    model.reset_hooks()
    assert hooked_layers() == []
    inject_qed(model, 0.1, layers=[3])
    assert hooked_layers() == [3]
    inject_qed(model, 0.0)
    assert hooked_layers() == []
    with model.hooks(fwd_hooks=[("blocks.0.linear_attn.hook_q", lambda q, hook: None)]):
        assert hooked_layers() == [0]
    assert hooked_layers() == []

    e2.add_hook(lambda e, hook: model.reset_hooks())  # removes itself while layer 2 runs
    model(ids)
    assert hooked_layers() == [] and ours == [1]
    model.run_with_hooks(ids, fwd_hooks=[("blocks.2.linear_attn.hook_o", lambda o, hook: None)])
    assert ours == [1, 1]  # layer 2 alone: no layer was left active

    seen = []  # torch's own hook on a hook point: attached, fired, and once removed by its handle, detached after
    handle = model.hook_dict["blocks.0.linear_attn.hook_e"].register_forward_hook(lambda m, a, out: seen.append(out))
    assert hooked_layers() == [0]
    model(ids)
    assert len(seen) == 1 and ours == [1, 1, 1]
    handle.remove()
    model(ids)  # layer 0 runs natively again (the switch learns it in this forward) and detaches
    assert hooked_layers() == [] and ours == [1, 1, 1] and len(seen) == 1

    e2.add_hook(lambda e, hook: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        model(ids)
    assert hooked_layers() == [2] and model.recurrence(2).switch.tokens == []
    model.reset_hooks()
    assert hooked_layers() == []
    model.detach()
    assert hooked_layers() == [] and all(model.recurrence(l).switch is None for l in layers)
    e2.add_hook(lambda e, hook: None)
    assert hooked_layers() == []


def test_injection_selects_layers_and_heads_and_feeds_the_op():
    """arm rand on layer 3, heads 1 and 3: hook_o is qed_naive (float64) on the hooked inputs."""
    model = adapt(tiny_hf("qwen3_5_moe"))
    ids = hf_ids(t=12)
    inject_qed(model, torch.tensor([[0.1, 0.25]]), arm="rand", layers=[3], heads=[1, 3], rand_seed=5)
    _, cache = model.run_with_cache(ids)
    assert cache["blocks.3.linear_attn.hook_lambda"].tolist() == pytest.approx([0, 0.1, 0, 0.25])
    assert not cache["blocks.0.linear_attn.hook_lambda"].any()
    x = {n: cache[f"blocks.3.linear_attn.hook_{n}"].double() for n in ("q", "k", "v", "g", "b", "w", "lambda")}
    o, _, probes = qed_naive(x["q"], x["k"], x["v"], x["g"], x["b"], x["w"], x["lambda"], arm="rand",
                             z=random_directions(4, 16, 5 + 3).double(), return_probes=True)
    torch.testing.assert_close(cache["blocks.3.linear_attn.hook_o"].double(), o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache["blocks.3.linear_attn.hook_Sd"].double(), probes["Sd"], rtol=1e-5, atol=1e-5)


@torch.no_grad()
def test_direction_replacement_on_a_transformers_model_is_the_rand_arm():
    model = adapt(tiny_hf("qwen3_5"))
    ids = hf_ids(t=12)
    rand = inject_qed(model, 0.2, arm="rand", layers=[3], rand_seed=4)(ids)
    inject_qed(model, 0.2, arm="full", layers=[3])
    rep = DirectionReplacement(random_directions(4, 16, 4 + 3))
    replaced = model.run_with_hooks(ids, fwd_hooks=rep.fwd_hooks([3], mixer_name=model.mixer_name))
    torch.testing.assert_close(replaced, rand, rtol=0, atol=1e-6)
    assert float((replaced - model(ids)).abs().max()) > 1e-4


def test_strength_phases_in_generate_and_recorders_in_every_step():
    model = inject_qed(adapt(tiny_hf("olmo_hybrid")), 0.1, arm="nogate_noproj")
    seen = []
    record = lambda lam, hook: seen.append(round(float(lam[0]), 6))  # noqa: E731
    rec = ProbeRecorder(model, probes=("e", "rho"), layers=[0, 2])
    with strength(model, 2.0, phase="decode"), model.hooks(fwd_hooks=[("blocks.0.linear_attn.hook_lambda", record)]), \
            rec.attach():
        new = model.generate([[5, 6, 7, 8, 9], [10, 11, 12]], 4, return_type="new_tokens")
    assert [len(t) for t in new] == [4, 4]
    assert sorted(seen) == [0.1, 0.1] + [0.2] * 6  # two prompt lengths: two prefills, 3 decode steps each
    assert rec.stats[("e", 2)].count.tolist() == [5 + 3 + 2 * 3] * 4
    _, cache = model.run_with_cache(hf_ids())  # unprojected arm: e = 1 - beta ||k_hat||^2 - lam rho
    k, b = cache["blocks.0.linear_attn.hook_k"].double(), cache["blocks.0.linear_attn.hook_b"].double()
    k_hat = k / torch.sqrt((k ** 2).sum(-1, keepdim=True) + 1e-6)
    expect = 1 - b * (k_hat ** 2).sum(-1) - 0.1 * cache["blocks.0.linear_attn.hook_rho"].double()
    torch.testing.assert_close(cache["blocks.0.linear_attn.hook_e"].double(), expect, rtol=0, atol=1e-6)


@torch.no_grad()
def test_lambda_scale_given_to_a_call_is_the_strength_block_around_it():
    """``lambda_scale=`` reaches the layers transformers calls, as a ``strength`` block does, and
    replaces the blocks around the call for that call only."""
    model = inject_qed(adapt(tiny_hf("qwen3_5")), 0.2, arm="full")
    ids, prompts = hf_ids(), [[5, 6, 7, 8, 9], [10, 11, 12]]
    base = model(ids)
    scale = LambdaScale.select(model, 0.0, layers=[2], phase="decode")
    with strength(model, 0.0, layers=[2], phase="decode"):
        blocked, new = model(ids), model.generate(prompts, 4, return_type="new_tokens")
    assert torch.equal(model(ids, lambda_scale=scale), blocked)
    assert model.generate(prompts, 4, return_type="new_tokens", lambda_scale=scale) == new
    with strength(model, 0.0):
        torch.testing.assert_close(model(ids, lambda_scale=LambdaScale()), base, rtol=0, atol=0)
        assert float((model(ids) - base).abs().max()) > 1e-4


def test_unsupported_models_and_bad_arguments_are_refused(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    llama = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(UnsupportedModelError, match="type 'llama' is not supported; supported model types: qwen3_5"):
        adapt(llama)
    llama.save_pretrained(tmp_path / "llama")
    with pytest.raises(UnsupportedModelError, match="olmo_hybrid"):
        adapt(tmp_path / "llama")
    with pytest.raises(ValueError, match="not a model folder"):
        adapt(tmp_path / "nowhere")
    assert set(SUPPORTED) >= {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid"}
    hf = tiny_hf("qwen3_5")
    model = adapt(hf)
    with pytest.raises(ValueError, match="adapted already"):
        adapt(hf)
    for kwargs, match in (({"lam": -0.1}, r"in \[0, 0.25\]"), ({"lam": 0.3}, "allow_extrapolation"),
                          ({"lam": torch.zeros(2, 2)}, r"shape \[layers, heads\] = \(3, 4\)"),
                          ({"lam": 0.1, "arm": "qed"}, "`arm` must be one of"),
                          ({"lam": 0.1, "arm": "gdn2"}, "no erase direction"),
                          ({"lam": 0.1, "layers": [1]}, r"`layers` must be .* in \[0, 2, 3\]")):
        with pytest.raises(ValueError, match=match):
            inject_qed(model, **kwargs)
    with pytest.raises(ValueError, match="`model` must be an HFQEDModel"):
        inject_qed(hf, 0.1)
    inject_qed(model, 0.1)
    with pytest.raises(ValueError, match=r"`layers` must be .* in \[0, 2, 3\]"):
        with strength(model, 1.5, layers=[1]):
            pass
    assert model.generate([[3, 4, 5]], 4, do_sample=True, top_k=1) == model.generate([[3, 4, 5]], 4)
    with pytest.raises(ValueError, match="`generator` is not supported"):
        model.generate([[3, 4]], 2, do_sample=True, generator=torch.Generator())
    with pytest.raises(ValueError, match=r"token ids must be ints in \[0, 160\)"):
        model.generate([[3, 400]], 2)
    assert model.detach() is hf
    adapt(hf)  # detached: may be adapted again


ROOT_SCRIPT = """
import importlib.metadata, os, sys
try:
    importlib.metadata.version("kernels")
    installed = True
except importlib.metadata.PackageNotFoundError:
    installed = False
try:
    import kernels
    print("kernels", os.path.dirname(os.path.abspath(kernels.__file__)) != os.path.abspath("kernels"), installed)
except ModuleNotFoundError as err:
    print("missing", str(err) == "No module named 'kernels'", not installed)
try:
    import hooks
    print("hooks", os.path.dirname(os.path.abspath(hooks.__file__)) != os.path.abspath("hooks"))
except ModuleNotFoundError as err:
    print("missing", str(err) == "No module named 'hooks'")
import torch
from transformers import AutoModelForCausalLM, Qwen3_5TextConfig
from qedprobe.hf import adapt
from qedprobe.hooks import ProbeRecorder
from qedprobe.kernels.qed import qed_naive
cfg = Qwen3_5TextConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=1,
                        linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
                        layer_types=["linear_attention", "full_attention"])
model = adapt(AutoModelForCausalLM.from_config(cfg).eval())
print("logits", tuple(model.run_with_cache(torch.tensor([[1, 2, 3]]))[1]["e", 0].shape))
"""


@pytest.mark.parametrize("where", ["root", "elsewhere"])
def test_bare_kernels_import_reaches_the_installed_package_from_any_directory(where, tmp_path):
    """From the repository root (on sys.path, as with ``python -c``), ``import kernels`` is the
    installed package transformers imports (or fails as without qedprobe), ``import hooks``
    likewise; qedprobe and the transformers path work there and from any other directory."""
    import subprocess
    import sys
    from pathlib import Path
    cwd = Path(__file__).resolve().parents[1] if where == "root" else tmp_path
    out = subprocess.run([sys.executable, "-c", ROOT_SCRIPT], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ""}, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [line.split() for line in out.stdout.splitlines()]
    assert lines[0] in (["kernels", "True", "True"], ["missing", "True", "True"])
    assert lines[1] in (["hooks", "True"], ["missing", "True"])
    assert lines[2] == ["logits", "(1,", "3,", "2)"]


def test_a_folder_with_a_tokenizer_gives_the_adapted_model_its_text_methods(tmp_path):
    import shutil

    from qedprobe.tokenizer import HFTokenizer

    tiny_hf("qwen3_5").save_pretrained(tmp_path / "m")
    assert adapt(tmp_path / "m").tokenizer is None
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"checkpoints/interference-full-s0/{name}", tmp_path / "m" / name)
    model, tok = adapt(tmp_path / "m"), HFTokenizer(tmp_path / "m")
    ids = model.to_tokens("apple 7341")
    assert ids.tolist() == [[tok.bos_id] + tok.encode("apple 7341")]
    assert model.to_string(ids[0]) == "apple 7341"


def _offload_map(model, near="cpu", far="disk") -> dict:
    """A ``device_map`` for accelerate: decoder layers 2 and 3 on ``far``, everything else on ``near``."""
    layers = next(n for n, m in model.named_modules() if n.endswith("layers") and isinstance(m, torch.nn.ModuleList))
    placed = {}

    def cover(prefix, module):
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if full == layers:
                placed.update({f"{full}.{i}": far if i >= 2 else near for i in range(len(child))})
            elif layers.startswith(full + "."):
                cover(full, child)
            else:
                placed[full] = near
    cover("", model)
    return placed


@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_device_map_with_disk_offload_equals_one_device(family, tmp_path):
    """A folder loaded with accelerate's device_map (layers 2, 3 offloaded to disk): the native
    run, hooks and probes, inject_qed, strength and generate equal the model on one device. Layers
    that run natively take transformers' PyTorch recurrence in both (on a GPU machine transformers
    5.24 hands these CPU tensors to fla's Triton kernel, which refuses them)."""
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path / "m")
    assert is_transformers_folder(tmp_path / "m")  # what `qedprobe sweep / eig --model` read
    assert folder_config(tmp_path / "m", qed_lambda=0.1).lam == ((0.1,) * 4,) * 3
    one = adapt(hf)
    split = adapt(tmp_path / "m", device_map=_offload_map(hf), offload_folder=tmp_path / "offload")
    assert set(split.hf_model.hf_device_map.values()) == {"cpu", "disk"}
    ids = hf_ids(t=12)
    with hf_torch_reference(hf):
        assert torch.equal(split(ids), one(ids))
        zero_b = [("blocks.3.linear_attn.hook_b", lambda b, hook: torch.zeros_like(b))]
        assert torch.equal(split.run_with_hooks(ids, fwd_hooks=zero_b), one.run_with_hooks(ids, fwd_hooks=zero_b))
        for model in (one, split):
            inject_qed(model, 0.1, arm="full", layers=[2, 3])
        probes = lambda name: name.endswith(("hook_e", "hook_Sd", "hook_lambda"))  # noqa: E731
        (logits, cache), (split_logits, split_cache) = (m.run_with_cache(ids, names_filter=probes)
                                                        for m in (one, split))
        assert torch.equal(split_logits, logits) and len(cache.cache_dict) == 9
        assert all(torch.equal(split_cache[name], cache[name]) for name in cache.cache_dict)
        with strength(one, 2.0, phase="decode"), strength(split, 2.0, phase="decode"):
            assert split.generate([[5, 6, 7, 8]], 6) == one.generate([[5, 6, 7, 8]], 6)


def _max_diff(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


def _paths(hf, model, ids) -> dict:
    """Logits of a forward and of 16 greedy steps, with their tokens, on three paths: the
    reference (transformers' PyTorch recurrence), the model's default (fla's kernels where fla
    is installed; the adapted model with nothing hooked runs it too) and qedprobe's op."""
    def run(hooks):
        with model.hooks(fwd_hooks=hooks):
            logits = hf(ids, use_cache=False).logits
            gen = hf.generate(ids, max_new_tokens=NEW, do_sample=False, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        return logits, torch.stack(gen.logits, 1), gen.sequences[0, ids.shape[1]:].tolist()
    with hf_torch_reference(hf):
        torch_path = run([])
    return {"torch": torch_path, "default": run([]), "ours": run(OP_PATH)}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the Triton path (qed_chunk, qed_recurrent)")
@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_gpu_lambda_zero_matches_transformers_at_4096_tokens(family):
    """On CUDA, T = 4096, float32: qedprobe's Triton prefill and decode against transformers'
    PyTorch recurrence, for a forward and 16 greedy steps: as close as the model's own default
    path (fla's kernels) is, or within 1e-4 of the logits' scale; greedy tokens agree wherever
    the default path's do. With nothing hooked the adapted model is the default path."""
    hf = tiny_hf(family).cuda()
    model = adapt(hf)
    ids = torch.randint(2, HF_VOCAB, (1, 4096), generator=torch.Generator().manual_seed(0)).cuda()
    paths = _paths(hf, model, ids)
    ref_logits, ref_steps, ref_tokens = paths["torch"]
    for part, ref in ((0, ref_logits), (1, ref_steps)):
        bound = max(2 * _max_diff(paths["default"][part], ref), 1e-4 * float(ref.abs().max()))
        assert _max_diff(paths["ours"][part], ref) <= bound, (family, part)
    agree = next((i for i, (a, b) in enumerate(zip(paths["default"][2], ref_tokens)) if a != b), NEW)
    assert paths["ours"][2][:agree] == ref_tokens[:agree]
    assert torch.equal(model(ids), hf(ids, use_cache=False).logits)  # free when off: the default path itself


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: host synchronisations are CUDA's")
@torch.no_grad()
def test_gpu_injected_hooked_model_never_waits_for_the_gpu_in_qedprobe():
    """Adapted and injected on cuda:0 with ``hook_e`` and ``hook_Sd`` hooked: the recurrences'
    buffers are on the GPU from adaptation, and a prefill with a cache and two decode steps make no
    host synchronisation in qedprobe's code (torch's sync debug mode; a wait per layer stalls a
    launch-bound decode step)."""
    model = inject_qed(adapt(tiny_hf("qwen3_5").cuda()), 0.1)
    assert {model.recurrence(l).lam.device.type for l in model.mixer_layers} == {"cuda"}
    ids = hf_ids(t=64).cuda()
    hooked = [(lambda name: name.endswith(("hook_e", "hook_Sd")), lambda act, hook: None)]
    with model.hooks(fwd_hooks=hooked), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = model.hf_model(ids, use_cache=True)
            for _ in range(2):
                out = model.hf_model(out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values, use_cache=True)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    waits = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message).lower()]
    assert not [w for w in waits if "qedprobe" in w], waits


@torch.no_grad()
def test_transformerlens_forward_conventions_on_the_adapted_model():
    """return_type "loss" / "both" / None (also through run_with_cache), a right-padded mask
    leaving the pads out of the loss, and what an adapted model cannot do refused by name."""
    model = inject_qed(adapt(tiny_hf("qwen3_5")), 0.1)
    ids = hf_ids(t=10)
    logits = model(ids)
    logp = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]
    loss, cache = model.run_with_cache(ids, return_type="loss")
    torch.testing.assert_close(loss, -logp.mean())
    assert cache["e", 0].shape == (2, 10, 4)
    both_logits, per_token = model(ids, return_type="both", loss_per_token=True)
    assert torch.equal(both_logits, logits) and torch.equal(per_token, -logp) and model(ids, return_type=None) is None
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    torch.testing.assert_close(model(ids, "loss", attention_mask=mask), -(logp[0].sum() + logp[1, :5].sum()) / 14)
    for kwargs, match in (({"stop_at_layer": 1}, "`stop_at_layer` is not supported"),
                          ({"start_at_layer": 1}, "`start_at_layer` is not supported"),
                          ({"return_type": "probs"}, "`return_type` must be one of"),
                          ({"attention_mask": mask.flip(1)}, "^HFQEDModel: `attention_mask` must pad on the right")):
        with pytest.raises(ValueError, match=match):
            model(ids, **kwargs)
    with pytest.raises(ValueError, match="^HFQEDModel: the loss needs at least 2 tokens"):
        model(ids[:, :1], return_type="loss")
    with pytest.raises(ValueError, match="tokenizer"):
        model.to_tokens("no tokenizer here")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a device_map over cuda:0 and the CPU")
@pytest.mark.parametrize("family", HF_FAMILIES)
@torch.no_grad()
def test_gpu_device_map_cuda_and_cpu_equals_one_device(family, tmp_path):
    """Layers 2 and 3 offloaded to the CPU, the rest on cuda:0: injected QED, probes, strength
    and generate as on the model wholly on cuda:0."""
    hf = tiny_hf(family)
    hf.save_pretrained(tmp_path / "m")
    one = inject_qed(adapt(hf.cuda()), 0.1, layers=[2, 3])
    split = inject_qed(adapt(tmp_path / "m", device_map=_offload_map(hf, near=0, far="cpu")), 0.1, layers=[2, 3])
    assert set(split.hf_model.hf_device_map.values()) == {0, "cpu"}
    ids = hf_ids(t=64).cuda()
    names = lambda name: name.endswith(("hook_e", "hook_Sd"))  # noqa: E731
    (logits, cache), (split_logits, split_cache) = (m.run_with_cache(ids, names_filter=names) for m in (one, split))
    torch.testing.assert_close(split_logits, logits, rtol=1e-4, atol=1e-4)
    for name in cache.cache_dict:
        torch.testing.assert_close(split_cache[name].cpu(), cache[name].cpu(), rtol=1e-4, atol=1e-4)
    with strength(one, 2.0), strength(split, 2.0):
        assert split.generate([[5, 6, 7, 8]], 6) == one.generate([[5, 6, 7, 8]], 6)
