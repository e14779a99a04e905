"""Strength sweeps on NIAH tasks: a resumable runner, the paired summary and its plots.

Python API (the CLI ``qedprobe sweep`` calls the same function)::

    from qedprobe.eval.sweep import run_sweep
    result = run_sweep(model, "bytes", task="s-niah-1", lengths=[1024, 2048],
                       strengths=[-1, 0, 0.5, 1, 1.5, 2], samples=500, seed=0, out="runs/a")
    result.summary, result.timing

The steps, each its own function: :func:`sweep_config` (what defines the folder),
:func:`open_store` (the folder, this rank's shard), :func:`plan_batches` (the missing rows in
packed batches), :func:`run_batch` (one generate call per strength), :func:`run_batches` (this rank's
batches, each call's rows appended as they come), :func:`rows_from_outputs`
(score the predictions), :func:`summarise` (summary and plots from every shard).

Files in ``out``:

* ``config.json``: what defines the samples, the model and the intervention; a later run into
  the same folder must agree on it (lengths and strengths may be added; the model's path may
  change when its weights hash does not: a moved checkpoint resumes, with a warning, and the new
  path is recorded). It is written with the first row, so a run that fails before any work leaves
  no config behind.
* ``config.json`` key ``decode`` (only with ``decode="answer"``): how many tokens each prompt
  decodes; a folder never mixes rows decoded to different budgets.
* ``results.jsonl``: one row per ``(length, s, sample_id)``, appended and fsync'ed batch by batch.
  A rerun skips the rows already there; a torn last line (a kill during a write) is cut off
  and its row recomputed, so no row is lost or duplicated. Any other broken line is refused
  with its ``file:line`` (never cut off with the good rows after it).
* ``results.rank{r}.jsonl``: the same for rank ``r > 0`` of a sweep run with torchrun (rank 0
  writes ``results.jsonl``). Readers take the union of all shards, so a folder resumes with any
  number of ranks; a killed rank loses only the rows it had not appended.
* ``summary.csv`` / ``summary.json`` (rewritten at the end of every completed run, from all
  shards, by rank 0): accuracy (every answer found) and Wilson 95% interval per length x s,
  RULER's score ``score_pct`` (``string_match_all``: the mean share of answers found, in
  percent), the task ``format``, and the exact McNemar test of each s against the reference
  strength (default 1) on the samples both have: ``b`` = right at s and wrong at the reference,
  ``c`` = the reverse, two-sided ``p``.
* ``acc_vs_length.png``, ``acc_vs_strength.png``.
"""
from __future__ import annotations

import contextlib
import csv
import functools
import json
import math
import os
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from qedprobe import dist
from qedprobe.folderlock import lock_folder
from qedprobe.lam import check_strengths
from qedprobe.model.checkpoint import state_dict_sha256

from .plots import (LOG_SPREAD, accuracy_errorbar, figure, format_length, linear_spread,
                    save_accuracy_figure, series_style)
from .stats import mcnemar_exact, wilson_interval
from .ruler import RulerTask
from .tasks import ANSWER_MARGIN, DEFAULT_FORMAT, NIAHTask, answer_fraction, make_task

__all__ = ["run_sweep", "SweepResult", "sweep_config", "open_store", "plan_batches", "SweepBatch", "run_batch", "run_batches",
           "rows_from_outputs", "summarise", "ResultsStore", "load_results", "shard_path", "shard_paths",
           "summarize", "write_summary", "plot_summary", "validate_grid", "check_model", "model_fingerprint",
           "SweepError", "SUMMARY_FIELDS", "parse_int_list", "parse_float_list"]

SUMMARY_FIELDS = ["task", "format", "length", "s", "n", "correct", "accuracy", "ci_low", "ci_high",
                  "score_pct", "ref_s", "n_paired", "b", "c", "mcnemar_p"]
"""``b``: right at s, wrong at ref_s; ``c``: wrong at s, right at ref_s (paired on sample ids)."""


DECODE_RULES = ("budget", "answer")
"""How many tokens a sweep decodes per prompt: the task's budget, or what the answers need."""


class SweepError(ValueError):
    """An argument, model, tokenizer or output folder that a sweep cannot use."""


def strength_key(s) -> float:
    """A strength as rows, cells and comparisons key it: ``float(s)`` rounded to 6 decimals, so
    ``1``, ``1.0`` and ``1.0000001`` are one strength."""
    return round(float(s), 6)


