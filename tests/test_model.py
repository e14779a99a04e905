"""The hooked QED model: hooks, strength, generation, bad input."""
import pytest
import torch

pytest.importorskip("transformer_lens", reason="the hooked model needs transformer-lens")

from qedprobe.kernels.qed import PROJECTED_ARMS, l2_normalize
from qedprobe.model import LambdaScale, QEDModel, strength
from qedprobe.model import decode_step as decode_step_module
from qedprobe.model import recurrence as recurrence_module
from qedprobe.model.strength import active_lambda_scale

from helpers import ids, tiny


@pytest.fixture(scope="module")
def model():
    return tiny()


# --- hooks ---------------------------------------------------------------------------------

def test_hook_names_and_shapes(model):
    B, T, H, K, V, D = 2, 11, 2, 16, 16, 64
    logits, cache = model.run_with_cache(ids(B, T))
    assert logits.shape == (B, T, 97)
    shapes = {"hook_embed": (B, T, D)}
    for l in range(2):
        for n in ("resid_pre", "resid_mid", "resid_post", "attn_out", "mlp_out"):
            shapes[f"blocks.{l}.hook_{n}"] = (B, T, D)
        a = f"blocks.{l}.attn.hook_"
        shapes.update({a + "rho": (B, T, H), a + "e": (B, T, H), a + "lambda": (H,)})
        shapes.update({a + n: (B, T, H, K) for n in ("q", "k", "b", "g", "d")})
        shapes.update({a + n: (B, T, H, V) for n in ("v", "w", "Sd", "o")})
        shapes.update({f"blocks.{l}.attn_norm.hook_scale": (B, T, 1), f"blocks.{l}.mlp_norm.hook_scale": (B, T, 1),
                       f"blocks.{l}.attn.o_norm.hook_scale": (B, T, H, 1)})
    shapes["norm.hook_scale"] = (B, T, 1)
    assert {k: tuple(v.shape) for k, v in cache.items()} == shapes
    assert cache["resid_post", 1].shape == (B, T, D)  # ActivationCache lookups work
    # residual bookkeeping is real: resid_mid = resid_pre + attn_out
    torch.testing.assert_close(cache["blocks.0.hook_resid_mid"],
                               cache["blocks.0.hook_resid_pre"] + cache["blocks.0.hook_attn_out"])
    # probes agree with their definitions on the cached inputs (q, k before L2 normalisation)
    q, k, b = (l2_normalize(cache[f"blocks.1.attn.hook_{n}"]) if n != "b" else cache["blocks.1.attn.hook_b"]
               for n in ("q", "k", "b"))
    lam = cache["blocks.1.attn.hook_lambda"]
    torch.testing.assert_close(cache["blocks.1.attn.hook_rho"], (q * k).sum(-1))
    a = b * k + lam[:, None] * cache["blocks.1.attn.hook_d"]
    torch.testing.assert_close(cache["blocks.1.attn.hook_e"], 1 - (a * k).sum(-1))
    torch.testing.assert_close(lam, 0.25 * torch.sigmoid(model.blocks[1].attn.theta.detach()))


def test_pos_slice_cuts_the_position_axis(model):
    x = ids()
    _, full = model.run_with_cache(x)
    _, last = model.run_with_cache(x, pos_slice=-1)
    for name in ("blocks.0.attn.hook_b", "blocks.0.attn.hook_Sd", "blocks.0.attn.hook_rho", "hook_embed"):
        assert torch.equal(last[name], full[name][:, -1:])  # TransformerLens keeps the axis
    assert torch.equal(last["blocks.0.attn.hook_lambda"], full["blocks.0.attn.hook_lambda"])
    _, one = model.run_with_cache(x[:1], pos_slice=(2, 5), remove_batch_dim=True)
    assert torch.equal(one["blocks.1.attn.hook_e"], full["blocks.1.attn.hook_e"][0, 2:5])


