"""Strength sweeps on NIAH tasks: a resumable runner, the paired summary and its plots.

Python API (the CLI ``qedprobe sweep`` calls the same function)::

    from qedprobe.eval.sweep import run_sweep
    rows = run_sweep(model, "bytes", task="s-niah-1", lengths=[1024, 2048],
                     strengths=[-1, 0, 0.5, 1, 1.5, 2], samples=500, seed=0, out="runs/a")

Files in ``out``:

* ``config.json``: what defines the samples, the model and the intervention; a later run into
  the same folder must agree on it (lengths and strengths may be added). It is written with the
  first row, so a run that fails before any work leaves no config behind.
* ``config.json`` key ``decode`` (only with ``decode="answer"``): how many tokens each prompt
  decodes; a folder never mixes rows decoded to different budgets.
* ``results.jsonl``: one row per ``(length, s, sample_id)``, appended and fsync'ed batch by batch.
  A rerun skips the rows already there; a torn last line (a kill during a write) is cut off
  and its row recomputed, so no row is lost or duplicated.
* ``summary.csv`` / ``summary.json``: accuracy and Wilson 95% interval per length x s, and the
  exact McNemar test of each s against the reference strength (default 1) on the samples both
  have: ``b`` = right at s and wrong at the reference, ``c`` = the reverse, two-sided ``p``.
* ``acc_vs_length.png``, ``acc_vs_strength.png``.
"""
from __future__ import annotations

import csv
import json
import math
import os
import time
from collections import defaultdict
from pathlib import Path

from qedprobe.lam import check_strengths

from .plots import accuracy_errorbar, figure, save_accuracy_figure
from .stats import mcnemar_exact, wilson_interval
from .tasks import ANSWER_MARGIN, NIAHTask, score

__all__ = ["run_sweep", "ResultsStore", "load_results", "summarize", "write_summary", "plot_summary",
           "SweepError", "SUMMARY_FIELDS", "parse_int_list", "parse_float_list"]

SUMMARY_FIELDS = ["task", "length", "s", "n", "correct", "accuracy", "ci_low", "ci_high", "ref_s",
                  "n_paired", "b", "c", "mcnemar_p"]
"""``b``: right at s, wrong at ref_s; ``c``: wrong at s, right at ref_s (paired on sample ids)."""


DECODE_RULES = ("budget", "answer")
"""How many tokens a sweep decodes per prompt: the task's budget, or what the answers need."""


class SweepError(ValueError):
    """An argument, model, tokenizer or output folder that a sweep cannot use."""


