r"""The QED token mixer: fla's ``GatedDeltaNet2`` layer plus the QED erase direction.

Per token (``H`` heads, key dim ``K``, value dim ``V``; ``x`` is the normed residual)::

    q, k, v = silu(conv(W_q x)), silu(conv(W_k x)), silu(conv(W_v x))   hook_q/k/v
    b       = sigmoid(W_b x)                  erase gate  [B,T,H,K]      hook_b
    w       = sigmoid(W_w x)                  write gate  [B,T,H,V]      hook_w
    g       = -exp(A_log_h) * softplus(F2 F1 x + dt_bias)   log-decay [B,T,H,K]  hook_g
    lambda  = s * lambda_max * sigmoid(theta) [H] (0 for arm gdn2; s from ``strength``)  hook_lambda
    d       = the arm's direction from q_hat, k_hat, b (z for arm rand)  [B,T,H,K]  hook_d
    o       = QED recurrence (qedprobe.ops.qed_attention, q and k L2-normalised inside)  hook_o
    out     = W_o( rms_norm(o) * sigmoid(G2 G1 x) )                      per head over V

The recurrence and its hook points (``hook_q`` ... ``hook_e``, their shapes, which are writable,
when ``d`` and the probes are computed) are :class:`qedprobe.model.recurrence.HookedRecurrence`'s,
shared with the transformers adapter; here every gate is per channel (``hook_b``, ``hook_g``
``[B,T,H,K]``, ``hook_w`` ``[B,T,H,V]``) and q, k have one head per value head.

Parameter names are fla's (``q_proj``, ``q_conv1d``, ``f_proj.0/1``, ``b_proj``, ``w_proj``,
``A_log``, ``dt_bias``, ``g_proj.0/1``, ``o_norm``, ``o_proj``) plus ``theta`` ``[H]`` (not for
arm gdn2) and the persistent buffer ``z`` ``[H, K]`` (arm rand only).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from qedprobe.lam import init_theta, lambda_from_theta, random_directions

from .config import QEDConfig
from .layers import RMSNorm, ShortConvolution
from .recurrence import HookedRecurrence


class MixerState(NamedTuple):
    """Carried state of one mixer: ``recurrent`` ``[N, H, K, V]`` (float32) and the q/k/v
    convolution caches, each ``[N, D, conv_size - 1]``."""

    recurrent: torch.Tensor
    conv: tuple


def log_decay(f: torch.Tensor, dt_bias: torch.Tensor, A_log: torch.Tensor, heads: int,
              dtype: torch.dtype) -> torch.Tensor:
    """``g = -exp(A_log_h) * softplus(f + dt_bias)`` from the decay projection ``f`` ``[..., H * K]``
    (``F2 F1 x``), ``[..., H, K]`` in ``dtype`` (float32, or float64 for a float64 model): the
    mixer's log-decay, also the fast path's (``fast.py``)."""
    g = F.softplus(f.to(dtype) + dt_bias.to(dtype))
    return -A_log.to(dtype).exp().unsqueeze(-1) * g.unflatten(-1, (heads, -1))


def init_decay_(A_log: nn.Parameter, dt_bias: nn.Parameter, a_range, dt_range) -> None:
    """Decay initialisation (fla's with QEDConfig's default ranges): ``exp(A_log) ~ U(a_range)``;
    ``softplus(dt_bias) = dt`` with ``dt`` log-uniform in ``dt_range``."""
    with torch.no_grad():
        A_log.copy_(torch.empty_like(A_log).uniform_(*a_range).log())
        log_dt = torch.empty_like(dt_bias).uniform_(math.log(dt_range[0]), math.log(dt_range[1]))
        dt = log_dt.exp()
        dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse of softplus


class QEDMixer(HookedRecurrence):
    """``[B, T, hidden] -> [B, T, hidden]`` QED token mixer of layer ``layer_idx``."""

    def __init__(self, cfg: QEDConfig, layer_idx: int):
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        H, K, V, D = cfg.num_heads, cfg.head_dim, cfg.head_v_dim, cfg.hidden_size
        self.q_proj = nn.Linear(D, H * K, bias=False)
        self.k_proj = nn.Linear(D, H * K, bias=False)
        self.v_proj = nn.Linear(D, H * V, bias=False)
        self.q_conv1d = ShortConvolution(H * K, cfg.conv_size, cfg.conv_bias)
        self.k_conv1d = ShortConvolution(H * K, cfg.conv_size, cfg.conv_bias)
        self.v_conv1d = ShortConvolution(H * V, cfg.conv_size, cfg.conv_bias)
        self.f_proj = nn.Sequential(nn.Linear(D, V, bias=False), nn.Linear(V, H * K, bias=False))
        self.b_proj = nn.Linear(D, H * K, bias=False)
        self.w_proj = nn.Linear(D, H * V, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        init_decay_(self.A_log, self.dt_bias, cfg.decay_a_range, cfg.decay_dt_range)
        self.g_proj = nn.Sequential(nn.Linear(D, V, bias=False), nn.Linear(V, H * V, bias=True))
        self.o_norm = RMSNorm(V, cfg.norm_eps)
        self.o_proj = nn.Linear(H * V, D, bias=False)
        if cfg.arm == "gdn2":
            self.register_parameter("theta", None)
        else:
            self.theta = nn.Parameter(init_theta(H))
        if cfg.arm == "rand":
            self.register_buffer("z", random_directions(H, K, cfg.rand_seed + layer_idx), persistent=True)
        else:
            self.z = None

    def _heads(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        return x.unflatten(-1, (self.cfg.num_heads, dim))

    def log_decay(self, x: torch.Tensor) -> torch.Tensor:
        """``g = -exp(A_log_h) * softplus(f_proj(x) + dt_bias)``, ``[B, T, H, K]`` in float32
        (float64 for a float64 model)."""
        return self.decay(self.f_proj[0](x))

    def decay(self, f_low: torch.Tensor) -> torch.Tensor:
        """:meth:`log_decay` from the first decay projection ``f_low = F1 x`` ``[B, T, V]``."""
        return log_decay(self.f_proj[1](f_low), self.dt_bias, self.A_log, self.cfg.num_heads,
                         torch.promote_types(f_low.dtype, torch.float32))

    def output(self, o: torch.Tensor, g_low: torch.Tensor) -> torch.Tensor:
        """``W_o(rms_norm(o) * sigmoid(G2 g_low))`` ``[B, T, hidden]`` from the recurrence's output
        ``o`` ``[B, T, H, V]`` and the first gate projection ``g_low = G1 x`` ``[B, T, V]``."""
        gate = self._heads(self.g_proj[1](g_low), self.cfg.head_v_dim)
        return self.o_proj(self.o_norm(o, gate).flatten(-2))

    def run_recurrence(self, q, k, v, g, b, w, lam_scale, state: MixerState | None, cu_seqlens,
                       want_state: bool, state_in_place: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`recur` with this layer's lambda (times ``lam_scale``), arm, directions and op,
        continuing ``state``'s recurrent state: ``(o [B, T, H, V], final state or None)``."""
        cfg = self.cfg
        return self.recur(q, k, v, g, b, w, self.lam(lam_scale), arm=cfg.arm, z=self.z, mode=cfg.op_mode,
                          initial_state=None if state is None else state.recurrent, output_final_state=want_state,
                          cu_seqlens=cu_seqlens, inplace_final_state=state_in_place)

    def lam(self, scale: torch.Tensor | None = None) -> torch.Tensor:
        """``scale * lambda_max * sigmoid(theta)``, ``[H]`` (zeros for arm gdn2), float32
        (float64 for a float64 model)."""
        ct = torch.promote_types(self.A_log.dtype, torch.float32)
        if self.theta is None:
            lam = torch.zeros(self.cfg.num_heads, dtype=ct, device=self.A_log.device)
        else:
            lam = lambda_from_theta(self.theta.to(ct), self.cfg.lambda_max)
        return lam if scale is None else lam * scale.to(lam)

    def forward(self, x: torch.Tensor, *, lam_scale: torch.Tensor | None = None,
                state: MixerState | None = None, cu_seqlens: torch.Tensor | None = None,
                want_state: bool = False, state_in_place: bool = False):
        """``x`` ``[B, T, hidden]`` -> ``(out [B, T, hidden], MixerState or None)``.

        ``lam_scale`` ``[H]`` multiplies lambda; ``state`` continues N sequences (N = B, or
        ``len(cu_seqlens) - 1`` for packed input with B = 1). ``state_in_place`` writes the new
        state over ``state``: the recurrent state (the recurrent op's ``inplace_final_state``:
        CUDA, one token per sequence) and the convolution caches, for a decode loop that owns
        its state buffers.
        """
        cfg = self.cfg
        K, V = cfg.head_dim, cfg.head_v_dim
        conv_in = state.conv if state is not None else (None, None, None)
        q, cq = self.q_conv1d(self.q_proj(x), conv_in[0], cu_seqlens)
        k, ck = self.k_conv1d(self.k_proj(x), conv_in[1], cu_seqlens)
        v, cv = self.v_conv1d(self.v_proj(x), conv_in[2], cu_seqlens)
        o, recurrent = self.run_recurrence(
            self._heads(q, K), self._heads(k, K), self._heads(v, V), self.log_decay(x),
            self._heads(self.b_proj(x).sigmoid(), K), self._heads(self.w_proj(x).sigmoid(), V), lam_scale,
            state, cu_seqlens, want_state, state_in_place)
        out = self.output(o, self.g_proj[0](x))
        conv_out = (cq, ck, cv)
        if state_in_place:
            conv_out = tuple(cache.copy_(new) for cache, new in zip(state.conv, conv_out))
        return out, (MixerState(recurrent, conv_out) if want_state else None)