def test_probes_requested_only_when_hooked(model, monkeypatch):
    asked = []
    real = recurrence_module.qed_attention

    def spy(*args, **kw):
        asked.append((kw["return_probes"], kw["d"] is not None))
        return real(*args, **kw)

    monkeypatch.setattr(recurrence_module, "qed_attention", spy)
    x = ids()
    plain = model(x)
    assert asked == [((), False)] * 2
    asked.clear()
    model.run_with_cache(x, names_filter="blocks.1.attn.hook_e")
    assert asked == [((), False), (("e",), False)]  # only the hooked probe is asked for
    asked.clear()
    model.run_with_cache(x, names_filter=["blocks.0.attn.hook_Sd", "blocks.0.attn.hook_rho"])
    assert asked == [(("rho", "Sd"), False), ((), False)]
    asked.clear()
    hooked = model.run_with_hooks(x, fwd_hooks=[("blocks.0.attn.hook_d", lambda d, hook: None)])
    assert asked == [((), True), ((), False)]
    torch.testing.assert_close(hooked, plain)  # passing the arm's own d changes nothing


def test_writable_hooks_reach_the_kernel(model):
    x = ids()
    base = model(x)
    zero_d = model.run_with_hooks(x, fwd_hooks=[(lambda n: n.endswith("hook_d"), lambda d, hook: d * 0)])
    zero_lam = model.run_with_hooks(x, fwd_hooks=[(lambda n: n.endswith("hook_lambda"), lambda l, hook: l * 0)])
    torch.testing.assert_close(zero_d, zero_lam, rtol=0, atol=1e-6)
    assert (zero_d - base).abs().max() > 1e-4
    # per-token lambda [B, T, H] is accepted, and equal per-token values match the [H] result
    lam_btH = lambda l, hook: l.expand(x.shape[0], x.shape[1], -1) * 1.0  # noqa: E731
    torch.testing.assert_close(model.run_with_hooks(x, fwd_hooks=[("blocks.0.attn.hook_lambda", lam_btH)]), base)
    # a changed v changes the output of that layer only from there on
    _, cache = model.run_with_cache(x)
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_v", lambda v, hook: v * 2)]):
        _, hcache = model.run_with_cache(x)
    torch.testing.assert_close(hcache["blocks.1.hook_resid_pre"], cache["blocks.1.hook_resid_pre"])
    assert (hcache["blocks.1.hook_attn_out"] - cache["blocks.1.hook_attn_out"]).abs().max() > 1e-4


@pytest.mark.parametrize("name", ["rho", "Sd", "e"])
def test_read_only_probes_refuse_changes(model, name):
    x = ids()
    model.run_with_hooks(x, fwd_hooks=[(f"blocks.0.attn.hook_{name}", lambda t, hook: t)])  # unchanged: fine
    with pytest.raises(ValueError, match=f"hook_{name}` is read-only"):
        model.run_with_hooks(x, fwd_hooks=[(f"blocks.0.attn.hook_{name}", lambda t, hook: t + 1)])


def test_writable_hook_with_wrong_shape_is_refused(model):
    with pytest.raises(ValueError, match=r"hook_lambda` must return a tensor of shape \(2,\) or \(2, 11, 2\)"):
        model.run_with_hooks(ids(), fwd_hooks=[("blocks.0.attn.hook_lambda", lambda l, hook: l[:1])])
    with pytest.raises(ValueError, match="hook_q` must return"):
        model.run_with_hooks(ids(), fwd_hooks=[("blocks.0.attn.hook_q", lambda q, hook: q[..., :8])])
    assert not any(hp.has_hooks() for hp in model.hook_points())  # hooks removed after errors


# --- strength ------------------------------------------------------------------------------

def test_strength_one_is_identity_and_zero_equals_zeroed_lambda(model):
    x = ids()
    base = model(x)
    with strength(model, 1):
        assert torch.equal(model(x), base)
    with strength(model, 0.0):
        s0 = model(x)
    zeroed = model.run_with_hooks(x, fwd_hooks=[(lambda n: n.endswith("hook_lambda"), lambda l, hook: l * 0)])
    assert torch.equal(s0, zeroed)
    assert (s0 - base).abs().max() > 1e-4
    assert torch.equal(model(x), base)  # restored


