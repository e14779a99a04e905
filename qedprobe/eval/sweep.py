"""The strength sweep's runner: a spec and a model in, rows in a results folder out.

    from qedprobe.eval import SweepSpec, run_sweep
    spec = SweepSpec(task="s-niah-1", lengths=[1024, 2048], strengths=[-1, 0, 0.5, 1, 1.5, 2],
                     samples=500, seed=0)
    result = run_sweep(model, spec, out="runs/a")
    result.summary, result.timing

The CLI ``qedprobe sweep`` calls the same function. The pipeline, one module a step:
:mod:`qedprobe.eval.spec` (what the sweep is, validated once) -> this runner (the missing rows,
:mod:`qedprobe.eval.plan`, in packed batches, one generate call per strength, each call's rows
appended as they come) -> :mod:`qedprobe.eval.store` (the folder: ``config.json``, resumable
``results.jsonl`` shards) -> :mod:`qedprobe.eval.summary` (``summary.csv`` / ``summary.json``:
accuracy, Wilson interval, RULER's score, paired exact McNemar) -> :mod:`qedprobe.eval.plots`
(``acc_vs_strength.png``; ``acc_vs_length.png`` with two lengths or more) and :mod:`qedprobe.eval.report` (several
folders side by side).

A folder never mixes rows decoded to different budgets (``config.json`` key ``decode``, only with
``decode="answer"``) or computed from different weights (the weights' SHA-256).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._dynamo.exc import TorchDynamoException
from tqdm.auto import tqdm

from qedprobe import dist
from qedprobe.model import LambdaScale, QEDModel, fast_path
from qedprobe.model.checkpoint import state_dict_sha256
from qedprobe.model.fast import has_fast_path
from qedprobe.model.packing import pack_prompts
from qedprobe.tasks import answer_fraction

from .plan import SweepBatch, default_batch_size, memory_batch_tokens, plan_batches, still_missing
from .plots import plot_summary, plot_title
from .spec import SweepSpec, check_model, sweep_config
from .store import ResultsStore, SweepError, open_store, strength_key
from .summary import summarize_folder

__all__ = ["run_sweep", "SweepResult", "run_batches", "run_batch", "rows_from_outputs", "generate_at",
           "sweep_fast_path", "sweep_title", "compile_failure", "Timings"]


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
    cuda = torch.cuda.is_available()
    dev = dist.rank_device("cuda") if cuda else torch.device("cpu")
    loaded = QEDModel.from_pretrained(model, dtype=torch.bfloat16 if cuda else torch.float32, device=dev)
    return loaded.eval(), model_id or str(Path(model).resolve())


def run_sweep(model, spec: SweepSpec, out) -> SweepResult:
    """Run (or resume) the sweep ``spec`` into ``out``; returns a :class:`SweepResult`.

    ``model``: a :class:`qedprobe.model.QEDModel` (on its device, in eval mode), a transformers
    model adapted by ``qedprobe.hf``, or a folder written by ``save_pretrained`` (loaded on CUDA in
    bfloat16 when available, else CPU float32). ``out``: a folder, or a
    :class:`qedprobe.eval.store.ResultsStore` the caller opened (and closes) with a
    :func:`qedprobe.eval.spec.sweep_config` that holds the weights hash.

    Each batch of prompts is packed once and run at every strength. The fast path's rows equal the
    plain path's up to float rounding (``qedprobe.model.fast``), so a folder keeps rows of either;
    when the default fast path fails to compile (:func:`compile_failure`), the sweep warns and
    runs the rest on the plain path; an explicitly requested one raises. With
    ``spec.time_limit``, a batch is not started when the last one's time would take it past the
    limit; the rows written stay, ``SweepResult.missing`` counts the others and a rerun resumes.

    Under an initialised ``torch.distributed`` process group of N ranks (``torchrun``), every
    rank calls ``run_sweep`` with the same spec and its own model replica: the missing rows are
    planned into the same batches as in one process, batch ``j`` runs on rank ``j mod N`` and
    appends to that rank's shard; the summary is written by rank 0 once all ranks are done and
    returned on every rank.
    """
    t_start = time.perf_counter()
    model, model_id = _resolve_model(model, spec.model_id)
    check_model(spec, getattr(model, "cfg", None))
    if isinstance(out, ResultsStore) and not out.config.get("model", {}).get("weights"):
        raise SweepError("the ResultsStore passed as `out` records no weights hash: open it with "
                         "sweep_config(..., weights=state_dict_sha256(model))")
    store = out if isinstance(out, ResultsStore) else open_store(out, _folder_config(model, model_id, spec))
    try:
        _check_decode_rule(store, spec)
        backend, timings = _run_missing(model, spec, store, t_start)
    finally:
        if not isinstance(out, ResultsStore):
            store.close()
    with timings.time("summary_s"):
        summary = summarize_folder(store.dir, spec.ref_strength)
        if dist.is_main() and summary:
            plot_summary(summary, store.dir, title=sweep_title(spec, model_id, model.cfg.arm))
    grid = {strength_key(x) for x in spec.strengths}
    done = sum(r["n"] for r in summary if r["length"] in spec.lengths and r["s"] in grid)
    return SweepResult(summary, _finish_timings(timings, t_start), fast_path=backend,
                       missing=len(spec.lengths) * len(spec.strengths) * spec.samples - done)


def sweep_title(spec: SweepSpec, model_id, arm) -> str:
    """What a sweep's figures and tables restate: model, arm, task with its settings, prompts
    per cell, seed, and where the strength acts (:func:`qedprobe.eval.plots.plot_title`)."""
    return plot_title(model_id, arm, spec.task, spec.seed, spec.layers, spec.heads, spec.phase, spec.samples)


def _folder_config(model, model_id, spec: SweepSpec) -> dict:
    """The ``config.json`` of a folder that ``run_sweep`` opens itself (the weights hashed here)."""
    return sweep_config(spec, model_id=model_id, model_cfg=getattr(model, "cfg", None), dtype=_model_dtype(model),
                        weights=state_dict_sha256(model))


def _check_decode_rule(store: ResultsStore, spec: SweepSpec) -> None:
    """A folder's rows were all decoded by one rule: refuse another."""
    want = sweep_config(spec, model_id=None, model_cfg=None, dtype=None, weights=None).get("decode")
    if store.config.get("decode") != want:
        raise SweepError(f"{str(store.dir)!r} was decoded with {store.config.get('decode')}, "
                         f"this run asks {want}: use a new --out")


