r"""Token-by-token Triton kernel of the QED recurrence (decode, short sequences, probes).

The recurrence is the one written out at the top of ``naive.py`` (``S_bar_t = Diag(exp g_t)
S_{t-1}``, ``a_t = b_t * k_hat_t + lam_t d_t``, ``S_t = S_bar_t + k_hat_t (w_t v_t - S_bar_t^T
a_t)^T``, ``o_t = S_t^T scale q_hat_t``), with the state ``K x V`` in float32 (float64 for float64
inputs).

Shapes: ``q, k`` ``[B, T, H, K]``; ``g, b`` ``[B, T, HV, K]``; ``v, w`` ``[B, T, HV, V]`` (any of
``g, b, w`` may be one scalar per token and value head, ``[B, T, HV]``, read once and broadcast);
``lam`` ``[HV]`` or ``[B, T, HV]``; states ``[N, HV, K, V]``; ``K, V <= 256``; value head ``j``
reads query/key head ``j // (HV // H)``. Probes (only when asked): ``rho = q_hat . k_hat``
``[B, T, HV]``, ``d`` ``[B, T, HV, K]``, ``Sd = S_bar^T d`` ``[B, T, HV, V]``,
``e = 1 - a . k_hat`` ``[B, T, HV]``.

One program holds the full key axis and a ``BV``-wide slice of the value axis of one
(sequence, value head) state in registers and walks its tokens; grid ``(N * HV, cdiv(V, BV))``.
The arm enters as the compile-time flags of ``arms.direction_flags``; absent inputs and outputs
are ``None``, and :func:`recurrent_fwd` passes their switches (and the gate and lambda layouts,
read from the validated problem) as plain arguments: a ``@triton.heuristics`` wrapper would
rebuild a dict of every argument for each switch at every launch.
Per token: one fused reduction for all dot products over K, then the two independent reads
``S_bar^T a`` and ``S_bar^T q`` (``o_t = S_bar^T q + (k.q) r_t``); the next token's inputs are
loaded while this one computes. ``scale`` is compiled in (exact for float64), so each new
``scale`` value compiles the kernel once.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .arms import direction_flags
from .inputs import QEDOutput, check_qed_inputs, on_input_device, probe_request

Tensor = torch.Tensor

MAX_HEAD_DIM = 256


@triton.jit
def _gate_vector(ptr, t, i_hv, HV, N, o, mask, HEAD: tl.constexpr):
    """Token ``t``'s gate vector over the channels ``o`` of value head ``i_hv``: per channel
    (``[B * T, HV, N]``), or a per-head gate's scalar (``[B * T, HV]``, ``HEAD``) read by every lane."""
    if HEAD:
        out = tl.load(ptr + t * HV + i_hv + o * 0, mask=mask, other=0)
    else:
        out = tl.load(ptr + (t * HV + i_hv) * N + o, mask=mask, other=0)
    return out


@triton.jit
def _token_inputs(q, k, g, b, w, v, t, i_h, i_hv, HV, K, V, sq, sk, sv, o_k, o_v, mask_k, mask_v,
                  G_HEAD: tl.constexpr, B_HEAD: tl.constexpr, W_HEAD: tl.constexpr):
    """The raw ``q, k`` (query/key head ``i_h``), ``g, b`` (K) and ``w, v`` (V) vectors (value
    head ``i_hv``) of token ``t``; a per-head gate is its one scalar broadcast. ``sq, sk, sv``:
    the token strides of ``q, k, v`` (their heads contiguous within a token)."""
    i_k = i_h * K + o_k
    return (tl.load(q + t * sq + i_k, mask=mask_k, other=0), tl.load(k + t * sk + i_k, mask=mask_k, other=0),
            _gate_vector(g, t, i_hv, HV, K, o_k, mask_k, G_HEAD), _gate_vector(b, t, i_hv, HV, K, o_k, mask_k, B_HEAD),
            _gate_vector(w, t, i_hv, HV, V, o_v, mask_v, W_HEAD),
            tl.load(v + t * sv + i_hv * V + o_v, mask=mask_v, other=0))


