r"""lm-eval tasks once per strength into a results folder (``qedprobe lm-eval``'s runner).

    from qedprobe.lmeval import QEDProbeLM
    from qedprobe.lmeval.run import load_tasks, run_lmeval
    lm = QEDProbeLM(pretrained="checkpoints/recall-full-s0", batch_size=16)
    tasks = load_tasks(["fda", "swde", "squad_completion"])
    summary = run_lmeval(lm, tasks, strengths=[-1, 0, 0.5, 1, 1.5, 2], out="runs/based")

The folder is a sweep folder (:mod:`qedprobe.eval.store`: ``config.json``, ``results.jsonl``
and per-rank shards, resumable; :mod:`qedprobe.eval.summary`: ``summary.csv/json`` with Wilson
intervals and the exact McNemar test of every strength against ``ref_strength`` on the
documents both have; :mod:`qedprobe.eval.plots`), so ``qedprobe report`` reads it. One row per
``(task, length, s, document)``:

* ``task``: lm-eval's task name (``name/filter`` for a task scored under several filters);
  ``length``: the document's ``max_length`` when the task has one (RULER: its metrics are keyed
  by length), else null; ``sample_id``: lm-eval's ``doc_id``.
* ``score``: the document's value of the task's metric (RULER: the one of its length, the share
  of the needles found; fda/swde/squad_completion: ``contains``; else the first metric the task
  reports, or ``metric``); ``correct``: ``score >= 1`` (the answer right: every needle found, the
  value contained, the choice taken); ``metrics``: every metric of the document.
* ``response`` / ``target``: the model's filtered answer and the reference, and lm-eval's
  ``doc_hash`` and ``prompt_hash``: every sample is logged.

Every strength sees the same documents (all, or :func:`select_docs`' first ``limit`` of each
task and length). The missing
rows are planned as chunks of ``batch_size`` documents of one task at one strength, each one
``lm_eval.evaluator.evaluate`` call on exactly those documents; under ``torch.distributed``
(torchrun) chunk ``j`` runs on rank ``j mod N`` (each rank with its own model replica and shard),
so the rows are those one process writes, and rank 0 writes the summary once every rank is done.
"""
from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from lm_eval.evaluator import evaluate
from lm_eval.tasks import TaskManager

from qedprobe import dist
from qedprobe.eval.plots import plot_summary
from qedprobe.eval.store import SweepError, open_store, strength_key
from qedprobe.eval.summary import summarize_folder
from qedprobe.lam import check_strengths

__all__ = ["LMEVAL_FORMAT", "FEWSHOT_SEED", "load_tasks", "task_manager", "check_grid", "select_docs",
           "lmeval_config", "Chunk", "plan_chunks", "run_chunk", "sample_rows", "run_lmeval"]

LMEVAL_FORMAT = "lm-eval"
"""The rows' ``format``: the task's own prompt and metric, as lm-eval defines them."""

FEWSHOT_SEED = 1234
"""The seed of few-shot example draws (lm-eval's ``simple_evaluate`` default)."""


def load_tasks(names, *, include_path=None, metadata: dict | None = None, num_fewshot: int | None = None) -> dict:
    """``{task name: lm-eval Task}`` for ``names`` (tasks, groups or tags; a group gives its
    tasks), from lm-eval's registry plus the yaml folder ``include_path``; ``metadata`` reaches
    the tasks as ``simple_evaluate`` passes it (RULER reads ``max_seq_lengths`` and
    ``tokenizer`` there). Few-shot counts as in ``simple_evaluate``: ``num_fewshot`` where the
    task does not fix 0, else the task's own, else 0."""
    manager = task_manager(names, include_path, metadata)
    unknown = [n for n in names if n not in manager.all_tasks]
    if unknown:
        raise SweepError(f"--tasks: unknown task(s) {', '.join(unknown)} (lm-eval's `lm_eval ls tasks` lists them; "
                         "--include-path adds a folder of task yamls)")
    tasks = dict(manager.load(list(names))["tasks"])
    for task in tasks.values():
        own = task.get_config("num_fewshot")
        if num_fewshot is not None and own != 0:
            task.set_config(key="num_fewshot", value=num_fewshot)
        elif own is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=FEWSHOT_SEED)
    return tasks


def task_manager(names, include_path, metadata) -> TaskManager:
    """lm-eval's ``TaskManager`` for ``names``: of ``include_path`` alone when it defines them all
    (indexing lm-eval's few thousand built-in yamls takes seconds), else of both."""
    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False, metadata=metadata)
        if all(n in local.all_tasks for n in names):
            return local
    return TaskManager(include_path=include_path, metadata=metadata)


