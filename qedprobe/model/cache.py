r"""TransformerLens' ``ActivationCache`` with qedprobe's hook names: :class:`RecurrenceCache`
for every hooked model, :class:`QEDActivationCache` for a ``QEDModel``.

TransformerLens resolves shorthand keys with ``get_act_name``: ``cache["resid_post", 1]`` is
``blocks.1.hook_resid_post`` and ``cache["q", 0]`` is ``blocks.0.attn.hook_q``, but a name it does
not know as an attention activation lands outside the mixer (``("e", 0)`` -> ``blocks.0.hook_e``).
Here ``cache[name, layer]`` (``layer_type`` None, ``"attn"`` or the model's ``mixer_name``) of a
recurrence hook (``hooked.MIXER_HOOKS``: ``q, k, v, b, w, g, lambda, d, o, rho, Sd, e``; ``sd``
finds ``Sd``) is ``hook_name(name, layer, model.mixer_name)``, the same function that names the
hook points, so every mixer hook is reachable as ``cache[name, layer]`` on a ``QEDModel``
(``blocks.{l}.attn.hook_*``) and on a transformers model adapted by ``qedprobe.hf``
(``blocks.{l}.linear_attn.hook_*``). ``stack_activation`` of a recurrence hook stacks the layers
that have a recurrence (``model.mixer_layers``: every layer of a ``QEDModel``, the
linear-attention layers of a hybrid model).

:class:`QEDActivationCache` also maps TransformerLens' norm names to fla's modules::

    ln_final.hook_scale        -> norm.hook_scale
    blocks.{l}.ln1.hook_scale  -> blocks.{l}.attn_norm.hook_scale
    blocks.{l}.ln2.hook_scale  -> blocks.{l}.mlp_norm.hook_scale

so ``decompose_resid``, ``accumulated_resid``, ``apply_ln_to_stack`` and ``logit_attrs`` work.
The weights are not folded (TransformerLens' ``fold_ln``), so
:meth:`QEDActivationCache.apply_ln_to_stack` applies the norm's weight after dividing by the
cached scale: a stack that sums to a residual then sums to exactly what the norm outputs, and
``logit_attrs`` of ``decompose_resid()`` sums to the logits. Helpers that do not apply
(per-head or per-neuron results, SSM helpers, the bridge-only ``logit_lens``) raise a
``ValueError`` that says why and what to use instead (:func:`refuse_helpers`).
"""
from __future__ import annotations

import re

import torch
from transformer_lens.ActivationCache import ActivationCache
from transformer_lens.utilities import get_act_name

from .hooked import MIXER_HOOKS, hook_name

_NORMS = {"ln1": "attn_norm", "ln2": "mlp_norm"}
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
"""ActivationCache helpers that do not apply to a QEDModel, and why."""


def norm_scale_name(name: str) -> str:
    """A TransformerLens norm-scale name -> this model's (other names unchanged)."""
    if name == "ln_final.hook_scale":
        return "norm.hook_scale"
    if m := _BLOCK_NORM.fullmatch(name):
        return f"blocks.{m[1]}.{_NORMS[m[2]]}.hook_scale"
    return name


def is_mixer_hook(name) -> bool:
    """Whether ``name`` is the short name of a recurrence hook (``"sd"`` included)."""
    return name in MIXER_HOOKS or name == "sd"


class RecurrenceCache(ActivationCache):
    """An ``ActivationCache`` whose shorthand keys reach the model's recurrence hooks by
    :func:`~qedprobe.model.hook_name` (see the module docstring)."""

    def resolve(self, key) -> str:
        """The full hook name a key means (a full name, or ``(name, layer[, layer_type])``;
        a negative ``layer`` counts from ``n_layers``)."""
        if isinstance(key, str):
            return key if key in self.cache_dict else get_act_name(key)
        if not isinstance(key, tuple) or not key:
            raise KeyError(f"ActivationCache: a key is a hook name or a tuple (name, layer[, type]), got {key!r}")
        name, *rest = key
        if rest and isinstance(rest[0], int) and rest[0] < 0:
            rest[0] += self.model.cfg.n_layers
        mixer = self.model.mixer_name
        if is_mixer_hook(name) and len(rest) in (1, 2) and rest[1:] in ([], [None], ["attn"], [mixer]) \
                and isinstance(rest[0], int) and rest[0] >= 0:
            return hook_name(name, rest[0], mixer)
        return get_act_name(name, *rest)

    def __getitem__(self, key):
        if isinstance(key, str) and key in self.cache_dict:
            return self.cache_dict[key]
        name = self.resolve(key)
        if name not in self.cache_dict:
            first = f"blocks.{self.model.mixer_layers[0]}."
            held = sorted(k[len(first):] for k in self.cache_dict if k.startswith(first))
            raise KeyError(f"ActivationCache: no cached activation {name!r} (asked for {key!r}); "
                           f"this cache holds {len(self.cache_dict)} names, in {first[:-1]}: {held}")
        return self.cache_dict[name]

    def stack_activation(self, activation_name: str, layer: int = -1, sublayer_type=None):
        """TransformerLens' ``stack_activation`` (the layers below ``layer``; -1 or None: all),
        over the layers with a recurrence (``model.mixer_layers``) for a recurrence hook."""
        if not is_mixer_hook(activation_name):
            return super().stack_activation(activation_name, layer, sublayer_type)
        stop = self.model.cfg.n_layers if layer is None or layer == -1 else layer
        return torch.stack([self[(activation_name, l, sublayer_type)] for l in self.model.mixer_layers if l < stop])


class QEDActivationCache(RecurrenceCache):
    """An ``ActivationCache`` of a :class:`~qedprobe.model.QEDModel` run (see the module doc)."""

    def resolve(self, key) -> str:
        """:meth:`RecurrenceCache.resolve`, with TransformerLens' norm names mapped to fla's."""
        return norm_scale_name(super().resolve(key))

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


def refuse_helpers(cls: type, helpers: dict, model: str) -> None:
    """Replace each ``helpers`` method of ``cls`` (name -> why it does not apply to ``model``)
    by one that raises ``ValueError("ActivationCache.NAME: WHY")``."""
    for name, why in helpers.items():
        def refuse(self, *args, _name=name, _why=why, **kwargs):
            raise ValueError(f"ActivationCache.{_name}: {_why}")
        refuse.__name__ = name
        refuse.__doc__ = f"Not available for {model}: raises ValueError ({why})."
        setattr(cls, name, refuse)


refuse_helpers(QEDActivationCache, _NOT_HERE, "QEDModel")