def test_strength_selection_touches_only_selected_heads(model):
    x = ids()
    names = lambda n: n.endswith("hook_lambda") or n.endswith("hook_resid_post")  # noqa: E731
    _, base = model.run_with_cache(x, names_filter=names)
    with strength(model, 1.5, layers=[1], heads=[0]):
        _, sel = model.run_with_cache(x, names_filter=names)
    lam0, lam1 = base["blocks.0.attn.hook_lambda"], base["blocks.1.attn.hook_lambda"]
    assert torch.equal(sel["blocks.0.attn.hook_lambda"], lam0)
    torch.testing.assert_close(sel["blocks.1.attn.hook_lambda"], lam1 * torch.tensor([1.5, 1.0]))
    assert torch.equal(sel["blocks.0.hook_resid_post"], base["blocks.0.hook_resid_post"])
    assert (sel["blocks.1.hook_resid_post"] - base["blocks.1.hook_resid_post"]).abs().max() > 1e-5
    # a tensor over layers x heads
    s = torch.tensor([[0.5, 2.0], [-1.0, 1.0]])
    with strength(model, s):
        _, full = model.run_with_cache(x, names_filter=names)
    torch.testing.assert_close(full["blocks.0.attn.hook_lambda"], lam0 * s[0])
    with strength(model, s[1:], layers=1):
        _, one = model.run_with_cache(x, names_filter=names)
    torch.testing.assert_close(one["blocks.1.attn.hook_lambda"], lam1 * s[1])


def test_strength_nesting_and_exceptions_restore(model):
    x = ids()
    base = model(x)
    with strength(model, 2.0):
        with strength(model, 0.5):
            torch.testing.assert_close(model(x), base)  # factors multiply
        with strength(model, 0.0):
            inner = model(x)
    with strength(model, 0.0):
        torch.testing.assert_close(model(x), inner)
    with pytest.raises(RuntimeError, match="boom"):
        with strength(model, 0.0):
            raise RuntimeError("boom")
    assert active_lambda_scale(model).factors == ()
    assert torch.equal(model(x), base)


def test_lambda_scale_passed_to_a_call_is_the_strength_block_around_it(model):
    """``LambdaScale.select`` checks and builds what a ``strength`` block applies; given to a call
    it is that call's strength (the blocks around it are not applied), and a block in another
    thread does not reach this one's calls."""
    import threading
    x = ids()
    base, scale = model(x), LambdaScale.select(model, 0.0, layers=[1], phase="prefill")
    with strength(model, 0.0, layers=[1], phase="prefill"):
        blocked, gen = model(x), model.generate(x, 4)
    assert (blocked - base).abs().max() > 1e-4
    assert torch.equal(model(x, lambda_scale=scale), blocked) and torch.equal(model.generate(x, 4, lambda_scale=scale), gen)
    with strength(model, 2.0):
        assert torch.equal(model(x, lambda_scale=LambdaScale()), base)
    seen = []
    with strength(model, 0.0):
        thread = threading.Thread(target=lambda: seen.append(model(x)))
        thread.start()
        thread.join()
    assert torch.equal(seen[0], base)
    with pytest.raises(ValueError, match="tested range"):
        LambdaScale.select(model, 3.0)


def test_lambda_scale_copies_each_factor_to_a_device_once(model):
    """The factors of a phase, multiplied, on the device asked for; each factor is copied there
    once (a transformers model asks in every layer at every decode step, and a copy from host
    memory at each would wait for the device)."""
    scale = LambdaScale(LambdaScale.select(model, 0.5, layers=[1]).factors
                        + LambdaScale.select(model, 2.0, heads=[0], phase="decode").factors)
    decode, prefill = scale.for_phase("decode"), scale.for_phase("prefill")
    expect = torch.ones_like(decode)
    expect[1] = 0.5
    assert torch.equal(prefill, expect)
    expect[:, 0] *= 2.0
    assert torch.equal(decode, expect) and decode.device.type == "cpu"
    first = [f.on("meta") for f in scale.factors]
    assert all(a is f.on(torch.device("meta")) for a, f in zip(first, scale.factors))
    assert scale.for_phase("decode", "meta").device.type == "meta" and scale.for_phase("decode", "meta").shape == decode.shape
    assert LambdaScale().for_phase("decode", "meta") is None


