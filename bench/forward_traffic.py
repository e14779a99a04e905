r"""Bytes each forward launch reads and writes: ``qed_chunk`` against fla 0.6.0 ``chunk_gdn2``.

    python bench/forward_traffic.py [--B 8] [--T 4096] [--H 16] [--K 128] [--V 128] [--details]
                                    [--measured kernels.json]

An analytic model, not a measurement. Each launch is a list of tensor accesses written down from
the kernel's loads and stores (the kernel and line each one comes from is named beside it); the
tensor sizes are those the wrappers allocate for bf16 ``q, k, v, b, w``, float32 ``g`` and
state, on a GPU (intermediate buffers in bf16, ``chunk.chunk_precision``). Per access:

* ``elems``: elements of the tensor (as allocated), ``share``: the fraction of them the
  launch touches (masked-off elements not counted: e.g. only the lower triangle of a causal
  ``[BT, BT]`` tile);
* ``times``: how many programs request the same element (e.g. one per value block when the
  grid splits V; a score row block re-reading the earlier key rows of its chunk).

Two totals per launch: ``unique`` = each element once (the traffic DRAM must carry if re-reads
hit L2; the figure to compare with the H200's ~4.3 TB/s), and ``requested`` = with ``times``
(what the loads ask of L2). Launch configurations come from the kernels' own rule constants
(``state_config``, ``output_config``); fla's autotuned value blocks are assumptions, named in the
table (``--fla-state-bv``, ``--fla-output-bv``). Branches the benchmark inputs never take
(the exact diagonal blocks at decay spans over ``SPAN_MAX``) are not counted.

``--measured`` joins the model with the per-kernel rows ``bench/kernel_times.py --parts`` wrote (ms
per call, torch.profiler, same shape): per kernel GB/s of unique bytes and the share of the
H200's ``PEAK_TBS``, which says whether a launch is bound by bytes moved or by something else.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch
import triton

from qedprobe.kernels.qed.chunk_common import BC, BT
from qedprobe.kernels.qed.chunk_scan import output_config, state_config

IO, F32 = 2, 4
"""Bytes per element of the benchmark's inputs / intermediates (bf16) and of float32 tensors."""
PEAK_TBS = 4.8
"""The H200's HBM3e bandwidth by its specification, TB/s."""
H200_SMS = 132
"""The H200's streaming multiprocessors (the state scan's value block depends on them)."""


@dataclass(frozen=True)
class Shape:
    """The benchmark shape; ``HV = H`` (no grouped value heads)."""

    B: int
    T: int
    H: int
    K: int
    V: int

    @property
    def rows(self) -> int:
        """Token-heads ``B * T * H``."""
        return self.B * self.T * self.H

    @property
    def chunks(self) -> int:
        """Chunk-heads ``B * cdiv(T, BT) * H``."""
        return self.B * triton.cdiv(self.T, BT) * self.H


@dataclass(frozen=True)
class Access:
    """One tensor a launch reads or writes: a ``share`` of its ``elems`` elements of ``nbytes``
    each, requested ``times`` over."""

    tensor: str
    elems: float
    nbytes: int
    times: float = 1.0
    share: float = 1.0

    @property
    def allocated(self) -> float:
        return self.elems * self.nbytes

    @property
    def unique(self) -> float:
        return self.allocated * self.share

    @property
    def requested(self) -> float:
        return self.unique * self.times


@dataclass(frozen=True)
class Launch:
    """One launch: its ``reads`` and ``writes`` (:class:`Access`) and the name of its kernel as
    the profiler reports it (``None`` for a PyTorch fill)."""

    name: str
    reads: tuple
    writes: tuple
    kernel: str | None = None

    def total(self, kind: str) -> tuple[float, float]:
        """``(read, written)`` bytes, ``kind`` ``"unique"``, ``"requested"`` or ``"allocated"``."""
        return (sum(getattr(a, kind) for a in self.reads), sum(getattr(a, kind) for a in self.writes))


