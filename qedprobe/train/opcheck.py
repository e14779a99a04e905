"""Does the QED op the model will call have a working backward on the training device?

The Triton ops may ship a forward before their backward. A forward without autograd support
either returns a tensor cut off from the graph (training would then silently freeze q, k, v,
b, w, g and theta) or raises on ``backward``. :func:`backward_problem` runs the op once on small
inputs of the training shape and dtype and says what is wrong, so the trainer can stop with a
clear message or fall back to the PyTorch reference.
"""
from __future__ import annotations

import torch

from qedprobe.lam import random_directions
from qedprobe.ops import qed_attention

PROBE_TOKENS = 64


def backward_problem(model_cfg, device: torch.device, dtype: torch.dtype, mode: str) -> str | None:
    """None when ``qed_attention(mode=mode)`` gives finite gradients to ``q, k, v, g, b, w`` (and
    ``lam`` for arms other than ``gdn2``) on ``device``; otherwise the reason, in words.

    Inputs are ``[1, PROBE_TOKENS, H, K|V]`` in ``dtype`` (``g`` float32, as the model makes them).
    """
    H, K, V = model_cfg.num_heads, model_cfg.head_dim, model_cfg.head_v_dim
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape, dt=dtype, fn=lambda x: x):
        return fn(torch.randn(1, PROBE_TOKENS, *shape, generator=gen)).to(device, dt).requires_grad_()

    q, k, v = leaf(H, K), leaf(H, K), leaf(H, V)
    g = leaf(H, K, dt=torch.float32, fn=lambda x: -torch.nn.functional.softplus(x) * 0.1)
    b, w = leaf(H, K, fn=torch.sigmoid), leaf(H, V, fn=torch.sigmoid)
    lam = torch.full((H,), 0.05, device=device, requires_grad=model_cfg.arm != "gdn2")
    z = random_directions(H, K, 0).to(device) if model_cfg.arm == "rand" else None
    inputs = {"q": q, "k": k, "v": v, "g": g, "b": b, "w": w}
    if lam.requires_grad:
        inputs["lam"] = lam
    try:
        o, _, _ = qed_attention(q, k, v, g, b, w, lam, mode=mode, arm=model_cfg.arm, z=z)
        if not o.requires_grad:
            return f"qed_attention(mode={mode!r}) returns an output without a gradient graph on {device}"
        o.float().square().sum().backward()
    except Exception as err:  # noqa: BLE001 - any failure means: no usable backward
        return f"qed_attention(mode={mode!r}) failed forward/backward on {device}: {type(err).__name__}: {err}"
    bad = [n for n, t in inputs.items() if t.grad is None or not torch.isfinite(t.grad).all()]
    if bad:
        return f"qed_attention(mode={mode!r}) gives no finite gradient to {bad} on {device}"
    return None