@pytest.mark.parametrize("arm", PROJECTED_ARMS + ("nogate_noproj", "noproj"))
def test_projected_arms_eigenvalue_is_independent_of_strength(arm):
    m = tiny(arm)
    x = ids()
    es = []
    for s in (0.0, 1.0, 2.0):
        with strength(m, s, layers=[1]):
            _, cache = m.run_with_cache(x, names_filter="blocks.1.attn.hook_e")
        es.append(cache["blocks.1.attn.hook_e"])
    change = max((e - es[0]).abs().max().item() for e in es)
    if arm in PROJECTED_ARMS:
        # not exactly 0: the l2norm's eps (1e-6) leaves ||k_hat||^2 = 1 - 1e-6/||k||^2 (~1e-4 here)
        assert change < 2e-5
    else:
        assert change > 1e-2  # without the projection, e moves with lambda


def test_strength_decode_phase_leaves_prefill_untouched(model):
    x = ids()
    logits, states = model.forward_with_state(x, want_state=True)
    step = torch.tensor([[3], [5]])
    dec, _ = model.forward_with_state(step, states=states, phase="decode", want_state=True)
    with strength(model, 0.0, phase="decode"):
        assert torch.equal(model(x), logits)
        dec0, _ = model.forward_with_state(step, states=states, phase="decode", want_state=True)
    assert (dec0 - dec).abs().max() > 1e-4
    with strength(model, 0.0, phase="prefill"):
        assert (model(x) - logits).abs().max() > 1e-4
        dec_p, _ = model.forward_with_state(step, states=states, phase="decode", want_state=True)
    assert torch.equal(dec_p, dec)


@pytest.mark.parametrize("kwargs, match", [
    (dict(s=2.5), r"must lie in \[-1.0, 2.0\]"),
    (dict(s=-1.01), "allow_extrapolation"),
    (dict(s=float("nan")), "finite"),
    (dict(s="1"), "must be a float or a tensor"),
    (dict(s=True), "must be a float or a tensor"),
    (dict(s=torch.ones(3, 2)), r"shape \[layers, heads\] = \(2, 2\)"),
    (dict(s=torch.ones(2, 2), layers=[0]), r"= \(1, 2\)"),
    (dict(s=1.0, phase="train"), "`phase` must be one of"),
    (dict(s=1.0, layers=[2]), r"`layers` must be a non-empty list of ints in \[0, 2\)"),
    (dict(s=1.0, layers=[]), "`layers`"),
    (dict(s=1.0, heads=[0, 0]), "repeated"),
    (dict(s=1.0, heads=[-1]), "`heads`"),
    (dict(s=1.0, heads=0.5), "`heads`"),
])
def test_strength_bad_input(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        with strength(model, **kwargs):
            pass
    assert active_lambda_scale(model).factors == ()


def test_strength_extrapolation_allowed_and_non_model_refused(model):
    with strength(model, 3.0, allow_extrapolation=True):
        _, c = model.run_with_cache(ids(), names_filter="blocks.0.attn.hook_lambda")
    torch.testing.assert_close(c["blocks.0.attn.hook_lambda"], 3 * model.blocks[0].attn.lam().detach())
    with pytest.raises(ValueError, match="`model` must be a QEDModel"):
        with strength(torch.nn.Linear(2, 2), 1.0):
            pass


# --- generation ----------------------------------------------------------------------------

def greedy_by_forward(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(int(model(torch.tensor([seq]))[0, -1].argmax()))
    return seq[len(prompt):]


def test_greedy_generate_matches_repeated_forward_under_strength(model):
    prompts = [[5, 17, 33, 2, 8, 61, 90], [44], [7, 7, 12]]
    with strength(model, 1.5):
        out = model.generate(prompts, 6, return_type="new_tokens")
        expected = [greedy_by_forward(model, p, 6) for p in prompts]
    assert out == expected
    assert out != [greedy_by_forward(model, p, 6) for p in prompts]  # strength 1.5 matters here
    with strength(model, 1.5):
        from_tensor = model.generate(torch.tensor([prompts[0], prompts[0]]), 6)
    assert torch.equal(from_tensor, torch.tensor([prompts[0] + expected[0]] * 2))


def test_packed_prefill_respects_sequence_bounds(model):
    a, b = ids(1, 9, seed=4), ids(1, 5, seed=5)
    packed, _ = model.forward_with_state(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 9, 14]))
    torch.testing.assert_close(packed[:, :9], model(a))
    torch.testing.assert_close(packed[:, 9:], model(b))