LOWER = (BT + 1) / (2 * BT)
"""Fraction of a ``[BT, BT]`` tile on and below the diagonal (``A_qk`` loads)."""
STRICT = (BT - 1) / (2 * BT)
"""Fraction strictly below the diagonal (``A_dk`` loads)."""
EARLIER_KEYS = sum(i + 1 for i in range(BT // BC)) / (BT // BC)
"""Key-row blocks the four row-block programs of the scores kernel read, per chunk, in chunks
(row block ``i`` reads key rows ``0 .. (i+1) BC - 1``)."""
BLOCKS_ON_AND_BELOW = sum(range(1, BT // BC + 1)) / (BT // BC) ** 2
"""Fraction of a ``[BT, BT]`` tile in the ``BC``-blocks on and below the diagonal (what the
scores kernel writes; the block inverse writes the zero blocks above them too)."""
INV_LOADED = (sum(range(BC)) * (BT // BC) + 6 * BC * BC) / (BT * BT)
"""Fraction of ``A_kk`` the block inverse loads: the strict lower part of the four diagonal
blocks (row ``i`` reads ``i`` entries) and the six blocks below them."""


def qed_launches(s: Shape, probes: bool, io: int = IO) -> list[Launch]:
    """``qed_chunk``'s six launches (arm full, no initial or final state), from
    ``kernels/qed/chunk_intra.py``, ``chunk_wy.py`` and ``chunk_scan.py``; ``io`` bytes per element
    of the inputs and intermediate buffers (``tests/test_bench.py`` checks the written bytes
    against the wrappers' outputs with float32 ones)."""
    tk, tv, tr, ta = s.rows * s.K, s.rows * s.V, s.rows, s.rows * BT
    states = s.chunks * s.K * s.V
    nvb_state = triton.cdiv(s.V, state_config(s.K, s.V, torch.bfloat16, scans=s.B * s.H, sm_count=H200_SMS)[0])
    nvb_out = triton.cdiv(s.V, output_config(s.V, torch.bfloat16, probes)[0])
    p = lambda *acc: acc if probes else ()  # noqa: E731
    prep = Launch("prep (qed_prep_kernel)",
                  reads=(Access("q (_stats, erase_tiles)", tk, io, 2), Access("k (_stats, erase_tiles)", tk, io, 2),
                         Access("b (_stats, erase_tiles)", tk, io, 2), Access("g", tk, F32)),
                  writes=(Access("rq, rk, cp", 3 * tr, F32), Access("gc = G", tk, F32), Access("kg, qg, ag", 3 * tk, io),
                          Access("gl = exp(G_last)", s.chunks * s.K, F32),
                          *p(Access("rho, e", 2 * tr, F32), Access("dg", tk, io), Access("d (probe)", tk, F32))),
                  kernel="qed_prep_kernel")
    scores = Launch("scores (qed_scores_kernel)",
                    reads=(Access("gc: G_f key rows, G_i, span rows", tk, F32, EARLIER_KEYS + 1 + 3 * 4 / BT),
                           Access("k: k_f key rows, _score_slice", tk, io, EARLIER_KEYS + 1),
                           Access("q, b (_score_slice)", 2 * tk, io), Access("rq, rk, cp (rows), rk (key rows)", 3 * tr, F32,
                                                                         (3 + EARLIER_KEYS) / 3)),
                    writes=(Access("aqk", ta, io, share=BLOCKS_ON_AND_BELOW), Access("akk", ta, F32, share=BLOCKS_ON_AND_BELOW),
                            *p(Access("adk", ta, io, share=BLOCKS_ON_AND_BELOW))), kernel="qed_scores_kernel")
    inverse = Launch("inverse (qed_inverse_kernel)", reads=(Access("akk", ta, F32, share=INV_LOADED),),
                     writes=(Access("ai (zeros above the diagonal)", ta, io),), kernel="qed_inverse_kernel")
    wy = Launch("W/U (qed_wy_kernel)",
                reads=(Access("ai (rows whole)", ta, io), Access("ag", tk, io), Access("v, w_gate", 2 * tv, io)),
                writes=(Access("w = W", tk, io), Access("u = U", tv, io)), kernel="qed_wy_kernel")
    state = Launch("state scan (qed_state_kernel)",
                   reads=(Access("w, kg", 2 * tk, io, nvb_state), Access("u", tv, io),
                          Access("gl", s.chunks * s.K, F32, nvb_state)),
                   writes=(Access("hs (chunk-start states)", states, io), Access("r (residuals)", tv, io)),
                   kernel="qed_state_kernel")
    output = Launch("output (qed_output_kernel)",
                    reads=(Access("hs", states, io), Access("r", tv, io), Access("qg", tk, io, nvb_out),
                           Access("aqk (lower)", ta, io, nvb_out, LOWER),
                           *p(Access("dg", tk, io, nvb_out), Access("adk (strict lower)", ta, io, nvb_out, STRICT))),
                    writes=(Access("o", tv, io), *p(Access("Sd (probe)", tv, F32))), kernel="qed_output_kernel")
    return [prep, scores, inverse, wy, state, output]


def fla_launches(s: Shape, state_bv: int, output_bv: int) -> list[Launch]:
    """fla 0.6.0 ``chunk_gdn2`` forward with its defaults (qk L2 norm in the kernel, gate not in
    the kernel, ``safe_gate=False``, ``disable_recompute=False``): ``fla/ops/gdn2/chunk.py``,
    ``chunk_fwd.py``, ``chunk_intra.py``, ``chunk_intra_token_parallel.py``, ``wy_fast.py``,
    ``fla/ops/common/chunk_delta_h.py``, ``fla/ops/gla/chunk.py`` (``chunk_gla_fwd_kernel_o``)."""
    tk, tv, tr, ta = s.rows * s.K, s.rows * s.V, s.rows, s.rows * BT
    states = s.chunks * s.K * s.V
    sub = sum(range(1, BC + 1)) / BC  # earlier-or-same rows of a 16-row sub-chunk, per token
    l2 = lambda x: Launch(f"l2norm_fwd({x})", reads=(Access(x, tk, IO),),  # noqa: E731
                          writes=(Access(f"{x} normalised", tk, IO), Access(f"{x}_rstd", tr, F32)),
                          kernel="l2norm_fwd_kernel")
    return [
        l2("q"), l2("k"),
        Launch("chunk_local_cumsum(g)", reads=(Access("g", tk, F32),), writes=(Access("g cumsum", tk, F32),),
               kernel="chunk_local_cumsum_vector_kernel"),
        Launch("torch.zeros (Akk)", reads=(), writes=(Access("Akk", ta, IO),)),
        Launch("intra_token_parallel", reads=(Access("q, b (own row)", 2 * tk, IO),
                                              Access("k (own row + sub-chunk rows)", tk, IO, 1 + sub),
                                              Access("g (own row + sub-chunk rows)", tk, F32, 1 + sub)),
               writes=(Access("Aqk diagonal blocks", ta, IO, share=sub / BT), Access("Akkd", tr * BC, F32, share=sub / BC)),
               kernel="chunk_gdn2_fwd_kernel_intra_token_parallel"),
        Launch("inter_solve_fused", reads=(Access("k, g: all sub-chunks", tk, IO + F32),
                                           Access("q, b: sub-chunks 1-3", 2 * tk, IO, share=0.75),
                                           Access("Akkd", tr * BC, F32)),
               writes=(Access("Aqk off-diagonal blocks", ta, IO, share=6 / 16),
                       Access("Akk^-1 lower blocks", ta, IO, share=10 / 16)),
               kernel="chunk_gdn2_fwd_kernel_inter_solve_fused"),
        Launch("recompute_w_u_fwd_gdn2", reads=(Access("Akk^-1", ta, IO), Access("v, w_gate", 2 * tv, IO),
                                                Access("k, b", 2 * tk, IO), Access("g cumsum", tk, F32)),
               writes=(Access("u", tv, IO), Access("w", tk, IO), Access("kg", tk, IO)),
               kernel="recompute_w_u_fwd_gdn2_kernel"),
        Launch("chunk_gated_delta_rule_fwd_h", reads=(Access("w, kg", 2 * tk, IO, triton.cdiv(s.V, state_bv)),
                                                      Access("u", tv, IO)),
               writes=(Access("h", states, IO), Access("v_new", tv, IO)),
               kernel="chunk_gated_delta_rule_fwd_kernel_h_blockdim64"),
        Launch("chunk_gla_fwd_o_gk", reads=(Access("q", tk, IO, triton.cdiv(s.V, output_bv)),
                                            Access("g cumsum", tk, F32, triton.cdiv(s.V, output_bv)),
                                            Access("h", states, IO), Access("v_new", tv, IO),
                                            Access("Aqk", ta, IO, triton.cdiv(s.V, output_bv))),
               writes=(Access("o", tv, IO),), kernel="chunk_gla_fwd_kernel_o"),
    ]


def table(title: str, launches: list[Launch]) -> list[str]:
    """Markdown rows: per launch MB read / written (unique, and requested), then the total."""
    mb = lambda x: f"{x / 1e6:,.0f}"  # noqa: E731
    out = [f"| {title} | read MB | written MB | read MB requested | written MB requested |", "|---|---|---|---|---|"]
    tot = [0., 0., 0., 0.]
    for ln in launches:
        vals = (*ln.total("unique"), *ln.total("requested"))
        tot = [a + b for a, b in zip(tot, vals)]
        out.append(f"| {ln.name} | " + " | ".join(mb(v) for v in vals) + " |")
    out.append(f"| **total, {len(launches)} launches** | " + " | ".join(f"**{mb(v)}**" for v in tot) + " |")
    out.append(f"| **read + written** | **{mb(tot[0] + tot[1])}** | | **{mb(tot[2] + tot[3])}** | |")
    return out


def measured(title: str, launches: list[Launch], rows: list[dict], pipeline: str) -> list[str]:
    """Markdown rows joining the model with ``bench/kernel_times.py --parts`` rows of ``pipeline``
    (``"qed"``, ``"qed+probes"`` or ``"fla"``; names ``"  PIPELINE: KERNEL"``, the kernel name cut
    to 40 characters, ``ms`` per forward call): per kernel the model's unique MB, ms, GB/s and
    the share of ``PEAK_TBS``. Launches of one kernel (fla's two L2 norms) are summed, as the
    profiler sums them; a kernel without a row is reported as such."""
    ms = {}
    for r in rows:
        name, _, kernel = r["name"].strip().partition(": ")
        if name == pipeline:
            ms[kernel] = ms.get(kernel, 0.) + r["ms"]
    out = [f"| {title} | MB (model) | ms (measured) | GB/s | share of {PEAK_TBS} TB/s |", "|---|---|---|---|---|"]
    grouped: dict = {}
    for ln in launches:
        grouped.setdefault(ln.kernel or ln.name, []).append(ln)
    tot_mb = tot_ms = 0.
    for kernel, lns in grouped.items():
        mb = sum(sum(ln.total("unique")) for ln in lns) / 1e6
        t = next((v for k, v in ms.items() if kernel[:40] == k or kernel.startswith(k)), None)
        if t is None:
            out.append(f"| {kernel} | {mb:,.0f} | no row | | |")
            continue
        tot_mb, tot_ms = tot_mb + mb, tot_ms + t
        out.append(f"| {kernel} | {mb:,.0f} | {t:.3f} | {mb / t:,.0f} | {mb / t / (PEAK_TBS * 1e3):.0%} |")
    if tot_ms:
        out.append(f"| **all with a row** | **{tot_mb:,.0f}** | **{tot_ms:.3f}** | **{tot_mb / tot_ms:,.0f}** | "
                   f"**{tot_mb / tot_ms / (PEAK_TBS * 1e3):.0%}** |")
    return out


def details(launches: list[Launch]) -> list[str]:
    """One line per access: launch, tensor, MB, times requested."""
    out = []
    for ln in launches:
        for kind, accs in (("R", ln.reads), ("W", ln.writes)):
            out += [f"  {ln.name:32s} {kind} {a.tensor:40s} {a.unique / 1e6:8,.0f} MB x {a.times:.2f}" for a in accs]
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for n, v in dict(B=8, T=4096, H=16, K=128, V=128).items():
        ap.add_argument(f"--{n}", type=int, default=v)
    ap.add_argument("--fla-state-bv", type=int, default=64, help="value block fla's autotuner picks for fwd_h")
    ap.add_argument("--fla-output-bv", type=int, default=64, help="value block fla's autotuner picks for chunk_o")
    ap.add_argument("--details", action="store_true", help="also list every access")
    ap.add_argument("--measured", metavar="JSON", help="kernels.json of bench/kernel_times.py --parts at the same shape")
    a = ap.parse_args()
    s = Shape(a.B, a.T, a.H, a.K, a.V)
    print(f"Model (not a measurement): B={s.B} T={s.T} H=HV={s.H} K={s.K} V={s.V}, bf16 inputs, float32 g and state\n")
    fla = fla_launches(s, a.fla_state_bv, a.fla_output_bv)
    for probes in (False, True):
        launches = qed_launches(s, probes)
        print("\n".join(table(f"qed_chunk, probes {'on' if probes else 'off'}", launches)) + "\n")
        if a.details:
            print("\n".join(details(launches)) + "\n")
    print("\n".join(table(f"fla chunk_gdn2 (fwd_h BV {a.fla_state_bv}, chunk_o BV {a.fla_output_bv})", fla)))
    if a.details:
        print("\n".join(details(fla)))
    if a.measured:
        with open(a.measured) as f:
            rows = json.load(f)
        for title, launches, pipeline in (("qed_chunk", qed_launches(s, False), "qed"),
                                          ("qed_chunk, probes", qed_launches(s, True), "qed+probes"),
                                          ("fla chunk_gdn2", fla, "fla")):
            print("\n" + "\n".join(measured(title, launches, rows, pipeline)))


if __name__ == "__main__":
    main()