def parse_int_list(text, name="list") -> list[int]:
    """``"1024,2K,4k"`` -> ``[1024, 2048, 4096]`` (K = 1024)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        mult = 1
        if part[-1] in "kK":
            part, mult = part[:-1], 1024
        try:
            out.append(int(part) * mult)
        except ValueError:
            raise SweepError(f"{name}: {part!r} is not an integer") from None
    if not out:
        raise SweepError(f"{name}: empty")
    return out


def parse_float_list(text, name="list") -> list[float]:
    try:
        out = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise SweepError(f"{name}: {text!r} is not a comma-separated list of numbers") from None
    if not out:
        raise SweepError(f"{name}: empty")
    return out


# --------------------------------------------------------------------------------------- IO
def shard_path(folder, rank: int = 0) -> Path:
    """The results file rank ``rank`` appends to: ``results.jsonl`` for rank 0 (the only one of
    a single-process sweep), ``results.rank{rank}.jsonl`` for the others."""
    return Path(folder) / ("results.jsonl" if rank == 0 else f"results.rank{rank}.jsonl")


def shard_paths(folder) -> list[Path]:
    """Every results shard in ``folder``, rank 0 first, then by rank."""
    folder = Path(folder)
    ranks = [int(p.name[len("results.rank"):-len(".jsonl")]) for p in folder.glob("results.rank*.jsonl")
             if p.name[len("results.rank"):-len(".jsonl")].isdigit()]
    paths = [shard_path(folder, r) for r in sorted(ranks) if r > 0]
    return ([folder / "results.jsonl"] if (folder / "results.jsonl").exists() else []) + paths


def _row_key(row) -> tuple:
    return row["length"], strength_key(row["s"]), row["sample_id"]


def _read_shard(path: Path, repair: bool) -> list[dict]:
    """The rows of one shard's complete lines. A torn last line (no newline: a kill during a
    write) is left out, and with ``repair`` cut off so that the next append starts on a clean
    line. Any other line that is not a row is a ``SweepError`` naming ``file:line``: no good
    row after it is ever dropped."""
    data = path.read_bytes() if path.exists() else b""
    rows, pos, lineno = [], 0, 0
    while (nl := data.find(b"\n", pos)) >= 0:
        line, pos, lineno = data[pos:nl], nl + 1, lineno + 1
        if line.strip():
            try:
                row = json.loads(line)
                _row_key(row)
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise SweepError(f"{path}:{lineno}: not a result row ({type(exc).__name__}: {exc}); "
                                 "repair or delete that line (the other rows are kept)") from None
            rows.append(row)
    if repair and pos < len(data):
        with open(path, "r+b") as fh:
            fh.truncate(pos)
    return rows


def _unique(rows) -> list[dict]:
    """The first row of every ``(length, s, sample_id)``."""
    seen, out = set(), []
    for r in rows:
        if (key := _row_key(r)) not in seen:
            seen.add(key)
            out.append(r)
    return out


class ResultsStore:
    """``OUTDIR`` with ``config.json`` and append-only results shards (:func:`shard_path`).

    Rank ``rank`` appends to its own shard and reads every shard, so ``done`` holds the rows of
    all ranks (and of earlier runs with any number of ranks). Opening takes an exclusive lock
    (``OUTDIR/.lock`` for rank 0, ``.lock.rank{r}`` for the others; released when the process
    ends) so that two runs never write the same file: every run has a rank 0, so two runs
    never share a folder. It refuses a folder whose config disagrees on ``fixed`` keys.
    """

    def __init__(self, out, config: dict, fixed=("samples_spec", "intervention", "model", "decode"),
                 rank: int = 0):
        self.dir = Path(out)
        self.rank = int(rank)
        config = json.loads(json.dumps(config))  # compare as stored: tuples become lists
        self._check_writable()
        self._lock = self._take_lock()
        self.config_path = self.dir / "config.json"
        self.path = shard_path(self.dir, self.rank)
        try:
            old = self._old_config(config, fixed)
        except SweepError:
            self.close()
            raise
        merged = dict(config)
        if old:
            merged["lengths"] = sorted(set(old.get("lengths", [])) | set(config.get("lengths", [])))
            merged["strengths"] = sorted(set(old.get("strengths", [])) | set(config.get("strengths", [])))
        self.config = merged
        self._config_changed = merged != old
        try:
            own = _read_shard(self.path, repair=True)
            others = [r for p in shard_paths(self.dir) if p != self.path for r in _read_shard(p, repair=False)]
        except SweepError:
            self.close()
            raise
        self.rows = _unique(own + others)
        self.done = {_row_key(r) for r in self.rows}
        self._fh = None  # config.json and the shard are written at the first append

    def _check_writable(self) -> None:
        if self.dir.exists() and not self.dir.is_dir():
            raise SweepError(f"output {str(self.dir)!r} exists and is not a folder")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".write_test{self.rank}"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise SweepError(f"output folder {str(self.dir)!r} is not writable: {exc}") from exc

    def _take_lock(self):
        lock = lock_folder(self.dir, ".lock" if self.rank == 0 else f".lock.rank{self.rank}")
        if lock is None:
            raise SweepError(f"another sweep is writing into {str(self.dir)!r}")
        return lock

    def _old_config(self, config: dict, fixed) -> dict | None:
        """The folder's ``config.json`` (None if new), after checking it agrees on ``fixed``."""
        if not self.config_path.exists():
            if any(p.stat().st_size > 0 for p in shard_paths(self.dir)):
                raise SweepError(f"{self.dir / 'results.jsonl'} exists without config.json; use a new --out")
            return None
        try:
            old = json.loads(self.config_path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise SweepError(f"{self.config_path} is unreadable ({exc}); use a new --out") from exc
        if "weights" in config.get("model", {}) and "weights" not in old.get("model", {}):
            raise SweepError(f"{str(self.dir)!r} holds a sweep with no weights hash (written by an older "
                             "qedprobe): its rows cannot be matched to these weights; use a new --out")
        for key in fixed:
            if key == "model" and _moved_model(old.get(key), config.get(key)):
                warnings.warn(f"{str(self.dir)!r} was written from the model at {old['model']['id']!r}; continuing "
                              f"with {config['model']['id']!r}, which has the same weights (sha256 "
                              f"{config['model']['weights'][:12]}...)", stacklevel=3)
                continue
            if old.get(key) != config.get(key):
                raise SweepError(
                    f"{str(self.dir)!r} holds a sweep with a different {key}{_differing(old.get(key), config.get(key))}"
                    ":\n  there: "
                    f"{json.dumps(old.get(key), sort_keys=True)}\n  now:   "
                    f"{json.dumps(config.get(key), sort_keys=True)}\nuse a new --out to keep both")
        return old

    def _open(self):
        if self._config_changed:  # every rank writes the same text; each replace is atomic
            tmp = self.config_path.with_suffix(f".json.tmp{self.rank}")
            tmp.write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.config_path)
            self._config_changed = False
        self._fh = open(self.path, "a", encoding="utf-8")

    def append(self, rows: list[dict]) -> None:
        """Append rows as one write, then flush and fsync."""
        if not rows:
            return
        if self._fh is None:
            self._open()
        text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
        self._fh.write(text)
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self.done.update(_row_key(r) for r in rows)
        self.rows.extend(rows)

    def close(self) -> None:
        fh = getattr(self, "_fh", None)
        if fh is not None and not fh.closed:
            fh.close()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _moved_model(old, new) -> bool:
    """Whether two configs' ``model`` records describe the same weights (equal SHA-256) and
    fingerprint read from different paths: a checkpoint that moved, whose rows still hold."""
    if not isinstance(old, dict) or not isinstance(new, dict) or not old.get("weights"):
        return False
    rest = lambda m: {k: v for k, v in m.items() if k != "id"}  # noqa: E731
    return old.get("id") != new.get("id") and rest(old) == rest(new)