def test_wide_convolution_decodes_and_packs_like_the_full_forward():
    """conv_size 8 (the convolution reaches 7 tokens back): the decode cache carries 7 inputs and a
    packed row keeps each sequence's window to itself."""
    wide = tiny(conv_size=8)
    prompt = [5, 17, 33, 2, 8, 61, 90, 3, 9, 40]
    assert wide.generate([prompt], 8, return_type="new_tokens") == [greedy_by_forward(wide, prompt, 8)]
    a, b = ids(1, 12, seed=6), ids(1, 10, seed=7)
    packed, _ = wide.forward_with_state(torch.cat([a, b], 1), cu_seqlens=torch.tensor([0, 12, 22]))
    torch.testing.assert_close(packed[:, 12:], wide(b))
    assert not torch.allclose(wide(torch.cat([a, b], 1))[:, 12:], wide(b), atol=1e-3)  # unpacked, a reaches b


@pytest.mark.parametrize("phase, prefill_s, decode_s", [("decode", 1.0, 0.5), ("prefill", 0.5, 1.0),
                                                      ("all", 0.5, 0.5)])
def test_generate_applies_strength_to_its_phase(model, phase, prefill_s, decode_s):
    seen = []
    with model.hooks(fwd_hooks=[("blocks.1.attn.hook_lambda", lambda lam, hook: seen.append(lam.clone()))]):
        with strength(model, 0.5, phase=phase):
            model.generate([[1, 2, 3, 4], [9, 8]], 4)
    base = model.blocks[1].attn.lam().detach()
    assert len(seen) == 5  # one prefill per prompt length + three decode steps
    for lam in seen[:2]:
        torch.testing.assert_close(lam, prefill_s * base)
    for lam in seen[2:]:
        torch.testing.assert_close(lam, decode_s * base)


def test_generate_stop_check_read_late_gives_the_same_tokens(model, monkeypatch):
    """The graph step's schedule (a stop check every few steps, each read at the next check) on
    the eager step: the same tokens as reading each check at once, after one more round of steps."""
    prompts = [[5, 17, 33], [44, 3], [7]]
    free = model.generate(prompts, 12, return_type="new_tokens")
    eos = [free[0][1], free[1][2], free[2][0]]
    at_once = model.generate(prompts, 12, eos_token_id=eos)
    monkeypatch.setattr(decode_step_module._EagerStep, "stop_check_every", 2)
    calls = {}
    for late in (False, True):
        monkeypatch.setattr(decode_step_module._EagerStep, "stop_read_late", late)
        seen = []
        with model.hooks(fwd_hooks=[("blocks.0.attn.hook_lambda", lambda lam, hook: seen.append(lam))]):
            assert model.generate(prompts, 12, eos_token_id=eos) == at_once
        calls[late] = len(seen)
    assert calls[True] == calls[False] + 2  # the late read costs one more round of two steps


def test_generate_eos_and_sampling(model):
    prompts = [[5, 17, 33], [44, 3]]
    greedy = model.generate(prompts, 5, return_type="new_tokens")
    eos = greedy[0][1]
    out = model.generate(prompts, 5, eos_token_id=eos, return_type="new_tokens")
    cut = greedy[0].index(eos) + 1
    assert out[0] == greedy[0][:cut]
    assert out[1] == (greedy[1][:greedy[1].index(eos) + 1] if eos in greedy[1] else greedy[1])
    assert model.generate(prompts, 0, return_type="new_tokens") == [[], []]
    assert model.generate(prompts, 0) == prompts
    assert model.generate(prompts, 5, do_sample=True, top_k=1, return_type="new_tokens") == greedy
    s1 = model.generate(prompts, 5, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(0))
    s2 = model.generate(prompts, 5, do_sample=True, temperature=2.0, generator=torch.Generator().manual_seed(0))
    assert s1 == s2 and [len(s) for s in s1] == [3 + 5, 2 + 5]


