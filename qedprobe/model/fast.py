r"""The fast inference path of :class:`~qedprobe.model.QEDModel`: each block's elementwise work
fused by ``torch.compile``, and the projections that read the same input run as one matmul.

    with fast_path(model):              # compiled by inductor (fast_path(model, backend=None): not compiled)
        model.generate(prompts, 16)     # the prefill and every decode step take the fast path

Each block is two compiled regions around the recurrence, which runs as on the plain path
(:meth:`QEDMixer.run_recurrence`)::

    pre:  h = attn_norm(x);  [q k v b w f g'] = h W_in^T          one matmul for 7 projections
          q, k, v = silu(conv(.));  b, w = sigmoid(.);  g = mixer.decay(f)
    op:   o = mixer.run_recurrence(q, k, v, g, b, w, ...)         (the plain path's call)
    post: x_mid = x + mixer.output(o, g')
          [a u] = mlp_norm(x_mid) W_gu^T;  x_out = x_mid + mlp.down_proj(silu(a) u)

The regions run the block's own modules and methods (the norms, :meth:`QEDMixer.decay`,
:meth:`QEDMixer.output`, the projections' layers) on the arithmetic the plain path uses
(``layers.rms_norm``, ``layers.conv_taps``, ``layers.swiglu``, ``mixer.log_decay``); what is the
fast path's own is the stacking and the packed convolution's mask. ``W_in`` stacks ``q_proj,
k_proj, v_proj, b_proj, w_proj, f_proj.0, g_proj.0`` (rows in that order) and ``W_gu`` stacks the
MLP's ``gate_proj, up_proj``: one wide matmul reads its input once and keeps the GPU busier than
seven narrow ones. The block is an argument of the regions (dynamo lifts its parameters to
inputs), so one compiled region serves every layer. A packed prefill's convolution masks the taps
that would reach the previous sequence (:class:`TokenLayout`, built once per pass, no host
synchronisation) instead of scattering the row into a padded copy as the plain path does.

Values: every element is computed as the plain path computes it (float32 where it works in
float32, the same rounding to the model's dtype); a fused kernel may order a few float
operations differently, cuBLAS may pick other kernels for the wider matmuls, and inductor keeps
the SwiGLU product ``silu(a) u`` in float32 where the plain path rounds ``silu(a)`` first. So the
fast path equals the plain path to float rounding (float32: ``tests/test_fast_path.py``), not
bit for bit.

When it runs: :meth:`QEDModel.run_blocks` takes it inside a :func:`fast_path` block when nothing
the plain path offers is needed: no hook attached anywhere in the model (hooks see every
intermediate), grad mode off (``torch.no_grad`` / ``torch.inference_mode``), value checks off
(they synchronise). Otherwise that call runs the plain path.

Compilation: the regions are marked dynamic in the axis that changes between calls (tokens for a
prefill, sequences for a decode step), so a sweep over lengths and batch sizes compiles each
region once per input layout (packed prefill, ``[B, T]`` rows, decode step, with and without
states), plus once where that axis has size 1 (torch specialises it). The stacked weights are
kept per block while their sources are the same tensors with the same version counters; an
in-place edit, a load or a move rebuilds them at the next call.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from qedprobe.kernels.qed.inputs import value_checks_enabled

from .hooked import hooks_attached
from .layers import conv_taps, swiglu
from .mixer import MixerState

__all__ = ["FastPath", "TokenLayout", "fast_path", "has_fast_path", "fast_path_setting", "active_fast_path", "fast_path_key", "fast_block_runner",
           "conv_silu"]

COMPILE_OPTIONS = {"emulate_precision_casts": True, "combo_kernels": True}
"""inductor options: round to the model's dtype where the plain path does (bf16 between ops);
fuse independent kernels of a region horizontally (the three convolution-cache writes of a decode
step and their neighbours run as one launch: a decode step is launch- and latency-bound)."""

RECOMPILE_LIMIT = 64
"""dynamo's compiles per region kept inside a :func:`fast_path` block (torch's default is 8): each
input layout, dtype, model shape and backend a process runs is one, and past the limit a
``fullgraph`` region fails instead of running."""


@dataclass(frozen=True)
class FastPath:
    """The setting of a :func:`fast_path` block: ``backend`` is a ``torch.compile`` backend (a
    name such as ``"inductor"``, or a callable), or None to run the fused regions uncompiled."""

    backend: object = "inductor"


_ACTIVE_BLOCKS: contextvars.ContextVar[tuple] = contextvars.ContextVar("qedprobe_fast_path_blocks", default=())
"""The :func:`fast_path` blocks active in this context: ``((model, FastPath), ...)``, as entered."""


def has_fast_path(model) -> bool:
    """Whether ``model`` can run the fast path (it has ``blocks`` of QED blocks: a ``QEDModel``)."""
    return getattr(model, "supports_fast_path", False)


@contextlib.contextmanager
def fast_path(model, backend="inductor"):
    """Inside this block ``model.run_blocks`` (prefill passes, decode steps, ``generate``) takes
    the fast path where it applies (module doc); ``backend=None`` runs the same fused regions
    without compiling them. The block raises dynamo's recompile limit to :data:`RECOMPILE_LIMIT`.
    The setting is held beside the model for the calls in this thread (or asyncio task), not on it."""
    if not (backend is None or isinstance(backend, str) or callable(backend)):
        raise ValueError(f"fast_path: `backend` must be None, a torch.compile backend name or a callable, "
                         f"got {backend!r}")
    if not has_fast_path(model):
        raise ValueError(f"fast_path: {type(model).__name__} has no fast path (QEDModel has)")
    entry = (model, FastPath(backend))
    _ACTIVE_BLOCKS.set(_ACTIVE_BLOCKS.get() + (entry,))
    limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    try:
        with torch._dynamo.config.patch(recompile_limit=limit):
            yield model
    finally:
        _ACTIVE_BLOCKS.set(tuple(block for block in _ACTIVE_BLOCKS.get() if block is not entry))


def fast_path_setting(model) -> FastPath | None:
    """The :class:`FastPath` of the innermost :func:`fast_path` block on ``model`` around this
    call, or None outside every such block."""
    return next((setting for owner, setting in reversed(_ACTIVE_BLOCKS.get()) if owner is model), None)


def active_fast_path(model, *, packed: bool = False, states=None) -> FastPath | None:
    """:func:`fast_path_setting` when a ``run_blocks`` call may take the fast path now, else None:
    no hooks, no grad, no value checks, and not a packed call (``packed``) that continues
    ``states`` (the masked convolution starts every sequence from zeros)."""
    fp = fast_path_setting(model)
    if fp is None or torch.is_grad_enabled() or value_checks_enabled() or hooks_attached(model) \
            or (packed and states is not None):
        return None
    return fp


def fast_path_key(model) -> tuple | None:
    """What a captured decode graph of the fast path depends on beyond the parameters'
    addresses: the backend and the addresses of the stacked weights (refreshed first). None when
    the fast path would not run."""
    fp = active_fast_path(model)
    if fp is None:
        return None
    return fp.backend, tuple(w.data_ptr() for block in model.blocks for w in stacked_weights(block))


# ------------------------------------------------------------------------------- weights
def _version(t: torch.Tensor):
    """``t``'s version counter (bumped by in-place edits); None for an inference tensor (none kept)."""
    return None if t.is_inference() else t._version