def _skey(s) -> float:
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
class ResultsStore:
    """``OUTDIR`` with ``config.json`` and an append-only ``results.jsonl``.

    Opening takes an exclusive lock (``OUTDIR/.lock``, released when the process ends) so that two
    runs never write the same file; it refuses a folder whose config disagrees on ``fixed`` keys.
    """

    def __init__(self, out, config: dict, fixed=("samples_spec", "intervention", "model", "decode")):
        self.dir = Path(out)
        config = json.loads(json.dumps(config))  # compare as stored: tuples become lists
        if self.dir.exists() and not self.dir.is_dir():
            raise SweepError(f"output {str(self.dir)!r} exists and is not a folder")
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / ".write_test"
            probe.write_text("ok")
            probe.unlink()
        except OSError as exc:
            raise SweepError(f"output folder {str(self.dir)!r} is not writable: {exc}") from exc
        self._lock = None
        try:
            import fcntl
            self._lock = open(self.dir / ".lock", "w")
            try:
                fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                self._lock.close()
                self._lock = None
                raise SweepError(f"another sweep is writing into {str(self.dir)!r}") from None
        except ImportError:  # pragma: no cover - non-POSIX
            pass
        self.config_path = self.dir / "config.json"
        self.path = self.dir / "results.jsonl"
        old = None
        if self.config_path.exists():
            try:
                old = json.loads(self.config_path.read_text())
            except (OSError, json.JSONDecodeError) as exc:
                self.close()
                raise SweepError(f"{self.config_path} is unreadable ({exc}); use a new --out") from exc
            for key in fixed:
                if old.get(key) != config.get(key):
                    self.close()
                    raise SweepError(
                        f"{str(self.dir)!r} holds a sweep with a different {key}:\n  there: "
                        f"{json.dumps(old.get(key), sort_keys=True)}\n  now:   "
                        f"{json.dumps(config.get(key), sort_keys=True)}\nuse a new --out to keep both")
        elif self.path.exists() and self.path.stat().st_size > 0:
            self.close()
            raise SweepError(f"{self.path} exists without config.json; use a new --out")
        merged = dict(config)
        if old:
            merged["lengths"] = sorted(set(old.get("lengths", [])) | set(config.get("lengths", [])))
            merged["strengths"] = sorted(set(old.get("strengths", [])) | set(config.get("strengths", [])))
        self.config = merged
        self._config_changed = merged != old
        self.rows = self._load_and_repair()
        self.done = {(r["length"], _skey(r["s"]), r["sample_id"]) for r in self.rows}
        self._fh = None  # config.json and results.jsonl are written at the first append

    def _open(self):
        if self._config_changed:
            tmp = self.config_path.with_suffix(".json.tmp")
            tmp.write_text(json.dumps(self.config, indent=2, sort_keys=True) + "\n")
            os.replace(tmp, self.config_path)
            self._config_changed = False
        self._fh = open(self.path, "a", encoding="utf-8")

    def _load_and_repair(self) -> list[dict]:
        if not self.path.exists():
            return []
        data = self.path.read_bytes()
        rows, seen, good_end, pos = [], set(), 0, 0
        while pos < len(data):
            nl = data.find(b"\n", pos)
            if nl < 0:
                break  # torn last line
            line = data[pos:nl]
            pos = nl + 1
            if not line.strip():
                good_end = pos
                continue
            try:
                row = json.loads(line)
                key = (row["length"], _skey(row["s"]), row["sample_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                break  # a corrupt line: keep what precedes it
            good_end = pos
            if key in seen:
                continue
            seen.add(key)
            rows.append(row)
        if good_end < len(data):
            with open(self.path, "r+b") as fh:
                fh.truncate(good_end)
        return rows

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
        for r in rows:
            self.done.add((r["length"], _skey(r["s"]), r["sample_id"]))
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


def load_results(out) -> list[dict]:
    """Complete rows of ``out/results.jsonl`` (a torn last line is skipped, not repaired)."""
    path = Path(out) / "results.jsonl"
    if not path.is_file():
        raise SweepError(f"no results.jsonl in {str(out)!r}")
    rows, seen = [], set()
    with open(path, encoding="utf-8") as fh:
        for line in fh:
            if not line.endswith("\n"):
                break
            try:
                r = json.loads(line)
                key = (r["length"], _skey(r["s"]), r["sample_id"])
            except (json.JSONDecodeError, KeyError, TypeError):
                break
            if key not in seen:
                seen.add(key)
                rows.append(r)
    return rows


# ---------------------------------------------------------------------------------- summary
def summarize(rows, ref_s=1.0) -> list[dict]:
    """Accuracy, Wilson 95% interval and the exact McNemar test against ``ref_s`` per length x s."""
    by = defaultdict(dict)  # (length, s) -> {sample_id: correct}
    task = {}
    for r in rows:
        by[(int(r["length"]), _skey(r["s"]))][int(r["sample_id"])] = bool(r["correct"])
        task[int(r["length"])] = r.get("task", "")
    ref = None if ref_s is None else _skey(ref_s)
    out = []
    for (length, s) in sorted(by):
        res = by[(length, s)]
        n, k = len(res), sum(res.values())
        lo, hi = wilson_interval(k, n)
        row = {"task": task[length], "length": length, "s": s, "n": n, "correct": k,
               "accuracy": k / n if n else math.nan, "ci_low": lo, "ci_high": hi,
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
    """``acc_vs_length.png`` (one line per s) and ``acc_vs_strength.png`` (one line per length)."""
    from matplotlib import colormaps
    out = Path(out)
    lengths = sorted({r["length"] for r in summary})
    strengths = sorted({r["s"] for r in summary})
    cell = {(r["length"], r["s"]): r for r in summary}
    paths = []
    for xs, series, xlabel, fname, legend in (
            (lengths, strengths, "context length (tokens)", "acc_vs_length.png", "s = {:g}"),
            (strengths, lengths, "strength s (lambda x s)", "acc_vs_strength.png", "L = {}")):
        fig = figure(figsize=(6.4, 4.2))
        ax = fig.subplots()
        cmap = colormaps["viridis"]
        for j, ser in enumerate(series):
            pts = [(x, cell.get((x, ser) if fname == "acc_vs_length.png" else (ser, x))) for x in xs]
            pts = [(x, r) for x, r in pts if r is not None and r["n"]]
            if pts:
                accuracy_errorbar(ax, pts, color=cmap(j / max(1, len(series) - 1)), label=legend.format(ser))
        paths.append(save_accuracy_figure(fig, ax, out / fname, xlabel=xlabel, title=title,
                                          lengths=lengths if fname == "acc_vs_length.png" else None))
    return paths


# ----------------------------------------------------------------------------------- runner
FINGERPRINT_EXCLUDES = ("op_mode", "decay_a_range", "decay_dt_range")
"""Config keys that do not change what a built model computes (the op used; the initialisation
ranges): left out of a sweep's model fingerprint, so folders stay resumable across them."""


def _model_fingerprint(model) -> dict:
    cfg = getattr(model, "cfg", None)
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


def _default_batch(length, device_type, batch_tokens):
    if device_type == "cuda":
        return max(1, int(batch_tokens) // int(length))
    return 4


def run_sweep(model, tokenizer="bytes", *, task="s-niah-1", lengths, strengths, samples, seed=0,
              out, batch_size=None, batch_tokens=2 ** 18, layers=None, heads=None, phase="all",
              ref_strength=1.0, allow_extrapolation=False, haystack_file=None, num_needles=None,
              max_new_tokens=None, haystack=None, model_id=None, progress=True, stop_after=None,
              decode="budget", cuda_graph=True):
    """Run (or resume) a strength sweep into ``out``; returns the summary rows.

    ``model``: a :class:`qedprobe.model.QEDModel` (on its device, in eval mode), or a folder
    written by ``save_pretrained`` (loaded on CUDA in bfloat16 when available, else CPU float32).
    ``tokenizer``: ``"bytes"``, a local HF folder or a tokenizer object.
    ``batch_size``: prompts per generate call (default: ``batch_tokens // length`` on CUDA, 4 on CPU).
    ``layers``, ``heads``, ``phase``: which lambdas the strength scales (see ``qedprobe.model.strength``).
    ``stop_after``: stop after this many generate calls (tests of resume); the summary is still written.
    ``decode``: ``"budget"`` decodes the task's ``max_new_tokens`` per prompt (the tokens the prompt
    length reserves; rows as always); ``"answer"`` decodes only what the longest answer of each batch
    needs (``NIAHTask.answer_tokens``: 11 instead of 16 for 7-digit numbers in bytes), so a
    prediction is a prefix of the ``"budget"`` one; recorded in ``config.json`` as ``decode``.
    Each batch of prompts is packed once and run at every strength.
    ``cuda_graph``: replay the decode step from a CUDA graph where that is exact (CUDA, no hooks;
    ``QEDModel.generate``); False forces eager steps. Rows are the same either way.
    The returned summary also has the timing in ``run_sweep.last_timing``.
    """
    import torch
    from qedprobe.model import strength as strength_cm
    from qedprobe.model.packing import pack_prompts

    t_start = time.perf_counter()
    if isinstance(model, (str, os.PathLike)):
        from qedprobe.model import QEDModel
        model_id = model_id or str(Path(model).resolve())
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        model = QEDModel.from_pretrained(model, dtype=torch.bfloat16 if dev == "cuda" else torch.float32,
                                         device=dev).eval()
    nt = task if isinstance(task, NIAHTask) else NIAHTask(task, tokenizer, haystack_file=haystack_file,
                                                          num_needles=num_needles,
                                                          max_new_tokens=max_new_tokens,
                                                          haystack=haystack)
    tok = nt.tokenizer
    lengths = [int(x) for x in lengths]
    strengths = [float(s) for s in strengths]
    _validate(nt, lengths, strengths, samples, phase, allow_extrapolation, model)
    if decode not in DECODE_RULES:
        raise SweepError(f"decode must be one of {DECODE_RULES}, got {decode!r}")
    config = {
        "samples_spec": {**nt.describe(), "samples": int(samples), "seed": int(seed)},
        "intervention": {"layers": None if layers is None else list(layers),
                         "heads": None if heads is None else list(heads), "phase": phase},
        "model": {"id": model_id, "config": _model_fingerprint(model), "dtype": _model_dtype(model)},
        "lengths": lengths, "strengths": strengths, "ref_strength": ref_strength,
    }
    if decode != "budget":
        config["decode"] = {"rule": decode, "margin": ANSWER_MARGIN}
    store = out if isinstance(out, ResultsStore) else ResultsStore(out, config)
    if store.config.get("decode") != config.get("decode"):
        raise SweepError(f"{str(store.dir)!r} was decoded with {store.config.get('decode')}, "
                         f"this run asks {config.get('decode')}: use a new --out")
    timing = defaultdict(float)
    n_prompt_tok = n_new_tok = 0
    try:
        todo = [(L, i, _skey(s)) for L in lengths for i in range(samples) for s in strengths
                if (L, _skey(s), i) not in store.done]
        bar = None
        if progress and todo:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(todo), unit="row", desc=f"sweep {nt.name}", dynamic_ncols=True)
        pending = defaultdict(lambda: defaultdict(list))  # L -> i -> [s]
        for L, i, s in todo:
            pending[L][i].append(s)
        device = getattr(model, "device", torch.device("cpu"))
        calls = 0
        for L in lengths:
            ids = sorted(pending[L])
            bs = batch_size or _default_batch(L, torch.device(device).type, batch_tokens)
            for start in range(0, len(ids), bs):
                chunk = ids[start:start + bs]
                t0 = time.perf_counter()
                smp = {i: nt.sample(L, i, samples=samples, seed=seed) for i in chunk}
                packed = {}  # who -> (PackedPrompts, new tokens), shared by the strengths
                timing["generate_prompts_s"] += time.perf_counter() - t0
                for s in strengths:
                    who = [i for i in chunk if _skey(s) in pending[L][i]]
                    if not who:
                        continue
                    if stop_after is not None and calls >= stop_after:
                        raise _Stop
                    t0 = time.perf_counter()
                    if tuple(who) not in packed:
                        batch = [smp[i] for i in who]
                        packed[tuple(who)] = (
                            pack_prompts([sm.input_ids for sm in batch], model.cfg.vocab_size, device),
                            nt.max_new_tokens if decode == "budget" else nt.answer_tokens(batch))
                    prompts, n_new = packed[tuple(who)]
                    with torch.inference_mode(), strength_cm(model, s, layers=layers, heads=heads,
                                                             phase=phase,
                                                             allow_extrapolation=allow_extrapolation):
                        new = model.generate(prompts, n_new, eos_token_id=tok.eos_id, do_sample=False,
                                             cuda_graph=cuda_graph)
                    if torch.device(device).type == "cuda":
                        torch.cuda.synchronize()
                    dt = time.perf_counter() - t0
                    timing["model_s"] += dt
                    calls += 1
                    t0 = time.perf_counter()
                    rows = []
                    for i, raw in zip(who, new):
                        toks = list(raw)
                        if tok.eos_id is not None and tok.eos_id in toks:
                            toks = toks[:toks.index(tok.eos_id)]
                        pred = tok.decode(toks)
                        sm = smp[i]
                        rows.append({"task": nt.name, "length": L, "s": s, "sample_id": i,
                                     "correct": score(pred, sm.answer), "prediction": pred,
                                     "answer": sm.answer, "key": sm.key, "depth": sm.depth,
                                     "prompt_tokens": len(sm.input_ids), "new_tokens": len(toks),
                                     "prompt_sha": sm.sha, "seed": int(seed)})
                        n_prompt_tok += len(sm.input_ids)
                        n_new_tok += len(raw)
                    store.append(rows)
                    timing["write_s"] += time.perf_counter() - t0
                    if bar is not None:
                        bar.update(len(rows))
                        bar.set_postfix(L=L, s=f"{s:g}", tok_s=f"{n_prompt_tok / max(timing['model_s'], 1e-9):,.0f}")
        if bar is not None:
            bar.close()
    except _Stop:
        pass
    finally:
        t0 = time.perf_counter()
        rows = list(store.rows)
        summary = summarize(rows, ref_strength)
        write_summary(summary, store.dir)
        if summary:
            plot_summary(summary, store.dir, title=f"{nt.name}, seed {seed}"
                         + (f", {model_id}" if model_id else ""))
        timing["summary_s"] += time.perf_counter() - t0
        if not isinstance(out, ResultsStore):
            store.close()
    timing["total_s"] = time.perf_counter() - t_start
    timing["prompt_tokens"] = n_prompt_tok
    timing["new_tokens"] = n_new_tok
    timing["prefill_tokens_per_s"] = n_prompt_tok / timing["model_s"] if timing["model_s"] else 0.0
    run_sweep.last_timing = dict(timing)
    return summary


run_sweep.last_timing = {}


class _Stop(Exception):
    pass


def _check_strengths(strengths, *, arm, allow_extrapolation=True):
    """``qedprobe.lam.check_strengths`` (the rule ``strength`` applies), as a SweepError, before any work."""
    try:
        check_strengths(strengths, arm=arm, allow_extrapolation=allow_extrapolation)
    except ValueError as exc:
        raise SweepError(str(exc)) from None


def _check_arm(cfg, strengths):
    """A gdn2 model has lambda = 0: only s = 1 applies."""
    _check_strengths(strengths, arm=getattr(cfg, "arm", None))


def _validate(nt, lengths, strengths, samples, phase, allow_extrapolation, model):
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise SweepError(f"samples must be a positive integer, got {samples!r}")
    if not lengths or any(L < 1 for L in lengths) or len(set(lengths)) != len(lengths):
        raise SweepError(f"lengths must be distinct positive integers, got {lengths}")
    if not strengths or len({_skey(s) for s in strengths}) != len(strengths):
        raise SweepError(f"strengths must be distinct numbers, got {strengths}")
    if any(not math.isfinite(s) for s in strengths):
        raise SweepError("strengths must be finite")
    _check_strengths(strengths, arm=None, allow_extrapolation=allow_extrapolation)
    if phase not in ("all", "prefill", "decode"):
        raise SweepError(f"phase must be all, prefill or decode, got {phase!r}")
    need = nt.min_length()
    short = [L for L in lengths if L < need]
    if short:
        raise SweepError(f"lengths {short} are too short for {nt.name} with this tokenizer "
                         f"(need >= {need} tokens)")
    if model is not None:
        cfg = getattr(model, "cfg", None)
        _check_arm(cfg, strengths)
        vs = getattr(cfg, "vocab_size", None)
        if vs is not None and nt.tokenizer.vocab_size > vs:
            raise SweepError(f"tokenizer {nt.tokenizer.name!r} has {nt.tokenizer.vocab_size} ids but the "
                             f"model's vocabulary has {vs}: wrong --tokenizer for this model?")
