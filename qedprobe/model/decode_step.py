r"""One decode step of a :class:`QEDModel` (every layer, N sequences, one new token each):
eager, or replayed from a CUDA graph.

    step = decode_step(model, states, scales, cuda_graph=True)
    logits = step(tokens)          # tokens [N] -> logits [N, vocab]; the states move on

The eager step runs ``model.run_blocks`` (hooks fire). The graph step captures the same call
once, on static buffers (token ids ``[N, 1]``, the per-layer states, the lambda factors), then
each call copies the tokens in, replays the graph and returns the static logits. Inside the
graph each layer writes its new state over its static state (``run_blocks(...,
state_in_place=True)``): the recurrent kernel its ``N x H x K x V`` float32 state, the largest
tensors of a step, read and written once per step instead of also copied; the convolution
caches by the block that computes them (on the fast path inside the compiled pre region, which
schedules the write-back itself). Replay runs the very kernels of the eager step on the same
inputs, so its results are the same bit for bit; it only removes the Python and launch cost
(~1000 launches per 24-layer step) and the state copies.

The graph is used only where it is exact and safe: CUDA tensors, no hook attached anywhere in
the model, ``op_mode`` ``"auto"`` or ``"recurrent"``, value checks off (they synchronise). The
last :data:`CACHE_SIZE` graphs of a model are kept (:func:`decode_graphs`: held beside the
model, not on it, and dropped with it), keyed by batch size, strength presence, dtype,
inference mode, the addresses of its parameters (moving or replacing them recaptures) and, inside
a ``fast_path`` block, the fast path's backend and stacked weights (:func:`.fast.fast_path_key`:
a graph of one path is never replayed for the other).
"""
from __future__ import annotations

import weakref
from collections import OrderedDict

import torch

from qedprobe.kernels.qed.inputs import value_checks_enabled

from .fast import fast_path_key
from .hooked import hooks_attached
from .mixer import MixerState

CACHE_SIZE = 2
"""Captured graphs kept per model (a sweep alternates at most two batch sizes per length)."""

STOP_CHECK_EVERY = 4
"""Graph steps between two of generate's "has every prompt emitted EOS?" checks. A graph step's
check is read at the next check, when ``STOP_CHECK_EVERY`` more steps are queued behind it, so the
read never leaves the GPU idle; an eager step's is read at once, after every step."""


def graph_usable(model) -> bool:
    """Whether the decode step of ``model`` may be replayed from a CUDA graph (see module doc)."""
    return (model.device.type == "cuda" and model.cfg.op_mode in ("auto", "recurrent")
            and not value_checks_enabled() and not hooks_attached(model))


def _clone(states):
    return [MixerState(s.recurrent.clone(), tuple(c.clone() for c in s.conv)) for s in states]


def _copy(dst, src) -> None:
    """Copy the states ``src`` into ``dst``."""
    for d, s in zip(dst, src):
        for dt, st in zip((d.recurrent, *d.conv), (s.recurrent, *s.conv)):
            dt.copy_(st)


class _EagerStep:
    stop_check_every = 1
    stop_read_late = False

    def __init__(self, model, states, scales):
        self.model, self.states, self.scales = model, states, scales

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        logits, self.states = self.model.run_blocks(tokens[:, None], states=self.states, cu_seqlens=None,
                                                    scales=self.scales, want_state=True)
        return logits[:, -1]


class _GraphStep:
    """Static buffers and the captured step; :meth:`load` points it at a new batch."""

    stop_check_every = STOP_CHECK_EVERY
    stop_read_late = True

    def __init__(self, model, states, scales):
        self.tokens = torch.zeros(len(states[0].recurrent), 1, dtype=torch.long, device=model.device)
        self.states = _clone(states)
        self.scales = None if scales is None else scales.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: Triton compiles, cuBLAS picks its kernels
            self._step(model)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.logits = self._step(model)

    def _step(self, model) -> torch.Tensor:
        """The step the graph captures (the model is not kept: the cache entry must not hold it)."""
        logits, _ = model.run_blocks(self.tokens, states=self.states, cu_seqlens=None,
                                     scales=self.scales, want_state=True, state_in_place=True)
        return logits[:, -1]

    def load(self, states, scales) -> "_GraphStep":
        _copy(self.states, states)
        if scales is not None:
            self.scales.copy_(scales)
        return self

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        self.tokens.copy_(tokens[:, None])
        self.graph.replay()
        return self.logits


_GRAPHS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> its captured decode steps (:func:`decode_graphs`)."""


def decode_graphs(model) -> OrderedDict:
    """The captured decode steps of ``model``, oldest first (at most :data:`CACHE_SIZE`)."""
    return _GRAPHS.setdefault(model, OrderedDict())


def _key(model, states, scales) -> tuple:
    tensors = list(model.parameters()) + list(model.buffers())
    return (len(states[0].recurrent), scales is None, states[0].recurrent.dtype, torch.is_inference_mode_enabled(),
            tuple(t.data_ptr() for t in tensors), fast_path_key(model))


def decode_step(model, states: list[MixerState], scales: torch.Tensor | None, *, cuda_graph: bool = True):
    """A callable ``tokens [N] -> logits [N, vocab]`` that continues ``states`` (the prefill's)
    with the lambda factors ``scales`` ``[L, H]`` (or None): the graph step when ``cuda_graph``
    and :func:`graph_usable`, else the eager step."""
    if not (cuda_graph and graph_usable(model)):
        return _EagerStep(model, states, scales)
    cache = decode_graphs(model)
    key = _key(model, states, scales)
    step = cache.pop(key, None)
    if step is None:
        while len(cache) >= CACHE_SIZE:  # free the oldest graph's memory before capturing
            cache.popitem(last=False)
        step = _GraphStep(model, states, scales)
    cache[key] = step
    return step.load(states, scales)
