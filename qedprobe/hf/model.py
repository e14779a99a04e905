r"""`HFQEDModel`: a transformers Qwen3.5 / Qwen3-Next / OLMo-Hybrid model whose linear-attention
recurrences run through qedprobe, hooked like a ``QEDModel``.

    model = adapt(AutoModelForCausalLM.from_pretrained(folder))   # or adapt(folder)
    logits = model(ids)                                  # [B, T, vocab], a prefill pass
    logits, cache = model.run_with_cache(ids)            # cache["e", 0] is cache["blocks.0.linear_attn.hook_e"]
    new = model.generate([[...], [...]], 16, return_type="new_tokens")   # as QEDModel.generate

The transformers model is ``model.hf_model`` (the same object: no weight is copied). Its
Gated DeltaNet layers call qedprobe's op for their recurrence (see :mod:`.route`); everything
else runs as transformers wrote it. Hooks are ``blocks.{l}.linear_attn.hook_*`` for each
linear-attention decoder layer ``l`` (``model.mixer_layers``; see :mod:`.recurrence` for the
shapes), with ``l`` the index in ``hf_model``'s layer list, so ``blocks.{l}.linear_attn`` is
``model.layers[l].linear_attn`` in transformers. They fire in every forward of ``hf_model``,
including its own ``generate`` (prefill and every decode step); ``qedprobe.model.strength`` and
``qedprobe.hooks.ProbeRecorder`` work as on a ``QEDModel``; :func:`qedprobe.hf.inject_qed`
sets the QED term.
"""
from __future__ import annotations

import contextlib
import os

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from qedprobe.model.generate import DEFAULT_MAX_NEW_TOKENS, as_output, checked_generate_inputs, until_stop
from qedprobe.model.hooked import HookedModel
from qedprobe.model.strength import LambdaScale, active_lambda_scale

from . import route
from .cache import HFActivationCache
from .families import HFQEDConfig, UnsupportedModelError, deltanet_class, modeling_module_name, refuse_shadowed_kernels
from .recurrence import LinearAttnRecurrence

_ADAPTED = "_qedprobe_adapted"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
"""A folder with one of these has a tokenizer: ``adapt(folder)`` gives the model its ``tokenizer``."""


def _deltanets(hf_model, cfg: HFQEDConfig) -> dict:
    """``{layer_idx: module}`` of the model's Gated DeltaNet layers, checked against ``cfg``."""
    cls = deltanet_class(cfg.model_type)
    found = {}
    for mod in hf_model.modules():
        if isinstance(mod, cls):
            if mod.layer_idx in found:
                raise ValueError(f"qedprobe.hf: two {cls.__name__} modules have layer_idx {mod.layer_idx}")
            found[mod.layer_idx] = mod
    if tuple(sorted(found)) != cfg.linear_layers:
        raise ValueError(f"qedprobe.hf: the config's linear-attention layers {list(cfg.linear_layers)} "
                         f"are not the model's {cls.__name__} layers {sorted(found)}")
    return found


