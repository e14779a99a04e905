r"""One linear-attention layer's recurrence, run by qedprobe, with the QEDModel hook vocabulary.

transformers' Gated DeltaNet (GDN with scalar gates) hands over, per token, ``Hk`` q/k heads and
``Hv = m * Hk`` value heads (value head ``j`` reads q/k head ``j // m``)::

    query, key [B, T, Hk, K] (after conv + SiLU)   value [B, T, Hv, V]
    g [B, T, Hv] (log-decay, float32)               beta [B, T, Hv] (sigmoid; x2 in OLMo-Hybrid)

and its update is, per value head, ``S = exp(g) S; S += k_hat (beta (v - S^T k_hat))^T;
o = S^T q_hat / sqrt(K)``. That is GDN-2 with ``b = beta 1_K``, ``w = beta 1_V`` and
``g 1_K``, so :meth:`LinearAttnRecurrence.recurrence` runs ``qedprobe.ops.qed_attention`` on::

    q, k = query, key repeated m times along the heads       hook_q, hook_k  [B, T, Hv, K]
    v    = value                                             hook_v          [B, T, Hv, V]
    b    = beta broadcast over K                             hook_b          [B, T, Hv, K]
    w    = beta broadcast over V                             hook_w          [B, T, Hv, V]
    g    = g broadcast over K                                hook_g          [B, T, Hv, K]
    lambda = s * lam  (injected lam [Hv], s from strength)   hook_lambda     [Hv] (or [B, T, Hv])
    d    = the arm's direction (only when hooked)            hook_d          [B, T, Hv, K]
    rho, e [B, T, Hv]; Sd [B, T, Hv, V]  (read-only probes)  hook_rho, hook_e, hook_Sd
    o    = the recurrence's output                           hook_o          [B, T, Hv, V]

With lambda = 0 this is the layer as trained: ``e = 1 - beta ||k_hat||^2`` with
``k_hat = k / sqrt(||k||^2 + 1e-6)``, i.e. ``1 - beta`` up to that epsilon. ``hook_q`` /
``hook_k`` show q and k before the L2 normalisation the op applies, one copy per value head (a
hook may give each value head its own). Writable hooks (q, k, v, b, w, g, lambda, d, o) return
what the op uses; the gates may come back per channel.

Cost: the op takes grouped heads natively, so q and k are copied per value head (``m`` times
larger) only while ``hook_q``, ``hook_k`` or ``hook_d`` has a hook; the scalar gates are always
materialised as ``b``, ``g`` ``[B, T, Hv, K]`` and ``w`` ``[B, T, Hv, V]`` (the op's gates are
per channel) where transformers passes ``[B, T, Hv]``.
"""
from __future__ import annotations

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from qedprobe.kernels.qed import erase_direction, l2_normalize
from qedprobe.lam import random_directions
from qedprobe.model.hookio import observe, through
from qedprobe.ops import qed_attention


