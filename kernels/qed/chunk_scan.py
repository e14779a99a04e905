r"""Inter-chunk kernels of ``qed_chunk``: the state recurrence, then the output (as fla's
``chunk_delta_h`` and ``chunk_o``).

``qed_state_kernel``: one program per (sequence, value head, block of ``BV`` value channels)
walks the chunks in order with the state block ``S`` (``K x BV``, float32 or float64) in
registers::

    hs  <- S                              the chunk-start state (intermediate dtype)
    R   = U - W S                         residuals of the chunk's tokens (-> r)
    S  <- Diag(exp(G_last)) S + kg^T R    (kg = k exp(G_last - G))

``qed_output_kernel``: one program per (chunk, value head, block of ``BV`` value channels),
all chunks at once, from the chunk-start state ``S0 = hs`` and the residuals ``R``::

    o   = qg S0 + A_qk R                  (qg = scale q exp(G), A_qk causal incl. diagonal)
    Sd  = dg S0 + A_dk R                  probes only (dg = d exp(G), A_dk strictly causal)

On the scalar-gate path ``qed_state_kernel`` can form ``o`` itself from ``S0`` and ``R`` while
they are in registers (``OUTPUT``; ``hs`` and ``R`` then never stored), where
:func:`scan_forms_output` rules so and ``Sd`` is not asked for; ``qed_scalar_output_kernel`` is the
scalar-gate path's output stage otherwise.

The backward reruns only the state kernel (its chunk-start states and residuals), not the output.
States are ``[NC, HV, K, V]`` by global chunk index.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .chunk_common import (BT, ChunkLayout, chunk_at, chunk_axes, chunk_rows, exp, gate_head, gate_tile,
                           heads_first, load_tile, row_factors, scan_program, scan_ranges)
from .chunk_intra import raw_direction, row_lam


@triton.jit
def _row_decay_products(b_x, b_k, b_h, b_r, G_x, G_k, keep, PREC: tl.constexpr):
    """``e^{G_x} X S0 + (X K^T * Dec) R`` ``[rows of X, BV]`` with a decay per row (the scalar-gate
    path): ``Dec[t, j] = e^{G_x,t - G_k,j}`` where ``keep`` (the causal mask), else 0; ``S0``
    (``b_h``), ``R`` and ``X K^T * Dec`` rounded to the dtype of ``X, K`` for their products."""
    dec = exp(tl.where(keep, G_x[:, None] - G_k[None, :], 0.))
    b_a = tl.where(keep, tl.dot(b_x, tl.trans(b_k), input_precision=PREC) * dec, 0.).to(b_x.dtype)
    return (tl.dot(b_x, b_h.to(b_x.dtype), input_precision=PREC) * exp(G_x)[:, None]
            + tl.dot(b_a, b_r.to(b_x.dtype), input_precision=PREC))


@triton.jit
def _chunk_output(S, b_r, b_kg, b_G, q, rq, o, scale, rows, m_t, m_tk, m_tv, o_t, o_k, o_v, i_h,
                  H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, PREC: tl.constexpr,
                  DT: tl.constexpr):
    """The output rows of one chunk inside the scan, from its start state ``S`` and residuals
    ``b_r`` still in registers: ``o = scale r_q (e^G q S + (q K^T * Dec) R)``, as the output
    kernel's ``SD = "off"`` launch forms them from the stored ``hs, R`` (``q`` the query/key head's
    queries as the scan's keys ``b_kg``: normalised, or raw with their reciprocal norms ``rq``)."""
    b_q = tl.load(q + rows[:, None] * (H * K) + o_k[None, :], mask=m_tk, other=0.).to(b_kg.dtype)
    b_o = _row_decay_products(b_q, b_kg, S, b_r, b_G, b_G, o_t[:, None] >= o_t[None, :], PREC)
    if rq is not None:
        b_o = b_o * (row_factors(rq, rows, m_t, H, i_h, DT) * scale)[:, None]
    else:
        b_o = b_o * scale
    tl.store(o + rows[:, None] * (HV * V) + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)