def _run_missing(model, spec: SweepSpec, store: ResultsStore, t_start: float):
    """Plan the rows missing from ``store``, run this rank's batches (on the fast path when it
    applies, the rest on the plain path if its default compile fails); returns the backend that
    ran (None: plain) and the timings."""
    device_type = torch.device(getattr(model, "device", "cpu")).type
    batch_tokens = spec.batch_tokens
    if batch_tokens is None and spec.batch_size is None and device_type == "cuda":
        batch_tokens = memory_batch_tokens(model)
    batches = plan_batches(store.done_in(spec.task.name), spec.lengths, spec.strengths, spec.samples,
                           lambda L: spec.batch_size or default_batch_size(L, device_type, batch_tokens))
    backend = sweep_fast_path(model, spec.fast_path)
    run = functools.partial(run_batches, model, spec, store,
                            deadline=None if spec.time_limit is None else t_start + spec.time_limit)
    mine = batches[dist.rank()::dist.world_size()]
    try:
        with _path_block(model, backend):
            return backend, run(mine)
    except Exception as err:  # noqa: BLE001 - only a failed compile of the default fast path is retried
        if spec.fast_path is not None or backend is None or not compile_failure(err):
            raise
        warnings.warn(f"run_sweep: the fast path did not compile ({type(err).__name__}: {err}); the rest of "
                      "the sweep runs the plain path (pass fast_path=False, --eager, to skip the attempt)",
                      RuntimeWarning, stacklevel=3)
        return None, run(still_missing(mine, store.done_in(spec.task.name)))


def _model_dtype(model):
    try:
        return str(next(model.parameters()).dtype).replace("torch.", "")
    except (AttributeError, StopIteration):
        return None


