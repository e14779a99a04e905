"""``qedprobe demo``: the paper's worked 2-D example and a probe table of a random QED layer per arm.

Runs on CPU in a second; prints what the recurrence does and where the probes live.
"""
from __future__ import annotations

import torch

from qedprobe.lam import random_directions
from qedprobe.ops import ARMS, qed_naive

F64 = torch.float64


def worked_example() -> list[str]:
    """The paper's 2-D example: K=2, V=1, k=(1,0), q=(0.6,0.8), b=(0.5,0.5), S_bar=(2,3), wv=1, lam=0.2."""
    t = lambda *x: torch.tensor(x, dtype=F64).view(1, 1, 1, -1)  # noqa: E731
    state = torch.tensor([2.0, 3.0], dtype=F64).view(1, 1, 2, 1)
    lines = ["Worked 2-D example (k=(1,0), q=(0.6,0.8), b=(0.5,0.5), S_bar=(2,3), w*v=1, lambda=0.2, no scale)"]
    for arm in ("gdn2", "full"):
        o, s, p = qed_naive(t(0.6, 0.8), t(1.0, 0.0), t(1.0), t(0.0, 0.0), t(0.5, 0.5), t(1.0),
                            torch.tensor([0.2], dtype=F64), arm=arm, scale=1.0, initial_state=state,
                            output_final_state=True, return_probes=True, use_qk_l2norm=False)
        d = ", ".join(f"{x:g}" for x in p["d"].flatten().tolist())
        st = ", ".join(f"{x:g}" for x in s.flatten().tolist())
        lines.append(f"  {arm:5s}: d=({d})  S_bar^T d={p['Sd'].item():g}  e={p['e'].item():g}  "
                     f"new state=({st})  output={o.item():g}")
    return lines


def probe_table(B=2, T=256, H=4, K=32, V=32, lam=0.2, seed=0) -> list[str]:
    """Random inputs through every arm from the same state: probe statistics and the output change."""
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen)  # noqa: E731
    u = lambda *s: torch.rand(*s, generator=gen)  # noqa: E731
    q, k, v = r(B, T, H, K), r(B, T, H, K), r(B, T, H, V)
    g, b, w = -0.1 * u(B, T, H, K), u(B, T, H, K), u(B, T, H, V)
    lam_h = torch.full((H,), lam)
    o_ref, _, _ = qed_naive(q, k, v, g, b, w, lam_h, arm="gdn2")
    lines = [f"Random QED layer (B={B}, T={T}, H={H}, K={K}, V={V}, lambda={lam}); "
             "probes per token and head, e = 1 - a.k",
             "| arm | mean rho | mean ||S_bar^T d|| | e min | e max | mean |o - o_gdn2| |",
             "|---|---|---|---|---|---|"]
    for arm in ARMS:
        z = random_directions(H, K, seed) if arm == "rand" else None
        o, _, p = qed_naive(q, k, v, g, b, w, lam_h, arm=arm, z=z, return_probes=True)
        lines.append(f"| {arm} | {p['rho'].mean():+.4f} | {p['Sd'].norm(dim=-1).mean():.4f} | "
                     f"{p['e'].min():.4f} | {p['e'].max():.4f} | {(o - o_ref).abs().mean():.2e} |")
    return lines
