"""Shared pieces of the ``qed_chunk`` kernels (forward and backward): the chunk sizes, the host
side :class:`ChunkLayout` of one call, and ``@triton.jit`` helpers.

Where a program's chunk or sequence lies (``chunk_position`` / ``chunk_at`` for the per-chunk
kernels, ``scan_program`` / ``sequence_span`` for the per-sequence scans), the index ranges, masks
and offsets built from that (``channel_slice``, ``scan_ranges``, ``chunk_rows``, ``state_block``),
pointers moved to one head (``shifted``), and masked loads and stores of 2-D tiles (``load_tile``,
``store_tile``): these compute only indices, masks and pointers (no arithmetic on the data). The
one arithmetic helper is ``exp`` (float32 exponentials without subnormal results). Triton
inlines them all into the kernels that call them.

Per-token tensors are laid out ``[B * T, H, N]`` (row stride ``H * N``); states ``[.., K, V]``.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BT = 64
"""Tokens per chunk."""
BC = 16
"""Tokens per row block inside a chunk (score blocks, the block inverse)."""


@dataclass(frozen=True)
class ChunkLayout:
    """Chunk bookkeeping of one call, shared by the forward and backward launches.

    ``NC`` chunks in all; ``grid`` the per-chunk launch grid ``(chunks, B * HV)`` (``(NC, HV)``
    with varlen); with ``cu_seqlens``, ``cu_seqlens`` (int32), ``chunk_indices`` (``[NC, 2]``:
    sequence, chunk within it) and ``chunk_offsets`` (first chunk of each sequence), else
    ``None``. ``state_dtype`` is the state dtype, ``DT`` the same as a Triton type, ``prec`` the
    ``tl.dot`` input precision; ``interpreting``: running in Triton's interpreter.
    """

    NC: int
    grid: tuple
    cu_seqlens: torch.Tensor | None
    chunk_indices: torch.Tensor | None
    chunk_offsets: torch.Tensor | None
    state_dtype: torch.dtype
    DT: object
    prec: str
    interpreting: bool


def interpreting() -> bool:
    """Whether Triton runs in its interpreter (``TRITON_INTERPRET=1``, the CPU tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@functools.lru_cache(maxsize=8)
def varlen_chunks(seq_bounds: tuple, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(chunk_indices [NC, 2], chunk_offsets [N])`` (int32, on ``device``) of packed sequences
    ``seq_bounds`` (``(row, bos, eos)`` each): per chunk its sequence and its chunk within it, per
    sequence its first chunk. Kept for the last few layouts, so the layers of one packed pass
    (and the passes over the same prompts) build them once; the kernels only read them."""
    idx, offs = [], []
    for n, (_, bos, eos) in enumerate(seq_bounds):
        offs.append(len(idx))
        idx.extend((n, i) for i in range(triton.cdiv(eos - bos, BT)))
    return (torch.tensor(idx, dtype=torch.int32, device=device),
            torch.tensor(offs, dtype=torch.int32, device=device))


def chunk_layout(problem, cu_seqlens, device, prec: str) -> ChunkLayout:
    """The :class:`ChunkLayout` of a validated call (``problem``: ``inputs.QEDProblem``)."""
    P = problem
    if cu_seqlens is not None:
        chunk_indices, chunk_offsets = varlen_chunks(P.seq_bounds, torch.device(device))
        cu = cu_seqlens.to(device=device, dtype=torch.int32).contiguous()
        NC, grid = len(chunk_indices), (len(chunk_indices), P.HV)
    else:
        chunk_indices = chunk_offsets = cu = None
        NC, grid = P.B * triton.cdiv(P.T, BT), (triton.cdiv(P.T, BT), P.B * P.HV)
    return ChunkLayout(NC=NC, grid=grid, cu_seqlens=cu, chunk_indices=chunk_indices, chunk_offsets=chunk_offsets,
                       state_dtype=P.compute_dtype, DT=TL_DTYPES[P.compute_dtype], prec=prec,
                       interpreting=interpreting())


TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32, torch.float64: tl.float64}
"""Triton's dtype of each torch dtype the kernels compute or store intermediates in."""


# ------------------------------------------------------------------------------ arithmetic
FTZ_EXP = tl.constexpr(not interpreting())
"""Whether :func:`exp` takes float32 through ``ex2.approx.ftz`` (compiled kernels) or ``tl.exp``
(Triton's interpreter, which runs no inline PTX)."""


@triton.jit
def exp(x):
    """``e^x`` elementwise. Float32 in a compiled kernel: ``2^(x log2 e)`` by ``ex2.approx.ftz.f32``,
    the instruction ``tl.exp`` also ends in, without the subnormal handling ``tl.exp`` adds around
    it (a compare and two multiplies per element; counts in docs/BENCHMARKS.md): results below ``2^-126`` (``x < -87.3``) are 0 instead of subnormal, which the
    decays here never need (a factor under ``1e-38`` of a bf16 or float32 term). Float64, and
    every dtype in the interpreter: ``tl.exp``."""
    if FTZ_EXP and x.dtype == tl.float32:
        return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=f,f", [x * 1.4426950408889634],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return tl.exp(x)


# ----------------------------------------------------------------------------------- tiles
@triton.jit
def load_tile(ptr, rows, m_r, cols, m_c, stride, DT: tl.constexpr):
    """The ``[rows, cols]`` tile at ``ptr`` (row stride ``stride``), masked to 0, as ``DT``."""
    return tl.load(ptr + rows[:, None] * stride + cols[None, :],
                   mask=m_r[:, None] & m_c[None, :], other=0.).to(DT)


@triton.jit
def store_tile(ptr, x, rows, m_r, cols, m_c, stride):
    """Store ``x`` as the ``[rows, cols]`` tile at ``ptr`` (row stride ``stride``), masked."""
    tl.store(ptr + rows[:, None] * stride + cols[None, :], x.to(ptr.dtype.element_ty),
             mask=m_r[:, None] & m_c[None, :])


@triton.jit
def row_factors(rn, rows, m_r, rn_stride, rn_offset, DT: tl.constexpr):
    """Per-row factors ``[rows]`` at ``rn + rn_offset`` (row stride ``rn_stride``) as ``DT``."""
    return tl.load(rn + rn_offset + rows * rn_stride, mask=m_r, other=0.).to(DT)


@triton.jit
def gate_head(ptr, i_hv, N: tl.constexpr, HEAD: tl.constexpr):
    """A gate's pointer moved to value head ``i_hv``: channel ``i_hv * N`` of a per-channel
    ``[B * T, HV, N]`` gate, or element ``i_hv`` of a per-head ``[B * T, HV]`` one (``HEAD``)."""
    if HEAD:
        out = ptr + i_hv
    else:
        out = ptr + i_hv * N
    return out


@triton.jit
def gate_tile(ptr, rows, m_r, cols, m_c, HV: tl.constexpr, N: tl.constexpr, HEAD: tl.constexpr, DT: tl.constexpr):
    """The ``[rows, cols]`` tile of a gate (``ptr`` moved by :func:`gate_head`) as ``DT``: per channel
    (row stride ``HV * N``), or a per-head gate's one scalar per row broadcast over the columns
    (``HEAD``: row stride ``HV``; loaded as a ``[rows]`` vector and broadcast in registers, since a
    tile load with every lane of a row reading the same element is compiled to one scalar load per
    element), masked to 0."""
    if HEAD:
        row = tl.load(ptr + rows * HV, mask=m_r, other=0.).to(DT)
        out = tl.where(m_c[None, :], row[:, None], 0.)
    else:
        out = load_tile(ptr, rows, m_r, cols, m_c, HV * N, DT)
    return out


@triton.jit
def channel_slice(i, BS: tl.constexpr, N):
    """Slice ``i`` of ``BS`` channels of an ``N``-channel axis: ``(cols, mask)``."""
    cols = i * BS + tl.arange(0, BS)
    return cols, cols < N


# ------------------------------------------------------------------- per-chunk kernels
GRID_AXIS_LIMIT = 65535
"""CUDA's bound on a launch grid's second and third axes."""


def heads_first(grid: tuple, blocks: int = 1) -> tuple[tuple, bool]:
    """``(grid, HEADS_FIRST)`` of a per-chunk launch whose chunk-major grid is
    ``(chunks * blocks, heads)`` (``grid`` = :attr:`ChunkLayout.grid` or one with fewer heads):
    turned to ``(heads, chunks * blocks)`` when that many fit the second axis. Heads first, the
    programs of one chunk run side by side, so the value heads of a query/key head read its
    ``q, k`` tiles while they are in L2 and neighbouring heads' rows of ``[B, T, H, ...]``
    tensors are read together; chunk-major remains for longer inputs (over 4M tokens)."""
    chunks, heads = grid[0] * blocks, grid[1]
    return ((heads, chunks), True) if chunks <= GRID_AXIS_LIMIT else ((chunks, heads), False)


@triton.jit
def chunk_axes(HEADS_FIRST: tl.constexpr):
    """``(chunk index, batch-head index)`` of this program in a :func:`heads_first` grid."""
    if HEADS_FIRST:
        return tl.program_id(1), tl.program_id(0)
    return tl.program_id(0), tl.program_id(1)


@triton.jit
def chunk_position(cu_seqlens, chunk_indices, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr,
                   HEADS_FIRST: tl.constexpr):
    """This program's chunk, grid ``(chunks, B * H)`` (or ``(NC, H)`` with varlen), turned to
    ``(B * H, chunks)`` with ``HEADS_FIRST`` (:func:`heads_first`): ``(i_h, i_t, i_g, bos, eos)``
    = head, chunk within its sequence, global chunk index and the sequence's token span in the
    flattened ``B * T`` rows."""
    return chunk_at(*chunk_axes(HEADS_FIRST), cu_seqlens, chunk_indices, T, H, BT, IS_VARLEN)


@triton.jit
def chunk_at(i_c, i_bh, cu_seqlens, chunk_indices, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """:func:`chunk_position` of chunk ``i_c`` (of ``chunks``, or of ``NC`` with varlen) and
    batch-head ``i_bh``, for grids that place them elsewhere than axes 0 and 1."""
    i_c, i_bh = i_c.to(tl.int64), i_bh.to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    if IS_VARLEN:
        i_n = tl.load(chunk_indices + i_c * 2).to(tl.int64)
        i_t = tl.load(chunk_indices + i_c * 2 + 1).to(tl.int64)
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        i_g = i_c
    else:
        i_t = i_c
        bos = i_b * T
        eos = bos + T
        i_g = i_b * tl.cdiv(T, BT) + i_t
    return i_h, i_t, i_g, bos, eos


# ------------------------------------------------------------------------ scan kernels
@triton.jit
def sequence_span(cu_seqlens, chunk_offsets, i_n, T, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Sequence ``i_n``: ``(bos, eos, NT, c0)`` = token span in the flattened ``B * T`` rows,
    number of chunks and index of its first chunk."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
        c0 = tl.load(chunk_offsets + i_n).to(tl.int64)
        NT = tl.cdiv(eos - bos, BT)
    else:
        bos = i_n * T
        eos = bos + T
        NT = tl.cdiv(T, BT)
        c0 = i_n * NT
    return bos, eos, NT, c0


@triton.jit
def scan_program(cu_seqlens, chunk_offsets, T, H: tl.constexpr, BT: tl.constexpr, IS_VARLEN: tl.constexpr):
    """This program of a scan kernel, grid ``(value blocks, N * H)``:
    ``(i_v, i_nh, i_h, bos, eos, NT, c0)`` = value block, (sequence, head) index, head, and the
    sequence's span (:func:`sequence_span`)."""
    i_v, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos, NT, c0 = sequence_span(cu_seqlens, chunk_offsets, i_n, T, BT, IS_VARLEN)
    return i_v, i_nh, i_h, bos, eos, NT, c0


@triton.jit
def scan_ranges(i_v, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
                BV: tl.constexpr):
    """Index ranges of a scan program with value block ``i_v``: ``(o_t, o_k, o_v, m_k, m_v)`` =
    the rows of a chunk, the key channels, the block's value channels and their masks."""
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    return o_t, o_k, o_v, o_k < K, o_v < V


@triton.jit
def state_block(i, o_k, o_v, m_k, m_v, K: tl.constexpr, V: tl.constexpr):
    """Offsets and mask of the ``[BK, BV]`` block (rows ``o_k``, columns ``o_v``) of state ``i``
    in a ``[.., K, V]`` tensor."""
    return i * K * V + o_k[:, None] * V + o_v[None, :], m_k[:, None] & m_v[None, :]


@triton.jit
def chunk_rows(i_t, bos, eos, o_t, m_k, m_v, BT: tl.constexpr):
    """Chunk ``i_t`` of a scan program's sequence: ``(rows, m_t, m_tk, m_tv)`` = its rows in the
    flattened ``B * T`` axis, their mask and the masks of its ``[BT, BK]`` / ``[BT, BV]`` tiles."""
    rows = bos + i_t * BT + o_t
    m_t = rows < eos
    return rows, m_t, m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]


# ---------------------------------------------------------------------------- pointers
@triton.jit
def shifted(ptrs, off):
    """The pointers of the tuple ``ptrs``, each moved by ``off`` elements (e.g. to one head's
    channels: ``off = i_h * K`` in a ``[B * T, H, K]`` tensor)."""
    out = ()
    for i in tl.static_range(len(ptrs)):
        out = out + (ptrs[i] + off,)
    return out
