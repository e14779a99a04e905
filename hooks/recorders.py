r"""Streaming probe recorders: per-head statistics over all tokens seen, O(H) memory.

:class:`RunningStats` keeps, per head, the count, mean and sum of squared deviations (merged
batch by batch with Chan's parallel update, and across processes with :meth:`RunningStats.merge`),
min, max and, optionally, counts in fixed bins; ``qedprobe.eval.eig`` builds on it too.
:class:`ProbeRecorder` attaches one ``RunningStats`` per (probe, layer) to a model's hooks::

    rec = ProbeRecorder(model, probes=("e", "rho"), edges={"e": torch.linspace(-0.25, 1.25, 61)})
    with rec.attach():
        model(ids)
    rec.stats[("e", 3)].mean      # [H]

Probe values per token and head: ``e`` and ``rho`` as they are, ``Sd`` and ``d`` as their L2
norm over the last axis, ``lambda`` as given (``[H]`` counts as one sample per head).
"""
from __future__ import annotations

import contextlib

import torch

from qedprobe.model.hooked import hook_name
from qedprobe.model.strength import index_selection

PROBES = ("e", "rho", "Sd", "d", "lambda")


class RunningStats:
    r"""Per-head running count / mean / variance / min / max (float64), optional histogram.

    Moments, min and max are over the finite samples (``count`` is their number); the histogram
    counts every sample, NaN in the overflow bin. A batch's ``(n_b, mean_b, M2_b)`` is combined
    with the running ``(n_a, mean_a, M2_a)`` by Chan et al.'s parallel update

        n = n_a + n_b,  delta = mean_b - mean_a,
        mean = mean_a + delta n_b / n,  M2 = M2_a + M2_b + delta^2 n_a n_b / n,

    which is exact in exact arithmetic for any split of the samples, so :meth:`merge` of
    statistics gathered apart (other ranks, other runs) equals one pass over all the samples up
    to float64 rounding; counts, min and max merge exactly. Batches are reduced on their own
    device; only the ``[H]`` results move to the CPU.

    ``edges``: increasing bin edges ``[nb + 1]``; ``counts`` is ``[H, nb + 2]`` with the
    under- and overflow bins first and last.
    """

    def __init__(self, num_heads: int, edges: torch.Tensor | None = None):
        self.num_heads = num_heads
        self.count = torch.zeros(num_heads, dtype=torch.float64)
        self.mean = torch.zeros(num_heads, dtype=torch.float64)
        self.m2 = torch.zeros(num_heads, dtype=torch.float64)
        self.min = torch.full((num_heads,), float("inf"), dtype=torch.float64)
        self.max = torch.full((num_heads,), float("-inf"), dtype=torch.float64)
        self.edges = None
        self.counts = None
        if edges is not None:
            edges = torch.as_tensor(edges, dtype=torch.float64).flatten()
            if edges.numel() < 2 or not bool((edges[1:] > edges[:-1]).all()):
                raise ValueError(f"RunningStats: `edges` must be >= 2 strictly increasing values, got {edges.tolist()}")
            self.edges = edges
            self.counts = torch.zeros(num_heads, edges.numel() + 1, dtype=torch.float64)

    def update(self, x: torch.Tensor) -> None:
        """Add samples ``x`` ``[..., H]`` (every leading index is one sample per head)."""
        if x.shape[-1] != self.num_heads:
            raise ValueError(f"RunningStats: last axis must be the {self.num_heads} heads, got shape {tuple(x.shape)}")
        x = x.detach().reshape(-1, self.num_heads).double()
        if x.shape[0] == 0:
            return
        finite = torch.isfinite(x)
        n_b = finite.sum(0).double()
        mean_b = torch.where(finite, x, 0.0).sum(0) / n_b.clamp_min(1)
        m2_b = torch.where(finite, x - mean_b, 0.0).square().sum(0)
        inf = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
        self._combine(n_b.cpu(), mean_b.cpu(), m2_b.cpu(), torch.where(finite, x, inf).min(0).values.cpu(),
                      torch.where(finite, x, -inf).max(0).values.cpu())
        if self.edges is not None:
            self.counts += self._bin_counts(x).cpu()

    def _bin_counts(self, x: torch.Tensor) -> torch.Tensor:
        """``[H, nb + 2]`` bin counts of ``x`` ``[N, H]`` (NaN counted as overflow)."""
        nb2 = self.counts.shape[1]
        idx = torch.bucketize(x, self.edges.to(x.device), right=True)  # 0: < edges[0], nb2 - 1: >= edges[-1]
        idx = torch.where(torch.isnan(x), nb2 - 1, idx)
        flat = idx + torch.arange(self.num_heads, device=x.device) * nb2
        return torch.bincount(flat.reshape(-1), minlength=self.num_heads * nb2).view(self.num_heads, nb2).double()

    def _combine(self, n_b, mean_b, m2_b, min_b, max_b) -> None:
        """Chan's update with another set of per-head statistics (see the class docstring)."""
        total = self.count + n_b
        delta = mean_b - self.mean
        share = torch.where(total > 0, n_b / total.clamp_min(1), 0.0)
        self.mean = self.mean + delta * share
        self.m2 = self.m2 + m2_b + delta.square() * self.count * share
        self.count = total
        self.min = torch.minimum(self.min, min_b)
        self.max = torch.maximum(self.max, max_b)

    def merge(self, other: RunningStats) -> RunningStats:
        """Add the samples ``other`` has seen (same heads and edges); returns ``self``."""
        if other.num_heads != self.num_heads or (self.edges is None) != (other.edges is None) or (
                self.edges is not None and not torch.equal(self.edges, other.edges)):
            raise ValueError("RunningStats.merge: `other` must have the same heads and bin edges")
        self._combine(other.count, other.mean, other.m2, other.min, other.max)
        if self.edges is not None:
            self.counts = self.counts + other.counts
        return self

    @property
    def var(self) -> torch.Tensor:
        """Population variance per head (NaN before any sample)."""
        return self.m2 / self.count

    def to_dict(self) -> dict:
        out = {"count": self.count.tolist(), "mean": self.mean.tolist(), "var": self.var.tolist(),
               "min": self.min.tolist(), "max": self.max.tolist()}
        if self.edges is not None:
            out["edges"] = self.edges.tolist()
            out["counts"] = self.counts.tolist()
        return out