def _differing(old, new) -> str:
    """`` (a, b differ)`` for two dicts, naming the keys whose values differ; else ``""``."""
    if not isinstance(old, dict) or not isinstance(new, dict):
        return ""
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return f" ({', '.join(keys)} differ)"


def load_results(out) -> list[dict]:
    """Complete rows of every results shard in ``out`` (torn last lines are skipped, not repaired)."""
    paths = shard_paths(out)
    if not paths:
        raise SweepError(f"no results.jsonl in {str(out)!r}")
    return _unique(r for p in paths for r in _read_shard(p, repair=False))


# ---------------------------------------------------------------------------------- summary
def summarize(rows, ref_s=1.0) -> list[dict]:
    """Accuracy, Wilson 95% interval, RULER's score in percent (``score_pct``: the mean of the rows'
    ``score``) and the exact McNemar test against ``ref_s`` per length x s. Rows written before
    task formats existed have no ``score`` or ``format``: their ``correct`` is their score and
    their format is ``legacy``."""
    by = defaultdict(dict)  # (length, s) -> {sample_id: correct}
    share = defaultdict(dict)  # (length, s) -> {sample_id: share of the answers found}
    task, fmt = {}, {}
    for r in rows:
        cell = (int(r["length"]), strength_key(r["s"]))
        by[cell][int(r["sample_id"])] = bool(r["correct"])
        share[cell][int(r["sample_id"])] = float(r.get("score", r["correct"]))
        task[int(r["length"])] = r.get("task", "")
        fmt[int(r["length"])] = r.get("format", "legacy")
    ref = None if ref_s is None else strength_key(ref_s)
    out = []
    for (length, s) in sorted(by):
        res = by[(length, s)]
        n, k = len(res), sum(res.values())
        lo, hi = wilson_interval(k, n)
        row = {"task": task[length], "format": fmt[length], "length": length, "s": s, "n": n, "correct": k,
               "accuracy": k / n if n else math.nan, "ci_low": lo, "ci_high": hi,
               "score_pct": round(100 * sum(share[(length, s)].values()) / n, 2) if n else math.nan,
               "ref_s": ref, "n_paired": None, "b": None, "c": None, "mcnemar_p": None}
        base = by.get((length, ref)) if ref is not None else None
        if base is not None:
            shared = sorted(set(res) & set(base))
            b = sum(1 for i in shared if res[i] and not base[i])
            c = sum(1 for i in shared if base[i] and not res[i])
            row.update(n_paired=len(shared), b=b, c=c, mcnemar_p=mcnemar_exact(b, c))
        out.append(row)
    return out


def write_summary(summary: list[dict], out) -> list[Path]:
    """``summary.csv`` and ``summary.json`` in ``out``."""
    out = Path(out)
    paths = [out / "summary.csv", out / "summary.json"]
    with open(paths[0], "w", newline="", encoding="utf-8") as fh:
        w = csv.DictWriter(fh, fieldnames=SUMMARY_FIELDS)
        w.writeheader()
        for row in summary:
            w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in SUMMARY_FIELDS})
    paths[1].write_text(json.dumps({"interval": "wilson95", "test": "mcnemar_exact_two_sided",
                                    "b": "right at s, wrong at ref_s", "c": "wrong at s, right at ref_s",
                                    "rows": summary}, indent=2) + "\n")
    return paths