@triton.jit
def _state_step(S, i_t, bos, eos, c0, i_hv, o_t, o_k, o_v, m_k, m_v, w, u, kg, gl, gc, hs, r, q, rq, o, scale,
                H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr,
                STORE_HS: tl.constexpr, STORE_R: tl.constexpr, OUTPUT: tl.constexpr, DT: tl.constexpr,
                PREC: tl.constexpr, ROW_DECAY: tl.constexpr):
    """One chunk: store its start state (and residuals), return the next state. Per-token
    pointers are already moved to value head ``i_hv``; the chunk decay ``gl`` is per key channel
    (``[NC, HV, K]``). With ``ROW_DECAY`` (the scalar-gate path) ``kg`` holds the keys of the
    query/key head (row stride ``H * K``: normalised, or raw where ``w, u`` carry their reciprocal
    norms on their rows, so that ``K^T (r_k r) = K_hat^T r``) and ``gc`` the within-chunk cumsum
    ``G`` per row: the residuals are scaled by ``e^{G_last - G}`` before the key product (in the
    state dtype, then rounded once to the products' dtype), and the state by ``e^{G_last}``. With
    ``OUTPUT`` (scalar-gate path only) the chunk's output rows are formed here
    (:func:`_chunk_output`) instead of storing the start state and residuals for the output kernel."""
    if STORE_HS:
        tl.store(hs + ((c0 + i_t) * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :],
                 S.to(hs.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])
    rows, m_t, m_tk, m_tv = chunk_rows(i_t, bos, eos, o_t, m_k, m_v, BT)
    b_w = tl.load(w + rows[:, None] * (HV * K) + o_k[None, :], mask=m_tk, other=0.)
    b_kg = tl.load(kg + rows[:, None] * ((H if ROW_DECAY else HV) * K) + o_k[None, :], mask=m_tk,
                   other=0.).to(b_w.dtype)
    b_u = tl.load(u + rows[:, None] * (HV * V) + o_v[None, :], mask=m_tv, other=0.).to(DT)
    if ROW_DECAY:
        b_G = tl.load(gc + rows * HV, mask=m_t, other=0.).to(DT)
        b_gl = tl.load(gc + (tl.minimum(bos + i_t * BT + BT, eos) - 1) * HV).to(DT)
    else:
        b_gl = tl.load(gl + ((c0 + i_t) * HV + i_hv) * K + o_k, mask=m_k, other=0.).to(DT)
    b_r = b_u - tl.dot(b_w, S.to(b_w.dtype), input_precision=PREC)
    if STORE_R:
        tl.store(r + rows[:, None] * (HV * V) + o_v[None, :], b_r.to(r.dtype.element_ty), mask=m_tv)
    if OUTPUT:
        _chunk_output(S, b_r, b_kg, b_G, q, rq, o, scale, rows, m_t, m_tk, m_tv, o_t, o_k, o_v, i_hv // (HV // H),
                      H, HV, K, V, PREC, DT)
    if ROW_DECAY:
        b_rd = (b_r * tl.where(m_t, exp(b_gl - b_G), 0.)[:, None]).to(b_w.dtype)
        out = S * exp(b_gl) + tl.dot(tl.trans(b_kg), b_rd, input_precision=PREC)
    else:
        out = S * b_gl[:, None] + tl.dot(tl.trans(b_kg), b_r.to(b_w.dtype), input_precision=PREC)
    return out


