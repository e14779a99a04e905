r"""Streaming statistics of the erase factor ``M_t = I - k_t a_t^T`` per layer and head.

For every token and head the hooks read ``k`` (normalised here as the op does,
``k / sqrt(sum k^2 + 1e-6)``), ``b``, ``lambda``, ``d``, and the probes ``e``, ``rho``, ``Sd``;
they reduce them at once to fixed-size accumulators (nothing per token is kept, so memory does
not grow with the input length):

* ``e_t = 1 - a_t . k_t`` (the non-trivial eigenvalue, ``a_t = b_t * k_t + lam d_t``): histogram on
  fixed bins over ``[-0.5, 1.5]`` (the theoretical range ``[-lam, 1 + lam]`` for any
  ``lam <= 0.5``, i.e. ``lambda_max = 0.25`` up to ``s = 2``), plus under/overflow bins, so the
  counts of a head always sum to the number of tokens seen; min / max; counts of ``e < 0``,
  ``|e| > 1`` and ``e`` outside ``(0, 1)``.
* ``rho_t = q_t . k_t``: histogram on ``[-1, 1]`` and moments.
* ``||S_bar_t^T d_t||`` and the output correction ``|lam rho_t| * scale * ||S_bar_t^T d_t||``
  (``scale = head_dim ** -0.5``, the op's default): histograms of ``log10`` on ``[-8, 4]``.
* ``sigma_t``: the largest singular value of ``M_t``. With ``c = a.k``, ``p = ||k||^2 ||a||^2``,
  ``M^T M`` is the identity off ``span{k, a}``, and on that plane ``sigma_1^2 + sigma_2^2 =
  2 - 2c + p`` and ``sigma_1 sigma_2 = |det M| = |1 - c|``, so::

      sigma_max^2 - 1 = (p - 2c + sqrt(p (4 - 4c + p))) / 2   (>= 0 because p >= c^2)

  (``M`` has the eigenvalue 1, so ``sigma_max >= 1``: a spectral radius below 1 never bounds
  the norm.) Histogram of ``log10(sigma_max - 1)`` on ``[-12, 1]``; count of ``sigma_max > 1``
  while ``|e| < 1`` (eigenvalues inside, norm above 1: non-normality).

Histograms and moments are kept by ``qedprobe.hooks.RunningStats`` (the engine of
``qedprobe.hooks.ProbeRecorder``, which records single probes); this module adds the joint quantities (``sigma_max`` from
``k, b, lambda, d``; the correction from ``lambda, rho, Sd``), the range counts and the figures.

Python::

    from qedprobe.eval.eig import run_eig, task_batches
    acc = run_eig(model, task_batches("s-niah-1", "bytes", length=4096, samples=8), s=1.0)
    acc.save("runs/eig")          # eig.npz, eig.json, eig_*.png
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from qedprobe import dist
from qedprobe.hooks import RunningStats
from qedprobe.kernels.qed import erase_vector, l2_normalize
from qedprobe.model import strength
from qedprobe.model.hooked import hook_name
from qedprobe.tasks import make_task
from qedprobe.tokenizer import load_tokenizer

from .plots import figure

__all__ = ["sigma_max_rank_one", "EigAccumulator", "run_eig", "reduce_ranks", "task_batches", "text_batches", "BINS"]

BINS = {
    "e": (-0.5, 1.5, 800),
    "rho": (-1.0, 1.0, 200),
    "log10_sd": (-8.0, 4.0, 240),
    "log10_corr": (-8.0, 4.0, 240),
    "log10_sigma_m1": (-12.0, 1.0, 260),
}
"""name -> (low, high, bins). Every histogram also has an underflow (index 0) and an overflow
(index -1) bin; log histograms put zeros in the underflow bin."""

STATS = ("e", "rho", "sd", "corr", "sigma")
COUNTS = ("n", "e_lt0", "e_abs_gt1", "e_out01", "sigma_gt1", "sigma_gt1_e_in", "nan")


def sigma_max_rank_one(k: torch.Tensor, a: torch.Tensor, *, minus_one: bool = False) -> torch.Tensor:
    """Largest singular value of ``I - k a^T`` along the last axis (closed form, float64).

    With ``minus_one``, returns ``sigma_max - 1`` computed without cancellation.
    Needs a last-axis size >= 2 (then ``sigma_max >= 1``).
    """
    k = k.double()
    a = a.double()
    c = (k * a).sum(-1)
    p = (k * k).sum(-1) * (a * a).sum(-1)
    s2m1 = 0.5 * (p - 2 * c + torch.sqrt((p * (4 - 4 * c + p)).clamp_min(0)))
    s2m1 = s2m1.clamp_min(0)
    sm1 = s2m1 / (1 + torch.sqrt(1 + s2m1))
    return sm1 if minus_one else 1 + sm1


def _note_outside(ax, lines: list[str]) -> None:
    """``lines`` (:meth:`EigAccumulator.outside_range`) at the top left of a log-count panel,
    above the histogram: the count axis is raised by a fifth of its decades per line."""
    if not lines:
        return
    low, high = ax.get_ylim()
    ax.set_ylim(low, high * (high / low) ** (0.2 * len(lines)))
    ax.text(0.02, 0.97, "\n".join(lines), transform=ax.transAxes, va="top", fontsize=6)


class EigAccumulator:
    """Fixed-size per-layer, per-head accumulators fed by model hooks (see module docstring).

    ``acc.fwd_hooks()`` gives the hooks for ``model.run_with_hooks`` / ``model.hooks``. Tensors
    may be ``[B, T, H, ...]`` or packed ``[1, sum T, H, ...]``; ``lambda`` ``[H]`` or ``[B, T, H]``.
    ``layers`` (default all ``n_layers``) are recorded from the hooks
    ``blocks.{l}.{mixer_name}.hook_*`` (``model.mixer_name``).
    Histograms and moments are :class:`qedprobe.hooks.RunningStats` (one per quantity and
    layer), so :meth:`merge` combines accumulators filled apart (ranks, runs) exactly: sums of
    counts, min / max, Chan's merge of the moments.
    """

    NEEDS = ("k", "b", "lambda", "d", "e", "rho", "Sd")

    def __init__(self, n_layers: int, n_heads: int, head_dim: int, *, scale: float | None = None,
                 layers=None, device="cpu", mixer_name: str = "attn"):
        if head_dim < 2:
            raise ValueError("EigAccumulator needs head_dim >= 2")
        self.L, self.H, self.K = int(n_layers), int(n_heads), int(head_dim)
        self.scale = float(head_dim ** -0.5 if scale is None else scale)
        self.layers = list(range(self.L)) if layers is None else [int(x) for x in layers]
        self.mixer_name = mixer_name
        self.device = torch.device(device)
        self.edges = {name: torch.linspace(lo, hi, n + 1, dtype=torch.float64)
                      for name, (lo, hi, n) in BINS.items()}
        self.binned = {(name, l): RunningStats(self.H, self.edges[name]) for name in BINS for l in range(self.L)}
        self.moments = {(name, l): RunningStats(self.H) for name in STATS for l in range(self.L)}
        self.counts = {name: torch.zeros(self.L, self.H, dtype=torch.int64) for name in COUNTS}
        self.e_recompute_maxdiff = 0.0
        self.tokens = 0
        self.meta = {}
        self.pending = {}
        """Layer -> the tensors its hooks gave so far in this forward pass (reduced and dropped
        as soon as the layer's last hook fires)."""

    # ------------------------------------------------------------------------------- hooks
    def fwd_hooks(self) -> list:
        """``[(hook name, fn)]`` for ``run_with_hooks`` / ``model.hooks``: each recorded layer's
        ``NEEDS`` hooks."""
        out = []
        for l in self.layers:
            for name in self.NEEDS:
                out.append((hook_name(name, l, self.mixer_name), self._make_hook(l, name)))
        return out

    def _make_hook(self, layer, name):
        def hook(x, hook=None):  # noqa: ARG001 - TransformerLens passes the HookPoint
            slot = self.pending.setdefault(layer, {})
            slot[name] = x.detach()
            if len(slot) == len(self.NEEDS):
                del self.pending[layer]
                self.update(layer, slot)
            return None
        return hook

    def end_forward(self) -> None:
        """Drop what a forward pass left of layers whose hooks did not all fire."""
        self.pending.clear()

    # ------------------------------------------------------------------------------ update
    @torch.no_grad()
    def update(self, layer: int, t: dict) -> None:
        """Reduce one layer's tensors (``k, b, lambda, d, e, rho, Sd``) into the accumulators."""
        H, K = self.H, self.K
        k = t["k"].double()
        lead = k.shape[:-2]
        n = int(np.prod(lead))
        k = k.reshape(n, H, K)
        k = l2_normalize(k)
        b = t["b"].double()  # a scalar gate [..., H] (a transformers model's beta) acts on every channel
        b = (b if b.dim() == t["k"].dim() else b.unsqueeze(-1)).expand(t["k"].shape).reshape(n, H, K)
        d = t["d"].double().reshape(n, H, K)
        lam = t["lambda"].double()
        lam = lam.expand(*lead, H).reshape(n, H) if lam.dim() == 1 else lam.reshape(n, H)
        a = erase_vector(k, b, lam, d)
        e = t["e"].double().reshape(n, H)
        rho = t["rho"].double().reshape(n, H)
        sd = torch.linalg.vector_norm(t["Sd"].double().reshape(n, H, -1), dim=-1)
        corr = (lam * rho).abs() * self.scale * sd
        sm1 = sigma_max_rank_one(k, a, minus_one=True)
        e_re = 1 - (a * k).sum(-1)
        diff = (e_re - e).abs()
        if diff.numel():
            self.e_recompute_maxdiff = max(self.e_recompute_maxdiff, float(diff.max()))
        tiny = torch.tensor(0.0, dtype=torch.float64, device=e.device)
        log = lambda x: torch.where(x > 0, torch.log10(x.clamp_min(1e-300)), tiny - math.inf)  # noqa: E731
        for name, x in (("e", e), ("rho", rho), ("log10_sd", log(sd)), ("log10_corr", log(corr)),
                        ("log10_sigma_m1", log(sm1))):
            self.binned[name, layer].update(x)
        for name, x in (("e", e), ("rho", rho), ("sd", sd), ("corr", corr), ("sigma", 1 + sm1)):
            self.moments[name, layer].update(x)
        c = self.counts
        c["n"][layer] += n
        c["nan"][layer] += torch.isnan(e).sum(0).cpu()
        c["e_lt0"][layer] += (e < 0).sum(0).cpu()
        c["e_abs_gt1"][layer] += (e.abs() > 1).sum(0).cpu()
        c["e_out01"][layer] += ((e <= 0) | (e >= 1)).sum(0).cpu()
        gt1 = sm1 > 1e-12
        c["sigma_gt1"][layer] += gt1.sum(0).cpu()
        c["sigma_gt1_e_in"][layer] += (gt1 & (e.abs() < 1)).sum(0).cpu()
        if layer == self.layers[0]:
            self.tokens += n

    def merge(self, other: EigAccumulator) -> EigAccumulator:
        """Add what ``other`` (same model shape, layers and scale) has seen; returns ``self``."""
        if (other.L, other.H, other.K, other.layers, other.scale) != (self.L, self.H, self.K, self.layers, self.scale):
            raise ValueError("EigAccumulator.merge: `other` must have the same layers, heads, head_dim and scale")
        for key, rs in self.binned.items():
            rs.merge(other.binned[key])
        for key, rs in self.moments.items():
            rs.merge(other.moments[key])
        for name, c in self.counts.items():
            c += other.counts[name]
        self.e_recompute_maxdiff = max(self.e_recompute_maxdiff, other.e_recompute_maxdiff)
        self.tokens += other.tokens
        return self

    # ------------------------------------------------------------------------------ output
    @property
    def hist(self) -> dict:
        """``{name: [L, H, bins + 2]}`` int64 histogram counts (under/overflow first/last)."""
        return {name: torch.stack([self.binned[name, l].counts for l in range(self.L)]).long() for name in BINS}

    def _stacked(self, attr) -> dict:
        return {name: torch.stack([getattr(self.moments[name, l], attr) for l in range(self.L)]) for name in STATS}

    @property
    def min(self) -> dict:
        """``{name: [L, H]}`` minimum over the finite values of each quantity of ``STATS``."""
        return self._stacked("min")

    @property
    def max(self) -> dict:
        """``{name: [L, H]}`` maximum over the finite values of each quantity of ``STATS``."""
        return self._stacked("max")

    def nbytes(self) -> int:
        """Memory held by the accumulators (constant: independent of the tokens seen)."""
        stats = list(self.binned.values()) + list(self.moments.values())
        tensors = [t for rs in stats for t in (rs.count, rs.mean, rs.m2, rs.min, rs.max, rs.counts)
                   if t is not None] + list(self.counts.values())
        return sum(x.numel() * x.element_size() for x in tensors)

    def summary(self) -> dict:
        """Per layer and head: counts, min / max / mean / std (over finite values) of each quantity."""
        out = {"tokens": self.tokens, "scale": self.scale, "bins": {k: list(v) for k, v in BINS.items()},
               "e_recompute_maxdiff": self.e_recompute_maxdiff, "meta": self.meta, "layers": []}
        for l in self.layers:
            heads = []
            for h in range(self.H):
                row = {name: int(self.counts[name][l, h]) for name in COUNTS}
                for name in STATS:
                    rs = self.moments[name, l]
                    n = float(rs.count[h])
                    row[name] = {"min": float(rs.min[h]), "max": float(rs.max[h]),
                                 "mean": float(rs.mean[h]) if n else math.nan,
                                 "std": math.sqrt(float(rs.m2[h]) / n) if n else math.nan}
                heads.append(row)
            out["layers"].append({"layer": l, "heads": heads})
        return out

    def arrays(self) -> dict:
        """``eig.npz``: ``hist_*`` / ``edges_*`` per binned quantity, ``count_*`` per count, and
        per quantity of ``STATS`` its ``n_*`` (finite values), ``mean_*``, ``m2_*`` (sum of
        squared deviations), ``min_*``, ``max_*``, all ``[L, H]``."""
        arr = {}
        hist = self.hist
        for name in BINS:
            arr[f"hist_{name}"] = hist[name].numpy()
            arr[f"edges_{name}"] = self.edges[name].numpy()
        for name in COUNTS:
            arr[f"count_{name}"] = self.counts[name].numpy()
        for kind, attr in (("n", "count"), ("mean", "mean"), ("m2", "m2"), ("min", "min"), ("max", "max")):
            for name, x in self._stacked(attr).items():
                arr[f"{kind}_{name}"] = x.numpy()
        arr["layers"] = np.array(self.layers)
        return arr

    def save(self, out, plots: bool = True) -> list[Path]:
        """``eig.npz`` (histograms and moments), ``eig.json`` (summary) and PNG figures."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        paths = [out / "eig.npz", out / "eig.json"]
        np.savez_compressed(paths[0], **self.arrays())
        paths[1].write_text(json.dumps(self.summary(), indent=1, default=float) + "\n")
        if plots:
            paths += self.plot(out)
        return paths

    def title(self) -> str:
        """What the figures show: model, arm, input (a task with its settings), inputs and their
        length, strength, from :attr:`meta`."""
        m = self.meta
        model = Path(m["model"]).name if m.get("model") else "model"
        source = Path(m["text"]).name if m.get("text") else m.get("task_label") or m.get("task") or ""
        length = f"{m['samples']} inputs of {m['length']} tokens" if m.get("samples") and m.get("length") \
            else f"L = {m['length']}" if m.get("length") else ""
        parts = [f"{model} (arm {m.get('arm', '?')})", source, length, f"s = {m.get('s', 1.0):g}"]
        return ", ".join(p for p in parts if p)

    def hist_range(self, name: str, hist: torch.Tensor) -> tuple[float, float]:
        """The x range of the occupied bins of ``hist`` (``name``'s ``[L, H, bins + 2]``) over every
        recorded layer and head (with a two-bin margin; ``e``'s range always shows 0 and 1)."""
        lo, hi, n = BINS[name]
        used = (hist[self.layers, :, 1:-1] > 0).any(0).any(0).nonzero()
        if len(used) == 0:
            return lo, hi
        width = (hi - lo) / n
        a, b = lo + (int(used[0]) - 2) * width, lo + (int(used[-1]) + 3) * width
        if name == "e":
            a, b = min(a, -0.05), max(b, 1.05)
        return max(a, lo), min(b, hi)

    def outside_range(self, name: str, hist: torch.Tensor) -> list[str]:
        """Per head of one layer (``hist`` ``[H, bins + 2]``), the tokens in the under- and overflow
        bins of ``name``'s histogram, which a figure of the bins leaves out: ``"h1: 1,201 of 3,988
        below 1e-8 (or 0)"``; empty when every token is inside the range."""
        lo, hi, _ = BINS[name]
        log = name.startswith("log10_")
        below = f"below 1e{lo:g} (or 0)" if log else f"below {lo:g}"
        above = f"above 1e{hi:g}" if log else f"above {hi:g}"
        lines = []
        for h in range(self.H):
            total = int(hist[h].sum())
            for count, where in ((int(hist[h, 0]), below), (int(hist[h, -1]), above)):
                if count:
                    lines.append(f"h{h}: {count:,} of {total:,} {where}, not drawn")
        return lines

    def plot(self, out) -> list[Path]:
        """One figure of per-head histograms per quantity (empty bins are gaps, not a floor),
        and ``eig_heatmaps.png`` (min e, max e, max sigma per layer and head)."""
        from matplotlib.ticker import MaxNLocator, NullFormatter
        out = Path(out)
        paths = []
        L = len(self.layers)
        all_hist = self.hist
        cols = min(4, L)
        rows = math.ceil(L / cols)
        for name, xlabel, fname in (("e", "e_t = 1 - a_t . k_t", "eig_e_hist.png"),
                                    ("log10_sigma_m1", "log10(sigma_max(M_t) - 1)", "eig_sigma_hist.png"),
                                    ("log10_corr", "log10 |lam rho| scale ||S_bar^T d||", "eig_corr_hist.png"),
                                    ("rho", "rho_t = q_t . k_t", "eig_rho_hist.png")):
            centers = 0.5 * (self.edges[name][1:] + self.edges[name][:-1]).numpy()
            legend_rows = math.ceil(self.H / 8)
            fig = figure(figsize=(3.2 * cols, 2.4 * rows + 0.5 + 0.15 * legend_rows))
            axes = fig.subplots(rows, cols, squeeze=False)
            for j, l in enumerate(self.layers):
                ax = axes[j // cols][j % cols]
                for h in range(self.H):
                    hist = all_hist[name][l, h, 1:-1].numpy().astype(float)
                    ax.step(centers, np.where(hist > 0, hist, np.nan), where="mid", lw=0.8, label=f"h{h}")
                ax.set_yscale("log")
                ax.yaxis.set_minor_formatter(NullFormatter())  # decade labels only, never 2x10^0 ... 6x10^0
                ax.set_xlim(*self.hist_range(name, all_hist[name]))
                ax.set_title(f"layer {l}", fontsize=8)
                ax.tick_params(labelsize=7)
                ax.xaxis.set_major_locator(MaxNLocator(nbins=5))  # labels of a 3-inch panel never touch
                if name == "e":
                    for v in (0.0, 1.0):
                        ax.axvline(v, color="k", lw=0.5, ls="--")
                _note_outside(ax, self.outside_range(name, all_hist[name][l]))
            for j in range(L, rows * cols):
                axes[j // cols][j % cols].axis("off")
            fig.suptitle(self.title(), fontsize=9)
            handles, labels = axes[0][0].get_legend_handles_labels()  # one legend for all panels, under the title
            top = 1 - (0.35 + 0.15 * legend_rows) / fig.get_figheight()
            fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, top + 0.1 / fig.get_figheight()),
                       ncol=min(self.H, 8), fontsize=6, frameon=False)
            fig.supxlabel(xlabel, fontsize=9)
            fig.supylabel("tokens (log)", fontsize=9)
            fig.tight_layout(rect=(0, 0, 1, top - 0.05 / fig.get_figheight()))
            fig.savefig(out / fname, dpi=110)
            paths.append(out / fname)
        paths.append(self._plot_heatmaps(out / "eig_heatmaps.png"))
        return paths

    def _plot_heatmaps(self, path: Path) -> Path:
        """min e_t, max e_t and max sigma_max(M_t) as ``[layer, head]`` maps with integer ticks."""
        from matplotlib.ticker import MaxNLocator
        L = len(self.layers)
        fig = figure(figsize=(11, 0.3 * L + 2.4))
        axes = fig.subplots(1, 3)
        for ax, (title, data) in zip(axes, (("min e_t", self.min["e"][self.layers].numpy()),
                                             ("max e_t", self.max["e"][self.layers].numpy()),
                                             ("max sigma_max(M_t)", self.max["sigma"][self.layers].numpy()))):
            im = ax.imshow(data, aspect="auto", cmap="viridis", interpolation="nearest")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("head")
            ax.set_ylabel("layer")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(self.H, 8)))  # <= 9 labels: no overlap
            ax.tick_params(axis="x", labelsize=8)
            step = max(1, math.ceil(L / 24))  # at most 24 layer labels, so they never overlap
            ax.set_yticks(range(0, L, step))
            ax.set_yticklabels(self.layers[::step], fontsize=7)
            fig.colorbar(im, ax=ax)
        fig.suptitle(self.title(), fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        return path


# ------------------------------------------------------------------------------------ inputs
def _batch_starts(samples, batch_size, shard):
    """First sample of every batch, of this shard ``(rank, ranks)`` only: batch ``j`` is rank ``j mod ranks``'s."""
    rank, ranks = shard
    if not 0 <= rank < ranks:
        raise ValueError(f"shard must be (rank, ranks) with 0 <= rank < ranks, got {shard!r}")
    return range(0, samples, batch_size)[rank::ranks]


def task_batches(task, tokenizer="bytes", *, length, samples, seed=0, batch_size=1, shard=(0, 1), **task_kwargs):
    """Yield ``LongTensor [B, T]`` batches of a NIAH task's prompts (no padding: the prompts of
    a batch are cut to the shortest one so that no padding enters the statistics). ``shard``
    ``(rank, ranks)`` yields only that rank's batches (every ``ranks``-th, from ``rank``)."""
    nt = task if hasattr(task, "sample") else make_task(task, tokenizer, **task_kwargs)
    for start in _batch_starts(samples, batch_size, shard):
        ss = [nt.sample(length, i, samples=samples, seed=seed)
              for i in range(start, min(samples, start + batch_size))]
        T = min(len(s.input_ids) for s in ss)
        yield torch.tensor([s.input_ids[:T] for s in ss], dtype=torch.long)


def text_batches(path, tokenizer="bytes", *, length, samples, batch_size=1, shard=(0, 1)):
    """Yield ``[B, length]`` windows of a text file's tokens (BOS first when the tokenizer has
    one); the text is repeated when it is shorter than ``samples * length`` tokens. ``shard``
    as in :func:`task_batches`."""
    tok = load_tokenizer(tokenizer)
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    ids = tok.encode(text)
    if not ids:
        raise ValueError(f"{path!r} has no tokens")
    bos = [tok.bos_id] if tok.bos_id is not None else []
    body = length - len(bos)
    need = samples * body
    if len(ids) < need:
        ids = (ids * (need // len(ids) + 1))
    windows = [bos + ids[i * body:(i + 1) * body] for i in range(samples)]
    for start in _batch_starts(samples, batch_size, shard):
        yield torch.tensor(windows[start:start + batch_size], dtype=torch.long)


# ----------------------------------------------------------------------------------- runner
def run_eig(model, batches, *, s=1.0, layers=None, heads=None, record_layers=None,
            allow_extrapolation=False, progress=False, total=None) -> EigAccumulator:
    """Run ``batches`` (iterable of ``[B, T]`` id tensors) through ``model`` (a prefill pass) with
    lambda scaled by ``s`` on ``layers`` x ``heads``; returns the filled :class:`EigAccumulator`.

    Under a ``torch.distributed`` process group every rank passes its own share of the inputs
    (``task_batches(..., shard=(rank, ranks))``) and gets back the accumulator of all ranks
    (:func:`reduce_ranks`)."""
    cfg = model.cfg
    acc = EigAccumulator(cfg.num_hidden_layers, cfg.num_heads, cfg.head_dim,
                         layers=model.mixer_layers if record_layers is None else record_layers,
                         mixer_name=model.mixer_name)
    acc.meta = {"s": float(s), "strength_layers": layers, "strength_heads": heads,
                "arm": getattr(cfg, "arm", None)}
    it = batches
    if progress:
        it = tqdm(batches, total=total, unit="batch", desc="eig", disable=not dist.is_main())
    device = model.device
    with torch.inference_mode(), strength(model, s, layers=layers, heads=heads, phase="all",
                                             allow_extrapolation=allow_extrapolation):
        for ids in it:
            ids = ids.to(device)
            model.run_with_hooks(ids, fwd_hooks=acc.fwd_hooks())
            acc.end_forward()
    return reduce_ranks(acc)


def reduce_ranks(acc: EigAccumulator) -> EigAccumulator:
    """The merge of every rank's ``acc`` in rank order (the same on every rank); ``acc`` itself
    without a process group."""
    if dist.world_size() == 1:
        return acc
    parts = dist.gather_objects(acc)
    total = EigAccumulator(acc.L, acc.H, acc.K, scale=acc.scale, layers=acc.layers, mixer_name=acc.mixer_name)
    total.meta = dict(acc.meta)
    for part in parts:
        total.merge(part)
    return total
