"""Argument checking shared by every QED op (``qed_naive``, ``qed_chunk``, ``qed_recurrent``).

One function, :func:`check_qed_inputs`, validates shapes, dtypes, devices and options and
returns a :class:`QEDProblem` with the sizes every op needs. Shapes follow fla's GDN-2
convention for grouped value heads: ``q, k`` ``[B, T, H, K]``; ``v, w`` ``[B, T, HV, V]``;
``g, b, d`` ``[B, T, HV, K]``; ``lam`` ``[HV]`` or ``[B, T, HV]``; ``z`` ``[HV, K]``; states
``[N, HV, K, V]``; ``HV`` a multiple of ``H`` (``HV == H``: one value head per query/key head).
Each gate ``g, b, w`` may instead be one scalar per token and value head, ``[B, T, HV]``, the
same for every channel (Gated DeltaNet's per-head decay and ``beta``; KDA's ``beta`` with a
per-channel ``g``): the ops broadcast it over ``K`` (``g, b``) or ``V`` (``w``).
Every failure is a
``ValueError`` that names the argument and what was expected; nothing is coerced.

Value checks (finite inputs, ``g <= 0``, ``|lam| <= LAMBDA_BOUND``) need a device
synchronisation, so they run only inside :func:`value_checks`::

    with qedprobe.ops.value_checks():
        qed_chunk(...)   # raises ValueError on NaN/Inf inputs, positive log-decay or |lam| too large
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass

import torch

from qedprobe.constants import ARMS

LAMBDA_BOUND = 1.0
"""Largest ``|lam|`` the ops are specified for. Up to it the chunk ops agree with the float64
token loop to float32 precision. Beyond it the transition ``M_t D_t`` (non-normal, and for the
unprojected arms with ``e_t`` outside ``[0, 1]``) can grow the state exponentially over the
sequence, and the ops overflow to Inf/NaN at different points: the token loop stays finite
longer than the chunk algorithm's within-chunk inverse. A model's ``lambda`` is below
``lambda_max = 0.25``, so strengths ``|s| <= 4`` stay within the bound."""

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
FLOAT_DTYPE_SET = frozenset(FLOAT_DTYPES)

QEDOutput = tuple[torch.Tensor, torch.Tensor | None, dict[str, torch.Tensor] | None]
"""What every QED op returns: ``(o, final_state, probes)``, ``None`` for what was not asked."""

PROBE_NAMES = ("rho", "d", "Sd", "e")
"""The per-token probes an op can return, in the order of its ``probes`` dict."""


_IN_ORDER = {names: names for names in (tuple(n for i, n in enumerate(PROBE_NAMES) if mask >> i & 1)
                                        for mask in range(2 ** len(PROBE_NAMES)))}
"""Every tuple of distinct probe names in :data:`PROBE_NAMES` order, mapped to itself: the requests
that :func:`probe_request` returns as given (a hooked layer asks for the same one at every step)."""


def probe_request(op: str, return_probes) -> tuple[str, ...]:
    """The probes one call asks for, in :data:`PROBE_NAMES` order: all of them for ``True``, none
    for ``False`` or ``None``, or the named ones (a collection of names, e.g. ``("e", "Sd")``, so
    that an op writes only what is looked at: ``d`` and ``Sd`` are ``[B, T, HV, K]`` /
    ``[B, T, HV, V]`` in the state dtype)."""
    if type(return_probes) is tuple:
        try:
            known = _IN_ORDER.get(return_probes)
        except TypeError:  # an unhashable entry: refused below
            known = None
        if known is not None:
            return known
    if return_probes is None or isinstance(return_probes, bool):
        return PROBE_NAMES if return_probes else ()
    if not isinstance(return_probes, (tuple, list, set, frozenset)) or not all(isinstance(n, str) for n in return_probes):
        raise ValueError(f"{op}: `return_probes` must be a bool or a collection of probe names from "
                         f"{PROBE_NAMES}, got {return_probes!r}")
    asked = set(return_probes)
    if not asked.issubset(PROBE_NAMES):
        raise ValueError(f"{op}: `return_probes` names unknown probes {sorted(asked.difference(PROBE_NAMES))}; "
                         f"expected names from {PROBE_NAMES}")
    return tuple(n for n in PROBE_NAMES if n in asked)


def selected_probes(every: dict, want: tuple[str, ...]) -> dict | None:
    """The op's ``probes`` result: the entries of ``every`` named in ``want`` (:func:`probe_request`),
    or None when none is asked for."""
    return {name: every[name] for name in want} if want else None


_VALUE_CHECKS = contextvars.ContextVar("qedprobe_value_checks", default=False)


@contextlib.contextmanager
def value_checks(enabled: bool = True):
    """Inside this block every QED op also checks values: all inputs finite, ``g <= 0``,
    ``|lam| <= LAMBDA_BOUND``."""
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def value_checks_enabled() -> bool:
    """Whether the current context is inside an enabled :func:`value_checks` block."""
    return _VALUE_CHECKS.get()


@dataclass(frozen=True)
class QEDProblem:
    """Sizes and options of one validated call.

    ``H`` is the number of query/key heads, ``HV`` the number of value heads (``HV = m * H``;
    value head ``j`` reads query/key head ``j // m``, ``m = HV // H`` is ``group``). ``N`` is the
    number of sequences: ``B`` without ``cu_seqlens``, ``len(cu_seqlens) - 1`` with it.
    ``offsets`` are the ``cu_seqlens`` values (``None`` without); ``seq_bounds`` lists
    ``(batch_row, bos, eos)`` for each of the N sequences.
    ``compute_dtype`` is float64 when the inputs are float64, else float32 (the state dtype).
    ``head_g, head_b, head_w``: whether that gate is one scalar per token and value head
    (``[B, T, HV]``) rather than per channel.
    """

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    scale: float
    lam_per_token: bool
    compute_dtype: torch.dtype
    offsets: tuple | None
    head_g: bool = False
    head_b: bool = False
    head_w: bool = False

    @property
    def seq_bounds(self) -> tuple:
        """``(batch_row, bos, eos)`` per sequence (built when asked: a decode step never asks)."""
        if self.offsets is None:
            return tuple((n, 0, self.T) for n in range(self.B))
        return tuple((0, a, b) for a, b in zip(self.offsets, self.offsets[1:]))

    @property
    def group(self) -> int:
        """Value heads per query/key head."""
        return self.HV // self.H


def _shape(name: str, x, expected: tuple, op: str, dims: str):
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"{op}: `{name}` must be a torch.Tensor of shape {dims}, got {type(x).__name__}")
    if x.shape != tuple(expected):
        raise ValueError(f"{op}: `{name}` must have shape {dims} = {tuple(expected)}, got {tuple(x.shape)}")


def _gate(name: str, x, channel_shape: tuple, op: str, dims: str) -> bool:
    """Check a gate of per-channel shape ``channel_shape`` (``dims``) or per-head shape
    ``[B, T, HV]``; True for the per-head form."""
    head_shape = tuple(channel_shape[:3])
    if isinstance(x, torch.Tensor) and x.shape == head_shape:
        return True
    if isinstance(x, torch.Tensor) and x.shape == tuple(channel_shape):
        return False
    got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
    raise ValueError(f"{op}: `{name}` must have shape {dims} = {tuple(channel_shape)} (per channel) or "
                     f"[B, T, HV] = {head_shape} (one scalar per value head), got {got}")


def _float(name: str, x: torch.Tensor, op: str):
    if x.dtype not in FLOAT_DTYPES:
        raise ValueError(
            f"{op}: `{name}` must be float16, bfloat16, float32 or float64, got {x.dtype}"
        )


def check_qed_inputs(op, q, k, v, g, b, w, lam, *, arm, z, d, scale, initial_state, cu_seqlens) -> QEDProblem:
    """Validate one call of a QED op; see the op's docstring for the meaning of each argument."""
    B, T, H, K, HV, V = _dims(op, q, v)
    _shape("k", k, (B, T, H, K), op, "[B, T, H, K]")
    _shape("v", v, (B, T, HV, V), op, "[B, T, HV, V]")
    head_g = _gate("g", g, (B, T, HV, K), op, "[B, T, HV, K]")
    head_b = _gate("b", b, (B, T, HV, K), op, "[B, T, HV, K]")
    head_w = _gate("w", w, (B, T, HV, V), op, "[B, T, HV, V]")
    if not isinstance(lam, torch.Tensor) or tuple(lam.shape) not in ((HV,), (B, T, HV)):
        got = tuple(lam.shape) if isinstance(lam, torch.Tensor) else type(lam).__name__
        raise ValueError(f"{op}: `lam` must be a tensor of shape [HV] = ({HV},) or [B, T, HV] = {(B, T, HV)}, "
                         f"got {got}")
    tensors = {"q": q, "k": k, "v": v, "g": g, "b": b, "w": w, "lam": lam, **_arm_tensors(op, arm, z, d, B, T, HV, K)}
    compute_dtype = _compute_dtype(op, tensors)
    N, offsets = _sequences(op, cu_seqlens, B, T)
    if initial_state is not None:
        _shape("initial_state", initial_state, (N, HV, K, V), op, "[N, HV, K, V]")
        if initial_state.dtype != compute_dtype:
            raise ValueError(f"{op}: `initial_state` must be {compute_dtype} (the state dtype), got {initial_state.dtype}")
        if initial_state.device != q.device:
            raise ValueError(f"{op}: `initial_state` is on {initial_state.device} but `q` is on {q.device}")
    if scale is None:
        scale = K ** -0.5
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (0 < float(scale) < float("inf")):
        raise ValueError(f"{op}: `scale` must be a positive finite float or None (= K ** -0.5), got {scale!r}")
    if value_checks_enabled():
        _check_values(op, tensors if initial_state is None else {**tensors, "initial_state": initial_state})
    return shared_problem(B, T, H, HV, K, V, N, float(scale), lam.dim() == 3, compute_dtype, offsets,
                          head_g, head_b, head_w)


@functools.lru_cache(maxsize=256)
def shared_problem(*fields) -> QEDProblem:
    """The :class:`QEDProblem` of ``fields`` (all of them, in field order), one object per distinct
    value: a problem is immutable, so the calls of a decode loop, which validate the same sizes at
    every step, share one instead of each building a frozen dataclass (a guarded attribute write
    per field)."""
    return QEDProblem(*fields)


def _dims(op: str, q, v) -> tuple[int, int, int, int, int, int]:
    """``(B, T, H, K, HV, V)`` from ``q`` ``[B, T, H, K]`` and ``v`` ``[B, T, HV, V]``: none empty,
    and ``HV`` a multiple of ``H`` (grouped value heads)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        got = tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__
        raise ValueError(f"{op}: `q` must be a 4-D tensor [B, T, H, K], got {got}")
    B, T, H, K = q.shape
    if not isinstance(v, torch.Tensor) or v.dim() != 4:
        got = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
        raise ValueError(f"{op}: `v` must be a 4-D tensor [B, T, HV, V], got {got}")
    HV, V = v.shape[2], v.shape[3]
    if T == 0 or K == 0 or V == 0 or H == 0 or B == 0 or HV == 0:
        raise ValueError(f"{op}: empty input, q has shape {tuple(q.shape)} and v {tuple(v.shape)}")
    if HV % H != 0:
        raise ValueError(f"{op}: the value heads of `v` (HV={HV}) must be a multiple of the query/key heads "
                         f"of `q` (H={H}): value head j reads query/key head j // (HV // H)")
    return B, T, H, K, HV, V


def _arm_tensors(op: str, arm, z, d, B: int, T: int, HV: int, K: int) -> dict:
    """The arm's extra inputs, checked: ``z`` ``[HV, K]`` (arm ``rand`` only, and required there)
    and the external direction ``d`` ``[B, T, HV, K]``; returns those given, by name."""
    if arm not in ARMS:
        raise ValueError(f"{op}: `arm` must be one of {ARMS}, got {arm!r}")
    extra = {}
    if arm == "rand":
        if z is None:
            raise ValueError(f"{op}: arm='rand' needs `z`, one unit vector per value head, shape [HV, K] = {(HV, K)}")
        _shape("z", z, (HV, K), op, "[HV, K]")
        extra["z"] = z
    elif z is not None:
        raise ValueError(f"{op}: `z` is only used by arm='rand', got arm={arm!r}; pass z=None")
    if d is not None:
        _shape("d", d, (B, T, HV, K), op, "[B, T, HV, K]")
        extra["d"] = d
    return extra


def _compute_dtype(op: str, tensors: dict) -> torch.dtype:
    """float64 when every input is float64, else float32 (float64 mixed with lower precision is
    refused); every input a float tensor on ``q``'s device. One pass over the inputs' dtypes and
    devices: a decode step checks them at every layer."""
    dtypes = [x.dtype for x in tensors.values()]
    if not FLOAT_DTYPE_SET.issuperset(dtypes):
        for name, x in tensors.items():
            _float(name, x, op)
    wide = dtypes.count(torch.float64)
    if wide and wide != len(dtypes):
        name = next(n for n, x in tensors.items() if x.dtype != torch.float64)
        raise ValueError(f"{op}: `{name}` is {tensors[name].dtype} but "
                         f"{[n for n, x in tensors.items() if x.dtype == torch.float64]} are float64; "
                         "float64 inputs cannot be mixed with lower precision")
    device = tensors["q"].device
    for name, x in tensors.items():
        if x.device != device:
            raise ValueError(f"{op}: `{name}` is on {x.device} but `q` is on {device}")
    return torch.float64 if wide else torch.float32


def _sequences(op: str, cu_seqlens, B: int, T: int) -> tuple[int, tuple | None]:
    """``(N, offsets)``: the ``B`` rows, or the ``N`` sequences packed in one row by ``cu_seqlens``
    (offsets rising strictly from 0 to ``T``, read on the host)."""
    if cu_seqlens is None:
        return B, None
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"{op}: `cu_seqlens` must be a 1-D integer tensor [N + 1] of sequence offsets")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{op}: `cu_seqlens` must be int32 or int64, got {cu_seqlens.dtype}")
    if B != 1:
        raise ValueError(f"{op}: with `cu_seqlens` the batch size must be 1 (packed sequences), got B={B}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T or any(b2 <= b1 for b1, b2 in zip(offsets, offsets[1:])):
        raise ValueError(f"{op}: `cu_seqlens` must rise strictly from 0 to T={T}, got {offsets}")
    return len(offsets) - 1, tuple(offsets)


def _check_values(op: str, tensors: dict) -> None:
    """The value checks (:func:`value_checks_enabled`; each reads its tensor on the host): every
    input finite, ``g <= 0`` (a log decay), ``|lam| <= LAMBDA_BOUND``."""
    for name, x in tensors.items():
        if not bool(torch.isfinite(x).all()):
            raise ValueError(f"{op}: `{name}` contains NaN or Inf")
    g, lam = tensors["g"], tensors["lam"]
    if bool((g > 0).any()):
        raise ValueError(f"{op}: `g` is a natural-log decay and must be <= 0, got max {g.max().item():.4g}")
    if bool((lam.abs() > LAMBDA_BOUND).any()):
        raise ValueError(f"{op}: `lam` must satisfy |lam| <= LAMBDA_BOUND = {LAMBDA_BOUND:g} (beyond it the "
                         f"state can grow without bound), got max |lam| {lam.abs().max().item():.4g}")


def on_input_device(fn):
    """Run ``fn`` with the CUDA device of its first tensor argument made current.

    Triton launches a kernel on the *current* CUDA device, whatever device its tensors live on:
    without this, inputs on ``cuda:1`` with ``cuda:0`` current would be read from the wrong GPU.
    """
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        if first is None or not first.is_cuda or first.get_device() == torch.cuda.current_device():
            return fn(*args, **kwargs)
        with torch.cuda.device(first.device):
            return fn(*args, **kwargs)
    return wrapper
