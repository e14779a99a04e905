r"""``qedprobe convert``: turn an fla-style GDN-2 model checkpoint into a qedprobe model.

fla's keys ``model.embeddings.*``, ``model.layers.{l}.*``, ``model.norm.*`` and ``lm_head.*``
become ``embeddings.*``, ``blocks.{l}.*``, ``norm.*`` and ``lm_head.*`` (dropped when the
embeddings are tied); each mixer's tensors keep fla's names. Sizes are read from the tensors;
``config.json`` beside the weights (if any) supplies ``norm_eps`` and ``initializer_range`` and is checked for options
qedprobe does not model. Arm ``gdn2`` adds nothing; a QED arm adds ``theta`` (every head set
to ``--theta``) and, for ``rand``, the directions ``z`` from ``--rand-seed``. A qedprobe
checkpoint (one that already holds ``theta``) is refused: converting it would reset its
trained strengths.

    qedprobe convert path/to/fla_ckpt out_dir --arm full --theta -2
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from qedprobe.lam import LAMBDA_MAX, THETA_INIT

from .checkpoint import check_state_dict, read_safetensors
from .config import QEDConfig
from .model import QEDModel

UNSUPPORTED = {  # fla config key -> the only value qedprobe models
    "use_short_conv": True, "allow_neg_eigval": False, "attn": None, "attnres_block_size": None,
    "hidden_act": "swish", "use_l2warp": False,
}


def read_checkpoint(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    """Tensors and the fla ``config.json`` (``{}`` if absent) of a checkpoint directory or file."""
    path = Path(path)
    config_file = (path if path.is_dir() else path.parent) / "config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"convert: {config_file} is not valid JSON ({err})") from err
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors = {}
            for shard in shards:
                tensors.update(read_safetensors(path / shard))
            return tensors, config
        for name in ("model.safetensors", "pytorch_model.bin"):
            if (path / name).is_file():
                return read_checkpoint(path / name)[0], config
        raise FileNotFoundError(f"convert: no model.safetensors(.index.json) or pytorch_model.bin in {path}")
    if not path.is_file():
        raise FileNotFoundError(f"convert: no checkpoint at {path}")
    if path.suffix == ".safetensors":
        return read_safetensors(path), config
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises several types for unreadable pickles
        raise ValueError(f"convert: {path} is not a readable torch checkpoint ({err})") from err
    for key in ("model", "state_dict"):
        if isinstance(obj, dict) and isinstance(obj.get(key), dict):
            obj = obj[key]
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise ValueError(f"convert: {path} does not hold a flat state dict of tensors")
    return obj, config


def rename_fla_keys(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``model.layers.{l}.x`` -> ``blocks.{l}.x``, ``model.x`` -> ``x``; other keys unchanged."""
    out = {}
    for key, value in tensors.items():
        new = re.sub(r"^model\.layers\.", "blocks.", key)
        out[re.sub(r"^model\.", "", new)] = value
    return out


def infer_config(tensors: dict[str, torch.Tensor], fla_config: dict, **qed_fields) -> QEDConfig:
    """A :class:`QEDConfig` from the (renamed) tensor shapes, fla's config and ``qed_fields``."""
    for key, supported in UNSUPPORTED.items():
        if key in fla_config and fla_config[key] != supported:
            raise ValueError(f"convert: fla config has {key}={fla_config[key]!r}; qedprobe supports only {supported!r}")
    try:
        vocab, hidden = tensors["embeddings.weight"].shape
        layers = len({int(m.group(1)) for k in tensors if (m := re.match(r"blocks\.(\d+)\.", k))})
        heads = tensors["blocks.0.attn.A_log"].shape[0]
        key_dim = tensors["blocks.0.attn.q_proj.weight"].shape[0]
        value_dim = tensors["blocks.0.attn.v_proj.weight"].shape[0]
        conv_size = tensors["blocks.0.attn.q_conv1d.weight"].shape[-1]
        intermediate = tensors["blocks.0.mlp.gate_proj.weight"].shape[0]
    except KeyError as err:
        raise ValueError(f"convert: not an fla GDN-2 model checkpoint, missing tensor {err}") from None
    num_v_heads = fla_config.get("num_v_heads")
    if num_v_heads not in (None, heads):
        raise ValueError(f"convert: grouped value heads (num_v_heads={num_v_heads} != num_heads={heads}) are not supported")
    tied = fla_config.get("tie_word_embeddings")
    if tied is None:
        tied = "lm_head.weight" not in tensors or torch.equal(tensors["lm_head.weight"], tensors["embeddings.weight"])
    return QEDConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_heads=heads,
                     head_dim=key_dim // heads, expand_v=value_dim / key_dim, intermediate_size=intermediate,
                     conv_size=conv_size, conv_bias="blocks.0.attn.q_conv1d.bias" in tensors,
                     norm_eps=float(fla_config.get("norm_eps", 1e-6)), tie_word_embeddings=bool(tied),
                     initializer_range=float(fla_config.get("initializer_range", 0.02)),
                     **qed_fields)


def convert(tensors: dict[str, torch.Tensor], fla_config: dict, *, arm: str = "gdn2",
            theta: float = THETA_INIT, lambda_max: float = LAMBDA_MAX, rand_seed: int = 0) -> QEDModel:
    """A :class:`QEDModel` holding fla's weights unchanged plus ``theta`` (and ``z``) for QED arms."""
    tensors = rename_fla_keys(tensors)
    trained = sorted(k for k in tensors if k.endswith(".attn.theta"))
    if trained:
        raise ValueError(f"convert: the input is a qedprobe checkpoint (it holds trained theta, e.g. {trained[0]}); "
                         "converting would reset theta. Load it with QEDModel.from_pretrained as it is")
    cfg = infer_config(tensors, fla_config, arm=arm, lambda_max=lambda_max, rand_seed=rand_seed)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    model = QEDModel(cfg)
    added = {k: v for k, v in model.state_dict().items() if k.endswith((".attn.theta", ".attn.z"))}
    for key in added:
        if key.endswith(".theta"):
            added[key] = torch.full_like(added[key], theta)
    check_state_dict(model.state_dict(), {**tensors, **added}, "convert")
    model.load_state_dict({**tensors, **added}, strict=True)
    return model.to(tensors["embeddings.weight"].dtype)
