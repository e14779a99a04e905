r"""`QEDActivationCache`: TransformerLens' ``ActivationCache`` with this model's names and norms.

TransformerLens resolves shorthand keys with ``get_act_name``: ``cache["resid_post", 1]`` is
``blocks.1.hook_resid_post`` and ``cache["q", 0]`` is ``blocks.0.attn.hook_q``, but a name it does
not know as an attention activation lands outside the mixer (``("e", 0)`` -> ``blocks.0.hook_e``).
Here a block-level name the cache does not hold resolves to the mixer's hook of that name (so
every mixer hook, ``q, k, v, b, w, g, lambda, d, o, rho, Sd, e``, is reachable as
``cache[name, layer]``), and TransformerLens' norm names map to fla's modules::

    ln_final.hook_scale        -> norm.hook_scale
    blocks.{l}.ln1.hook_scale  -> blocks.{l}.attn_norm.hook_scale
    blocks.{l}.ln2.hook_scale  -> blocks.{l}.mlp_norm.hook_scale

so ``stack_activation("e")``, ``decompose_resid``, ``accumulated_resid``, ``apply_ln_to_stack``
and ``logit_attrs`` work. The weights are not folded (TransformerLens' ``fold_ln``), so
:meth:`QEDActivationCache.apply_ln_to_stack` applies the norm's weight after dividing by the
cached scale: a stack that sums to a residual then sums to exactly what the norm outputs, and
``logit_attrs`` of ``decompose_resid()`` sums to the logits. Helpers that do not apply here
(per-head or per-neuron results, SSM helpers, the bridge-only ``logit_lens``) raise a
``ValueError`` that says why and what to use instead (``_NOT_HERE``).
"""
from __future__ import annotations

import re

from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.utilities import get_act_name

_NORMS = {"ln1": "attn_norm", "ln2": "mlp_norm"}
_BLOCK_HOOK = re.compile(r"blocks\.(\d+)\.hook_(\w+)")
_BLOCK_NORM = re.compile(r"blocks\.(\d+)\.(ln1|ln2)\.hook_scale")

_HEADS = ("QEDModel has no attention heads with a per-head result or pattern, nor MLP neurons with "
          "hook_post (its mixer is a linear recurrence, its MLP a SwiGLU without neuron hooks): use "
          "decompose_resid / accumulated_resid for residual contributions, or the mixer hooks "
          "(hook_o per head, hook_rho, hook_Sd, hook_e)")
_NOT_HERE = {
    **dict.fromkeys(("compute_head_results", "stack_head_results", "get_neuron_results",
                     "stack_neuron_results", "get_full_resid_decomposition"), _HEADS),
    **dict.fromkeys(("compute_ssm_effective_attention", "compute_ssm_state"),
                    "TransformerLens' SSM helpers read Mamba-style mixers; QEDModel's recurrence "
                    "state is carried by forward_with_state(..., want_state=True)"),
    "logit_lens": "TransformerLens' logit_lens needs a TransformerBridge; the same readout is "
                  "cache.accumulated_resid(apply_ln=True) @ model.W_U",
}
"""ActivationCache helpers that do not apply to this architecture, and why."""


def norm_scale_name(name: str) -> str:
    """A TransformerLens norm-scale name -> this model's (other names unchanged)."""
    if name == "ln_final.hook_scale":
        return "norm.hook_scale"
    if m := _BLOCK_NORM.fullmatch(name):
        return f"blocks.{m[1]}.{_NORMS[m[2]]}.hook_scale"
    return name


def mixer_name(name: str) -> str | None:
    """``blocks.{l}.hook_X`` -> ``blocks.{l}.attn.hook_X`` (where TransformerLens' shorthand puts
    a name it does not know as an attention activation; ``sd``, its lowercase, is ``Sd``), else None."""
    m = _BLOCK_HOOK.fullmatch(name)
    return f"blocks.{m[1]}.attn.hook_{'Sd' if m[2] == 'sd' else m[2]}" if m else None


class QEDActivationCache(ActivationCache):
    """An ``ActivationCache`` of a :class:`~qedprobe.model.QEDModel` run (see the module doc)."""

    def _act_name(self, key) -> str:
        if isinstance(key, str):
            return key if key in self.cache_dict else get_act_name(key)
        if not isinstance(key, tuple) or not key:
            raise KeyError(f"ActivationCache: a key is a hook name or a tuple (name, layer[, type]), got {key!r}")
        name, *rest = key
        if rest and isinstance(rest[0], int) and rest[0] < 0:
            rest[0] += self.model.cfg.n_layers
        return get_act_name(name, *rest)

    def __getitem__(self, key):
        if isinstance(key, str) and key in self.cache_dict:
            return self.cache_dict[key]
        name = norm_scale_name(self._act_name(key))
        if name not in self.cache_dict and mixer_name(name) in self.cache_dict:
            name = mixer_name(name)
        if name not in self.cache_dict:
            layer0 = sorted(k[len("blocks.0."):] for k in self.cache_dict if k.startswith("blocks.0."))
            raise KeyError(f"ActivationCache: no cached activation {name!r} (asked for {key!r}); "
                           f"this cache holds {len(self.cache_dict)} names, per layer: {layer0}")
        return self.cache_dict[name]

    def _norm(self, layer, mlp_input: bool):
        """The RMSNorm whose input a stack at ``layer`` (``None``, -1 or ``n_layers``: the final one) is."""
        if layer is None or layer in (-1, self.model.cfg.n_layers):
            return self.model.norm
        block = self.model.blocks[layer]
        return block.mlp_norm if mlp_input else block.attn_norm

    def apply_ln_to_stack(self, residual_stack, layer=None, mlp_input=False, pos_slice=None,
                          batch_slice=None, has_batch_dim=True, recompute_ln=False):
        """TransformerLens' ``apply_ln_to_stack`` (divide by the cached ``hook_scale``), times the
        norm's ``weight`` ``[d_model]``: each component's share of the normed residual. With
        ``recompute_ln`` at the final layer, each component goes through the final norm itself."""
        final = layer is None or layer in (-1, self.model.cfg.n_layers)
        out = super().apply_ln_to_stack(residual_stack, layer, mlp_input, pos_slice, batch_slice,
                                        has_batch_dim, recompute_ln)
        if recompute_ln and final:
            return out
        return out * self._norm(layer, mlp_input).weight.to(out.dtype)


def _refuse(name: str, why: str):
    def refuse(self, *args, **kwargs):
        raise ValueError(f"ActivationCache.{name}: {why}")
    refuse.__name__ = name
    refuse.__doc__ = f"Not available for QEDModel: raises ValueError ({why})."
    return refuse


for _name, _why in _NOT_HERE.items():
    setattr(QEDActivationCache, _name, _refuse(_name, _why))
