"""The results folder of a sweep: ``config.json`` and append-only, resumable results shards.

Any runner that scores samples at strengths writes here (``qedprobe sweep``'s
:func:`qedprobe.eval.sweep.run_sweep`, and a runner of other benchmarks alike): a row is a dict
identified by :func:`row_key`, ``(task, length, s, sample_id)`` (``sample_id``: the sample's,
or a benchmark document's, index), with at least ``correct`` (bool) and, optionally, ``score``
(the share of the answers found), ``format`` and ``prompt_sha``. Downstream,
:mod:`qedprobe.eval.summary` reads the rows back into per-cell statistics and
:mod:`qedprobe.eval.plots` draws them.

Files in ``out``:

* ``config.json``: what defines the rows (for a sweep: :func:`qedprobe.eval.spec.sweep_config`);
  a later run into the same folder must agree on its ``fixed`` keys (``lengths`` and
  ``strengths`` may be added; the model's path may change when its weights hash does not: a
  moved checkpoint resumes, with a warning, and the new path is recorded). It is written with
  the first row, so a run that fails before any work leaves no config behind.
* ``results.jsonl``: one row per :func:`row_key`, appended and fsync'ed batch by batch. A rerun
  skips the rows already there; a torn last line (a kill during a write) is cut off, with a
  warning, and its row recomputed, so no row is lost or duplicated. Any other broken line is refused with its
  ``file:line`` (never cut off with the good rows after it).
* ``results.rank{r}.jsonl``: the same for rank ``r > 0`` of a run under torchrun (rank 0 writes
  ``results.jsonl``). Readers take the union of all shards, so a folder resumes with any number
  of ranks; a killed rank loses only the rows it had not appended.
"""
from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

from qedprobe import dist
from qedprobe.folderlock import lock_folder

from .arguments import SweepError

__all__ = ["SweepError", "strength_key", "row_key", "shard_path", "shard_paths", "read_shard", "unique_rows",
           "ResultsStore", "load_results", "open_store"]


def strength_key(s) -> float:
    """A strength as rows, cells and comparisons key it: ``float(s)`` rounded to 6 decimals, so
    ``1``, ``1.0`` and ``1.0000001`` are one strength."""
    return round(float(s), 6)


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


def row_key(row) -> tuple:
    """What identifies a row in a folder: ``(task, length, s, sample_id)``, with ``s`` as
    :func:`strength_key` keys it (a row written without a ``task`` has task ``""``)."""
    return row.get("task", ""), row["length"], strength_key(row["s"]), row["sample_id"]


def read_shard(path: Path, repair: bool) -> list[dict]:
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
                row_key(row)
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
                raise SweepError(f"{path}:{lineno}: not a result row ({type(exc).__name__}: {exc}); "
                                 "repair or delete that line (the other rows are kept)") from None
            rows.append(row)
    if repair and pos < len(data):
        warnings.warn(f"{path}: its last line was incomplete (a run was stopped while writing it): "
                      f"cut off, and that row is computed again; the {len(rows)} complete rows are kept",
                      stacklevel=3)
        with open(path, "r+b") as fh:
            fh.truncate(pos)
    return rows


def unique_rows(rows) -> list[dict]:
    """The first row of every :func:`row_key`."""
    seen, out = set(), []
    for r in rows:
        if (key := row_key(r)) not in seen:
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
            own = read_shard(self.path, repair=True)
            others = [r for p in shard_paths(self.dir) if p != self.path for r in read_shard(p, repair=False)]
        except SweepError:
            self.close()
            raise
        self.rows = unique_rows(own + others)
        self.done = {row_key(r) for r in self.rows}
        self._fh = None  # config.json and the shard are written at the first append

    def done_in(self, task: str) -> set[tuple]:
        """The ``(length, s, sample_id)`` of every row of ``task`` in the folder (all shards)."""
        return {key[1:] for key in self.done if key[0] == task}

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
        self.done.update(row_key(r) for r in rows)
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
    return unique_rows(r for p in paths for r in read_shard(p, repair=False))


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