class HFQEDModel(HookedModel):
    """A transformers model of a supported family (see :data:`qedprobe.hf.SUPPORTED`), adapted.

    ``op_mode``: ``qedprobe.ops.qed_attention``'s mode (``"auto"``: Triton on CUDA, the PyTorch
    chunk path / token loop on CPU).
    """

    mixer_name = "linear_attn"
    cache_class = HFActivationCache  # run_with_cache's cache: cache["e", l], stack_activation("e")

    def __init__(self, hf_model: nn.Module, *, op_mode: str = "auto"):
        super().__init__()
        config = getattr(hf_model, "config", None)
        if not isinstance(hf_model, nn.Module) or config is None:
            raise UnsupportedModelError(f"qedprobe.hf: `model` must be a transformers model or a "
                                        f"folder, got {type(hf_model).__name__}")
        if getattr(hf_model, _ADAPTED, False):
            raise ValueError("qedprobe.hf: this transformers model is adapted already; use that "
                             "HFQEDModel (or its detach()) instead of adapting it twice")
        self.cfg = HFQEDConfig.from_transformers(config, op_mode=op_mode)
        layers = _deltanets(hf_model, self.cfg)
        self.hf_model = hf_model
        self.blocks = nn.ModuleDict({
            str(l): nn.ModuleDict({"linear_attn": LinearAttnRecurrence(self.cfg, l, self.lambda_scale)})
            for l in self.cfg.linear_layers})
        self.blocks.to(next(hf_model.parameters()).device)
        route.install(modeling_module_name(self.cfg.model_type))
        self._handles = [h for l, mod in layers.items() for h in route.attach(mod, self.recurrence(l))]
        setattr(hf_model, _ADAPTED, True)
        self.setup()

    def setup(self) -> None:
        """TransformerLens' hook tables over ``blocks`` only (the transformers modules are not
        renamed or listed)."""
        self.mod_dict, self.hook_dict = {}, {}
        for name, module in self.blocks.named_modules(prefix="blocks"):
            module.name = name
            self.mod_dict[name] = module
            if isinstance(module, HookPoint):
                self.hook_dict[name] = module

    def lambda_scale(self) -> LambdaScale:
        """The strength factors of the calls now running: the ``strength`` blocks' around them."""
        return active_lambda_scale(self)

    def recurrence(self, layer: int) -> LinearAttnRecurrence:
        """The recurrence module of linear-attention layer ``layer``."""
        return self.blocks[str(layer)]["linear_attn"]

    @property
    def mixer_layers(self) -> list[int]:
        """The linear-attention decoder layers (the others are softmax attention)."""
        return list(self.cfg.linear_layers)

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    def set_config(self, cfg: HFQEDConfig) -> None:
        """Use ``cfg`` (this model's sizes with another arm / lambda / op mode) from now on."""
        same = ("model_type", "vocab_size", "hidden_size", "num_hidden_layers", "linear_layers",
                "num_heads", "num_key_heads", "head_dim", "head_v_dim")
        if any(getattr(cfg, k) != getattr(self.cfg, k) for k in same):
            raise ValueError("HFQEDModel.set_config: `cfg` describes another model")
        for l in cfg.linear_layers:
            self.recurrence(l).configure(cfg)
        self.cfg = cfg

    def detach(self) -> nn.Module:
        """Route the transformers model's recurrences back to transformers and return it."""
        for h in self._handles:
            h.remove()
        self._handles = []
        setattr(self.hf_model, _ADAPTED, False)
        return self.hf_model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids`` ``[B, T]`` -> logits ``[B, T, vocab]`` (a prefill pass, no cache)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) \
                else type(input_ids).__name__
            raise ValueError(f"HFQEDModel: `input_ids` must be an integer tensor [B, T], got {got}")
        out = self.hf_model(input_ids=input_ids.to(self.device), attention_mask=attention_mask, use_cache=False)
        return out.logits

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                 eos_token_id: int | list[int] | None = None, stop_at_eos: bool = True,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None,
                 return_type: str = "input", pad_token_id: int | None = None, cuda_graph: bool = True):
        """As ``QEDModel.generate`` (same arguments and result: the prompts with their new tokens
        in the input's form, or ``return_type="new_tokens"``), by transformers' ``generate`` with
        its own cache.

        Prompts of equal length run as one batch, so no padding token ever enters the recurrence
        or the probes. Greedy by default; sampling uses transformers' samplers and torch's global
        generator (``generator`` must be None). Only the arguments given here are used, with
        transformers' defaults for the rest (not the model's ``generation_config``).
        ``cuda_graph`` is accepted for the sweep's interface: transformers runs each decode step
        eagerly.
        """
        from transformers import GenerationConfig
        packed, eos, stop_ids = checked_generate_inputs(
            self, prompts, max_new_tokens, eos_token_id=eos_token_id, stop_at_eos=stop_at_eos,
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator,
            return_type=return_type, pad_token_id=pad_token_id)
        if generator is not None:
            raise ValueError("generate: `generator` is not supported for a transformers model "
                             "(it samples with torch's global generator: use torch.manual_seed)")
        new = [[] for _ in packed.lengths]
        if max_new_tokens > 0:
            sampling = dict(temperature=temperature, top_k=top_k or 0, top_p=top_p or 1.0) if do_sample else {}
            gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=do_sample, **sampling,
                                   eos_token_id=list(stop_ids) or None, pad_token_id=stop_ids[0] if stop_ids else 0)
            with _defaults_only(self.hf_model):
                for who, ids in packed.by_length():
                    out = self.hf_model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen)
                    for i, toks in zip(who, until_stop(out[:, ids.shape[1]:].tolist(), stop_ids)):
                        new[i] = toks
        return as_output(prompts, packed, new, return_type, pad_token_id, eos)


@contextlib.contextmanager
def _defaults_only(hf_model):
    """transformers fills every option a ``generate`` call leaves unset from the model's
    ``generation_config`` (a folder's ``generation_config.json``: sampling, repetition penalty,
    ...); inside the block that is transformers' plain default config instead."""
    from transformers import GenerationConfig
    saved = hf_model.generation_config
    hf_model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        hf_model.generation_config = saved


def adapt(model, *, op_mode: str = "auto", dtype: torch.dtype | None = None, device=None) -> HFQEDModel:
    """An :class:`HFQEDModel` around ``model``: a transformers model object (adapted in place,
    its weights shared) or a local folder (read with ``AutoModelForCausalLM`` and
    ``local_files_only=True``: nothing is downloaded; ``dtype`` and ``device`` apply to it; its
    tokenizer, if it has one, becomes ``model.tokenizer`` for ``to_tokens`` / ``to_string``)."""
    folder = model if isinstance(model, (str, os.PathLike)) else None
    if folder is not None:
        model = load_transformers(folder, dtype=dtype, device=device)
    elif dtype is not None or device is not None:
        raise ValueError("adapt: `dtype` and `device` apply to a folder; move the model object yourself")
    adapted = HFQEDModel(model, op_mode=op_mode)
    if folder is not None and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        adapted.tokenizer = os.fspath(folder)  # model.to_tokens / to_string (read on first use)
    return adapted


def load_transformers(path, *, dtype: torch.dtype | None = None, device=None) -> nn.Module:
    """``AutoModelForCausalLM`` from the local folder ``path`` (in eval mode), refused with the
    list of supported types before any weight is read when its type is not supported."""
    refuse_shadowed_kernels()
    from transformers import AutoConfig, AutoModelForCausalLM
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"qedprobe.hf: {path!r} is not a model folder (no config.json; nothing is downloaded)")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    HFQEDConfig.from_transformers(config)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype)
    return (model if device is None else model.to(device)).eval()
