"""Config round trip, save/load, fla key compatibility, `qedprobe convert`, and the mixer
against an independent composition of fla's GDN-2 layer on CPU."""
import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformer_lens", reason="the hooked model needs transformer-lens")

from qedprobe.lam import random_directions
from qedprobe.model import QEDConfig, QEDModel, strength
from qedprobe.cli.convert import register
from qedprobe.model.convert import convert

from helpers import ids, tiny

H, K, V, D = 2, 16, 16, 64


def fla_gdn2_layer_keys(H, K, V, D, W=4):
    """Keys and shapes of fla's ``GatedDeltaNet2`` (fla/layers/gdn2.py: use_short_conv=True,
    conv_bias=False, expand_v=1, num_v_heads=num_heads), written out from its ``__init__``."""
    return {
        "q_proj.weight": (H * K, D), "k_proj.weight": (H * K, D), "v_proj.weight": (H * V, D),
        "q_conv1d.weight": (H * K, 1, W), "k_conv1d.weight": (H * K, 1, W), "v_conv1d.weight": (H * V, 1, W),
        "f_proj.0.weight": (V, D), "f_proj.1.weight": (H * K, V),
        "b_proj.weight": (H * K, D), "w_proj.weight": (H * V, D),
        "A_log": (H,), "dt_bias": (H * K,),
        "g_proj.0.weight": (V, D), "g_proj.1.weight": (H * V, V), "g_proj.1.bias": (H * V,),
        "o_norm.weight": (V,), "o_proj.weight": (D, H * V),
    }


@pytest.mark.parametrize("arm, extra", [("gdn2", {}), ("full", {"theta": (H,)}), ("nogate", {"theta": (H,)}),
                                        ("rand", {"theta": (H,), "z": (H, K)})])
def test_mixer_keys_are_fla_keys_plus_theta(arm, extra):
    m = tiny(arm)
    got = {k: tuple(v.shape) for k, v in m.blocks[1].attn.state_dict().items()}
    assert got == {**fla_gdn2_layer_keys(H, K, V, D), **extra}


def fla_layer_reference(attn, x):
    """fla's GatedDeltaNet2.forward (no cache, no padding) re-composed from torch ops and fla's
    reference recurrence ``fla.ops.gdn2.naive.naive_recurrent_gdn2``."""
    naive = pytest.importorskip("fla.ops.gdn2.naive")
    T = x.shape[1]

    def conv(proj, conv1d):
        y = F.conv1d(proj(x).transpose(1, 2), conv1d.weight, conv1d.bias, padding=conv1d.weight.shape[-1] - 1,
                     groups=conv1d.weight.shape[0])
        return F.silu(y[..., :T]).transpose(1, 2)

    heads = lambda t: t.unflatten(-1, (H, -1))  # noqa: E731
    l2 = lambda t: t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)  # noqa: E731  fla's l2norm
    q, k, v = heads(conv(attn.q_proj, attn.q_conv1d)), heads(conv(attn.k_proj, attn.k_conv1d)), \
        heads(conv(attn.v_proj, attn.v_conv1d))
    g = -attn.A_log.float().exp().unsqueeze(-1) * heads(F.softplus(attn.f_proj(x).float() + attn.dt_bias))
    b, w = heads(attn.b_proj(x).sigmoid()), heads(attn.w_proj(x).sigmoid())
    o, _ = naive.naive_recurrent_gdn2(l2(q), l2(k), v, g, b, w)
    gate = heads(attn.g_proj(x))
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + attn.o_norm.eps) * attn.o_norm.weight * gate.sigmoid()
    return attn.o_proj(o.flatten(-2))


def test_mixer_matches_fla_gdn2_composition_on_cpu():
    gdn2 = tiny("gdn2").blocks[0].attn
    full = tiny("full").blocks[0].attn
    x = torch.randn(2, 13, D, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = fla_layer_reference(gdn2, x)
        torch.testing.assert_close(gdn2(x)[0], expected, rtol=1e-4, atol=1e-5)
        full.load_state_dict({**gdn2.state_dict(), "theta": full.theta}, strict=True)
        torch.testing.assert_close(full(x, lam_scale=torch.zeros(H))[0], expected, rtol=1e-4, atol=1e-5)
        assert (full(x)[0] - expected).abs().max() > 1e-4


# --- config --------------------------------------------------------------------------------

def test_config_defaults_are_the_340m_layout_and_round_trip(tmp_path):
    cfg = QEDConfig()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_heads, cfg.head_dim, cfg.vocab_size,
            cfg.conv_size, cfg.tie_word_embeddings, cfg.lambda_max) == (1024, 24, 6, 128, 32000, 4, True, 0.25)
    assert cfg.intermediate_size == 2816  # fla GatedMLP: 256-rounded 2/3 * 4 * 1024
    cfg = QEDConfig(vocab_size=300, hidden_size=64, num_hidden_layers=3, num_heads=2, head_dim=32, arm="rand",
                    rand_seed=7, decay_a_range=[0.5, 2], decay_dt_range=(1e-4, 0.1))
    assert cfg.decay_a_range == (0.5, 2.0)  # JSON lists come back as tuples
    cfg.save(tmp_path / "config.json")
    assert QEDConfig.load(tmp_path / "config.json") == cfg
    assert json.loads((tmp_path / "config.json").read_text())["arm"] == "rand"


