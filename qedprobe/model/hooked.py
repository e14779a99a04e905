r"""What every hooked model of qedprobe shares: ``run_with_cache`` and the recurrence-layer contract.

A hooked model (``QEDModel``; ``qedprobe.hf.HFQEDModel`` around a transformers model) is a
TransformerLens ``HookedRootModule`` that also says where its recurrences are:

* ``mixer_layers``: the layer indices that run the QED recurrence (every layer of a
  ``QEDModel``; the linear-attention layers of a hybrid transformers model);
* ``mixer_name``: the hook names of layer ``l``'s recurrence are
  ``blocks.{l}.{mixer_name}.hook_{q,k,v,b,w,g,lambda,d,rho,Sd,e,o}``;
* ``cfg`` with ``num_hidden_layers``, ``num_heads`` (heads of the recurrence), ``head_dim``,
  ``vocab_size`` and ``arm``; ``_strength_factors`` for :func:`qedprobe.model.strength`.

The probe recorders, the eigenvalue statistics and ``strength`` read only this contract.
"""
from __future__ import annotations

from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.HookedRootModule import HookedRootModule
from transformer_lens.utilities import Slice


def mixer_hook_name(model, layer: int, name: str) -> str:
    """``blocks.{layer}.{model.mixer_name}.hook_{name}``."""
    return f"blocks.{layer}.{model.mixer_name}.hook_{name}"


class HookedModel(HookedRootModule):
    """``HookedRootModule`` whose ``run_with_cache`` returns an ``ActivationCache`` by default."""

    mixer_name = "attn"

    def run_with_cache(self, *model_args, return_cache_object: bool = True, remove_batch_dim: bool = False,
                       pos_slice=None, **kwargs):
        """As ``HookedRootModule.run_with_cache``, returning an ``ActivationCache`` by default.

        ``pos_slice`` slices the position axis of every cached tensor (axis 1, or 0 without the
        batch axis) and leaves per-head ``[H]`` lambda alone.
        """
        out, cache = super().run_with_cache(*model_args, remove_batch_dim=remove_batch_dim, **kwargs)
        if pos_slice is not None:
            pos, cut = int(not remove_batch_dim), Slice.unwrap(pos_slice)
            cache = {k: cut.apply(v, dim=pos) if v.dim() > pos + 1 else v for k, v in cache.items()}
        if return_cache_object:
            cache = ActivationCache(cache, self, has_batch_dim=not remove_batch_dim)
        return out, cache