def plot_summary(summary: list[dict], out, title=None) -> list[Path]:
    """``acc_vs_length.png`` (one line per s) and ``acc_vs_strength.png`` (one line per length);
    the series differ in colour and marker and are offset a little along x (see ``plots``)."""
    from matplotlib import colormaps
    out = Path(out)
    lengths = sorted({r["length"] for r in summary})
    strengths = sorted({r["s"] for r in summary})
    cell = {(r["length"], r["s"]): r for r in summary}
    paths = []
    for by_length, xs, series, xlabel, fname in (
            (True, lengths, strengths, "context length (tokens)", "acc_vs_length.png"),
            (False, strengths, lengths, "strength s (lambda x s)", "acc_vs_strength.png")):
        fig = figure(figsize=(6.4, 4.2))
        ax = fig.subplots()
        cmap = colormaps["viridis"]
        width = LOG_SPREAD if by_length else linear_spread(xs)
        for j, ser in enumerate(series):
            pts = [(x, cell.get((x, ser) if by_length else (ser, x))) for x in xs]
            pts = [(x, r) for x, r in pts if r is not None and r["n"]]
            if pts:
                accuracy_errorbar(ax, pts, log_x=by_length, **series_style(j, len(series), width),
                                  color=cmap(0.9 * j / max(1, len(series) - 1)),
                                  label=f"s = {ser:g}" if by_length else f"L = {format_length(ser)}")
        paths.append(save_accuracy_figure(fig, ax, out / fname, xlabel=xlabel, title=title,
                                          lengths=lengths if by_length else None,
                                          strengths=None if by_length else strengths))
    return paths


# ----------------------------------------------------------------------------------- runner
FINGERPRINT_EXCLUDES = ("op_mode", "decay_a_range", "decay_dt_range", "task_format")
"""Config keys that do not change what a built model computes (the op used; the initialisation
ranges; the recorded training format): left out of a sweep's model fingerprint, so folders stay
resumable across them."""


def model_fingerprint(cfg) -> dict:
    """The model config a sweep folder records (a ``QEDConfig`` or None), less
    :data:`FINGERPRINT_EXCLUDES`; the loaded model's and its ``config.json``'s are the same."""
    if cfg is None:
        return {}
    d = cfg.to_dict() if hasattr(cfg, "to_dict") else dict(vars(cfg))
    for key in FINGERPRINT_EXCLUDES:
        d.pop(key, None)
    return d


def _model_dtype(model):
    try:
        return str(next(model.parameters()).dtype).replace("torch.", "")
    except (AttributeError, StopIteration):
        return None


def sweep_config(nt: NIAHTask | RulerTask, *, samples, seed, lengths, strengths, layers, heads, phase, ref_strength,
                 model_id, model_cfg, dtype, weights, decode="budget") -> dict:
    """What defines a sweep folder (``config.json``): the samples, the intervention, the model
    (id, :func:`model_fingerprint`, weights dtype name, ``weights``: the loaded state dict's
    SHA-256, ``qedprobe.model.checkpoint.state_dict_sha256``, so that rows of different weights
    behind one config never mix), the grid, the reference strength and, unless
    ``decode="budget"``, the decode rule."""
    config = {
        "samples_spec": {**nt.describe(), "samples": int(samples), "seed": int(seed)},
        "intervention": {"layers": None if layers is None else list(layers),
                         "heads": None if heads is None else list(heads), "phase": phase},
        "model": {"id": model_id, "config": model_fingerprint(model_cfg), "dtype": dtype, "weights": weights},
        "lengths": [int(x) for x in lengths], "strengths": [float(s) for s in strengths],
        "ref_strength": ref_strength,
    }
    if decode != "budget":
        config["decode"] = {"rule": decode, "margin": ANSWER_MARGIN}
    return config


def open_store(out, config: dict) -> ResultsStore:
    """This rank's :class:`ResultsStore` on ``out``; under a process group every rank opens its
    shard and all of them raise (a ``SweepError``) if any rank cannot (lock, config, folder)."""
    store = error = None
    try:
        store = ResultsStore(out, config, rank=dist.rank())
    except SweepError as exc:
        error = exc
    try:
        dist.agree(error, kind=SweepError)
    except SweepError:
        if store is not None:
            store.close()
        raise
    return store


@dataclass
class SweepBatch:
    """One batch of prompts of one length, packed once: ``sample_ids``, and per strength the
    ids whose rows are still missing (``todo``: ``[(s, ids)]``, one generate call each)."""

    length: int
    sample_ids: list[int]
    todo: list[tuple[float, list[int]]]


def plan_batches(done, lengths, strengths, samples, batch_size_of) -> list[SweepBatch]:
    """The batches that compute every ``(length, s, sample_id)`` not in ``done``: per length,
    the sample ids missing at some strength, in runs of ``batch_size_of(length)``."""
    batches = []
    for L in lengths:
        missing = {i: [s for s in strengths if (L, strength_key(s), i) not in done] for i in range(samples)}
        ids = [i for i in range(samples) if missing[i]]
        bs = batch_size_of(L)
        for start in range(0, len(ids), bs):
            chunk = ids[start:start + bs]
            todo = [(s, [i for i in chunk if s in missing[i]]) for s in strengths]
            batches.append(SweepBatch(L, chunk, [(s, who) for s, who in todo if who]))
    return batches


def still_missing(batches, done) -> list[SweepBatch]:
    """``batches`` less the rows now in ``done`` (a batch left with nothing to do is dropped):
    what a rank still owes of the batches it was dealt."""
    left = []
    for b in batches:
        todo = [(s, [i for i in who if (b.length, strength_key(s), i) not in done]) for s, who in b.todo]
        todo = [(s, who) for s, who in todo if who]
        if todo:
            left.append(SweepBatch(b.length, b.sample_ids, todo))
    return left