@triton.heuristics({
    "USE_H0": lambda args: args["h0"] is not None,
    "STORE_HT": lambda args: args["ht"] is not None,
    "STORE_HS": lambda args: args["hs"] is not None,
    "STORE_R": lambda args: args["r"] is not None,
    "OUTPUT": lambda args: args["o"] is not None,
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "ROW_DECAY": lambda args: args["gc"] is not None,
})
@triton.jit(do_not_specialize=["T"])
def qed_state_kernel(
    w, u, kg, gl, gc, h0, hs, r, ht, q, rq, o,
    cu_seqlens, chunk_offsets, T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DT: tl.constexpr, PREC: tl.constexpr, WHILE_LOOP: tl.constexpr,
    USE_H0: tl.constexpr, STORE_HT: tl.constexpr, STORE_HS: tl.constexpr, STORE_R: tl.constexpr,
    OUTPUT: tl.constexpr, IS_VARLEN: tl.constexpr, ROW_DECAY: tl.constexpr,
):
    i_v, i_nh, i_hv, bos, eos, NT, c0 = scan_program(cu_seqlens, chunk_offsets, T, HV, BT, IS_VARLEN)
    o_t, o_k, o_v, m_k, m_v = scan_ranges(i_v, K, V, BT, BK, BV)
    S = tl.zeros([BK, BV], dtype=DT)
    if USE_H0:
        p_h = h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        S += tl.load(p_h, mask=m_k[:, None] & m_v[None, :], other=0.).to(DT)
    w += i_hv * K
    if ROW_DECAY:
        kg += (i_hv // (HV // H)) * K
        gc += i_hv
    else:
        kg += i_hv * K
    u += i_hv * V
    if STORE_R:
        r += i_hv * V
    if OUTPUT:
        q += (i_hv // (HV // H)) * K
        o += i_hv * V
    if WHILE_LOOP:  # the interpreter (numpy >= 2.4) cannot take a tensor as range() bound
        i_t = 0
        while i_t < NT:
            S = _state_step(S, i_t, bos, eos, c0, i_hv, o_t, o_k, o_v, m_k, m_v, w, u, kg, gl, gc, hs, r, q, rq, o,
                            scale, H, HV, K, V, BT, STORE_HS, STORE_R, OUTPUT, DT, PREC, ROW_DECAY)
            i_t += 1
    else:
        for i_t in range(NT):
            S = _state_step(S, i_t, bos, eos, c0, i_hv, o_t, o_k, o_v, m_k, m_v, w, u, kg, gl, gc, hs, r, q, rq, o,
                            scale, H, HV, K, V, BT, STORE_HS, STORE_R, OUTPUT, DT, PREC, ROW_DECAY)
    if STORE_HT:
        p_h = ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_h, S.to(ht.dtype.element_ty), mask=m_k[:, None] & m_v[None, :])


@triton.jit
def _key_block(hs, qg, dg, rows, m_t, o_k, o_v, m_v, k0, i_hv, HV: tl.constexpr, K: tl.constexpr,
               V: tl.constexpr, PROBES: tl.constexpr):
    """Key rows ``k0 + o_k`` of one chunk-start state block (``hs`` moved to the state) and the
    same key columns of ``qg`` and, with probes, ``dg`` (else ``qg`` again, unused)."""
    c_k = k0 + o_k
    m_c = c_k < K
    b_h = tl.load(hs + c_k[:, None] * V + o_v[None, :], mask=m_c[:, None] & m_v[None, :], other=0.)
    m_rk = m_t[:, None] & m_c[None, :]
    b_qg = tl.load(qg + rows[:, None] * (HV * K) + i_hv * K + c_k[None, :], mask=m_rk, other=0.)
    b_dg = b_qg
    if PROBES:
        b_dg = tl.load(dg + rows[:, None] * (HV * K) + i_hv * K + c_k[None, :], mask=m_rk, other=0.)
    return b_h, b_qg, b_dg


@triton.heuristics({
    "PROBES": lambda args: args["sd"] is not None,
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
})
@triton.jit(do_not_specialize=["T"])
def qed_output_kernel(
    qg, dg, aqk, adk, hs, r, o, sd,
    cu_seqlens, chunk_indices, T,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PREC: tl.constexpr, PROBES: tl.constexpr, IS_VARLEN: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    NV: tl.constexpr = (V + BV - 1) // BV
    i_x, i_bh = chunk_axes(HEADS_FIRST)
    i_hv, i_t, i_g, bos, eos = chunk_at(i_x // NV, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    i_v = i_x % NV
    o_t, o_k, o_v, m_k, m_v = scan_ranges(i_v, K, V, BT, BK, BV)
    rows, m_t, _, m_tv = chunk_rows(i_t, bos, eos, o_t, m_k, m_v, BT)
    p_h = hs + (i_g * HV + i_hv) * K * V
    # The first key block of the state's rows with the intra-chunk terms, then the other blocks
    # (none when BK covers K; with num_stages > 1 each block's loads overlap the products before).
    b_h, b_qg, b_dg = _key_block(p_h, qg, dg, rows, m_t, o_k, o_v, m_v, 0, i_hv, HV, K, V, PROBES)
    b_r = tl.load(r + rows[:, None] * (HV * V) + i_hv * V + o_v[None, :], mask=m_tv, other=0.)
    b_a = tl.load(aqk + rows[:, None] * (HV * BT) + i_hv * BT + o_t[None, :],
                  mask=m_t[:, None] & (o_t[:, None] >= o_t[None, :]), other=0.)
    b_o = tl.dot(b_qg, b_h, input_precision=PREC) + tl.dot(b_a, b_r, input_precision=PREC)
    if PROBES:
        b_ad = tl.load(adk + rows[:, None] * (HV * BT) + i_hv * BT + o_t[None, :],
                       mask=m_t[:, None] & (o_t[:, None] > o_t[None, :]), other=0.)
        b_sd = tl.dot(b_dg, b_h, input_precision=PREC) + tl.dot(b_ad, b_r, input_precision=PREC)
    for k0 in tl.range(BK, K, BK):
        b_h, b_qg, b_dg = _key_block(p_h, qg, dg, rows, m_t, o_k, o_v, m_v, k0, i_hv, HV, K, V, PROBES)
        b_o += tl.dot(b_qg, b_h, input_precision=PREC)
        if PROBES:
            b_sd += tl.dot(b_dg, b_h, input_precision=PREC)
    tl.store(o + rows[:, None] * (HV * V) + i_hv * V + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_tv)
    if PROBES:
        tl.store(sd + rows[:, None] * (HV * V) + i_hv * V + o_v[None, :], b_sd.to(sd.dtype.element_ty), mask=m_tv)


STATE_PROGRAMS_PER_SM = 2
"""Programs of the pipelined (bf16, 4-warp) state scan that an SM holds at once: shared memory
bounds it, each program's two pipeline stages taking 96 KB at ``BV = 64`` and 80 KB at ``BV = 32``
of an H100/H200 SM's 228 KB (``bench/chunk_aot.py``)."""


def state_config(K: int, V: int, inter_dtype: torch.dtype, *, scans: int | None = None,
                 sm_count: int | None = None, row_decay: bool = False) -> tuple[int, int, int]:
    """``(BV, num_warps, num_stages)`` of the state scan, by rule from ``K``, ``V``, the dtype of
    the intra buffers and, where known, the number of ``scans`` (sequences x value heads) and the
    GPU's ``sm_count``.

    bf16 tiles with ``K <= 128`` are pipelined two deep, in 4 warps (two programs per SM; faster
    than 8 warps); float32 / float64 ``[64, K]`` tiles do not fit twice in shared memory, nor do
    bf16 ones with K=256, and run in 8 warps, one stage (timings in docs/BENCHMARKS.md).

    Each program walks all chunks of its sequence in order, so the scan's time is the number of
    chunks times one step's latency once every program has an SM slot. When the pipelined scan's
    programs at ``BV = 32`` still fit in one wave (``scans * cdiv(V, 32) <= STATE_PROGRAMS_PER_SM *
    sm_count``: few, long sequences), it takes value blocks of 32: twice the programs, each step
    on half the state block. With more scans the second wave would cost more, and ``BV = 64`` stays.

    The scalar-gate path's scan (``row_decay``) takes the smallest value block (16, 32, else 64)
    whose programs fit one per SM (``scans * cdiv(V, BV) <= sm_count``), pipelined four deep at 16
    and three deep above (the stages leave room for one program per SM): on an H100 much faster
    than two deep at twice the programs. Value blocks of 64 stay three deep up to two waves of
    programs (eight sequences of 16 value heads: 256 programs), where one program per SM three deep
    still beats two per SM two deep (docs/BENCHMARKS.md).
    """
    BK = triton.next_power_of_2(K)
    BV = 64 if (BK <= 128 and inter_dtype != torch.float64) else 32
    pipelined = inter_dtype == torch.bfloat16 and BK <= 128
    known = scans is not None and sm_count is not None
    if pipelined and row_decay and known:
        for bv, stages, waves in ((16, 4, 1), (32, 3, 1), (64, 3, 2)):
            if scans * triton.cdiv(V, bv) <= waves * sm_count:
                return min(bv, triton.next_power_of_2(V)), 4, stages
    if pipelined and known and scans * triton.cdiv(V, 32) <= STATE_PROGRAMS_PER_SM * sm_count:
        BV = 32
    return min(BV, triton.next_power_of_2(V)), 4 if pipelined else 8, 2 if pipelined else 1


def scan_forms_output(K: int, V: int, inter_dtype: torch.dtype, *, scans: int, sm_count: int | None) -> bool:
    """Whether the scalar-gate path's state scan forms the output itself (``chunk_state_fwd`` with
    ``o``, probes other than ``Sd`` only), by rule: where :func:`state_config` runs it in value
    blocks of 64 three deep (one program per SM, up to two waves). There the output's three
    products per chunk (``q S``, ``q K^T``, ``A R``) cost less than storing and reading back the
    chunk-start states and residuals; in value blocks of 16 every program of a q/k head forms
    ``q K^T`` again (four times the ``W S`` product's work), and two programs per SM (two deep,
    many scans) do not fit the output's tiles beside the scan's (docs/BENCHMARKS.md)."""
    return state_config(K, V, inter_dtype, scans=scans, sm_count=sm_count, row_decay=True)[::2] == (64, 3)


@functools.lru_cache
def multiprocessors(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA ``device`` (None elsewhere: the interpreter)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else None


OUTPUT_KEY_BLOCK = 256
OUTPUT_STAGES = 1
"""Key block of the output kernel's loop over the chunk-start state's rows and the loop's pipeline
depth: by default one block over the whole key axis (K <= 256), unpipelined. Smaller blocks in two
or more stages let the next block's ``hs, qg, dg`` loads overlap the current block's products
(time a setting as a kernel version: ``scripts/kernel_versions.sh``)."""


def output_config(V: int, inter_dtype: torch.dtype, probes: bool) -> tuple[int, int]:
    """``(BV, num_warps)`` of the output kernel, by rule (its programs are independent: one per
    chunk, value head and value block): bf16 tiles without probes take the whole value axis up to
    128 in 8 warps (``qg`` and ``A_qk`` read once per chunk); with probes (a second product, ``Sd``)
    value blocks of 64 in 4 warps; float32 / float64 tiles value blocks of 64 in 8 warps, where
    they do not spill (timings in docs/BENCHMARKS.md), but for float64 with probes: its tiles at
    ``BV = 64`` take 256 KB of shared memory, more than an SM has (227 KB), and ``BV = 32`` 208 KB."""
    if inter_dtype == torch.float64 and probes:
        return min(32, triton.next_power_of_2(V)), 8
    if inter_dtype != torch.bfloat16:
        return min(64, triton.next_power_of_2(V)), 8
    return (min(64, triton.next_power_of_2(V)), 4) if probes else (min(128, triton.next_power_of_2(V)), 8)


def chunk_state_fwd(lay: ChunkLayout, *, w, u, kg, gl, hs, gc=None, r=None, h0=None, ht=None, q=None, rq=None,
                    o=None, scale: float = 1.0, T: int, N: int, config: tuple[int, int, int] | None = None) -> None:
    """Launch ``qed_state_kernel`` (grid: value blocks x sequences x value heads): writes, when
    given, the chunk-start states ``hs`` ``[NC, HV, K, V]``, the residuals ``r`` ``[B, T, HV, V]``
    and the final states ``ht``; ``h0`` the initial states. Keys and decay: ``kg = k e^{G_last -
    G}`` per value head and ``gl = e^{G_last}``, or (the scalar-gate path) ``kg`` the keys ``[B, T,
    H, K]`` (normalised, or raw with their reciprocal norms on the rows of ``w, u``), ``gc`` the
    per-row ``G`` ``[B, T, HV]`` and ``gl`` None. On the scalar-gate path with ``o`` the scan also
    writes the output ``o`` ``[B, T, HV, V]`` from the queries ``q`` ``[B, T, H, K]`` (as ``kg``:
    with their reciprocal norms ``rq`` ``[B, T, H]`` where raw) and ``scale``, so that ``hs`` and
    ``r`` need not be stored. ``config`` ``(BV, num_warps, num_stages)`` overrides
    :func:`state_config` (for screening configurations, ``scripts/scan_configs.py``)."""
    _, _, HV, K = w.shape
    V = u.shape[-1]
    if o is not None and (gc is None or q is None):
        raise ValueError("chunk_state_fwd: the output `o` is formed in the scan only on the scalar-gate path "
                         "(`gc` given) and needs the queries `q`")
    BV, num_warps, num_stages = config or state_config(K, V, w.dtype, scans=N * HV, sm_count=multiprocessors(w.device),
                                                       row_decay=gc is not None)
    qed_state_kernel[(triton.cdiv(V, BV), N * HV)](
        w=w, u=u, kg=kg, gl=gl, gc=gc, h0=h0, hs=hs, r=r, ht=ht, q=q, rq=rq, o=o,
        cu_seqlens=lay.cu_seqlens, chunk_offsets=lay.chunk_offsets, T=T, scale=scale,
        H=kg.shape[2], HV=HV, K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), BV=BV, DT=lay.DT, PREC=lay.prec,
        WHILE_LOOP=lay.interpreting, num_warps=num_warps, num_stages=num_stages,
    )


def chunk_output_fwd(lay: ChunkLayout, *, qg, aqk, hs, r, o, dg=None, adk=None, sd=None,
                     config: tuple[int, int, int, int] | None = None) -> None:
    """Launch ``qed_output_kernel`` (grid: value heads x (chunks x value blocks),
    :func:`~.chunk_common.heads_first`; the value blocks of a chunk run close together, so that
    the second reads the chunk's ``qg, A_qk`` (``dg, A_dk``) from L2): writes ``o`` and, with
    probes, ``sd`` (from ``dg, adk``). ``config`` ``(BV, num_warps, key_block, num_stages)``
    overrides :func:`output_config` and ``OUTPUT_KEY_BLOCK``, ``OUTPUT_STAGES`` (for screening
    configurations, ``scripts/scan_configs.py``)."""
    _, T, HV, K = qg.shape
    V = r.shape[-1]
    BV, num_warps, key_block, num_stages = config or (*output_config(V, qg.dtype, sd is not None),
                                                      OUTPUT_KEY_BLOCK, OUTPUT_STAGES)
    if key_block < 16 or key_block & (key_block - 1):
        raise ValueError(f"qed_output_kernel: the key block (chunk_scan.OUTPUT_KEY_BLOCK) must be a power of "
                         f"two of at least 16 (a tl.dot operand's side), got {key_block}")
    grid, first = heads_first(lay.grid, triton.cdiv(V, BV))
    qed_output_kernel[grid](
        qg=qg, dg=dg, aqk=aqk, adk=adk, hs=hs, r=r, o=o, sd=sd,
        cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T,
        HV=HV, K=K, V=V, BT=BT, BK=min(key_block, triton.next_power_of_2(K)), BV=BV, PREC=lay.prec,
        HEADS_FIRST=first, num_warps=num_warps, num_stages=num_stages,
    )


SD_MIN_DENOMINATOR = 0.5
"""Smallest ``1 - lam rho`` (arm full) for which the output stage takes ``Sd`` from the residual
(:func:`sd_form`): below it the division would enlarge the residual's rounding by more than 2x,
and the chunk's ``Sd`` is formed from its direction rows instead (the ``"patch"`` launch). Only
``|lam| > 1 - SD_MIN_DENOMINATOR`` can reach it (``|rho| <= 1``)."""


def sd_form(flags: dict) -> str:
    """How the scalar-gate output stage forms the probe ``Sd_t = S_bar_t^T d_t`` for an arm's
    direction flags (``arms.direction_flags``): ``"residual"`` where ``d_t`` lies in the span of
    ``q_hat_t`` and ``k_hat_t`` and its ``k_hat`` part can be read off the residual (no direction;
    a direction from ``q`` that is gated or not projected: every arm but ``nogate``, ``rand`` and
    a given ``d``), else ``"stacked"``: the direction rows ``d`` go through the output's products
    under the queries. Why the residual suffices: with ``a = alpha k_hat + gamma q_hat`` and ``d =
    bx q_hat - c k_hat`` the residual ``r = w v - S_bar^T a`` gives ``S_bar^T k_hat`` wherever
    ``alpha = b - lam c`` is bounded away from 0, which for the gated projected arm (``alpha = b
    (1 - lam rho)``) holds up to a known factor and for the unprojected ones is not needed (``c =
    0``); for ``nogate`` ``alpha = b - lam rho`` can vanish at any row."""
    source, gated, projected = flags["DIR_SOURCE"], flags["DIR_GATED"], flags["DIR_PROJECTED"]
    return "residual" if source == "none" or (source == "q" and (gated or not projected)) else "stacked"


def sd_patched(flags: dict) -> bool:
    """Whether the residual form of ``Sd`` divides by ``1 - lam rho`` (the gated projected arm) and
    so needs the Gram stage's flags of the chunks where it is below :data:`SD_MIN_DENOMINATOR` and
    the ``"patch"`` launch that forms their ``Sd`` from the direction rows."""
    return sd_form(flags) == "residual" and flags["DIR_SOURCE"] == "q" and flags["DIR_PROJECTED"]


@triton.jit
def _residual_sd(b_o, b_r, q_fac, r_k, rho, b, lam, w, v, r0, o_t, m_t, o_v, m_v, i_hv,
                 HV: tl.constexpr, V: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr,
                 DIR_PROJECTED: tl.constexpr, LAM_TOKEN: tl.constexpr, W_HEAD: tl.constexpr, DT: tl.constexpr):
    """``Sd = S_bar^T d`` ``[BT, BV]`` of the chunk's rows from the output's accumulator ``b_o`` (the
    rows of ``S^T x``, ``x`` the queries as loaded: ``q_fac`` their factors to ``q_hat``, else
    ``None``) and the residuals ``b_r`` (``r_k``: the factors the W/U stage put on their rows, else
    ``None``), without the direction rows. With ``Sq = S_t^T q_hat_t = S_bar_t^T q_hat_t + rho_t
    r_t`` (the state after the token's write ``k_hat r^T``) and ``S_bar^T a = w v - r``::

        d = bx q_hat (unprojected)          Sd = bx (Sq - rho r)
        d = b (q_hat - rho k_hat) (full)    Sd = (b Sq - rho w v + rho (1 - b) r) / (1 - lam rho)

    (from ``a = b (1 - lam rho) k_hat + lam b q_hat``: eliminate ``S_bar^T k_hat``)."""
    p = (r0 + o_t) * HV + i_hv
    b_rho = tl.load(rho + p, mask=m_t, other=0.).to(DT)
    sq = b_o * q_fac[:, None] if q_fac is not None else b_o
    res = b_r.to(DT)
    if r_k is not None:
        res = res / tl.where(m_t, r_k, 1.)[:, None]
    if DIR_SOURCE == "none":
        out = sq * 0.
    elif DIR_PROJECTED:
        b_b = tl.load(b + p, mask=m_t, other=0.).to(DT)
        b_l = row_lam(lam + i_hv, r0 + o_t, m_t, HV, LAM_TOKEN, DT)
        inv = 1. / (1. - b_l * b_rho)
        b_v = load_tile(v + r0 * (HV * V) + i_hv * V, o_t, m_t, o_v, m_v, HV * V, DT)
        wv = b_v * gate_tile(gate_head(w + r0 * (HV if W_HEAD else HV * V), i_hv, V, W_HEAD), o_t, m_t, o_v, m_v,
                             HV, V, W_HEAD, DT)
        out = (sq * (b_b * inv)[:, None] + res * (b_rho * (1. - b_b) * inv)[:, None]
               - wv * (b_rho * inv)[:, None])
    else:
        bx = tl.load(b + p, mask=m_t, other=0.).to(DT) if DIR_GATED else b_rho * 0. + 1.
        out = (sq - res * b_rho[:, None]) * bx[:, None]
    return out


@triton.heuristics({
    "IS_VARLEN": lambda args: args["cu_seqlens"] is not None,
    "FOLD_NORMS": lambda args: args["rq"] is not None,
    "LAM_TOKEN": lambda args: args["lam"].dim() == 3,
    "W_HEAD": lambda args: args["w"].dim() == 3,
})
@triton.jit(do_not_specialize=["T"])
def qed_scalar_output_kernel(
    q, k, rq, rk, gc, b, lam, cp, rho, patch, z, d_in, v, w, hs, r, o, sd,
    cu_seqlens, chunk_indices, T, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DIR_SOURCE: tl.constexpr, DIR_GATED: tl.constexpr,
    DIR_PROJECTED: tl.constexpr, SD: tl.constexpr, DT: tl.constexpr, PREC: tl.constexpr, IS_VARLEN: tl.constexpr,
    FOLD_NORMS: tl.constexpr, LAM_TOKEN: tl.constexpr, W_HEAD: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    """``SD``: ``"off"`` (``o`` only), ``"residual"`` (``o``, and ``Sd`` from the residuals,
    :func:`_residual_sd`), ``"stacked"`` (``o`` and ``Sd`` from the direction rows stacked under
    the queries) or ``"patch"`` (``Sd`` only, stacked, in the chunks the Gram stage flagged in
    ``patch``; the other programs return at once)."""
    NV: tl.constexpr = (V + BV - 1) // BV
    STACKED: tl.constexpr = SD == "stacked" or SD == "patch"
    i_x, i_bh = chunk_axes(HEADS_FIRST)
    i_hv, i_t, i_g, bos, eos = chunk_at(i_x // NV, i_bh, cu_seqlens, chunk_indices, T, HV, BT, IS_VARLEN)
    if SD == "patch":
        if tl.load(patch + i_g * HV + i_hv) == 0:
            return
    i_h = i_hv // (HV // H)
    o_t, o_k, o_v, m_k, m_v = scan_ranges(i_x % NV, K, V, BT, BK, BV)
    # stacked: the chunk's queries (-> o), then its directions (-> Sd)
    SR: tl.constexpr = 2 * BT if STACKED else BT
    o_s = tl.arange(0, SR)
    top = o_s < BT
    t_s = o_s % BT
    r0 = bos + i_t * BT
    m_t = o_t < eos - r0
    m_s = t_s < eos - r0
    q += r0 * (H * K) + i_h * K
    k += r0 * (H * K) + i_h * K
    gc += r0 * HV + i_hv
    IT: tl.constexpr = r.dtype.element_ty
    b_k = load_tile(k, o_t, m_t, o_k, m_k, H * K, IT)
    b_h = load_tile(hs + (i_g * HV + i_hv) * K * V, o_k, m_k, o_v, m_v, V, hs.dtype.element_ty)
    b_r = load_tile(r + r0 * (HV * V) + i_hv * V, o_t, m_t, o_v, m_v, HV * V, r.dtype.element_ty)
    b_G = tl.load(gc + o_t * HV, mask=m_t, other=0.).to(DT)
    if STACKED:
        # d_t = bx_t x_t - c_t k_hat_t; Sd_t = d_t^T S_bar_t, the state before token t (j < t)
        rows = r0 + t_s
        p = rows * HV + i_hv
        if z is not None:
            z += i_hv * K
        if d_in is not None:
            d_in += i_hv * K
        b_q = load_tile(q, t_s, m_s, o_k, m_k, H * K, DT)
        b_ks = load_tile(k, t_s, m_s, o_k, m_k, H * K, DT)
        bx = tl.load(b + p, mask=m_s, other=0.).to(DT)
        c = tl.load(cp + p, mask=m_s, other=0.).to(DT)
        q_hat = b_q
        if FOLD_NORMS:
            r_x = row_factors(rq, t_s, m_s, H, r0 * H + i_h, DT)
            q_hat = b_q * r_x[:, None]
            c *= row_factors(rk, t_s, m_s, H, r0 * H + i_h, DT)
            r_x = tl.where(top, r_x, 1.)  # the directions' rows are formed normalised
        x = raw_direction(q_hat, bx[:, None], z, d_in, rows, m_s, o_k, m_k, HV, K, DIR_SOURCE, DIR_GATED, DT)
        b_x = tl.where(top[:, None], b_q, x - c[:, None] * b_ks).to(IT)
        G_s = tl.load(gc + t_s * HV, mask=m_s, other=0.).to(DT)
        keep = tl.where(top[:, None], t_s[:, None] >= o_t[None, :], t_s[:, None] > o_t[None, :])
    else:
        b_x = load_tile(q, o_t, m_t, o_k, m_k, H * K, IT)
        r_x = row_factors(rq, o_t, m_t, H, r0 * H + i_h, DT) if FOLD_NORMS else None
        G_s = b_G
        keep = o_t[:, None] >= o_t[None, :]
    b_o = _row_decay_products(b_x, b_k, b_h, b_r, G_s, b_G, keep, PREC)
    p_o = (r0 + t_s)[:, None] * (HV * V) + i_hv * V + o_v[None, :]
    m_o = m_s[:, None] & m_v[None, :]
    if SD != "patch":
        # the raw queries' norms on their rows (the keys' are on R's rows: the W/U stage's)
        b_os = b_o * (r_x * scale)[:, None] if FOLD_NORMS else b_o * scale
        tl.store(o + p_o, b_os.to(o.dtype.element_ty), mask=m_o & top[:, None])
    if STACKED:
        tl.store(sd + p_o, b_o.to(sd.dtype.element_ty), mask=m_o & ~top[:, None])
    if SD == "residual":
        r_k = row_factors(rk, o_t, m_t, H, r0 * H + i_h, DT) if FOLD_NORMS else None
        b_sd = _residual_sd(b_o, b_r, r_x, r_k, rho, b, lam, w, v, r0, o_t, m_t, o_v, m_v, i_hv, HV, V, DIR_SOURCE,
                            DIR_GATED, DIR_PROJECTED, LAM_TOKEN, W_HEAD, DT)
        tl.store(sd + p_o, b_sd.to(sd.dtype.element_ty), mask=m_o)


def scalar_output_config(V: int, inter_dtype: torch.dtype, stacked: bool) -> tuple[int, int, int]:
    """``(BV, num_warps, num_stages)`` of the scalar-gate output kernel, by rule: bf16 tiles take the
    whole value axis up to 128 in 4 warps, with probes or without (with ``stacked`` rows the ``2
    BT`` rows ``[q_hat; d]`` go through the products once per chunk rather than once per value
    block; on an H100 4 warps are faster than 8 or value blocks of 64, docs/BENCHMARKS.md); float32
    / float64 tiles as :func:`output_config` (with probes where the rows are stacked), unpipelined,
    but in 4 warps where the value block is narrower than 32: in 8 warps Triton's code for the
    ``[BT, 16]`` products reads shared memory out of bounds on an H100 (compute-sanitizer; an
    illegal memory access at K = V = 16)."""
    if inter_dtype == torch.bfloat16:
        return min(128, triton.next_power_of_2(V)), 4, 1
    BV, num_warps = output_config(V, inter_dtype, stacked)
    return BV, num_warps if BV >= 32 else 4, 1


def scalar_output_fwd(lay: ChunkLayout, x, intra, *, v, w, hs, r, o, scale: float, sd=None,
                      config: tuple[int, int, int] | None = None) -> None:
    """Launch ``qed_scalar_output_kernel`` (grid: value heads x chunks x value blocks,
    :func:`~.chunk_common.heads_first`) of the scalar-gate path: ``o = scale (e^G q_hat S0 + (Q K^T
    * Dec) R)`` from the Gram stage's ``intra`` (``scalar_gram.ScalarGram``): its normalised
    queries and keys, or the raw ones with the queries' reciprocal norms applied to the output's
    rows (the keys' are on the rows of ``R``, which the W/U stage scaled), and ``G``, with ``Q K^T``
    formed here rather than stored. With ``sd`` also the probe ``S_bar^T d``, as :func:`sd_form`
    rules for the arm in ``x`` (``chunk_intra.DirectionInputs``): from the residuals ``r``, the
    values ``v``, the write gate ``w`` and the Gram stage's ``rho`` in the same programs; or each
    program builds ``d = bx x - c k_hat`` in registers from the stored ``c`` and stacks it under
    ``q_hat``, so that the ``2 BT`` rows ``[q_hat; d]`` go through the same three products as
    ``q_hat`` alone (``X S0``, ``X K^T``, ``(X K^T * Dec) R``), causal including the diagonal for
    ``o`` and strictly causal for ``Sd``. Where the residual form divides (:func:`sd_patched`) a
    second launch forms, stacked, the ``Sd`` of the chunks the Gram stage flagged (``intra.patch``);
    its other programs return at once. ``config`` ``(BV, num_warps, num_stages)`` overrides the
    first launch's rule (for screening configurations)."""
    B, T, H, K = x.k.shape
    HV, V = r.shape[2], r.shape[-1]
    form = "off" if sd is None else sd_form(x.flags)
    if sd is not None and sd_patched(x.flags) and intra.patch is None:
        raise ValueError("scalar_output_fwd: the residual form of `Sd` for this arm needs the Gram stage's flags of "
                         "the chunks to form again (scalar_gram_fwd(..., patch_below=SD_MIN_DENOMINATOR)), got "
                         "intra.patch None")
    q, k = intra.qk_rows(x)

    def launch(mode, cfg):
        BV, num_warps, num_stages = cfg
        grid, first = heads_first(lay.grid, triton.cdiv(V, BV))
        qed_scalar_output_kernel[grid](
            q=q, k=k, rq=intra.rq, rk=intra.rk, gc=intra.gc, b=x.b, lam=x.lam, cp=intra.c, rho=intra.rho,
            patch=intra.patch, z=x.z, d_in=x.d, v=v, w=w, hs=hs, r=r, o=o, sd=sd,
            cu_seqlens=lay.cu_seqlens, chunk_indices=lay.chunk_indices, T=T, scale=scale,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=triton.next_power_of_2(K), BV=BV, DIR_SOURCE=x.flags["DIR_SOURCE"],
            DIR_GATED=x.flags["DIR_GATED"], DIR_PROJECTED=x.flags["DIR_PROJECTED"], SD=mode, DT=lay.DT,
            PREC=lay.prec, HEADS_FIRST=first, num_warps=num_warps, num_stages=num_stages,
        )

    launch(form, config or scalar_output_config(V, r.dtype, form == "stacked"))
    if intra.patch is not None and sd is not None:
        launch("patch", scalar_output_config(V, r.dtype, True))
