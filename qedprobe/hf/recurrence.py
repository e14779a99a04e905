r"""One transformers linear-attention layer's recurrence, run by qedprobe with the QEDModel hooks.

Every supported layer (see :mod:`.families`) hands its recurrence function, per token, ``Hk``
q/k heads and ``Hv = m * Hk`` value heads (value head ``j`` reads q/k head ``j // m``)::

    query, key [B, T, Hk, K] (after conv + SiLU)     value [B, T, Hv, V]
    g     GDN families: [B, T, Hv] log-decay, one per value head
          KDA families: [B, T, Hv, K] log-decay, one per key channel
    beta  [B, T, Hv] in (0, 1) (sigmoid); OLMo-Hybrid with linear_allow_neg_eigval: 2 sigmoid, in (0, 2)

and its update is, per value head, ``S = Diag(exp g) S; S += k_hat (beta (v - S^T k_hat))^T;
o = S^T q_hat / sqrt(K)`` (q and k L2-normalised in the function, ``use_qk_l2norm_in_kernel``).
That is the QED recurrence with ``b = w = beta`` (erase and write gates both ``beta``) and
``lambda = 0``, so :meth:`LinearAttnRecurrence.recurrence` hands ``(query, key, value, g, beta,
beta, lambda)`` to :meth:`qedprobe.model.recurrence.HookedRecurrence.recur`. The hooks show what
the family computes:

=============== ======================== ========================
hook            GDN families             KDA families
=============== ======================== ========================
hook_q, hook_k  [B, T, Hv, K]            [B, T, Hv, K]
hook_v, hook_o  [B, T, Hv, V]            [B, T, Hv, V]
hook_b, hook_w  [B, T, Hv] (beta)        [B, T, Hv] (beta)
hook_g          [B, T, Hv]               [B, T, Hv, K]
hook_lambda     [Hv] (a hook may return [B, T, Hv])
hook_d          [B, T, Hv, K]
hook_rho        [B, T, Hv]
hook_Sd         [B, T, Hv, V]
hook_e          [B, T, Hv]
=============== ======================== ========================

A hook on ``hook_b``, ``hook_w`` or ``hook_g`` may return the per-channel shape (``[B, T, Hv,
K]`` for b and g, ``[B, T, Hv, V]`` for w). ``hook_q`` / ``hook_k`` show q and k before the L2
normalisation, one copy per value head (see ``HookedRecurrence``: grouped heads are copied only
while q, k or d is hooked). ``hook_o`` is the recurrence's output, before the layer's gated norm.

With ``lambda = 0`` the erase eigenvalue is the model's own, ``e = 1 - beta ||k_hat||^2`` with
``k_hat = k / sqrt(||k||^2 + 1e-6)`` (transformers' and fla's L2 norm), i.e. ``1 - beta`` up to
that epsilon: in (0, 1) for every family except OLMo-Hybrid with ``linear_allow_neg_eigval``
(its default), where ``beta = 2 sigmoid(.)`` and ``e = 1 - 2 sigmoid(.) ||k_hat||^2`` lies in
(-1, 1).

**Free when off**: while a layer has no hook on any of its hook points and its injected lambda
is 0 (:meth:`LinearAttnRecurrence.runs_native`, decided on the host from the config and the hook
tables), :mod:`.route` calls the model's own function instead (fla's kernel, FlashQLA through
fla, or transformers' PyTorch code), and the layer carries no module hook (its
:class:`~.route.LayerSwitch` attaches them when a hook is added or lambda injected): the
unhooked, uninjected model runs at native speed with native outputs.
"""
from __future__ import annotations

import torch

from qedprobe.lam import random_directions
from qedprobe.model.recurrence import HookedRecurrence