def select_docs(task, limit: int | None) -> list[int]:
    """The documents every strength evaluates: all, or the first ``limit`` of each length (a RULER
    task's documents run through its lengths in order, ``max_length`` naming each one's) or of
    the task when its documents have no length."""
    if limit is None:
        return list(range(len(task.eval_docs)))
    taken, out = Counter(), []
    for i, doc in enumerate(task.eval_docs):
        length = doc.get("max_length") if isinstance(doc, dict) else None
        if taken[length] < limit:
            taken[length] += 1
            out.append(i)
    return out


def _task_record(task, docs: list[int]) -> dict:
    """What a folder records of a task: its version, few-shot count, document count and a hash of
    the first document's prompt, so a changed task definition is refused on resume."""
    first = next(iter(task.doc_iterator(limit=1)), None)
    prompt = "" if first is None else str(task.doc_to_text(first[1]))
    return {"version": task.VERSION, "num_fewshot": task.get_config("num_fewshot"), "docs": len(docs),
            "first_prompt_sha": hashlib.sha256(prompt.encode()).hexdigest()[:16]}


def lmeval_config(lm, tasks: dict, docs: dict, *, limit, strengths, ref_strength) -> dict:
    """``config.json`` of an lm-eval folder: the documents (``samples_spec``: per task its record
    and the count of ``docs[task]``, its :func:`select_docs`), the intervention (``layers``,
    ``heads``, ``phase``), the model (folder, config, dtype, the ``tokenizer`` argument (None: the
    model's own), injected ``qed_lambda``/``qed_arm``, the weights' SHA-256), the strengths and
    ``ref_strength``. A rerun must agree on all but the strengths (a moved model folder with the
    same weights resumes, as a sweep's)."""
    from qedprobe.eval.spec import model_fingerprint
    from qedprobe.model.checkpoint import state_dict_sha256
    a = lm.args
    return {
        "samples_spec": {"format": LMEVAL_FORMAT, "limit": limit,
                         "tasks": {name: _task_record(t, docs[name]) for name, t in sorted(tasks.items())}},
        "intervention": {"layers": None if a.layers is None else list(a.layers),
                         "heads": None if a.heads is None else list(a.heads), "phase": a.phase},
        "model": {"id": str(Path(a.pretrained).resolve()), "config": model_fingerprint(lm.model.cfg),
                  "dtype": str(next(lm.model.parameters()).dtype).replace("torch.", ""),
                  "tokenizer": a.tokenizer, "qed_lambda": a.qed_lambda,
                  "qed_arm": None if a.qed_lambda is None else a.qed_arm,
                  "weights": state_dict_sha256(lm.model)},
        "lengths": [], "strengths": [float(s) for s in strengths], "ref_strength": float(ref_strength),
    }


@dataclass(frozen=True)
class Chunk:
    """Documents ``doc_ids`` of task ``task`` at strength ``s``: one ``evaluate`` call."""

    s: float
    task: str
    doc_ids: tuple[int, ...]


def plan_chunks(docs: dict, strengths, done, chunk_docs: int) -> list[Chunk]:
    """The chunks that compute every ``(task, s, doc)`` of ``docs`` (task -> document ids) not in
    ``done``: per strength and task (sorted), the missing documents in runs of ``chunk_docs``.
    The plan depends only on what is missing, so every rank computes the same one."""
    out = []
    for s in strengths:
        for task in sorted(docs):
            missing = [i for i in docs[task] if (task, strength_key(s), i) not in done]
            out += [Chunk(float(s), task, tuple(missing[k:k + chunk_docs]))
                    for k in range(0, len(missing), chunk_docs)]
    return out


def _done_keys(store) -> set:
    """``(task, s, doc)`` of every row in the folder (the task without its ``/filter``)."""
    return {(task.split("/")[0], s, doc) for task, _length, s, doc in store.done}