@triton.jit
def _add4(a0, a1, a2, a3, b0, b1, b2, b3):
    return a0 + b0, a1 + b1, a2 + b2, a3 + b3


@triton.jit(do_not_specialize=["T"])
def qed_recurrent_kernel(
    q, k, v, g, b, w, lam, z, d, o, h0, ht, cu_seqlens,
    rho_out, d_out, sd_out, e_out,
    T, sq, sk, sv,
    scale: tl.constexpr,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    DIR_SOURCE: tl.constexpr,
    DIR_GATED: tl.constexpr,
    DIR_PROJECTED: tl.constexpr,
    USE_QK_L2NORM: tl.constexpr,
    DT: tl.constexpr,
    LAM_PER_TOKEN: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr,
    STORE_FINAL_STATE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
    STORE_RHO: tl.constexpr,
    STORE_D: tl.constexpr,
    STORE_SD: tl.constexpr,
    STORE_E: tl.constexpr,
    G_HEAD: tl.constexpr,
    B_HEAD: tl.constexpr,
    W_HEAD: tl.constexpr,
):
    i_nh = tl.program_id(0).to(tl.int64)
    i_v = tl.program_id(1)
    i_n, i_hv = i_nh // HV, i_nh % HV
    i_h = i_hv // (HV // H)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = i_n * T
        eos = bos + T

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    mask_k = o_k < K
    mask_v = o_v < V

    b_h = tl.zeros([BK, BV], dtype=DT)
    if USE_INITIAL_STATE:
        p_h0 = h0 + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        b_h += tl.load(p_h0, mask=mask_k[:, None] & mask_v[None, :], other=0).to(DT)
    if DIR_SOURCE == "z":  # rand: z is fixed per value head
        b_z = tl.load(z + i_hv * K + o_k, mask=mask_k, other=0).to(DT)
    if not LAM_PER_TOKEN:
        b_lam = tl.load(lam + i_hv).to(DT)

    # Each token's vectors are loaded one token ahead, so their memory latency hides behind the
    # previous token's arithmetic (and the first token's behind the state load).
    nxt = _token_inputs(q, k, g, b, w, v, bos, i_h, i_hv, HV, K, V, sq, sk, sv, o_k, o_v, mask_k, mask_v,
                        G_HEAD, B_HEAD, W_HEAD)
    t = bos
    while t < eos:  # a while loop: the interpreter cannot range() over program-id tensors
        i_tk = (t * HV + i_hv) * K + o_k
        i_tv = (t * HV + i_hv) * V + o_v
        b_q, b_k, b_g, b_b, b_w, b_v = nxt
        t_next = tl.minimum(t + 1, eos - 1)  # the last token re-reads itself
        nxt = _token_inputs(q, k, g, b, w, v, t_next, i_h, i_hv, HV, K, V, sq, sk, sv, o_k, o_v, mask_k, mask_v,
                            G_HEAD, B_HEAD, W_HEAD)
        b_q, b_k, b_g, b_b = b_q.to(DT), b_k.to(DT), b_g.to(DT), b_b.to(DT)
        b_wv = b_w.to(DT) * b_v.to(DT)
        if LAM_PER_TOKEN:
            b_lam = tl.load(lam + t * HV + i_hv).to(DT)

        # The raw direction x (before the norms of q and k are applied), then every dot product
        # over K in one reduction (k.x: the projection coefficient).
        if DIR_SOURCE == "z":
            b_x = b_z
        elif DIR_SOURCE == "d":
            b_x = tl.load(d + i_tk, mask=mask_k, other=0).to(DT)
        else:
            b_x = b_q
        if DIR_GATED:
            b_x = b_b * b_x
        qq, kk, qk, kx = tl.reduce((b_q * b_q, b_k * b_k, b_q * b_k, b_k * b_x), 0, _add4)
        if USE_QK_L2NORM:
            r_q = 1 / tl.sqrt(qq + 1e-6)
            r_k = 1 / tl.sqrt(kk + 1e-6)
            b_q *= r_q
            b_k *= r_k
            qk *= r_q * r_k
            kx *= r_k
            if DIR_SOURCE == "q":
                b_x *= r_q
                kx *= r_q

        if DIR_SOURCE == "none":
            b_d = tl.zeros([BK], dtype=DT)
        elif DIR_PROJECTED:
            b_d = b_x - b_k * kx
        else:
            b_d = b_x
        b_a = b_b * b_k + b_lam * b_d

        b_h *= tl.exp(b_g)[:, None]
        # o_t = S_t^T q = S_bar^T q + (k.q) r_t: both reads of S_bar are independent.
        b_sq = b_q * scale
        b_r = b_wv - tl.sum(b_h * b_a[:, None], 0)
        b_o = tl.sum(b_h * b_sq[:, None], 0) + scale * qk * b_r
        if STORE_SD:
            tl.store(sd_out + i_tv, tl.sum(b_h * b_d[:, None], 0).to(sd_out.dtype.element_ty), mask=mask_v)
        if i_v == 0:  # the per-token probes, written once per (token, value head)
            if STORE_RHO:
                tl.store(rho_out + t * HV + i_hv, qk.to(rho_out.dtype.element_ty))
            if STORE_E:
                tl.store(e_out + t * HV + i_hv, (1 - tl.sum(b_a * b_k)).to(e_out.dtype.element_ty))
            if STORE_D:
                tl.store(d_out + i_tk, b_d.to(d_out.dtype.element_ty), mask=mask_k)
        b_h += b_k[:, None] * b_r[None, :]
        tl.store(o + i_tv, b_o.to(o.dtype.element_ty), mask=mask_v)
        t += 1

    if STORE_FINAL_STATE:
        p_ht = ht + i_nh * K * V + o_k[:, None] * V + o_v[None, :]
        tl.store(p_ht, b_h.to(ht.dtype.element_ty), mask=mask_k[:, None] & mask_v[None, :])


