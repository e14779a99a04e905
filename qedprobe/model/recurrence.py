r"""The delta-rule recurrence with its hook points: written once, used by every model qedprobe runs.

:class:`HookedRecurrence` owns the hook points of one layer's recurrence, the erase direction
``d`` (built only when ``hook_d`` has a hook), the probes (requested only when a probe hook has a
hook) and the call of ``qedprobe.ops.qed_attention``. The QED token mixer
(``qedprobe.model.mixer.QEDMixer``) and the transformers adapter
(``qedprobe.hf.recurrence.LinearAttnRecurrence``) are subclasses: they compute the recurrence's
inputs their own way and hand them to :meth:`HookedRecurrence.recur`.

Per token, ``H`` heads (value heads of a grouped model), key dim ``K``, value dim ``V``::

    S_bar_t = Diag(exp g_t) S_{t-1}            a_t = b_t * k_hat_t + lambda d_t
    S_t = S_bar_t + k_hat_t (w_t * v_t - S_bar_t^T a_t)^T     o_t = S_t^T (q_hat_t / sqrt(K))
    e_t = 1 - a_t . k_hat_t       (the erase eigenvalue; q_hat, k_hat: L2-normalised q, k)

Hook points (``hook_q`` ... ``hook_o`` are writable: a hook's return value is what the op uses;
``hook_rho``, ``hook_Sd``, ``hook_e`` are read-only probes)::

    hook_q, hook_k   [B, T, H, K]   before the op's L2 normalisation; one copy per value head
    hook_v           [B, T, H, V]
    hook_b           [B, T, H, K] per-channel erase gate, or [B, T, H] for a scalar gate
    hook_w           [B, T, H, V] per-channel write gate, or [B, T, H] for a scalar gate
    hook_g           [B, T, H, K] per-channel log-decay,  or [B, T, H] for a scalar decay
    hook_lambda      [H] (a hook may return [B, T, H]: per-token lambda)
    hook_d           [B, T, H, K]   the arm's direction (computed only when hooked)
    hook_o           [B, T, H, V]   the recurrence's output
    hook_rho [B, T, H] q_hat . k_hat;  hook_Sd [B, T, H, V] S_bar^T d;  hook_e [B, T, H] e_t

A scalar gate's hook may return the per-channel shape (each channel its own gate). The op takes
each gate as it comes, per head or per channel (nothing is widened or copied here). A model whose
q/k heads are shared by ``m`` value heads (``group_size``) hands them to the op grouped (the op
reads head ``j // m`` for value head ``j``); only while ``hook_q``, ``hook_k`` or ``hook_d`` has a
hook are they copied per value head, so that the hooks see and may change each value head's own.

``hook_Sd`` is the one mixed-case hook name: it is the op's probe ``"Sd"``, the key of
``probes``, of ``ProbeRecorder(probes=...)`` and of ``qedprobe eig``. It has no lowercase alias:
a second attribute holding the same hook point is dropped from ``hook_dict`` (``named_modules``
lists a module once), and entering it there under a name of its own would make name filters
attach one hook twice.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from qedprobe.kernels.qed import erase_direction, l2_normalize
from qedprobe.ops import qed_attention

from .hookio import WatchedHookPoint, has_hook, observe, through


def _gate_through(hook: HookPoint, x: torch.Tensor, width: int) -> torch.Tensor:
    """``x`` through ``hook``: a scalar gate ``[B, T, H]`` may come back as itself or per channel
    ``[B, T, H, width]``; a per-channel gate comes back in its own shape. An unhooked gate is
    returned before its allowed shapes are built (a decode step passes three gates per layer)."""
    if not has_hook(hook):
        return x
    if x.dim() == 3:
        return through(hook, x, tuple(x.shape), (*x.shape, width))
    return through(hook, x)


class RecurrencePoints(NamedTuple):
    """The hook points of one recurrence by name, in the order they fire. :meth:`HookedRecurrence.recur`
    reads them from this plain tuple rather than as submodules: ``nn.Module.__getattr__`` costs about
    a microsecond a lookup, and a decode step makes a dozen per layer."""
    q: HookPoint
    k: HookPoint
    v: HookPoint
    b: HookPoint
    w: HookPoint
    g: HookPoint
    lam: HookPoint
    d: HookPoint
    rho: HookPoint
    Sd: HookPoint
    e: HookPoint
    o: HookPoint


class HookedRecurrence(nn.Module):
    """The hook points of one recurrence and :meth:`recur`, which runs them around the op."""

    def __init__(self, on_hooks_changed=None):
        """``on_hooks_changed``: called after a hook is registered on one of the hook points or
        TransformerLens removes their hooks (they are then :class:`~.hookio.WatchedHookPoint`; a
        torch hook removed by its own handle calls nothing); None: plain ``HookPoint``."""
        super().__init__()
        point = HookPoint if on_hooks_changed is None else (lambda: WatchedHookPoint(on_hooks_changed))
        # Inputs of the recurrence: writable (a hook's return value is what the op uses).
        self.hook_q = point()  # [B, T, H, K] before the op's L2 norm, one copy per value head
        self.hook_k = point()  # [B, T, H, K] idem
        self.hook_v = point()  # [B, T, H, V]
        self.hook_b = point()  # [B, T, H, K] erase gate ([B, T, H] where the model's is scalar)
        self.hook_w = point()  # [B, T, H, V] write gate ([B, T, H] where the model's is scalar)
        self.hook_g = point()  # [B, T, H, K] log-decay ([B, T, H] where the model's is scalar)
        self.hook_lambda = point()  # [H], or [B, T, H] when a hook returns per-token values
        self.hook_d = point()  # [B, T, H, K] erase direction (computed only when hooked)
        self.hook_o = point()  # [B, T, H, V] output of the recurrence
        # Probes of the recurrence: read-only observations (requested only when hooked).
        self.hook_rho = point()  # [B, T, H] q_hat . k_hat
        self.hook_Sd = point()  # [B, T, H, V] S_bar^T d (mixed case: the probe's name "Sd")
        self.hook_e = point()  # [B, T, H] erase eigenvalue 1 - a . k_hat
        self._points = RecurrencePoints(self.hook_q, self.hook_k, self.hook_v, self.hook_b, self.hook_w,
                                        self.hook_g, self.hook_lambda, self.hook_d, self.hook_rho, self.hook_Sd,
                                        self.hook_e, self.hook_o)
        # The read-only probe hook points by probe name (the op's ``probes`` keys).
        self._probe_points = (("rho", self.hook_rho), ("Sd", self.hook_Sd), ("e", self.hook_e))

    def hook_points(self) -> tuple[HookPoint, ...]:
        """Every hook point of the recurrence, inputs first, in the order they fire."""
        return self._points

    def is_hooked(self) -> bool:
        """Whether any hook point of the recurrence has a hook (forward or backward): a host-side
        check of the hook points' hook lists, no device work (a plain loop, no generator: a
        transformers model asks it of every layer at every decode step)."""
        for hook in self._points:
            if has_hook(hook):
                return True
        return False

    def _query_key(self, q: torch.Tensor, k: torch.Tensor, group_size: int) -> tuple:
        """q and k through their hooks, one copy per value head (``[B, T, Hk, K]`` ->
        ``[B, T, Hk * group_size, K]``); grouped heads stay grouped while ``hook_q``, ``hook_k``
        and ``hook_d`` have no hook (the op reads head ``j // m`` itself)."""
        hp = self._points
        if group_size > 1:
            if not any(has_hook(h, forward_only=True) for h in (hp.q, hp.k, hp.d)):
                return q, k
            q, k = q.repeat_interleave(group_size, dim=2), k.repeat_interleave(group_size, dim=2)
        return through(hp.q, q), through(hp.k, k)

    def _direction(self, q, k, b, arm: str, z) -> torch.Tensor | None:
        """``hook_d`` on the arm's direction from ``q_hat``, ``k_hat``, ``b`` (per value head,
        float32 or wider), or None (the op builds it) when ``hook_d`` has no hook."""
        hook_d = self._points.d
        if not has_hook(hook_d, forward_only=True):
            return None
        ct = torch.promote_types(q.dtype, torch.float32)
        b = b if b.dim() == 4 else b.unsqueeze(-1)
        return through(hook_d, erase_direction(l2_normalize(q.to(ct)), l2_normalize(k.to(ct)),
                                               b.to(ct), arm, z))

    def recur(self, q, k, v, g, b, w, lam, *, arm: str, z=None, mode: str = "auto", group_size: int = 1,
              use_qk_l2norm: bool = True, **op_kwargs):
        """The recurrence on ``q``, ``k`` ``[B, T, H / group_size, K]``, ``v`` ``[B, T, H, V]``,
        gates ``g``, ``b``, ``w`` (per channel or scalar, see the module docstring) and ``lam``
        ``[H]``, each through its hook -> ``(o [B, T, H, V] through hook_o, final state or None)``.

        ``arm`` and ``z`` (arm ``rand``'s ``[H, K]``) define ``d``; ``mode`` picks the op;
        ``op_kwargs`` (``initial_state``, ``output_final_state``, ``cu_seqlens``,
        ``inplace_final_state``) go to ``qedprobe.ops.qed_attention`` unchanged.
        """
        B, T, H, V = v.shape
        hp = self._points
        q, k = self._query_key(q, k, group_size)
        v = through(hp.v, v)
        K = q.shape[-1]
        b = _gate_through(hp.b, b, K)
        w = _gate_through(hp.w, w, V)
        g = _gate_through(hp.g, g, K)
        lam = through(hp.lam, lam, (H,), (B, T, H))
        d = self._direction(q, k, b, arm, z)
        hooked = {name: hook for name, hook in self._probe_points if has_hook(hook, forward_only=True)}
        o, state, probes = qed_attention(q, k, v, g, b, w, lam, mode=mode, arm=arm, z=z, d=d,
                                         return_probes=tuple(hooked), use_qk_l2norm=use_qk_l2norm, **op_kwargs)
        for name, hook in hooked.items():
            observe(hook, probes[name])
        return through(hp.o, o), state