@pytest.mark.parametrize("kwargs, match", [
    (dict(arm="qed"), "`arm` must be one of"), (dict(num_heads=0), "`num_heads` must be a positive int"),
    (dict(hidden_size=64.0), "`hidden_size`"), (dict(lambda_max=-1.0), "`lambda_max`"),
    (dict(head_dim=16, expand_v=0.3), "head_dim \\* expand_v"), (dict(op_mode="fast"), "`op_mode`"),
    (dict(tie_word_embeddings="yes"), "`tie_word_embeddings` must be a bool"),
    (dict(decay_a_range=(2.0,)), "`decay_a_range` must be a pair"),
    (dict(decay_dt_range=(0.1, 1e-3)), "`decay_dt_range` must have low <= high"),
    (dict(decay_a_range=(0.0, 1.0)), "`decay_a_range` must be a positive"),
])
def test_config_bad_values(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QEDConfig(**kwargs)


def test_decay_initialisation_follows_the_configured_ranges():
    """A = exp(A_log) in decay_a_range per head, softplus(dt_bias) in decay_dt_range per channel;
    the defaults are fla's (1, 16) and (1e-3, 1e-1)."""
    for a_range, dt_range in (((1.0, 16.0), (1e-3, 1e-1)), ((0.5, 2.0), (1e-4, 1e-1))):
        torch.manual_seed(0)
        model = QEDModel(QEDConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_heads=4, head_dim=32,
                                   decay_a_range=a_range, decay_dt_range=dt_range))
        A = torch.cat([b.attn.A_log.exp() for b in model.blocks])
        dt = torch.cat([F.softplus(b.attn.dt_bias.double()) for b in model.blocks])
        assert a_range[0] <= A.min() and A.max() <= a_range[1]
        assert dt_range[0] * (1 - 1e-5) <= dt.min() and dt.max() <= dt_range[1] * (1 + 1e-5)
        assert dt.log().std() > 0.25 * (math.log(dt_range[1]) - math.log(dt_range[0]))  # spread, not one value


def test_config_unknown_key_and_corrupt_file(tmp_path):
    with pytest.raises(ValueError, match=r"unknown keys \['n_layer'\]"):
        QEDConfig.from_dict({"n_layer": 3})
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        QEDConfig.load(tmp_path / "config.json")


# --- save / load ---------------------------------------------------------------------------

@pytest.mark.parametrize("arm", ["rand", "gdn2"])
def test_save_load_round_trip_is_exact(tmp_path, arm):
    m = tiny(arm, tie_word_embeddings=arm == "rand")
    m.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    m2 = QEDModel.from_pretrained(tmp_path)
    assert m2.cfg == m.cfg
    sd, sd2 = m.state_dict(), m2.state_dict()
    assert sd.keys() == sd2.keys() and all(torch.equal(sd[k], sd2[k]) for k in sd)
    x = ids()
    assert torch.equal(m(x), m2(x))
    if arm == "rand":
        assert torch.equal(m2.blocks[1].attn.z, random_directions(H, K, seed=1))
    half = QEDModel.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert half.embeddings.weight.dtype == torch.bfloat16


