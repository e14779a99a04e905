"""The conventions TransformerLens and Hugging Face users expect: ``generate``'s calling convention,
hooks inside ``generate`` seeing one row per prompt, ``forward(return_type="loss")`` and the
``ActivationCache`` helpers (checked against exact identities, transformers' own warpers and
autograd)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformer_lens", reason="the hooked model needs transformer-lens")

from qedprobe.model.generate import DEFAULT_MAX_NEW_TOKENS, filter_logits

from helpers import ids, tiny

PROMPTS = [[5, 17, 33], [44, 3], [7, 7, 12]]


@pytest.fixture(scope="module")
def model():
    return tiny()


# --- generate ------------------------------------------------------------------------------

def test_tensor_in_gives_tensor_out_with_the_prompt(model):
    x = torch.tensor([PROMPTS[0], PROMPTS[2]])
    full = model.generate(x, 6)
    new = model.generate(x, 6, return_type="new_tokens")
    assert isinstance(full, torch.Tensor) and full.dtype == torch.long and full.shape == (2, 3 + 6)
    assert torch.equal(full[:, :3], x)
    assert full[:, 3:].tolist() == new
    one = model.generate(x[1], 6)  # a 1-D prompt gives a 1-D result
    assert one.shape == (9,) and torch.equal(one, full[1])
    assert model.generate(x).shape == (2, 3 + DEFAULT_MAX_NEW_TOKENS)
    assert model.generate(PROMPTS, 4) == [p + n for p, n in zip(PROMPTS, model.generate(PROMPTS, 4, return_type="new_tokens"))]


def test_eos_as_a_list_stops_each_prompt_and_pads_the_tensor(model):
    x = torch.tensor([PROMPTS[0], PROMPTS[2]])
    free = model.generate(x, 8, return_type="new_tokens")
    eos = [free[0][1], free[1][3]]

    def until_eos(row):
        return row[:next((i for i, t in enumerate(row) if t in eos), len(row) - 1) + 1]

    new = model.generate(x, 8, eos_token_id=eos, return_type="new_tokens")
    assert new == [until_eos(r) for r in free] and len(new[0]) <= 2 and len(new[1]) <= 4
    full = model.generate(x, 8, eos_token_id=eos, pad_token_id=0)
    assert full.shape == (2, 3 + max(len(n) for n in new))
    for row, n in zip(full.tolist(), new):
        assert row[3:3 + len(n)] == n and set(row[3 + len(n):]) <= {0}
    padded_with_eos = model.generate(x, 8, eos_token_id=eos)
    assert set(padded_with_eos[0, 3 + len(new[0]):].tolist()) <= {eos[0]}
    assert model.generate(x, 8, eos_token_id=eos, stop_at_eos=False, return_type="new_tokens") == free


def test_top_k_and_top_p_filter_as_transformers_does():
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3
    for top_p in (0.05, 0.3, 0.9, 0.999):
        ours = filter_logits(logits, None, top_p)
        assert torch.equal(ours, TopPLogitsWarper(top_p)(None, logits.clone()))
    for top_k in (1, 7, 49):
        assert torch.equal(filter_logits(logits, top_k, None), TopKLogitsWarper(top_k)(None, logits.clone()))
    both = TopPLogitsWarper(0.5)(None, TopKLogitsWarper(10)(None, logits.clone()))
    assert torch.equal(filter_logits(logits, 10, 0.5), both)


def test_top_p_sampling_draws_only_from_the_nucleus(model):
    gen = torch.Generator().manual_seed(0)
    tiny_p = model.generate(PROMPTS, 5, do_sample=True, top_p=1e-6, generator=gen, return_type="new_tokens")
    assert tiny_p == model.generate(PROMPTS, 5, return_type="new_tokens")  # nucleus of one: greedy


# --- hooks inside generate see one row per prompt -----------------------------------------------

def _record(model, names, run):
    seen = {n: [] for n in names}
    hooks = [(n, lambda x, hook: seen[hook.name].append(x.detach().clone())) for n in names]
    with model.hooks(fwd_hooks=hooks):
        out = run()
    return out, seen


def test_prefill_hooks_see_each_prompt_as_in_a_one_prompt_run(model):
    names = ["blocks.1.attn.hook_e", "blocks.0.hook_resid_post", "blocks.1.attn.hook_Sd"]
    out, seen = _record(model, names, lambda: model.generate(PROMPTS, 3, return_type="new_tokens"))
    assert out == model.generate(PROMPTS, 3, return_type="new_tokens")  # hooked == packed
    e = seen["blocks.1.attn.hook_e"]
    assert [tuple(t.shape) for t in e] == [(2, 3, 2), (1, 2, 2), (3, 1, 2), (3, 1, 2)]  # lengths 3, 2; 2 steps
    rows = {0: (0, 0), 2: (0, 1), 1: (1, 0)}  # prompt -> (prefill call, row)
    for name in names:
        for p, (call, row) in rows.items():
            _, cache = model.run_with_cache(torch.tensor([PROMPTS[p]]), names_filter=name)
            # float32 GEMMs of 2 rows and of 1 row may block the sums differently (2.6e-6 seen on
            # residuals of about 2); another prompt's row differs by 4e-3 or more in every hook
            torch.testing.assert_close(seen[name][call][row], cache[name][0], rtol=1e-5, atol=1e-5)


def test_writable_hooks_inside_generate_act_per_prompt(model):
    from qedprobe.hooks import zero_direction

    with model.hooks(fwd_hooks=[("blocks.0.attn.hook_d", zero_direction)]):
        ragged = model.generate(PROMPTS, 4, return_type="new_tokens")
        alone = [model.generate([p], 4, return_type="new_tokens")[0] for p in PROMPTS]
    assert ragged == alone
    assert ragged != model.generate(PROMPTS, 4, return_type="new_tokens")  # the hook matters here


# --- forward and the ActivationCache ---------------------------------------------------------

def test_forward_loss_is_next_token_cross_entropy(model):
    x = ids(2, 9)
    logits, loss = model(x, return_type="both")
    ref = F.cross_entropy(logits[:, :-1].reshape(-1, 97), x[:, 1:].reshape(-1))
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(model(x, return_type="loss"), ref)
    per = model(x, return_type="loss", loss_per_token=True)
    assert per.shape == (2, 8) and torch.allclose(per.mean(), ref)
    assert model(x, return_type=None) is None
    with pytest.raises(ValueError, match="`return_type`"):
        model(x, return_type="str")
    with pytest.raises(ValueError, match="at least 2 tokens"):
        model(x[:, :1], return_type="loss")


def test_run_with_cache_backward_on_the_loss_caches_gradients(model):
    x = ids(2, 9)
    loss, cache = model.run_with_cache(x, return_type="loss", incl_bwd=True)
    model.zero_grad()
    resid = {}
    with model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda t, hook: resid.setdefault("x", t))]):
        ref_loss = model(x, return_type="loss")
    (grad,) = torch.autograd.grad(ref_loss, resid["x"])
    torch.testing.assert_close(cache["blocks.0.hook_resid_post_grad"], grad)
    assert cache["blocks.1.attn.hook_o_grad"].abs().sum() > 0
    model.zero_grad()


def test_cache_shorthand_reaches_the_mixer_probes(model):
    _, cache = model.run_with_cache(ids(2, 9))
    assert torch.equal(cache["e", 0], cache["blocks.0.attn.hook_e"])
    assert torch.equal(cache["e", -1], cache["blocks.1.attn.hook_e"])
    assert torch.equal(cache["e", 1, "attn"], cache["blocks.1.attn.hook_e"])
    assert torch.equal(cache["lambda", 1], cache["blocks.1.attn.hook_lambda"])
    assert torch.equal(cache["Sd", 0], cache["blocks.0.attn.hook_Sd"])
    assert torch.equal(cache["sd", 0], cache["blocks.0.attn.hook_Sd"])
    assert torch.equal(cache["q", 0], cache["blocks.0.attn.hook_q"])
    assert torch.equal(cache["scale", 1, "ln2"], cache["blocks.1.mlp_norm.hook_scale"])
    assert torch.equal(cache.stack_activation("e"), torch.stack([cache["e", 0], cache["e", 1]]))
    with pytest.raises(KeyError, match="no cached activation 'blocks.0.attn.hook_pattern'"):
        cache["pattern", 0]


def test_residual_decomposition_and_norms_are_exact(model):
    x = ids(2, 9)
    logits, cache = model.run_with_cache(x)
    parts, labels = cache.decompose_resid(return_labels=True)
    assert labels == ["embed", "0_attn_out", "0_mlp_out", "1_attn_out", "1_mlp_out"]
    torch.testing.assert_close(parts.sum(0), cache["resid_post", 1])
    normed = cache.decompose_resid(apply_ln=True)               # shares of the final norm's output
    torch.testing.assert_close(normed.sum(0), model.norm(cache["resid_post", 1]))
    mid = cache.apply_ln_to_stack(cache.decompose_resid(layer=1), layer=1)  # what layer 1's mixer reads
    torch.testing.assert_close(mid.sum(0), model.blocks[1].attn_norm(cache["resid_pre", 1]))
    scale = cache["blocks.1.attn_norm.hook_scale"]
    torch.testing.assert_close(scale, cache["resid_pre", 1].pow(2).mean(-1, keepdim=True).add(1e-6).sqrt())
    acc, labels = cache.accumulated_resid(apply_ln=True, return_labels=True)
    assert labels == ["0_pre", "1_pre", "final_post"]
    torch.testing.assert_close(acc[-1] @ model.W_U, logits)  # logit lens ends at the logits


def test_logit_attributions_sum_to_the_logits(model):
    x = ids(2, 9)
    logits, cache = model.run_with_cache(x)
    target = x[:, -1]
    attrs = cache.logit_attrs(cache.decompose_resid(pos_slice=-1), target, pos_slice=-1)
    assert attrs.shape == (5, 2)
    torch.testing.assert_close(attrs.sum(0), logits[torch.arange(2), -1, target])
    diff = cache.logit_attrs(cache.decompose_resid(), 5, incorrect_tokens=7)
    torch.testing.assert_close(diff.sum(0), logits[..., 5] - logits[..., 7])
    with pytest.raises(ValueError, match="no tokenizer"):
        cache.logit_attrs(cache.decompose_resid(), " the")
    with pytest.raises(ValueError, match=r"token ids in \[0, 97\)"):
        cache.logit_attrs(cache.decompose_resid(), 97)


@pytest.mark.parametrize("helper", ["stack_head_results", "compute_head_results", "stack_neuron_results",
                                    "get_full_resid_decomposition", "logit_lens"])
def test_helpers_without_meaning_here_say_so(model, helper):
    _, cache = model.run_with_cache(ids(1, 5))
    with pytest.raises(ValueError, match=f"ActivationCache.{helper}: "):
        getattr(cache, helper)()


# --- TransformerLens' layer, mask and text conventions ------------------------------------------

def test_w_e_is_the_embedding_hook_embed_reads(model):
    x = ids(1, 6)
    _, cache = model.run_with_cache(x)
    assert model.W_E.shape == (97, model.cfg.hidden_size)
    torch.testing.assert_close(cache["hook_embed"], model.W_E[x])


def test_stop_and_start_at_layer_split_the_forward(model):
    x = ids(2, 9)
    logits, cache = model.run_with_cache(x)
    resid = model(x, stop_at_layer=1)
    torch.testing.assert_close(resid, cache["blocks.1.hook_resid_pre"])
    torch.testing.assert_close(model(x, stop_at_layer=-1), resid)  # negative: from the end
    torch.testing.assert_close(model(x, stop_at_layer=2), cache["blocks.1.hook_resid_post"])
    torch.testing.assert_close(model(resid, start_at_layer=1), logits)
    torch.testing.assert_close(model(resid, return_type="loss", start_at_layer=1, tokens=x),
                               model(x, return_type="loss"))
    with pytest.raises(ValueError, match="`stop_at_layer`"):
        model(x, stop_at_layer=3)
    with pytest.raises(ValueError, match="stop_at_layer=1 returns the residual"):
        model(x, return_type="loss", stop_at_layer=1)
    with pytest.raises(ValueError, match="`tokens`"):
        model(resid, return_type="loss", start_at_layer=1)
    with pytest.raises(ValueError, match="`start_at_layer`, `input` is the residual"):
        model(x, start_at_layer=1)


def test_right_padded_attention_mask_gives_the_unpadded_logits_and_loss(model):
    short, long = ids(1, 5, seed=3), ids(1, 8, seed=4)
    batch = torch.cat([torch.cat([short, torch.zeros(1, 3, dtype=torch.long)], 1), long])
    mask = torch.tensor([[1] * 5 + [0] * 3, [1] * 8])
    logits, loss = model(batch, return_type="both", attention_mask=mask)
    torch.testing.assert_close(logits[:1, :5], model(short))
    per_short, per_long = (model(r, return_type="loss", loss_per_token=True)[0] for r in (short, long))
    torch.testing.assert_close(loss, torch.cat([per_short, per_long]).mean())
    per = model(batch, return_type="loss", loss_per_token=True, attention_mask=mask)
    torch.testing.assert_close(per[0], torch.cat([per_short, torch.zeros(3)]))
    with pytest.raises(ValueError, match="`attention_mask` must pad on the right"):
        model(batch, attention_mask=mask.flip(1))
    with pytest.raises(ValueError, match="`attention_mask` must be 0/1"):
        model(batch, attention_mask=mask[:, :4])


def test_generate_verbose_draws_a_bar_and_the_kv_cache_flag_is_refused(model, capsys):
    x = torch.tensor([PROMPTS[0]])
    assert torch.equal(model.generate(x, 5, verbose=True), model.generate(x, 5))
    assert "generate" in capsys.readouterr().err
    with pytest.raises(ValueError, match="`use_past_kv_cache` must be True"):
        model.generate(x, 5, use_past_kv_cache=False)


def test_a_shipped_checkpoint_brings_its_tokenizer():
    from qedprobe.model import QEDModel
    from qedprobe.tokenizer import HFTokenizer

    folder = "checkpoints/interference-full-s0"
    model, tok = QEDModel.from_pretrained(folder), HFTokenizer(folder)
    text = "The special magic number for apple is 7341."
    ids_ = model.to_tokens(text)
    assert ids_.tolist() == [[tok.bos_id] + tok.encode(text)] and tok.bos_id == 0
    assert model.to_tokens(text, prepend_bos=False).tolist() == [tok.encode(text)]
    assert model.to_string(ids_[0]) == text and model.to_string(ids_) == [text]
    assert model.to_str_tokens(text)[0] == "<bos>" and "".join(model.to_str_tokens(text)[1:]) == text
    two = model.to_tokens([text, "apple"])
    assert two.shape[0] == 2 and two[1, 2:].eq(tok.pad_id).all()
    assert model.to_single_token("7") == tok.encode("7")[0]
    out = model.generate(text, 4)
    continuation = model.to_string(model.generate(ids_, 4)[0, ids_.shape[1]:])
    assert isinstance(out, str) and out == text + continuation
    with pytest.raises(ValueError, match="`padding_side` must be 'right'"):
        model.to_tokens([text], padding_side="left")
    with pytest.raises(ValueError, match="is 4 tokens, not one"):
        model.to_single_token("apple pie")


def test_without_a_tokenizer_the_text_methods_say_how_to_set_one(model):
    with pytest.raises(ValueError, match="to_tokens: this model has no tokenizer.*model.tokenizer = 'bytes'"):
        model.to_tokens("hi")
    with pytest.raises(ValueError, match="no tokenizer"):
        model.generate("hi", 2)
    other = tiny()
    other.tokenizer = "bytes"
    assert other.tokenizer.name == "bytes" and model.tokenizer is None