def _score(task: str, sample: dict, metric: str | None) -> tuple[float, int | None]:
    """``(score, length)`` of one logged sample: RULER's metric of the document's length, else
    ``metric``, else the task's first metric; non-numeric metrics are refused by name."""
    doc, names = sample["doc"], list(sample["metrics"])
    length = doc.get("max_length") if isinstance(doc, dict) else None
    if isinstance(length, int) and str(length) in names:
        name = str(length)
    else:
        length, name = None, metric or ("contains" if "contains" in names else names[0])
    if name not in names:
        raise SweepError(f"--metric {name}: task {task} reports {', '.join(names)}")
    value = sample[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise SweepError(f"task {task}: metric {name} is {value!r} per document, not a number: qedprobe lm-eval "
                         "pairs documents by a per-document score (corpus-level metrics such as perplexity "
                         "need lm_eval itself)")
    return float(value), length


def sample_rows(task: str, s: float, samples: list[dict], metric: str | None = None) -> list[dict]:
    """One row per logged sample of ``evaluate`` (module docstring); a task scored under several
    filters gives one task ``name/filter`` per filter."""
    filters = {x["filter"] for x in samples}
    rows = []
    for x in samples:
        score, length = _score(task, x, metric)
        name = task if filters == {"none"} else f"{task}/{x['filter']}"
        resp = x["filtered_resps"][0] if len(x["filtered_resps"]) == 1 else x["filtered_resps"]
        rows.append({"task": name, "format": LMEVAL_FORMAT, "length": length, "s": float(s),
                     "sample_id": int(x["doc_id"]), "correct": score >= 1, "score": score,
                     "metrics": {m: x[m] for m in x["metrics"]}, "response": _jsonable(resp),
                     "target": _jsonable(x["target"]), "doc_hash": x["doc_hash"], "prompt_sha": x["prompt_hash"]})
    return rows


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return str(value)


def run_chunk(lm, tasks: dict, chunk: Chunk, metric: str | None = None) -> list[dict]:
    """The rows of one chunk: ``lm`` at strength ``chunk.s`` on those documents of the task."""
    lm.set_strength(chunk.s)
    task = tasks[chunk.task]
    out = evaluate(lm, {"tasks": {chunk.task: task}, "groups": {}}, samples={chunk.task: list(chunk.doc_ids)},
                   bootstrap_iters=0, log_samples=True)
    return sample_rows(chunk.task, chunk.s, out["samples"][chunk.task], metric)


def check_grid(strengths, ref_strength, limit, *, arm=None, allow_extrapolation=False) -> None:
    """The run's strengths (distinct, in range, allowed by the model's ``arm`` when given), the
    reference among them, and ``limit``; a ``SweepError`` naming the flag."""
    if not strengths or len({strength_key(s) for s in strengths}) != len(strengths):
        raise SweepError(f"--strengths must be distinct numbers, got {list(strengths)}")
    try:
        check_strengths(strengths, arm=arm, allow_extrapolation=allow_extrapolation)
    except ValueError as exc:
        raise SweepError(f"--strengths: {exc}") from None
    if strength_key(ref_strength) not in {strength_key(s) for s in strengths}:
        raise SweepError(f"--ref-strength {ref_strength:g} is not among --strengths: the paired tests need its rows")
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SweepError(f"--limit must be an integer >= 1, got {limit!r}")


def run_lmeval(lm, tasks: dict, *, strengths, out, ref_strength: float = 1.0, limit: int | None = None,
               metric: str | None = None, progress: bool = True, title: str | None = None) -> list[dict]:
    """Evaluate ``tasks`` (:func:`load_tasks`) with ``lm`` (a :class:`~qedprobe.lmeval.QEDProbeLM`)
    at every strength into the folder ``out`` (module docstring), resuming what is there; returns
    the summary rows (every shard's, on every rank)."""
    check_grid(strengths, ref_strength, limit, arm=lm.model.cfg.arm, allow_extrapolation=lm.args.allow_extrapolation)
    docs = {name: select_docs(t, limit) for name, t in tasks.items()}
    config = lmeval_config(lm, tasks, docs, limit=limit, strengths=strengths, ref_strength=ref_strength)
    store = open_store(out, config)
    try:
        chunks = plan_chunks(docs, strengths, _done_keys(store), lm.batch_size)
        mine = chunks[dist.rank()::dist.world_size()]
        for chunk in _progress(mine, progress):
            store.append(run_chunk(lm, tasks, chunk, metric))
    finally:
        store.close()
    lm.set_strength(lm.args.strength)
    summary = summarize_folder(out, ref_strength)
    if dist.is_main():
        plot_summary(summary, out, title=title)
    return summary


def _progress(chunks, enabled: bool):
    if not enabled or not chunks:
        return chunks
    from tqdm import tqdm
    return tqdm(chunks, desc=f"lm-eval rank {dist.rank()}" if dist.world_size() > 1 else "lm-eval", unit="chunk")
