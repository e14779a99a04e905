"""Random recurrence inputs shared by the benchmarks (``bench/``) and the launch screens
(``scripts/``), so that every timing of one shape runs on the same tensors.

Two layouts: the per-channel one of a GDN-2 / QED layer (``g``, ``b`` per key channel, ``w`` per
value channel) and the scalar-gate one of a Qwen3.5 / Qwen3-Next layer (``g`` and ``beta`` one per
token and value head; with ``channel_g`` a KDA layer's per-channel ``g``). Values are drawn in a fixed
order after ``torch.manual_seed(seed)``; ``v`` is halved and the log-decay lies in ``(-0.1, 0]`` so that
long sequences keep the state bounded.
"""
from __future__ import annotations

import torch


def per_channel_inputs(B, T, H, HV, K, V, *, device="cuda", dtype=torch.bfloat16, seed=0) -> dict:
    """``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]``, float32 ``g`` and ``b`` ``[B, T, HV, K]``
    (``b`` in ``dtype``), ``w`` ``[B, T, HV, V]``, ``lam`` 0.1 per value head (float32) and ``z``
    ``[HV, K]``, one unit direction per value head (the ``rand`` arm's)."""
    torch.manual_seed(seed)
    return dict(
        q=torch.randn(B, T, H, K, device=device, dtype=dtype), k=torch.randn(B, T, H, K, device=device, dtype=dtype),
        v=torch.randn(B, T, HV, V, device=device, dtype=dtype) * 0.5,
        g=-torch.rand(B, T, HV, K, device=device, dtype=torch.float32) * 0.1,
        b=torch.rand(B, T, HV, K, device=device, dtype=dtype), w=torch.rand(B, T, HV, V, device=device, dtype=dtype),
        lam=0.1 * torch.ones(HV, device=device, dtype=torch.float32),
        z=torch.nn.functional.normalize(torch.randn(HV, K, device=device), dim=-1))


def head_gate_inputs(B, T, H, HV, K, V=None, *, device="cuda", channel_g=False, seed=0) -> dict:
    """bf16 ``q, k`` ``[B, T, H, K]``, ``v`` ``[B, T, HV, V]`` (``V`` defaults to ``K``), float32 ``g``
    ``[B, T, HV]`` (``[B, T, HV, K]`` with ``channel_g``), bf16 ``beta`` ``[B, T, HV]`` and ``lam`` 0.1
    per value head (float32)."""
    torch.manual_seed(seed)
    bf = dict(device=device, dtype=torch.bfloat16)
    g_shape = (B, T, HV, K) if channel_g else (B, T, HV)
    return dict(q=torch.randn(B, T, H, K, **bf), k=torch.randn(B, T, H, K, **bf),
                v=torch.randn(B, T, HV, K if V is None else V, **bf) * 0.5,
                g=-0.1 * torch.rand(*g_shape, device=device), beta=torch.rand(B, T, HV, **bf),
                lam=torch.full((HV,), 0.1, device=device))