def _default_batch(length, device_type, batch_tokens):
    if device_type == "cuda":
        return max(1, int(batch_tokens) // int(length))
    return 4


MAX_BATCH_TOKENS = 2 ** 20
"""The most prompt tokens :func:`memory_batch_tokens` packs into one call: the recurrence's
Triton kernels compute element offsets ``token x heads x head_dim`` in int32, which stays below
2^31 for ``heads x head_dim <= 2048`` (768 for the 340M shape)."""


def prefill_bytes_per_token(cfg) -> int:
    """A bound on a prefill's live activation bytes per prompt token of a ``QEDConfig`` model:
    the widest tensors one block holds at once (bf16 projections and MLP, float32 log-decay and
    the recurrence's intra-chunk buffers, float32 residual and norms): an upper bound, so that a
    batch sized by it fits whatever the path (docs/BENCHMARKS.md has the measured peaks)."""
    hk = cfg.num_heads * max(cfg.head_dim, cfg.head_v_dim)
    wide = 3 * cfg.intermediate_size + 2 * (5 * hk + 2 * cfg.head_v_dim)
    return 2 * wide + 4 * 7 * hk + 8 * cfg.hidden_size


def memory_batch_tokens(model, share: float = 0.6) -> int:
    """Prompt tokens per generate call on a CUDA device: the largest power of two whose prefill
    (:func:`prefill_bytes_per_token`) fits in ``share`` of the device's free memory, at most
    :data:`MAX_BATCH_TOKENS` and at least 2^14."""
    free, _ = torch.cuda.mem_get_info(model.device)
    fit = int(share * free) // prefill_bytes_per_token(model.cfg)
    return max(2 ** 14, min(MAX_BATCH_TOKENS, 1 << max(fit, 1).bit_length() - 1))


def sweep_fast_path(model, fast_path) -> str | None:
    """The ``torch.compile`` backend a sweep runs the model's fast path with
    (:func:`qedprobe.model.fast_path`), or None for the plain path. ``fast_path``: None (default)
    is ``"inductor"`` for a model with a fast path (a ``QEDModel``) on CUDA and the plain path
    otherwise; False the plain path; True ``"inductor"``; a string that backend."""
    if fast_path is None:
        on_cuda = torch.device(getattr(model, "device", "cpu")).type == "cuda"
        fast_path = on_cuda and hasattr(model, "fast_path")
    if fast_path is False:
        return None
    if not hasattr(model, "fast_path"):
        raise SweepError(f"fast_path={fast_path!r}: {type(model).__name__} has no fast path (a QEDModel "
                         "has); pass fast_path=False (--eager)")
    if fast_path is True:
        return "inductor"
    if not isinstance(fast_path, str):
        raise SweepError(f"fast_path must be None, a bool or a torch.compile backend name, got {fast_path!r}")
    return fast_path


def compile_failure(err: BaseException) -> bool:
    """Whether ``err`` is ``torch.compile`` failing (dynamo's or a backend's error), as opposed to
    an error of the model or the data, which the plain path would hit as well."""
    from torch._dynamo.exc import TorchDynamoException
    return isinstance(err, TorchDynamoException)


def _path_block(model, backend):
    """The block a sweep's batches run in: the fast path with ``backend``, or nothing (plain)."""
    if backend is None:
        return contextlib.nullcontext()
    from qedprobe.model import fast_path
    return fast_path(model, backend)


class Timings(dict):
    """Seconds per phase (``timings.time(name)`` adds a block's wall time) and token counts."""

    @contextlib.contextmanager
    def time(self, name: str, device=None):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if device is not None and torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)
            self[name] = self.get(name, 0.0) + time.perf_counter() - t0

    def add(self, name: str, value) -> None:
        self[name] = self.get(name, 0) + value


@dataclass
class Intervention:
    """Which lambdas a strength scales and how (``qedprobe.model.strength``'s arguments)."""

    layers: list[int] | None = None
    heads: list[int] | None = None
    phase: str = "all"
    allow_extrapolation: bool = False


def generate_at(model, prompts, n_new: int, s: float, iv: Intervention, eos_id, cuda_graph=True):
    """Greedy continuations ``[B][n_new]`` of packed ``prompts`` with lambda scaled by ``s``."""
    from qedprobe.model import strength as strength_cm
    with torch.inference_mode(), strength_cm(model, s, layers=iv.layers, heads=iv.heads, phase=iv.phase,
                                             allow_extrapolation=iv.allow_extrapolation):
        return model.generate(prompts, n_new, eos_token_id=eos_id, do_sample=False, return_type="new_tokens",
                              cuda_graph=cuda_graph)