def run_batches(model, spec: SweepSpec, store: ResultsStore, batches, *, deadline=None) -> Timings:
    """Run ``batches`` of ``spec`` (:func:`run_batch` each), appending every generate call's rows
    to ``store`` as they come; returns the time per phase and the token counts. With ``deadline``
    (a ``time.perf_counter()`` value) a batch starts only if the previous batch's time fits
    before it."""
    timings = Timings()
    bar = _progress(batches, spec.task.name) if spec.progress else None
    last = 0.0
    for batch in batches:
        started = time.perf_counter()
        if deadline is not None and started + last > deadline:
            break
        for rows in run_batch(model, spec, batch, timings):
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
    return tqdm(total=total, unit="row", desc=f"sweep {name}", dynamic_ncols=True,
                disable=not dist.is_main())


def _finish_timings(timings: Timings, t_start: float) -> dict:
    out = {"generate_prompts_s": 0.0, "model_s": 0.0, "write_s": 0.0, "prompt_tokens": 0, "new_tokens": 0,
           **timings, "total_s": time.perf_counter() - t_start}
    out["prefill_tokens_per_s"] = out["prompt_tokens"] / out["model_s"] if out["model_s"] else 0.0
    return out


def sweep_fast_path(model, fast_path) -> str | None:
    """The ``torch.compile`` backend a sweep runs the model's fast path with
    (:func:`qedprobe.model.fast_path`), or None for the plain path. ``fast_path``: None (default)
    is ``"inductor"`` for a model with a fast path (a ``QEDModel``) on CUDA and the plain path
    otherwise; False the plain path; True ``"inductor"``; a string that backend."""
    if fast_path is None:
        on_cuda = torch.device(getattr(model, "device", "cpu")).type == "cuda"
        fast_path = on_cuda and has_fast_path(model)
    if fast_path is False:
        return None
    if not has_fast_path(model):
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
    return isinstance(err, TorchDynamoException)


def _path_block(model, backend):
    """The block a sweep's batches run in: the fast path with ``backend``, or nothing (plain)."""
    if backend is None:
        return contextlib.nullcontext()
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


def generate_at(model, prompts, n_new: int, s: float, spec: SweepSpec, eos_id):
    """Greedy continuations ``[B][n_new]`` of packed ``prompts`` with lambda scaled by ``s`` where
    ``spec`` says (``layers``, ``heads``, ``phase``)."""
    scale = LambdaScale.select(model, s, layers=spec.layers, heads=spec.heads, phase=spec.phase,
                               allow_extrapolation=spec.allow_extrapolation)
    with torch.inference_mode():
        return model.generate(prompts, n_new, eos_token_id=eos_id, do_sample=False, return_type="new_tokens",
                              cuda_graph=spec.cuda_graph, lambda_scale=scale)


def rows_from_outputs(nt, length: int, s: float, samples: dict, outputs, seed: int) -> list[dict]:
    """One result row per ``(sample_id -> Sample)`` of ``samples`` of task ``nt`` and its generated ids
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


def run_batch(model, spec: SweepSpec, batch: SweepBatch, timings: Timings):
    """Yield the rows of each strength of ``batch`` (one generate call each); the prompts are
    built and packed once per set of ids and shared by the strengths."""
    nt, device = spec.task, getattr(model, "device", torch.device("cpu"))
    with timings.time("generate_prompts_s"):
        smp = {i: nt.sample(batch.length, i, samples=spec.samples, seed=spec.seed) for i in batch.sample_ids}
    packed = {}  # ids -> (PackedPrompts, new tokens)
    for s, who in batch.todo:
        with timings.time("model_s", device):
            if tuple(who) not in packed:
                prompts = [smp[i] for i in who]
                packed[tuple(who)] = (
                    pack_prompts([sm.input_ids for sm in prompts], model.cfg.vocab_size, device),
                    nt.max_new_tokens if spec.decode == "budget" else nt.answer_tokens(prompts))
            new = generate_at(model, *packed[tuple(who)], s, spec, nt.tokenizer.eos_id)
        timings.add("new_tokens", sum(len(raw) for raw in new))
        rows = rows_from_outputs(nt, batch.length, s, {i: smp[i] for i in who}, new, spec.seed)
        timings.add("prompt_tokens", sum(r["prompt_tokens"] for r in rows))
        yield rows