def _edit_weights(tmp_path, edit):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(tmp_path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"))


@pytest.mark.parametrize("edit, match", [
    (lambda t: t.pop("blocks.1.attn.theta"), r"missing keys \['blocks.1.attn.theta'\]"),
    (lambda t: t.update({"blocks.0.attn.extra": torch.zeros(1)}), r"unexpected keys \['blocks.0.attn.extra'\]"),
    (lambda t: t.update({"blocks.0.attn.A_log": torch.zeros(3)}),
     r"mis-shaped tensors \[blocks.0.attn.A_log: expected \(2,\), got \(3,\)\]"),
])
def test_load_refuses_mismatched_state_dict(tmp_path, edit, match):
    tiny().save_pretrained(tmp_path)
    _edit_weights(tmp_path, edit)
    with pytest.raises(ValueError, match=match):
        QEDModel.from_pretrained(tmp_path)


def test_load_refuses_corrupt_or_missing_files(tmp_path):
    tiny().save_pretrained(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        QEDModel.from_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights file"):
        QEDModel.from_pretrained(tmp_path)
    with pytest.raises(FileNotFoundError, match="not a directory"):
        QEDModel.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="`dtype`"):
        QEDModel.from_pretrained(tmp_path, dtype=torch.int8)


# --- convert -------------------------------------------------------------------------------

def fla_checkpoint(model):
    """Our gdn2 weights under fla's model keys (model.layers.{l}..., untied lm_head copy)."""
    out = {"lm_head.weight": model.embeddings.weight.detach().clone()}
    for k, v in model.state_dict().items():
        out["model." + k.replace("blocks.", "layers.", 1)] = v.clone()
    return out


def test_convert_fla_checkpoint_to_gdn2_and_qed(tmp_path):
    src = tiny("gdn2")
    fla = fla_checkpoint(src)
    x = ids()
    gdn2 = convert(fla, {"norm_eps": 1e-6, "tie_word_embeddings": True, "initializer_range": 0.1})
    assert gdn2.cfg == src.cfg
    assert torch.equal(gdn2(x), src(x))
    full = convert(fla, {}, arm="full", theta=0.0)
    assert full.cfg.tie_word_embeddings  # inferred: lm_head equals the embedding
    assert torch.equal(full.blocks[0].attn.theta, torch.zeros(H))
    with strength(full, 0.0):
        torch.testing.assert_close(full(x), src(x), rtol=0, atol=1e-6)
    assert (full(x) - src(x)).abs().max() > 1e-4
    # the CLI command end to end, from a directory with safetensors + config.json
    from safetensors.torch import save_file
    (tmp_path / "fla").mkdir()
    save_file(fla, str(tmp_path / "fla" / "model.safetensors"))
    (tmp_path / "fla" / "config.json").write_text(json.dumps({"norm_eps": 1e-6, "tie_word_embeddings": False}))
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["convert", str(tmp_path / "fla"), str(tmp_path / "out"), "--arm", "rand"])
    assert args.func(args) == 0
    out = QEDModel.from_pretrained(tmp_path / "out")
    assert out.cfg.arm == "rand" and not out.cfg.tie_word_embeddings
    assert torch.equal(out.lm_head.weight, src.embeddings.weight)


@pytest.mark.parametrize("edit, config, match", [
    (lambda t: t.pop("model.layers.0.attn.A_log"), {}, "missing tensor 'blocks.0.attn.A_log'"),
    (lambda t: t.pop("model.layers.1.attn.b_proj.weight"), {}, r"missing keys \['blocks.1.attn.b_proj.weight'\]"),
    (lambda t: t.update({"model.layers.0.attn.beta": torch.zeros(1)}), {}, "unexpected keys"),
    (lambda t: None, {"allow_neg_eigval": True}, "allow_neg_eigval=True"),
    (lambda t: None, {"num_v_heads": 4}, "grouped value heads"),
])
def test_convert_refuses_what_it_cannot_model(edit, config, match):
    fla = fla_checkpoint(tiny("gdn2"))
    edit(fla)
    with pytest.raises(ValueError, match=match):
        convert(fla, config)


def test_fla_layer_state_dict_loads_unchanged_when_fla_layers_is_installed():
    """With flash-linear-attention importable (not in CI), fla's own layer's weights load strictly."""
    try:
        from fla.layers.gdn2 import GatedDeltaNet2
    except Exception as err:  # not installed, or its transformers dependency is missing
        pytest.skip(f"fla.layers.gdn2 not importable: {err}")
    fla = GatedDeltaNet2(hidden_size=D, head_dim=K, num_heads=H, layer_idx=0)
    assert {k: tuple(v.shape) for k, v in fla.state_dict().items()} == fla_gdn2_layer_keys(H, K, V, D)
    ours = tiny("full").blocks[0].attn
    ours.load_state_dict({**fla.state_dict(), "theta": torch.zeros(H)}, strict=True)
    assert torch.equal(ours.q_conv1d.weight, fla.q_conv1d.weight)
