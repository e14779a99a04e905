r"""`HFActivationCache`: what ``HFQEDModel.run_with_cache`` returns.

An adapted transformers model has hook points only inside its linear-attention recurrences
(``blocks.{l}.linear_attn.hook_*``), so of TransformerLens' ``ActivationCache`` helpers those
that read hook names work as on a ``QEDModel`` (``qedprobe.model.cache.RecurrenceCache``)::

    cache["e", 0]                 # blocks.0.linear_attn.hook_e   [B, T, value heads]
    cache["sd", 2]                # blocks.2.linear_attn.hook_Sd
    cache.stack_activation("e")   # [linear layers, B, T, value heads], in model.mixer_layers order

and the helpers that read the residual stream, attention heads or MLP neurons (transformers'
modules, which have no hook points) raise a ``ValueError`` saying so and what to use instead.
"""
from __future__ import annotations

from qedprobe.model.cache import RecurrenceCache, refuse_helpers

_RESIDUAL = ("an adapted transformers model hooks only its linear-attention recurrences "
             "(blocks.{l}.linear_attn.hook_*), not transformers' residual stream, norms, attention "
             "heads or MLP neurons: read those from model.hf_model(ids, output_hidden_states=True)")
_NOT_HERE = dict.fromkeys(
    ("accumulated_resid", "decompose_resid", "apply_ln_to_stack", "logit_attrs", "logit_lens",
     "get_full_resid_decomposition", "compute_head_results", "stack_head_results", "get_neuron_results",
     "stack_neuron_results", "compute_ssm_effective_attention", "compute_ssm_state"), _RESIDUAL)
"""ActivationCache helpers that need hook points an adapted transformers model does not have."""


class HFActivationCache(RecurrenceCache):
    """An ``ActivationCache`` of an :class:`~qedprobe.hf.HFQEDModel` run (see the module doc)."""


refuse_helpers(HFActivationCache, _NOT_HERE, "an HFQEDModel")