@functools.lru_cache(maxsize=256)
def default_block_config(K: int, V: int, dtype: torch.dtype, states: int) -> tuple[int, int]:
    """``(BV, num_warps)``: the value-slice width each program holds, and its warps, by rule from
    ``K``, ``V``, the state dtype and the number of ``states`` (sequences x value heads).

    Float32 states run in 2 warps, in value slices of 64 once there are at least
    :data:`WIDE_SLICE_STATES` states (enough programs to fill the GPU; each then streams a larger
    block of the state) and of 32 below, at most 8,192 state elements per program (a ``K = 256``
    state takes slices half as wide). Float64 states keep slices of 16. docs/BENCHMARKS.md has
    the decode screen behind it. Cached: a decode loop asks for it once per step."""
    BK = triton.next_power_of_2(K)
    if dtype != torch.float32:
        BV = min(triton.next_power_of_2(V), 16)
        return BV, 4 if BK * BV <= 4096 else 8
    BV = 64 if states >= WIDE_SLICE_STATES else 32
    return min(BV, 8192 // BK, triton.next_power_of_2(V)), 2


WIDE_SLICE_STATES = 256
"""From this many states (sequences x value heads) on, float32 decode uses value slices of 64."""


WARPS = (1, 2, 4, 8, 16, 32)


def checked_block_config(block_config, V: int) -> tuple[int, int]:
    """``block_config`` as ``(BV, num_warps)``, refused by name unless ``BV`` is a power of two in
    ``[1, next_power_of_2(V)]`` (a wider slice would only hold masked lanes) and ``num_warps``
    one of :data:`WARPS`."""
    ok = isinstance(block_config, tuple) and len(block_config) == 2 and all(
        isinstance(x, int) and not isinstance(x, bool) for x in block_config)
    if ok:
        BV, warps = block_config
        ok = 1 <= BV <= triton.next_power_of_2(V) and BV & (BV - 1) == 0 and warps in WARPS
    if not ok:
        raise ValueError(f"qed_recurrent: `block_config` must be a tuple (BV, num_warps) with BV a power of "
                         f"two in [1, {triton.next_power_of_2(V)}] and num_warps in {WARPS}, got {block_config!r}")
    return block_config


@functools.lru_cache(maxsize=64)
def _padded_and_blocks(K: int, V: int, BV: int) -> tuple[int, int]:
    """``(BK, value blocks)``: the key axis padded to a power of two, and ``V`` in slices of ``BV``
    (cached with the launch rule: both are asked for at every decode step)."""
    return triton.next_power_of_2(K), triton.cdiv(V, BV)


def token_rows(x: Tensor) -> tuple[Tensor, int]:
    """``x`` ``[B, T, heads, D]`` and the stride between its tokens (elements): ``x`` itself where
    each token's heads lie in one contiguous row and the rows are evenly spaced (as in a view of
    one projection's output split along its last axis, which is how transformers hands over q, k
    and v), so that the kernel reads them in place; else a contiguous copy."""
    B, T, heads, D = x.shape
    sb, st, sh, sd = x.stride()
    if (sd == 1 or D == 1) and (sh == D or heads == 1) and (T == 1 or B == 1 or sb == T * st):
        return x, st if T > 1 else sb
    return x.contiguous(), heads * D


def recurrent_fwd(q, k, v, g, b, w, lam, z, d, scale: float, initial_state, output_final_state: bool,
                  return_probes: bool, use_qk_l2norm: bool, cu_seqlens, arm: str, problem,
                  block_config: tuple[int, int], inplace_final_state: bool) -> tuple:
    """Launch :func:`qed_recurrent_kernel`: ``(o, final_state, probes)``, ``o`` contiguous; with
    ``inplace_final_state`` the final state is written over ``initial_state``. ``q, k, v`` are
    read at their token strides (:func:`token_rows`), every other input contiguous."""
    P = problem
    B, T, HV, K, V, ct = P.B, P.T, P.HV, P.K, P.V, P.compute_dtype
    (q, sq), (k, sk), (v, sv) = token_rows(q), token_rows(k), token_rows(v)
    o = v.new_empty(v.shape)
    final_state = None
    if output_final_state:
        final_state = initial_state if inplace_final_state else q.new_empty(P.N, HV, K, V, dtype=ct)
    want = probe_request("qed_recurrent", return_probes)
    probes = {}  # exactly the probes asked for, in their order: the op's probes result
    if want:
        shapes = {"rho": (B, T, HV), "d": (B, T, HV, K), "Sd": (B, T, HV, V), "e": (B, T, HV)}
        probes = {name: q.new_empty(shapes[name], dtype=ct) for name in want}
    BV, num_warps = block_config
    BK, value_blocks = _padded_and_blocks(K, V, BV)
    qed_recurrent_kernel[(P.N * HV, value_blocks)](
        q=q, k=k, v=v, g=g, b=b, w=w, lam=lam, z=z, d=d, o=o, h0=initial_state, ht=final_state,
        cu_seqlens=cu_seqlens,
        rho_out=probes.get("rho"), d_out=probes.get("d"), sd_out=probes.get("Sd"), e_out=probes.get("e"),
        T=T, sq=sq, sk=sk, sv=sv, scale=scale, H=P.H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        **direction_flags(arm, d is not None), USE_QK_L2NORM=use_qk_l2norm,
        DT=tl.float64 if ct == torch.float64 else tl.float32, LAM_PER_TOKEN=P.lam_per_token,
        USE_INITIAL_STATE=initial_state is not None, STORE_FINAL_STATE=final_state is not None,
        IS_VARLEN=cu_seqlens is not None, STORE_RHO="rho" in probes, STORE_D="d" in probes, STORE_SD="Sd" in probes,
        STORE_E="e" in probes, G_HEAD=P.head_g, B_HEAD=P.head_b, W_HEAD=P.head_w, num_warps=num_warps,
    )
    return o, final_state, probes or None


@on_input_device
def qed_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, b: Tensor, w: Tensor, lam: Tensor, *,
                  arm: str = "full", z: Tensor | None = None, d: Tensor | None = None, scale: float | None = None,
                  initial_state: Tensor | None = None, output_final_state: bool = False,
                  return_probes: bool = False, use_qk_l2norm: bool = True, cu_seqlens: Tensor | None = None,
                  block_config: tuple[int, int] | None = None, inplace_final_state: bool = False) -> QEDOutput:
    """Token-by-token QED forward in one Triton launch (decode; forward only, no gradients).

    Args:
        q, k: ``[B, T, H, K]`` queries and keys.
        v: ``[B, T, HV, V]`` values, ``HV = m H``.
        g, b: log-decay and erase gate, ``[B, T, HV, K]`` or ``[B, T, HV]`` (one scalar per value head).
        w: write gate, ``[B, T, HV, V]`` or ``[B, T, HV]``.
        lam: strength ``[HV]`` or ``[B, T, HV]``.
        arm, z, d, scale, initial_state, output_final_state, return_probes, use_qk_l2norm,
            cu_seqlens: as :func:`qedprobe.kernels.qed.naive.qed_naive`; ``K, V <= 256``.
        block_config: ``(BV, num_warps)``, each program's value-slice width and its warps (the
            results are the same up to the rounding order of its reductions); None is
            :func:`default_block_config`. A tuning knob for benchmarks (``bench/recurrent_decode.py``).
        inplace_final_state: with ``output_final_state=True`` and a contiguous ``initial_state``,
            write the final state over ``initial_state`` and return that tensor: a decode loop
            that owns its state buffers then reads and writes its state once per step, instead of
            writing a new tensor and copying it back (twice the state traffic). It is exact: each
            program reads its ``[K, BV]`` block of the state before the first token and writes the
            same block after the last, and no other program touches it.

    Returns:
        ``(o, final_state, probes)`` as ``qed_naive`` (grouped value heads included).
        ``q, k, v`` whose tokens are evenly spaced rows of contiguous heads (views of one
        projection's output) are read in place; other non-contiguous inputs are copied to
        contiguous ones first.
    """
    if inplace_final_state:
        _check_inplace_state(initial_state, output_final_state)
    P = check_qed_inputs("qed_recurrent", q, k, v, g, b, w, lam, arm=arm, z=z, d=d, scale=scale,
                         initial_state=initial_state, cu_seqlens=cu_seqlens)
    if P.K > MAX_HEAD_DIM or P.V > MAX_HEAD_DIM:
        raise ValueError(f"qed_recurrent: K and V must be at most {MAX_HEAD_DIM}, got K={P.K}, V={P.V}")
    launch = default_block_config(P.K, P.V, P.compute_dtype, P.N * P.HV) if block_config is None \
        else checked_block_config(block_config, P.V)
    contiguous = lambda x: None if x is None else x.contiguous()  # noqa: E731
    return recurrent_fwd(q, k, v, *(x.contiguous() for x in (g, b, w, lam)), contiguous(z), contiguous(d),
                         P.scale, contiguous(initial_state), output_final_state, return_probes, use_qk_l2norm,
                         None if cu_seqlens is None else cu_seqlens.to(q.device), arm, P, launch,
                         inplace_final_state)


def _check_inplace_state(initial_state, output_final_state: bool) -> None:
    """Refuse, by name, an ``inplace_final_state`` request that could not update ``initial_state``
    in place (no state, no final state asked, or a non-contiguous state that would be copied)."""
    if not output_final_state:
        raise ValueError("qed_recurrent: `inplace_final_state=True` needs `output_final_state=True`")
    if initial_state is None:
        raise ValueError("qed_recurrent: `inplace_final_state=True` needs an `initial_state` to write over, got None")
    if not initial_state.is_contiguous():
        raise ValueError(f"qed_recurrent: `inplace_final_state=True` needs a contiguous `initial_state` "
                         f"(a copy would receive the update), got strides {tuple(initial_state.stride())}")