class LinearAttnRecurrence(nn.Module):
    """The qedprobe recurrence of decoder layer ``layer_idx`` (sizes from an ``HFQEDConfig``).

    ``lambda_scale()`` gives the strength factors of the call now running (the adapted model's
    :meth:`~qedprobe.hf.HFQEDModel.lambda_scale`, read at every call). ``lam`` ``[Hv]`` and, for arm ``rand``, ``z`` ``[Hv, K]`` are buffers
    (float32, not saved: the injection lives in the config).
    """

    def __init__(self, cfg, layer_idx: int, lambda_scale):
        super().__init__()
        self.layer_idx = layer_idx
        self.row = cfg.linear_layers.index(layer_idx)
        self.group_size = cfg.group_size
        self.lambda_scale = lambda_scale
        self.register_buffer("lam", torch.zeros(cfg.num_heads), persistent=False)
        self.register_buffer("z", None, persistent=False)
        self.arm, self.op_mode = "gdn2", cfg.op_mode
        # Inputs of the recurrence: writable (a hook's return value is what the op uses).
        self.hook_q = HookPoint()  # [B, T, Hv, K] q/k head j // m for value head j, before the L2 norm
        self.hook_k = HookPoint()  # [B, T, Hv, K] idem
        self.hook_v = HookPoint()  # [B, T, Hv, V]
        self.hook_b = HookPoint()  # [B, T, Hv, K] erase gate: beta broadcast over K
        self.hook_w = HookPoint()  # [B, T, Hv, V] write gate: beta broadcast over V
        self.hook_g = HookPoint()  # [B, T, Hv, K] log-decay broadcast over K
        self.hook_lambda = HookPoint()  # [Hv], or [B, T, Hv] when a hook returns per-token values
        self.hook_d = HookPoint()  # [B, T, Hv, K] erase direction (computed only when hooked)
        self.hook_o = HookPoint()  # [B, T, Hv, V] output of the recurrence, before the gated norm
        # Probes of the recurrence: read-only observations (requested only when hooked).
        self.hook_rho = HookPoint()  # [B, T, Hv] q_hat . k_hat
        self.hook_Sd = HookPoint()  # [B, T, Hv, V] S_bar^T d
        self.hook_e = HookPoint()  # [B, T, Hv] erase eigenvalue 1 - a . k_hat
        self.configure(cfg)

    def probe_hooks(self) -> dict[str, HookPoint]:
        """The read-only probe hook points by probe name (the op's ``probes`` keys)."""
        return {"rho": self.hook_rho, "Sd": self.hook_Sd, "e": self.hook_e}

    def configure(self, cfg) -> None:
        """Take the arm, lambda and op mode of ``cfg`` (an ``HFQEDConfig``)."""
        self.arm, self.op_mode = cfg.arm, cfg.op_mode
        with torch.no_grad():
            self.lam.copy_(torch.tensor(cfg.lam[self.row], dtype=torch.float32))
        z = None
        if cfg.arm == "rand":
            z = random_directions(cfg.num_heads, cfg.head_dim, cfg.rand_seed + self.layer_idx).to(self.lam.device)
        self.z = z

    def lam_now(self, phase: str, device) -> torch.Tensor:
        """``[Hv]`` float32 on ``device`` (the layer's: a model split over devices keeps its
        buffers on one): the injected lambda times the active strength factors of ``phase``."""
        scales = self.lambda_scale().for_phase(phase)
        lam = self.lam.to(device)
        return lam if scales is None else lam * scales[self.layer_idx].to(device)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        """``[B, T, Hk, K]`` -> ``[B, T, Hv, K]`` (value head ``j`` gets q/k head ``j // m``)."""
        return x if self.group_size == 1 else x.repeat_interleave(self.group_size, dim=2)

    def _query_key(self, query: torch.Tensor, key: torch.Tensor) -> tuple:
        """q and k for the op: as transformers gives them (``[B, T, Hk, K]``, the op reads head
        ``j // m`` for value head ``j``), or, when ``hook_q``, ``hook_k`` or ``hook_d`` has a
        hook, one copy per value head (``[B, T, Hv, K]``) through ``hook_q`` / ``hook_k``."""
        if not any(h.has_hooks(dir="fwd") for h in (self.hook_q, self.hook_k, self.hook_d)):
            return query, key
        return through(self.hook_q, self._heads(query)), through(self.hook_k, self._heads(key))

    def recurrence(self, query, key, value, g, beta, *, phase: str, initial_state=None,
                   output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                   cu_seqlens=None, **unused):
        """transformers' ``torch_{chunk,recurrent}_gated_delta_rule`` signature (see module
        docstring) -> ``(o [B, T, Hv, V] in value's dtype, state [N, Hv, K, V] float32 or None)``.

        ``unused``: the keyword arguments transformers' own PyTorch functions also ignore
        (``chunk_size`` and what the layer's ``**kwargs`` carry).
        """
        B, T, Hv, V = value.shape
        K = query.shape[-1]
        q, k = self._query_key(query, key)
        v = through(self.hook_v, value)
        b = through(self.hook_b, beta.unsqueeze(-1).expand(B, T, Hv, K))
        w = through(self.hook_w, beta.unsqueeze(-1).expand(B, T, Hv, V))
        g = through(self.hook_g, g.unsqueeze(-1).expand(B, T, Hv, K))
        lam = through(self.hook_lambda, self.lam_now(phase, value.device), (Hv,), (B, T, Hv))
        z = None if self.z is None else self.z.to(value.device)
        d = None
        if self.hook_d.has_hooks(dir="fwd"):  # q, k are per value head here (_query_key)
            ct = torch.promote_types(q.dtype, torch.float32)
            d = through(self.hook_d, erase_direction(l2_normalize(q.to(ct)), l2_normalize(k.to(ct)),
                                                     b.to(ct), self.arm, z))
        probe_hooks = self.probe_hooks()
        want_probes = any(hook.has_hooks(dir="fwd") for hook in probe_hooks.values())
        o, state, probes = qed_attention(
            q, k, v, g, b, w, lam, mode=self.op_mode, arm=self.arm, z=z, d=d,
            initial_state=initial_state, output_final_state=output_final_state,
            return_probes=want_probes, use_qk_l2norm=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens)
        if want_probes:
            for name, hook in probe_hooks.items():
                observe(hook, probes[name])
        return through(self.hook_o, o), state
