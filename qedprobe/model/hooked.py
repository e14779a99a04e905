r"""What every hooked model of qedprobe shares: ``run_with_cache`` and the recurrence-layer contract.

A hooked model (``QEDModel``; ``qedprobe.hf.HFQEDModel`` around a transformers model) is a
TransformerLens ``HookedRootModule`` that also says where its recurrences are:

* ``mixer_layers``: the layer indices that run the QED recurrence (every layer of a
  ``QEDModel``; the linear-attention layers of a hybrid transformers model);
* ``mixer_name``: the hook names of layer ``l``'s recurrence are
  ``blocks.{l}.{mixer_name}.hook_{q,k,v,b,w,g,lambda,d,rho,Sd,e,o}`` (:func:`hook_name` builds
  every hook name);
* ``cfg`` with ``num_hidden_layers``, ``num_heads`` (heads of the recurrence), ``head_dim``,
  ``vocab_size`` and ``arm`` (what :func:`qedprobe.model.strength` checks its arguments against).

The probe recorders, the eigenvalue statistics and ``strength`` read only this contract.
"""
from __future__ import annotations

from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.HookedRootModule import HookedRootModule
from transformer_lens.utilities import Slice

from .hookio import has_hook
from .tokens import TokenMethods


MODEL_HOOKS = ("embed",)
BLOCK_HOOKS = ("resid_pre", "attn_out", "resid_mid", "mlp_out", "resid_post")
MIXER_HOOKS = ("q", "k", "v", "b", "w", "g", "lambda", "d", "o", "rho", "Sd", "e")
"""The short names of the hook points: the model's, each block's and each recurrence's
(``qedprobe/model/model.py``: the model and ``QEDBlock``; ``mixer.py``)."""


def hook_name(name: str, layer: int | None = None, mixer_name: str = "attn") -> str:
    """The full hook name of the short ``name``, as TransformerLens' ``get_act_name``.

    ``hook_name("embed")`` -> ``"hook_embed"``; ``hook_name("resid_pre", 2)`` ->
    ``"blocks.2.hook_resid_pre"``; ``hook_name("e", 1)`` -> ``"blocks.1.attn.hook_e"``, with
    ``mixer_name`` the model's ``model.mixer_name`` (``"linear_attn"`` for a transformers model
    from ``qedprobe.hf``). ``"sd"`` (TransformerLens' lowercase) names the probe ``"Sd"``.
    """
    name = "Sd" if name == "sd" else name
    if name in MODEL_HOOKS:
        if layer is not None:
            raise ValueError(f"hook_name: {name!r} is a model hook, it takes no `layer` (got {layer!r})")
        return f"hook_{name}"
    if name not in BLOCK_HOOKS + MIXER_HOOKS:
        raise ValueError(f"hook_name: `name` must be one of {MODEL_HOOKS + BLOCK_HOOKS + MIXER_HOOKS}, got {name!r}")
    if isinstance(layer, bool) or not isinstance(layer, int) or layer < 0:
        raise ValueError(f"hook_name: {name!r} needs a `layer` index >= 0, got {layer!r}")
    return f"blocks.{layer}.hook_{name}" if name in BLOCK_HOOKS else f"blocks.{layer}.{mixer_name}.hook_{name}"


def hooks_attached(model) -> bool:
    """Whether any hook point of ``model`` has a hook (forward or backward; TransformerLens' or
    torch's own, :func:`~.hookio.has_hook`)."""
    return any(has_hook(hp) for hp in model.hook_dict.values())


class HookedModel(TokenMethods, HookedRootModule):
    """``HookedRootModule`` whose ``run_with_cache`` returns a ``cache_class`` (TransformerLens'
    ``ActivationCache``, or a model's subclass of it) by default, with TransformerLens' text
    methods (``tokenizer``, ``to_tokens``, ``to_string``, ...: :mod:`.tokens`)."""

    mixer_name = "attn"
    cache_class = ActivationCache

    def run_with_cache(self, *model_args, return_cache_object: bool = True, remove_batch_dim: bool = False,
                       pos_slice=None, **kwargs):
        """As ``HookedRootModule.run_with_cache``, returning a ``cache_class`` by default.

        ``pos_slice`` slices the position axis of every cached tensor (axis 1, or 0 without the
        batch axis) and leaves per-head ``[H]`` lambda alone.
        """
        out, cache = super().run_with_cache(*model_args, remove_batch_dim=remove_batch_dim, **kwargs)
        if pos_slice is not None:
            pos, cut = int(not remove_batch_dim), Slice.unwrap(pos_slice)
            cache = {k: cut.apply(v, dim=pos) if v.dim() > pos + 1 else v for k, v in cache.items()}
        if return_cache_object:
            cache = self.cache_class(cache, self, has_batch_dim=not remove_batch_dim)
        return out, cache
