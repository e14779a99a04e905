r"""`HFQEDModel`: a transformers model with Gated DeltaNet or Kimi Delta Attention layers (see
:mod:`.families`) whose linear-attention recurrences run through qedprobe, hooked like a ``QEDModel``.

    model = adapt(AutoModelForCausalLM.from_pretrained(folder))   # or adapt(folder)
    logits = model(ids)                                  # [B, T, vocab], a prefill pass
    logits, cache = model.run_with_cache(ids)            # cache["e", 0] is cache["blocks.0.linear_attn.hook_e"]
    new = model.generate([[...], [...]], 16, return_type="new_tokens")   # as QEDModel.generate

The transformers model is ``model.hf_model`` (the same object: no weight is copied; it may be
dispatched over devices, with CPU or disk offload, by accelerate's ``device_map``). Its
linear-attention layers call qedprobe's op for their recurrence while one of their hook points
has a hook or QED is injected, and the model's own function otherwise (see :mod:`.route`);
everything else runs as transformers wrote it. Hooks are ``blocks.{l}.linear_attn.hook_*`` for each
linear-attention decoder layer ``l`` (``model.mixer_layers``; see :mod:`.recurrence` for the
shapes), with ``l`` the index in ``hf_model``'s layer list: ``blocks.{l}.linear_attn`` is
decoder layer ``l``'s linear attention (``layers[l].linear_attn`` in transformers' GDN families,
``layers[l].self_attn`` in its KDA families; the hook names are the same in every family). They fire in every forward of ``hf_model``,
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
from qedprobe.model.model import RETURN_TYPES, next_token_loss, right_padded_lengths
from qedprobe.model.strength import LambdaScale, active_lambda_scale, call_lambda_scale

from . import route
from .cache import HFActivationCache
from .families import HFQEDConfig, UnsupportedModelError, deltanet_class, modeling_module_name, routed_functions
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


def _weights_device(module: nn.Module) -> torch.device | None:
    """The device of ``module``'s first parameter (None without one, or on the meta device of an
    offloaded module): where its recurrence's buffers are put at adaptation, so that the first
    call does not copy them from the host, a wait per layer."""
    weight = next(module.parameters(), None)
    return None if weight is None or weight.is_meta else weight.device


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
        for l, mod in layers.items():
            device = _weights_device(mod)
            if device is not None:
                self.recurrence(l).follow(device)
        route.install(modeling_module_name(self.cfg.model_type), routed_functions(self.cfg.model_type))
        for l, mod in layers.items():
            self.recurrence(l).switch = route.LayerSwitch(mod, self.recurrence(l))
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
        """Where token ids go: the input embedding's device (for a model dispatched by
        accelerate with a ``device_map``, the device it executes on, also when offloaded)."""
        embed = self.hf_model.get_input_embeddings()
        executes_on = getattr(getattr(embed, "_hf_hook", None), "execution_device", None)
        return embed.weight.device if executes_on is None else torch.device(executes_on)

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
        for l in self.cfg.linear_layers:
            recurrence = self.recurrence(l)
            if recurrence.switch is not None:
                recurrence.switch.remove()
                recurrence.switch = None
        setattr(self.hf_model, _ADAPTED, False)
        return self.hf_model

    def forward(self, input, return_type: str | None = "logits", loss_per_token: bool = False, *,
                attention_mask: torch.Tensor | None = None, prepend_bos: bool | None = None,
                start_at_layer: int | None = None, stop_at_layer: int | None = None, tokens=None,
                lambda_scale: LambdaScale | None = None) -> torch.Tensor:
        """``input`` ``[B, T]`` token ids (or a text / list of texts, through :meth:`to_tokens`)
        -> logits ``[B, T, vocab]`` (a prefill pass, no cache), as ``QEDModel.forward``.

        ``return_type``: ``"logits"``, ``"loss"`` (mean next-token cross-entropy, or ``[B, T - 1]``
        with ``loss_per_token``), ``"both"`` or ``None``. ``attention_mask`` ``[B, T]`` must pad
        on the right (left pads would enter the recurrent state); the loss leaves out the targets
        at and after a pad. ``start_at_layer`` / ``stop_at_layer`` / ``tokens`` are refused by
        name: transformers' decoder layers have no hook points to stop or start at.
        ``lambda_scale``: this pass's strength (default: the ``strength`` blocks around it).
        """
        for name, value in (("start_at_layer", start_at_layer), ("stop_at_layer", stop_at_layer), ("tokens", tokens)):
            if value is not None:
                raise ValueError(f"HFQEDModel: `{name}` is not supported (an adapted transformers model runs "
                                 "whole; read hidden states from model.hf_model(ids, output_hidden_states=True))")
        if return_type not in RETURN_TYPES:
            raise ValueError(f"HFQEDModel: `return_type` must be one of {RETURN_TYPES}, got {return_type!r}")
        if isinstance(input, (str, list, tuple)):
            input = self.to_tokens(input, prepend_bos=prepend_bos)
        if not isinstance(input, torch.Tensor) or input.dim() != 2 or input.is_floating_point():
            got = f"{input.dtype} {tuple(input.shape)}" if isinstance(input, torch.Tensor) else type(input).__name__
            raise ValueError(f"HFQEDModel: `input` must be token ids [B, T] (an integer tensor) or text, got {got}")
        lengths = right_padded_lengths(attention_mask, input.shape, owner="HFQEDModel")
        mask = None if attention_mask is None else torch.as_tensor(attention_mask).to(self.device)
        with call_lambda_scale(self, lambda_scale):
            logits = self.hf_model(input_ids=input.to(self.device), attention_mask=mask, use_cache=False).logits
        if return_type in ("logits", None):
            return None if return_type is None else logits
        loss = next_token_loss(logits, input, lengths, loss_per_token, owner="HFQEDModel")
        return loss if return_type == "loss" else (logits, loss)

    @torch.no_grad()
    def generate(self, prompts, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, *,
                 eos_token_id: int | list[int] | None = None, stop_at_eos: bool = True,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, generator: torch.Generator | None = None,
                 return_type: str = "input", pad_token_id: int | None = None, cuda_graph: bool = True,
                 lambda_scale: LambdaScale | None = None):
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
            with _defaults_only(self.hf_model), call_lambda_scale(self, lambda_scale):
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


def adapt(model, *, op_mode: str = "auto", dtype: torch.dtype | None = None, device=None,
          device_map=None, offload_folder=None) -> HFQEDModel:
    """An :class:`HFQEDModel` around ``model``: a transformers model object (adapted in place,
    its weights shared; it may be dispatched over devices by accelerate) or a local folder (read
    with ``local_files_only=True``: nothing is downloaded; ``dtype``, and ``device`` or
    accelerate's ``device_map`` with ``offload_folder``, apply to it; its tokenizer, if it has
    one, becomes ``model.tokenizer`` for ``to_tokens`` / ``to_string``)."""
    folder = model if isinstance(model, (str, os.PathLike)) else None
    if folder is not None:
        model = load_transformers(folder, dtype=dtype, device=device, device_map=device_map,
                                  offload_folder=offload_folder)
    elif any(x is not None for x in (dtype, device, device_map, offload_folder)):
        raise ValueError("adapt: `dtype`, `device`, `device_map` and `offload_folder` apply to a folder; "
                         "load or move the model object yourself")
    adapted = HFQEDModel(model, op_mode=op_mode)
    if folder is not None and any(os.path.isfile(os.path.join(folder, f)) for f in TOKENIZER_FILES):
        adapted.tokenizer = os.fspath(folder)  # model.to_tokens / to_string (read on first use)
    return adapted


def load_transformers(path, *, dtype: torch.dtype | None = None, device=None, device_map=None,
                      offload_folder=None) -> nn.Module:
    """The model of the local folder ``path`` (in eval mode): ``AutoModelForCausalLM``, or
    ``AutoModelForImageTextToText`` for a family that transformers builds only as an image-text
    model (GLM-5-Next); refused with the list of supported types before any weight is read when
    its type is not supported. ``device_map`` / ``offload_folder``: accelerate's dispatch."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    path = os.fspath(path)
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"qedprobe.hf: {path!r} is not a model folder (no config.json; nothing is downloaded)")
    if device is not None and device_map is not None:
        raise ValueError("adapt: give `device` or `device_map`, not both")
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    HFQEDConfig.from_transformers(config)
    auto = AutoModelForCausalLM if config.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES else AutoModelForImageTextToText
    placed = {} if device_map is None else dict(device_map=device_map, offload_folder=offload_folder)
    model = auto.from_pretrained(path, local_files_only=True, dtype=dtype, **placed)
    return (model if device is None else model.to(device)).eval()