@pytest.mark.parametrize("args, kwargs, match", [
    (([],), {}, "`prompts` must be"),
    (([[1], []],), {}, "non-empty lists"),
    (([[1, 97]],), {}, r"token ids must be ints in \[0, 97\)"),
    (([[1]],), {"max_new_tokens": -1}, "`max_new_tokens`"),
    (([[1]],), {"eos_token_id": 97}, "`eos_token_id`"),
    (([[1]],), {"eos_token_id": [3, -1]}, "`eos_token_id`"),
    (([[1]],), {"eos_token_id": 2.0}, "`eos_token_id`"),
    (([[1]],), {"temperature": 0.0, "do_sample": True}, "`temperature`"),
    (([[1]],), {"top_k": 0, "do_sample": True}, "`top_k`"),
    (([[1]],), {"top_p": 0.0, "do_sample": True}, "`top_p`"),
    (([[1]],), {"top_p": 1.5, "do_sample": True}, "`top_p`"),
    (([[1]],), {"generator": 3, "do_sample": True}, "`generator`"),
    (([[1]],), {"top_p": 0.9}, "`top_p` act only when sampling"),
    (([[1]],), {"temperature": 0.7, "top_k": 3}, "`temperature`, `top_k` act only when sampling"),
    (([[1]],), {"return_type": "str"}, "`return_type`"),
    (([[1]],), {"stop_at_eos": 1}, "`stop_at_eos`"),
    (([[1]],), {"pad_token_id": "x"}, "`pad_token_id`"),
    (("some text",), {}, "no tokenizer"),
    ((torch.ones(2, 3),), {}, "integer tensor"),
    ((torch.ones(2, 3, 4, dtype=torch.long),), {}, "integer tensor"),
])
def test_generate_bad_input(model, args, kwargs, match):
    kwargs = {"max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        model.generate(*args, **kwargs)


@pytest.mark.parametrize("bad", [torch.ones(2, 3), torch.tensor([1, 2]), torch.tensor([[1, 97]]),
                                 torch.tensor([[-1, 2]]), torch.zeros(1, 0, dtype=torch.long)])
def test_forward_bad_ids(model, bad):
    with pytest.raises(ValueError, match="QEDModel"):
        model(bad)


@pytest.mark.parametrize("op_mode", ["chunk", "recurrent"])
def test_triton_kernels_give_the_reference_cache(model, op_mode):
    """The model through qedprobe's Triton kernels (the interpreter on CPU): same cache, incl.
    probes, given d and packed sequences."""
    import dataclasses
    fast = QEDModel(dataclasses.replace(model.cfg, op_mode=op_mode))
    fast.load_state_dict(model.state_dict())
    x = ids()
    with torch.no_grad():
        _, ref = model.run_with_cache(x)
        _, got = fast.run_with_cache(x)
        for name in ref:
            torch.testing.assert_close(got[name], ref[name], rtol=1e-4, atol=1e-5)
        cu = torch.tensor([0, 4, 11])
        packed = fast.forward_with_state(x[:1], cu_seqlens=cu)[0]
        torch.testing.assert_close(packed, model.forward_with_state(x[:1], cu_seqlens=cu)[0], rtol=1e-4, atol=1e-5)


def test_strength_other_than_one_on_a_gdn2_model_is_refused():
    from qedprobe.model import QEDConfig, QEDModel, strength

    model = QEDModel(QEDConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_heads=2, head_dim=16,
                               arm="gdn2"))
    with strength(model, 1.0):
        pass
    with pytest.raises(ValueError, match="gdn2"):
        with strength(model, 0.5):
            pass