def _stack(linears) -> torch.Tensor:
    """The weights ``[out_i, in]`` of ``linears`` stacked along the output axis, as normal tensors
    (not inference tensors: the stack outlives the ``inference_mode`` block that built it)."""
    with torch.inference_mode(False), torch.no_grad():
        return torch.cat([lin.weight for lin in linears])


_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""block -> (the source weights' (address, version) pairs, (W_in, W_gu))."""


def stacked_weights(block) -> tuple[torch.Tensor, torch.Tensor]:
    """``(W_in, W_gu)`` of ``block`` (module doc), rebuilt when a source weight is another tensor
    or was edited in place since the last call (always, for inference-tensor weights: they keep
    no version)."""
    mixer, mlp = block.attn, block.mlp
    inputs = (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.b_proj, mixer.w_proj, mixer.f_proj[0],
              mixer.g_proj[0])
    gate_up = (mlp.gate_proj, mlp.up_proj)
    key = tuple((lin.weight.data_ptr(), _version(lin.weight)) for lin in inputs + gate_up)
    cached = _STACKS.get(block)
    if cached is None or cached[0] != key or any(v is None for _, v in key):
        cached = _STACKS[block] = (key, (_stack(inputs), _stack(gate_up)))
    return cached[1]


# --------------------------------------------------------------------------- token layout
@dataclass(frozen=True)
class TokenLayout:
    """Where each token of a packed row sits, for the short convolutions (width ``W``):
    ``pos`` ``[T]`` its position inside its sequence; ``tail_at`` ``[N, W-1]`` where the last
    ``W - 1`` inputs of each sequence sit in the row left-padded by ``W - 1`` zeros (``end + i``);
    ``tail_ok`` ``[N, W-1]`` which of them belong to the sequence (the others are zeros, as a
    sequence shorter than ``W - 1`` has)."""

    pos: torch.Tensor
    tail_at: torch.Tensor
    tail_ok: torch.Tensor

    @classmethod
    def packed(cls, cu_seqlens: torch.Tensor, T: int, width: int) -> "TokenLayout":
        """The layout of ``T`` tokens packed by ``cu_seqlens`` ``[N + 1]`` (on the device)."""
        cu = cu_seqlens.long()
        idx = torch.arange(T, device=cu.device)
        start = cu[torch.searchsorted(cu[1:], idx, right=True)]
        slot = torch.arange(width - 1, device=cu.device)
        lengths = cu[1:] - cu[:-1]
        return cls(pos=idx - start, tail_at=cu[1:, None] + slot,
                   tail_ok=slot >= (width - 1 - lengths)[:, None])


# ---------------------------------------------------------------------------- the regions
def conv_silu(x: torch.Tensor, weight: torch.Tensor, bias, cache, layout: TokenLayout | None):
    """Causal depthwise convolution + SiLU of ``x`` ``[B, T, D]`` (``weight`` ``[D, 1, W]``):
    ``(y [B, T, D], cache [N, D, W-1])``, as ``ShortConvolution``.

    Rows (``layout`` None): each row continues from ``cache`` ``[B, D, W-1]`` (zeros if None).
    Packed (``layout`` given, ``B = 1``, ``cache`` None): the tap ``j`` of token ``t`` reads
    ``x[t - (W-1-j)]`` only when that token is in ``t``'s sequence (``pos[t] >= W-1-j``).
    """
    B, T, D = x.shape
    W = weight.shape[-1]
    hist = x.new_zeros(B, W - 1, D) if cache is None else cache.transpose(1, 2).to(x.dtype)
    xp = torch.cat([hist, x], dim=1)
    y = conv_taps(xp.float(), weight, bias, T, None if layout is None else W - 1 - layout.pos).to(x.dtype)
    if layout is None:
        tail = xp[:, T:]
    else:
        tail = torch.where(layout.tail_ok[..., None], xp[0, layout.tail_at], 0.0)  # [N, W-1, D]
    return y, tail.transpose(1, 2).contiguous()  # one layout for every call: no recompile on strides


def input_widths(mixer) -> tuple[int, ...]:
    """The row counts of ``W_in``'s seven parts (module doc), in its order."""
    return tuple(lin.out_features for lin in (mixer.q_proj, mixer.k_proj, mixer.v_proj, mixer.b_proj,
                                              mixer.w_proj, mixer.f_proj[0], mixer.g_proj[0]))


def mixer_inputs(block, x, w_in, caches, layout, caches_in_place: bool):
    """The pre region: ``x`` ``[B, T, D]`` -> ``(q, k, v, b, w, g, g_low, conv caches)``, the
    recurrence's inputs ``[B, T, H, .]`` (``g`` in float32, float64 for a float64 model) and
    ``g_low`` ``[B, T, V]``, the gate's first projection, computed by ``block``'s own modules
    (``attn_norm``, the mixer's convolutions' weights, :meth:`QEDMixer.decay`) around the one
    stacked matmul ``w_in`` (:func:`stacked_weights`).

    ``caches``: the q, k, v convolution caches ``[B, D_i, W-1]`` or None each.
    ``caches_in_place``: the new caches are written over ``caches`` (inside the compiled region,
    so the write is part of the kernel that reads them) and those tensors are returned.
    """
    mixer = block.attn
    heads = mixer.cfg.num_heads
    q_raw, k_raw, v_raw, b_raw, w_raw, f_low, g_low = F.linear(block.attn_norm(x), w_in).split(
        input_widths(mixer), dim=-1)
    outs, tails = [], []
    for raw, conv, cache in zip((q_raw, k_raw, v_raw), (mixer.q_conv1d, mixer.k_conv1d, mixer.v_conv1d), caches):
        y, tail = conv_silu(raw, conv.weight, conv.bias, cache, layout)
        outs.append(y.unflatten(-1, (heads, -1)))
        tails.append(cache.copy_(tail) if caches_in_place else tail)
    b = b_raw.sigmoid().unflatten(-1, (heads, -1))
    w = w_raw.sigmoid().unflatten(-1, (heads, -1))
    return (*outs, b, w, mixer.decay(f_low), g_low, tuple(tails))


def block_outputs(block, x, o, g_low, w_gu):
    """The post region: ``x_out`` ``[B, T, D]`` from the block input ``x``, the recurrence's output
    ``o`` ``[B, T, H, V]`` and ``g_low``, by ``block``'s own modules (:meth:`QEDMixer.output`,
    ``mlp_norm``, ``mlp.down_proj``) with the MLP's gate and up projections as the one stacked
    matmul ``w_gu``."""
    mid = x + block.attn.output(o, g_low)
    a, u = F.linear(block.mlp_norm(mid), w_gu).chunk(2, dim=-1)
    return mid + block.mlp.down_proj(swiglu(a, u))


@functools.cache
def _compiled(fn, backend):
    """``fn`` compiled once per backend (None: ``fn`` itself)."""
    if backend is None:
        return fn
    options = COMPILE_OPTIONS if backend == "inductor" else None
    return torch.compile(fn, backend=backend, fullgraph=True, options=options)


def _mark_dynamic(axes: tuple, *tensors) -> None:
    """Mark ``axes`` of each tensor dynamic for ``torch.compile`` (a size-1 axis stays static)."""
    for t in tensors:
        if t is not None:
            for axis in axes:
                torch._dynamo.maybe_mark_dynamic(t, axis)


# --------------------------------------------------------------------------------- driver
def _run_block(fp: FastPath, block, x, lam_scale, state, cu_seqlens, layout, want_state, state_in_place):
    """One block on the fast path: ``(x_out, MixerState or None)``."""
    w_in, w_gu = stacked_weights(block)
    caches = state.conv if state is not None else (None, None, None)
    axes = (0,) if layout is None and x.shape[1] == 1 else (1,) if layout is not None else (0, 1)
    _mark_dynamic(axes, x)  # decode steps vary in sequences, packed prefills in tokens, rows in both
    if axes == (0,):
        _mark_dynamic(axes, *caches)
    if layout is not None:
        _mark_dynamic((0,), layout.pos, layout.tail_at, layout.tail_ok)
    q, k, v, b, w, g, g_low, tails = _compiled(mixer_inputs, fp.backend)(
        block, x, w_in, caches, layout, state_in_place and state is not None)
    o, recurrent = block.attn.run_recurrence(q, k, v, g, b, w, lam_scale, state, cu_seqlens, want_state,
                                             state_in_place)
    _mark_dynamic(axes, o, g_low)
    out = _compiled(block_outputs, fp.backend)(block, x, o, g_low, w_gu)
    return out, (MixerState(recurrent, tails) if want_state else None)


def fast_block_runner(fp: FastPath, cu_seqlens, T: int, width: int):
    """A callable ``(block, x, *, lam_scale, state, cu_seqlens, want_state, state_in_place) -> (x_out, state)``,
    the signature of a plain ``QEDBlock`` call, that runs the block on the fast path (``fp`` from
    :func:`active_fast_path`) for a pass over ``T`` tokens; the packed layout (convolution
    width ``width``) is built here once, for every block."""
    layout = None if cu_seqlens is None else TokenLayout.packed(cu_seqlens, T, width)

    def run(block, x, *, lam_scale, state, cu_seqlens, want_state, state_in_place):
        return _run_block(fp, block, x, lam_scale, state, cu_seqlens, layout, want_state, state_in_place)
    return run