def probe_values(name: str, x: torch.Tensor) -> torch.Tensor:
    """Per token-and-head scalars of probe ``name``: norms for ``Sd``/``d``, else ``x``."""
    return x.float().norm(dim=-1) if name in ("Sd", "d") else x


class ProbeRecorder:
    """One :class:`RunningStats` per (probe, layer), fed by forward hooks.

    Args:
        model: a hooked model (``QEDModel``, or ``qedprobe.hf.HFQEDModel``: used for its hook
            names, its recurrence layers ``model.mixer_layers`` and its heads).
        probes: names from ``PROBES``.
        layers: layer indices among ``model.mixer_layers`` (default all of them).
        edges: optional ``{probe: bin edges}`` for histograms.
    """

    def __init__(self, model, probes=("e", "rho", "Sd"), layers=None, edges: dict | None = None):
        unknown = [p for p in probes if p not in PROBES]
        if unknown or not probes:
            raise ValueError(f"ProbeRecorder: `probes` must be a non-empty subset of {PROBES}, got {probes!r}")
        layers = index_selection("layers", layers, model.mixer_layers, who="ProbeRecorder")
        edges = edges or {}
        self.model = model
        self.stats = {(p, l): RunningStats(model.cfg.num_heads, edges.get(p))
                      for p in probes for l in layers}

    def _hook(self, key):
        def record(x, hook):
            self.stats[key].update(probe_values(key[0], x))
        return record

    def fwd_hooks(self) -> list:
        """``[(hook name, fn)]`` for ``run_with_hooks`` / ``model.hooks``."""
        return [(hook_name(p, l, self.model.mixer_name), self._hook((p, l))) for p, l in self.stats]

    @contextlib.contextmanager
    def attach(self):
        """Record every forward pass (also inside ``generate``) while the block is active."""
        with self.model.hooks(fwd_hooks=self.fwd_hooks()):
            yield self

    def summary(self) -> dict:
        """``{"probe/layer": RunningStats.to_dict()}``."""
        return {f"{p}/{l}": s.to_dict() for (p, l), s in self.stats.items()}