def rows_from_outputs(nt: NIAHTask | RulerTask, length: int, s: float, samples: dict, outputs, seed: int) -> list[dict]:
    """One result row per ``(sample_id -> Sample)`` of ``samples`` and its generated ids
    (``outputs`` in the same order): the prediction is cut at the first EOS and scored: ``score``
    is the share of the sample's answers found (RULER's ``string_match_all``), ``correct`` is all
    of them."""
    tok, rows = nt.tokenizer, []
    for (i, sm), raw in zip(samples.items(), outputs):
        toks = list(raw)
        if tok.eos_id is not None and tok.eos_id in toks:
            toks = toks[:toks.index(tok.eos_id)]
        pred = tok.decode(toks)
        found = answer_fraction(pred, sm.answers)
        rows.append({"task": nt.name, "format": nt.format, "length": length, "s": s, "sample_id": i,
                     "correct": found == 1.0, "score": found, "prediction": pred, "answer": sm.answer,
                     "answers": sm.answers, "key": sm.key, "depth": sm.depth, "prompt_tokens": len(sm.input_ids),
                     "new_tokens": len(toks), "prompt_sha": sm.sha, "seed": int(seed)})
    return rows


def run_batch(model, nt: NIAHTask | RulerTask, batch: SweepBatch, *, samples, seed, iv: Intervention, decode, timings,
              cuda_graph=True):
    """Yield the rows of each strength of ``batch`` (one generate call each); the prompts are
    built and packed once per set of ids and shared by the strengths."""
    from qedprobe.model.packing import pack_prompts
    device = getattr(model, "device", torch.device("cpu"))
    with timings.time("generate_prompts_s"):
        smp = {i: nt.sample(batch.length, i, samples=samples, seed=seed) for i in batch.sample_ids}
    packed = {}  # ids -> (PackedPrompts, new tokens)
    for s, who in batch.todo:
        with timings.time("model_s", device):
            if tuple(who) not in packed:
                prompts = [smp[i] for i in who]
                packed[tuple(who)] = (
                    pack_prompts([sm.input_ids for sm in prompts], model.cfg.vocab_size, device),
                    nt.max_new_tokens if decode == "budget" else nt.answer_tokens(prompts))
            new = generate_at(model, *packed[tuple(who)], s, iv, nt.tokenizer.eos_id, cuda_graph)
        timings.add("new_tokens", sum(len(raw) for raw in new))
        rows = rows_from_outputs(nt, batch.length, s, {i: smp[i] for i in who}, new, seed)
        timings.add("prompt_tokens", sum(r["prompt_tokens"] for r in rows))
        yield rows


def summarise(folder, ref_strength, title=None) -> list[dict]:
    """The summary of every shard in ``folder``, once all ranks are done; rank 0 writes
    ``summary.csv`` / ``summary.json`` and the plots."""
    dist.barrier()
    rows = load_results(folder) if shard_paths(folder) else []
    summary = summarize(rows, ref_strength)
    if dist.is_main():
        write_summary(summary, folder)
        if summary:
            plot_summary(summary, folder, title=title)
    return summary


@dataclass
class SweepResult:
    """What :func:`run_sweep` returns: the summary rows (every shard), this rank's timings
    (seconds per phase ``*_s``, ``prompt_tokens``, ``new_tokens``, ``prefill_tokens_per_s``), the
    rows of the grid still missing from the folder (0 once complete; more when ``time_limit``
    stopped the run) and the fast path's backend (None: the plain path)."""

    summary: list[dict]
    timing: dict = field(default_factory=dict)
    missing: int = 0
    fast_path: str | None = None