class LinearAttnRecurrence(HookedRecurrence):
    """The qedprobe recurrence of decoder layer ``layer_idx`` (sizes from an ``HFQEDConfig``).

    ``lambda_scale()`` gives the strength factors of the call now running (the adapted model's
    :meth:`~qedprobe.hf.HFQEDModel.lambda_scale`, read at every call). ``lam`` ``[Hv]`` and, for
    arm ``rand``, ``z`` ``[Hv, K]`` are buffers (float32, not saved: the injection lives in the
    config); ``injected`` is whether any of this layer's lambdas is non-zero (a host-side bool).
    ``switch``: the :class:`~qedprobe.hf.route.LayerSwitch` that routes the layer's calls here
    while it does not run natively (set by the adapted model; None once detached).
    """

    def __init__(self, cfg, layer_idx: int, lambda_scale):
        super().__init__(on_hooks_changed=self.native_changed)
        self.switch = None
        self.layer_idx = layer_idx
        self.row = cfg.linear_layers.index(layer_idx)
        self.group_size = cfg.group_size
        self.lambda_scale = lambda_scale
        self.register_buffer("lam", torch.zeros(cfg.num_heads), persistent=False)
        self.register_buffer("z", None, persistent=False)
        self.arm, self.op_mode, self.injected = "gdn2", cfg.op_mode, False
        self.configure(cfg)

    def configure(self, cfg) -> None:
        """Take the arm, lambda and op mode of ``cfg`` (an ``HFQEDConfig``)."""
        self.arm, self.op_mode = cfg.arm, cfg.op_mode
        self.injected = any(x != 0 for x in cfg.lam[self.row])
        with torch.no_grad():
            self.lam.copy_(torch.tensor(cfg.lam[self.row], dtype=torch.float32))
        z = None
        if cfg.arm == "rand":
            z = random_directions(cfg.num_heads, cfg.head_dim, cfg.rand_seed + self.layer_idx).to(self.lam.device)
        self.z = z
        self.native_changed()

    def runs_native(self) -> bool:
        """Whether this layer's recurrence is the model's own function: nothing injected and no
        hook on any hook point (host-side: no device synchronisation)."""
        return not self.injected and not self.is_hooked()

    def native_changed(self) -> None:
        """Tell the switch that :meth:`runs_native` may have changed (a hook added or removed, a
        new injection)."""
        if self.switch is not None:
            self.switch.sync()

    def follow(self, device: torch.device) -> None:
        """Keep the buffers on ``device``, where the layer's tensors are (a model split over
        devices by accelerate runs each layer where its weights are): moved once, not per call."""
        if self._buffers["lam"].device != device:  # asked at every call: the buffer from its dict
            self.lam = self.lam.to(device)
            self.z = None if self.z is None else self.z.to(device)

    def lam_now(self, phase: str) -> torch.Tensor:
        """``[Hv]`` float32: the injected lambda times the active strength factors of ``phase``
        (on the layer's device, where each factor was copied once: no per-call copy or wait)."""
        lam = self._buffers["lam"]  # the buffer from its dict: nn.Module's attribute lookup costs more
        scales = self.lambda_scale().for_phase(phase, lam.device)
        if scales is None:
            return lam
        return lam * scales[self.layer_idx]

    def recurrence(self, query, key, value, g, beta, *, phase: str, initial_state=None,
                   output_final_state: bool = False, use_qk_l2norm_in_kernel: bool = False,
                   cu_seqlens=None, **unused):
        """transformers' recurrence-function signature (``torch_{chunk,recurrent}_gated_delta_rule``,
        ``{chunk,recurrent}_kimi_delta_attention``; see the module docstring) ->
        ``(o [B, T, Hv, V] in value's dtype, state [N, Hv, K, V] float32 or None)``.

        ``unused``: the keyword arguments transformers' own PyTorch functions also ignore
        (``chunk_size`` and what the layer's ``**kwargs`` carry).
        """
        self.follow(value.device)
        return self.recur(query, key, value, g, beta, beta, self.lam_now(phase), arm=self.arm, z=self._buffers["z"],
                          mode=self.op_mode, group_size=self.group_size, use_qk_l2norm=use_qk_l2norm_in_kernel,
                          initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)