def _resolve_model(model, model_id):
    """A loaded model (a ``save_pretrained`` folder is loaded on this rank's CUDA device in
    bfloat16 when available, else CPU float32) and its id."""
    if not isinstance(model, (str, os.PathLike)):
        return model, model_id
    from qedprobe.model import QEDModel
    cuda = torch.cuda.is_available()
    dev = dist.rank_device("cuda") if cuda else torch.device("cpu")
    loaded = QEDModel.from_pretrained(model, dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
    return loaded.eval(), model_id or str(Path(model).resolve())


def run_sweep(model, tokenizer="bytes", *, task="s-niah-1", lengths, strengths, samples, seed=0,
              out, batch_size=None, batch_tokens=None, layers=None, heads=None, phase="all",
              ref_strength=1.0, allow_extrapolation=False, haystack_file=None, num_needles=None,
              max_new_tokens=None, haystack=None, model_id=None, progress=True,
              decode="budget", cuda_graph=True, task_format=DEFAULT_FORMAT, fast_path=None,
              time_limit=None) -> SweepResult:
    """Run (or resume) a strength sweep into ``out``; returns a :class:`SweepResult`.

    ``model``: a :class:`qedprobe.model.QEDModel` (on its device, in eval mode), or a folder
    written by ``save_pretrained`` (loaded on CUDA in bfloat16 when available, else CPU float32).
    ``tokenizer``: ``"bytes"``, a local HF folder or a tokenizer object.
    ``out``: a folder, or a :class:`ResultsStore` the caller opened (and closes) with a
    :func:`sweep_config` that holds the weights hash.
    ``task``: a task name or a task object (``qedprobe.eval.tasks.make_task``); a name is built in
    ``task_format`` (``"ruler"``, the default, or ``"legacy"``, the shipped checkpoints' format).
    ``batch_size``: prompts per generate call (default: ``batch_tokens // length`` on CUDA, 4 on CPU);
    ``batch_tokens`` defaults to :func:`memory_batch_tokens` (what fits in the free GPU memory).
    ``layers``, ``heads``, ``phase``: which lambdas the strength scales (see ``qedprobe.model.strength``).
    ``decode``: ``"budget"`` decodes the task's ``max_new_tokens`` per prompt (the tokens the prompt
    length reserves; rows as always); ``"answer"`` decodes only what the longest answer of each batch
    needs (``NIAHTask.answer_tokens``: 11 instead of 16 for 7-digit numbers in bytes), so a
    prediction is a prefix of the ``"budget"`` one; recorded in ``config.json`` as ``decode``.
    Each batch of prompts is packed once and run at every strength.
    ``cuda_graph``: replay the decode step from a CUDA graph where that is exact (CUDA, no hooks;
    ``QEDModel.generate``); False forces eager steps. Rows are the same either way.
    ``fast_path``: run the model's compiled fast path (:func:`sweep_fast_path`: by default on CUDA
    for a ``QEDModel``; False forces the plain path). Its rows equal the plain path's up to float
    rounding (``qedprobe.model.fast``), so a folder keeps rows of either. When the default fast
    path fails to compile (:func:`compile_failure`), the sweep warns and runs the rest on the
    plain path; an explicitly requested one raises.
    ``time_limit``: seconds after which no new batch starts (a batch is not started when the last
    one's time would take it past the limit); the rows written stay, ``SweepResult.missing``
    counts the others and a rerun resumes.

    Under an initialised ``torch.distributed`` process group of N ranks (``torchrun``), every
    rank calls ``run_sweep`` with the same arguments and its own model replica: the missing
    rows are planned into the same batches as in one process, batch ``j`` runs on rank
    ``j mod N`` and appends to that rank's shard; the summary is written by rank 0 once all
    ranks are done and returned on every rank.
    """
    t_start = time.perf_counter()
    model, model_id = _resolve_model(model, model_id)
    nt = task if hasattr(task, "sample") else make_task(task, tokenizer, format=task_format,
                                                        haystack_file=haystack_file, num_needles=num_needles,
                                                        max_new_tokens=max_new_tokens, haystack=haystack)
    lengths = [int(x) for x in lengths]
    strengths = [float(s) for s in strengths]
    validate_grid(nt, lengths, strengths, samples, phase, allow_extrapolation)
    check_model(nt, getattr(model, "cfg", None), strengths, layers, heads)
    if decode not in DECODE_RULES:
        raise SweepError(f"decode must be one of {DECODE_RULES}, got {decode!r}")
    config = sweep_config(nt, samples=samples, seed=seed, lengths=lengths, strengths=strengths, layers=layers,
                          heads=heads, phase=phase, ref_strength=ref_strength, model_id=model_id,
                          model_cfg=getattr(model, "cfg", None), dtype=_model_dtype(model),
                          weights=None if isinstance(out, ResultsStore) else state_dict_sha256(model),
                          decode=decode)  # a caller's store was opened with the hash already
    if isinstance(out, ResultsStore) and not out.config.get("model", {}).get("weights"):
        raise SweepError("the ResultsStore passed as `out` records no weights hash: open it with "
                         "sweep_config(..., weights=state_dict_sha256(model))")
    store = out if isinstance(out, ResultsStore) else open_store(out, config)
    try:
        if store.config.get("decode") != config.get("decode"):
            raise SweepError(f"{str(store.dir)!r} was decoded with {store.config.get('decode')}, "
                             f"this run asks {config.get('decode')}: use a new --out")
        device_type = torch.device(getattr(model, "device", "cpu")).type
        if batch_tokens is None and batch_size is None and device_type == "cuda":
            batch_tokens = memory_batch_tokens(model)
        batches = plan_batches(store.done, lengths, strengths, samples,
                               lambda L: batch_size or _default_batch(L, device_type, batch_tokens))
        backend = sweep_fast_path(model, fast_path)
        run = functools.partial(run_batches, model, nt, store, samples=samples, seed=seed,
                                iv=Intervention(layers, heads, phase, allow_extrapolation), decode=decode,
                                cuda_graph=cuda_graph, progress=progress,
                                deadline=None if time_limit is None else t_start + time_limit)
        mine = batches[dist.rank()::dist.world_size()]
        try:
            with _path_block(model, backend):
                timings = run(mine)
        except Exception as err:  # noqa: BLE001 - only a failed compile of the default fast path is retried
            if fast_path is not None or backend is None or not compile_failure(err):
                raise
            warnings.warn(f"run_sweep: the fast path did not compile ({type(err).__name__}: {err}); the rest of "
                          "the sweep runs the plain path (pass fast_path=False, --eager, to skip the attempt)",
                          RuntimeWarning, stacklevel=2)
            backend = None
            timings = run(still_missing(mine, store.done))
    finally:
        if not isinstance(out, ResultsStore):
            store.close()
    with timings.time("summary_s"):
        summary = summarise(store.dir, ref_strength,
                            title=plot_title(model_id, model.cfg.arm, nt.name, seed, layers, heads, phase))
    done = sum(r["n"] for r in summary if r["length"] in lengths and r["s"] in {strength_key(x) for x in strengths})
    return SweepResult(summary, _finish_timings(timings, t_start), missing=len(lengths) * len(strengths) * samples - done,
                       fast_path=backend)


def run_batches(model, nt: NIAHTask, store: ResultsStore, batches, *, samples, seed, iv: Intervention, decode,
                cuda_graph=True, progress=True, deadline=None) -> Timings:
    """Run ``batches`` (:func:`run_batch` each), appending every generate call's rows to
    ``store`` as they come; returns the time per phase and the token counts. With ``deadline``
    (a ``time.perf_counter()`` value) a batch starts only if the previous batch's time fits
    before it."""
    timings = Timings()
    bar = _progress(batches, nt.name) if progress else None
    last = 0.0
    for batch in batches:
        started = time.perf_counter()
        if deadline is not None and started + last > deadline:
            break
        for rows in run_batch(model, nt, batch, samples=samples, seed=seed, iv=iv, decode=decode,
                              timings=timings, cuda_graph=cuda_graph):
            with timings.time("write_s"):
                store.append(rows)
            if bar is not None:
                bar.update(len(rows))
                bar.set_postfix(L=batch.length, s=f"{rows[0]['s']:g}",
                                tok_s=f"{timings['prompt_tokens'] / max(timings['model_s'], 1e-9):,.0f}")
        last = time.perf_counter() - started
    if bar is not None:
        bar.close()
    return timings


def _progress(batches, name):
    """A tqdm bar over the rows of ``batches`` (None when there are none)."""
    total = sum(len(who) for b in batches for _, who in b.todo)
    if not total:
        return None
    from tqdm.auto import tqdm
    return tqdm(total=total, unit="row", desc=f"sweep {name}", dynamic_ncols=True,
                disable=not dist.is_main())


def _finish_timings(timings: Timings, t_start: float) -> dict:
    out = {"generate_prompts_s": 0.0, "model_s": 0.0, "write_s": 0.0, "prompt_tokens": 0, "new_tokens": 0,
           **timings, "total_s": time.perf_counter() - t_start}
    out["prefill_tokens_per_s"] = out["prompt_tokens"] / out["model_s"] if out["model_s"] else 0.0
    return out


def check_strengths_for(strengths, *, arm, allow_extrapolation=True):
    """``qedprobe.lam.check_strengths`` (the rule ``strength`` applies), as a SweepError, before any
    work (a gdn2 model has lambda = 0: only s = 1 applies)."""
    try:
        check_strengths(strengths, arm=arm, allow_extrapolation=allow_extrapolation)
    except ValueError as exc:
        raise SweepError(str(exc)) from None


def plot_title(model_id, arm, task, seed, layers, heads, phase) -> str:
    """``"recall-full-s1 (arm full), s-niah-1, seed 0"``, plus where the strength acts when not everywhere."""
    name = Path(model_id).name if model_id else "model"
    where = [f"{k} {v}" for k, v in (("layers", layers), ("heads", heads)) if v is not None]
    where += [f"{phase} only"] if phase != "all" else []
    return f"{name} (arm {arm}), {task}, seed {seed}" + (f"; s on {', '.join(where)}" if where else "")


def validate_grid(nt, lengths, strengths, samples, phase, allow_extrapolation) -> None:
    """The checks that need no model: sample count, lengths (distinct, long enough for ``nt``),
    strengths (distinct, finite, in range), phase."""
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise SweepError(f"`samples` must be a positive integer, got {samples!r}")
    if not lengths or any(L < 1 for L in lengths) or len(set(lengths)) != len(lengths):
        raise SweepError(f"`lengths` must be distinct positive integers, got {lengths}")
    if not strengths or len({strength_key(s) for s in strengths}) != len(strengths):
        raise SweepError(f"`strengths` must be distinct numbers, got {strengths}")
    if any(not math.isfinite(s) for s in strengths):
        raise SweepError("`strengths` must be finite")
    check_strengths_for(strengths, arm=None, allow_extrapolation=allow_extrapolation)
    if phase not in ("all", "prefill", "decode"):
        raise SweepError(f"phase must be all, prefill or decode, got {phase!r}")
    need = nt.min_length()
    short = [L for L in lengths if L < need]
    if short:
        raise SweepError(f"lengths {short} are too short for {nt.name} with this tokenizer "
                         f"(need >= {need} tokens)")


def check_tokenizer_fits(tokenizer, vocab_size: int) -> None:
    """The tokenizer's ids must lie in the model's vocabulary ``range(vocab_size)``."""
    if tokenizer.vocab_size > vocab_size:
        raise SweepError(f"tokenizer {tokenizer.name!r} has {tokenizer.vocab_size} ids but the "
                         f"model's vocabulary has {vocab_size}: wrong --tokenizer for this model?")


def check_model(nt, cfg, strengths, layers=None, heads=None) -> None:
    """The checks against a model config (loaded or read from ``config.json``): the arm allows
    the strengths, the tokenizer's ids fit the vocabulary, ``layers`` / ``heads`` exist."""
    if cfg is None:
        return
    check_strengths_for(strengths, arm=getattr(cfg, "arm", None))
    vs = getattr(cfg, "vocab_size", None)
    if vs is not None:
        check_tokenizer_fits(nt.tokenizer, vs)
    for name, sel, size in (("--layers", layers, getattr(cfg, "num_hidden_layers", None)),
                            ("--heads", heads, getattr(cfg, "num_heads", None))):
        if sel is not None and size is not None and any(not 0 <= i < size for i in sel):
            raise SweepError(f"{name} {sel} outside 0..{size - 1}")
    linear = getattr(cfg, "linear_layers", None)  # a transformers model (qedprobe.hf): lambda lives there only
    if layers is not None and linear is not None and any(i not in linear for i in layers):
        raise SweepError(f"--layers {layers}: the recurrence runs in the linear-attention layers {list(linear)} only")
