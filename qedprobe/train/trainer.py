r"""The training loop: AdamW + WSD, bf16 autocast on CUDA, clipping, checkpoints, exact resume.

One optimizer step ``s`` (0-based) reads rows ``s*R .. s*R + R - 1`` of :class:`TrainData`
(``R = batch_size * accum``), splits them into ``accum`` micro-batches ``[batch_size, seq_len]``
and minimises the weighted mean next-token cross-entropy over the step's targets

    loss_s = sum_t w_t CE(logits_t, target_t) / sum_t w_t

(:func:`token_weights`: ``w_t`` is 1 on the targets of ``mask`` = non-PAD targets for
``loss="all"``, answer tokens for ``loss="answer"``, 0 elsewhere, and ``key_weight`` on the
key-dependent answer tokens, the few that say whether the asked key was matched; the
denominator is the whole step's, so accumulation gives the same gradient as one big batch).
Parameters stay float32 (master weights); on CUDA the forward runs under
``torch.autocast(dtype=bfloat16)``. Gradients are clipped to ``clip`` (global L2 norm), then
AdamW steps (:func:`make_optimizer`: ``theta`` at ``theta_lr_mult`` x the rate; weight decay on
matrices only) and the WSD schedule scales every group.

Files in ``out_dir``:

* ``loss.jsonl``: one JSON record per step, flushed when written (``step`` counts completed
  steps, ``loss``, ``answer_loss``, ``answer_acc`` (teacher-forced, per answer token),
  ``key_acc`` (the same on the key-dependent answer tokens: well above 1/needles only when the
  asked key is matched), ``lr``,
  ``theta_lr``, ``grad_norm``, ``lambda_mean``, ``tokens``, ``wall_s`` (cumulative), ``step_s`` (seconds since the previous record));
* ``train.log``: what happened (start, resume, warnings, checkpoints);
* ``train_config.json``, ``step-NNNNNN/`` and ``latest`` (see :mod:`qedprobe.train.state`);
* ``.lock``: held while a run trains, so a second run into the same folder is refused.

Resume: calling :func:`train` again on the same ``out_dir`` with the same config restores the
model, optimizer, scheduler, RNG states and data position (the step) from ``latest`` (or, with
that link removed, the newest complete ``step-NNNNNN``), drops log records past that step
(saying so in ``train.log``), and continues; the result is bit-identical to an uninterrupted run on
the same device and thread count.

Data parallel (``torchrun --nproc_per_node=N -m qedprobe.cli train ...``, or :func:`train` under
an initialised process group): the model is wrapped in ``DistributedDataParallel``, rank ``r``
reads its ``R/N`` rows of every step (``R`` must be a multiple of ``N``) and the loss is scaled
so that the averaged gradient is the one-process gradient of the same global batch (see
:func:`_step`); rank 0 writes the logs, checkpoints and the export. ``batch_size``, ``accum`` and
the data of a step do not depend on ``N``, so a run resumes with any number of ranks; the
numbers then agree with an uninterrupted run to float rounding (gradients are summed in
another order), not bit for bit.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from qedprobe import dist
from qedprobe.folderlock import lock_folder
from qedprobe.lam import param_groups
from qedprobe.model import QEDConfig, QEDModel

from .card import export
from .config import TrainConfig
from .data import TASK_FORMAT, TrainData
from .opcheck import backward_problem
from .runlog import LOG_NAME, note, read_log, truncate_log
from .schedule import WSD, wsd_scheduler
from .state import load_latest, load_model_weights, rng_state, save_checkpoint, set_rng_state

INIT_FREE = ("op_mode", "task_format")
"""Model-config keys that may differ from an ``init`` folder's: how the op runs and what the
earlier stage was trained on, not the model's shape or function."""
FALLBACK_OPS = ("torch", "naive")
"""Differentiable PyTorch ops tried, in order, when the configured op has no backward."""


@dataclass
class TrainResult:
    """What :func:`train` did: the last completed step, whether the run is complete, where the
    exported model is (None until complete), the final loss and cumulative wall time."""

    out_dir: Path
    step: int
    finished: bool
    export_dir: Path | None
    final_loss: float | None
    wall_s: float
    op_mode: str


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("train: `device` is 'cuda' but no CUDA device is available")
    return torch.device(name)


def build_model(cfg: TrainConfig, vocab_size: int) -> QEDModel:
    """The seeded initial model (``torch.manual_seed(cfg.seed)`` right before it is built), with
    the weights of the model folder ``cfg.init`` when given (a later training stage: its
    ``config.json`` must equal this run's model config but for :data:`INIT_FREE`); its config records
    the training documents' task format."""
    torch.manual_seed(cfg.seed)
    model = QEDModel(QEDConfig(vocab_size=vocab_size, arm=cfg.arm, task_format=TASK_FORMAT, **cfg.model))
    if cfg.init is not None:
        init = Path(cfg.init)
        if not (init / "config.json").is_file():
            raise ValueError(f"train: `init` {cfg.init!r} is not a model folder (no config.json)")
        want, have = model.cfg.to_dict(), QEDConfig.load(init / "config.json").to_dict()
        diffs = [f"{k}: {have.get(k)!r} != {want.get(k)!r}" for k in sorted(set(want) | set(have))
                 if k not in INIT_FREE and have.get(k) != want.get(k)]
        if diffs:
            raise ValueError(f"train: `init` {cfg.init} has another model config ({'; '.join(diffs)})")
        load_model_weights(model, init)
        model.float()
    return model


def make_optimizer(cfg: TrainConfig, model: QEDModel) -> torch.optim.AdamW:
    """AdamW over :func:`qedprobe.lam.param_groups` (``theta`` at ``theta_lr_mult`` x the rate, no
    weight decay), with the main group split: matrices (projections, convolutions, embedding)
    decay, vectors (norm weights, biases, ``A_log``, ``dt_bias``) do not, as fla exempts
    ``A_log`` and ``dt_bias``. Group names: ``main``, ``main_no_decay``, ``theta``."""
    groups = []
    for group in param_groups(model, cfg.lr, cfg.weight_decay, cfg.theta_lr_mult):
        if group["name"] == "main":
            vectors = [p for p in group["params"] if p.dim() < 2]
            groups.append({**group, "params": [p for p in group["params"] if p.dim() >= 2]})
            groups.append({**group, "params": vectors, "weight_decay": 0.0, "name": "main_no_decay"})
        else:
            groups.append(group)
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps)


def mean_lambda(model: QEDModel) -> float:
    """Mean trained ``lambda_h`` over layers and heads (0 for arm ``gdn2``)."""
    with torch.no_grad():
        return float(torch.stack([blk.attn.lam() for blk in model.blocks]).mean())


@contextlib.contextmanager
def op_mode(model: QEDModel, mode: str):
    """Temporarily set the op every mixer calls (the config is shared by all mixers)."""
    old, model.cfg.op_mode = model.cfg.op_mode, mode
    try:
        yield
    finally:
        model.cfg.op_mode = old


def _choose_op(cfg: TrainConfig, model: QEDModel, device: torch.device, dtype: torch.dtype, out_dir: Path) -> str:
    """The op mode to train with: the configured one if its backward works; otherwise, when
    ``op_fallback``, the first of ``FALLBACK_OPS`` that works (with a warning in ``train.log``);
    otherwise a ``RuntimeError`` that says why."""
    mode = model.cfg.op_mode
    problem = backward_problem(model.cfg, device, dtype, mode, cfg.seq_len)
    if problem is None:
        return mode
    if not cfg.op_fallback:
        raise RuntimeError(f"train: cannot train on {device}: {problem}. Allow the differentiable "
                           f"PyTorch ops {FALLBACK_OPS} with op_fallback (drop --no-op-fallback) or "
                           "train on CPU.")
    problems = [problem]
    for fallback in (m for m in FALLBACK_OPS if m != mode):
        found = backward_problem(model.cfg, device, dtype, fallback, cfg.seq_len)
        if found is None:
            note(out_dir, f"WARNING: {problem}. Training with the differentiable PyTorch op "
                           f"(mode {fallback!r}) instead; checkpoints keep op_mode {mode!r} in config.json.")
            return fallback
        problems.append(found)
    raise RuntimeError(f"train: cannot train on {device}: " + "; ".join(problems))


def _batches(data: TrainData, rows: int, start: int, stop: int, shard: tuple[int, int] = (0, 1)):
    """This rank's rows of steps ``start .. stop - 1``: rank ``r`` of ``N`` reads rows
    ``s*R + r*R/N .. s*R + (r+1)*R/N - 1`` of step ``s`` (``R = rows``), so the ranks together
    read the step's rows, each once. The next batch is built in a background thread while the
    current step runs (rows are pure functions of their index, so order is kept)."""
    rank, ranks = shard
    share = rows // ranks
    with ThreadPoolExecutor(max_workers=1) as pool:
        ahead = pool.submit(data.rows, start * rows + rank * share, share)
        for step in range(start, stop):
            batch = ahead.result()
            if step + 1 < stop:
                ahead = pool.submit(data.rows, (step + 1) * rows + rank * share, share)
            yield batch


def _all_sum(x: torch.Tensor) -> torch.Tensor:
    """``x`` summed over the ranks (``x`` itself in one process)."""
    if dist.world_size() > 1:
        x = x.clone()
        torch.distributed.all_reduce(x)
    return x


def token_weights(batch: dict, cfg: TrainConfig) -> torch.Tensor:
    """Per-target loss weights ``[rows, T]`` (float32): the mask of ``cfg.loss`` (non-PAD targets
    or answer tokens), with key-dependent answer tokens (``batch["key"]``) weighted ``key_weight``
    instead of 1."""
    mask = batch["valid"] if cfg.loss == "all" else batch["answer"]
    weights = mask.float()
    return torch.where(batch["key"] & mask, torch.full_like(weights, cfg.key_weight), weights)


def _step(model, batch, cfg: TrainConfig, device: torch.device, amp: bool) -> dict:
    """Forward/backward over this rank's micro-batches (``cfg.batch_size`` rows each); returns
    the step's statistics over all ranks.

    Each micro-batch backpropagates ``N * objective / total`` with ``total`` the summed weights
    (:func:`token_weights`) of the whole step on all ``N`` ranks: DistributedDataParallel averages
    the ranks' gradients, so the result is the gradient of ``loss_s`` over the global batch, as in
    one process. Gradients are synchronised on the last micro-batch only (``no_sync`` before it)."""
    ranks = dist.world_size()
    weights = token_weights(batch, cfg)
    total = _all_sum(weights.sum().to(device)).clamp(min=1e-12)
    sums = torch.zeros(4, device=device, dtype=torch.float64)
    starts = range(0, batch["input_ids"].shape[0], cfg.batch_size)
    for j, i in enumerate(starts):
        mb = {k: v[i:i + cfg.batch_size].to(device, non_blocking=True) for k, v in batch.items()}
        w = weights[i:i + cfg.batch_size].to(device, non_blocking=True)
        sync = j == len(starts) - 1 or not hasattr(model, "no_sync")
        with contextlib.nullcontext() if sync else model.no_sync():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                logits = model(mb["input_ids"])
            ce = F.cross_entropy(logits.float().flatten(0, 1), mb["targets"].flatten(),
                                 reduction="none").view_as(mb["targets"])
            objective = (ce * w).sum()
            (objective * ranks / total).backward()
        with torch.no_grad():
            hits = logits.argmax(-1) == mb["targets"]
            sums += torch.stack([objective, (ce * mb["answer"]).sum(), (hits & mb["answer"]).sum(),
                                 (hits & mb["key"]).sum()]).double()
    n_answer = _all_sum(batch["answer"].sum().to(device)).clamp(min=1).item()
    n_key = _all_sum(batch["key"].sum().to(device)).item()
    loss, answer_loss, answer_hits, key_hits = _all_sum(sums).tolist()
    return {"loss": loss / total.item(), "answer_loss": answer_loss / n_answer,
            "answer_acc": answer_hits / n_answer, "key_acc": key_hits / n_key if n_key else 0.0}


def train(cfg: TrainConfig, out_dir, *, export_dir=None, until_step: int | None = None,
          max_seconds: float | None = None, callback=None) -> TrainResult:
    """Train (or resume) the run ``cfg`` in ``out_dir``; see the module docstring.

    ``export_dir`` (default ``out_dir/final``) receives the bf16 model and its card when the
    run completes. ``until_step`` / ``max_seconds`` stop early (after a checkpoint) once that
    many steps are done / this call has run that long; call again to continue.
    ``callback(record)`` is called after every step.
    """
    if not isinstance(cfg, TrainConfig):
        raise ValueError(f"train: `cfg` must be a TrainConfig, got {type(cfg).__name__}")
    if until_step is not None and (isinstance(until_step, bool) or not isinstance(until_step, int) or until_step < 1):
        raise ValueError(f"train: `until_step` must be a positive int or None, got {until_step!r}")
    if max_seconds is not None and not max_seconds > 0:
        raise ValueError(f"train: `max_seconds` must be positive or None, got {max_seconds!r}")
    out_dir = Path(out_dir)
    export_dir = out_dir / "final" if export_dir is None else Path(export_dir)
    lock = lock_folder(out_dir) if dist.is_main() else None  # rank 0 holds the run's lock
    busy = dist.is_main() and lock is None
    dist.agree(ValueError(f"train: another training is writing into {out_dir}; wait for it or use a new "
                          "`out_dir`") if busy else None, kind=ValueError)
    try:
        return _train(cfg, out_dir, export_dir, until_step, max_seconds, callback)
    finally:
        if lock is not None:
            lock.close()


def _resume(cfg: TrainConfig, out_dir: Path, model, optimizer, scheduler, where: str) -> tuple[int, float]:
    """Load the latest checkpoint of ``out_dir`` into the model, optimizer, scheduler and RNGs
    (refusing one of another config); returns its step and wall seconds (0, 0.0 for a new run)."""
    found = load_latest(out_dir)
    if found is None:
        note(out_dir, f"new run: arm={cfg.arm} seed={cfg.seed} {where}")
        return 0, 0.0
    folder, state = found
    diffs = cfg.differences(TrainConfig.from_dict(state["train_config"]))
    if diffs:
        raise ValueError(f"train: {out_dir} holds a run with another config ({'; '.join(diffs)}); "
                         "use a new out_dir")
    load_model_weights(model, folder)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    note(out_dir, f"resumed from {folder.name} (step {state['step']})")
    return state["step"], state["wall_s"]


def _optimizer_step(model, optimizer, scheduler, clip: float) -> tuple[torch.Tensor, dict]:
    """Clip the gradient norm to ``clip``, step the optimizer and the schedule, clear the
    gradients; returns the norm before clipping and each parameter group's learning rate used."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    lrs = {g["name"]: g["lr"] for g in optimizer.param_groups}
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, lrs


def _stop_now(step: int, until_step, max_seconds, session_start: float) -> bool:
    """Whether this session ends after ``step``: ``until_step`` reached, or ``max_seconds`` spent
    on any rank (every rank stops together)."""
    if until_step is not None and step >= until_step:
        return True
    return max_seconds is not None and any(dist.gather_objects(time.perf_counter() - session_start >= max_seconds))


def _checkpoint(out_dir: Path, step: int, model, optimizer, scheduler, cfg: TrainConfig, wall: float,
                configured_op: str) -> None:
    """Checkpoint ``step``: rank 0 writes (the ranks hold the same weights and optimizer state; the
    folder's config.json keeps the configured op, not a fallback); every rank waits for it."""
    if dist.is_main():
        state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                 "rng": rng_state(), "wall_s": wall, "train_config": cfg.to_dict()}
        with op_mode(model, configured_op):
            folder = save_checkpoint(out_dir, step, model.save_pretrained, state)
        note(out_dir, f"checkpoint {folder.name}")
    dist.barrier()


def _train(cfg: TrainConfig, out_dir: Path, export_dir: Path, until_step, max_seconds, callback) -> TrainResult:
    """:func:`train` in the locked ``out_dir`` (created by rank 0's lock before every rank gets here)."""
    device = dist.rank_device(resolve_device(cfg.device))
    ranks = dist.world_size()
    if cfg.rows_per_step % ranks:
        raise ValueError(f"train: rows per step (batch_size x accum = {cfg.rows_per_step}) must be a "
                         f"multiple of the number of ranks ({ranks})")
    amp = device.type == "cuda"
    data = TrainData(cfg.seq_len, cfg.mixture, cfg.seed, cfg.tokenizer)
    model = build_model(cfg, data.tokenizer.vocab_size).to(device)
    optimizer = make_optimizer(cfg, model)
    scheduler = wsd_scheduler(optimizer, WSD(cfg.steps, cfg.warmup_steps, cfg.decay_steps, cfg.min_lr_ratio))
    start, wall = _resume(cfg, out_dir, model, optimizer, scheduler, f"device={device} ranks={ranks}")
    if dist.is_main():
        dropped = truncate_log(out_dir, start)
        if dropped:
            note(out_dir, f"dropped {dropped} loss.jsonl records past step {start} (the resume point)")
        cfg.save(out_dir / "train_config.json")
    configured_op = model.cfg.op_mode
    op_used = _choose_op(cfg, model, device, torch.bfloat16 if amp else torch.float32, out_dir)

    rows, session_start = cfg.rows_per_step, time.perf_counter()
    step = start
    net = model if ranks == 1 else torch.nn.parallel.DistributedDataParallel(
        model, device_ids=None if device.index is None or device.type != "cuda" else [device.index])
    log_path = out_dir / LOG_NAME if dist.is_main() else os.devnull
    with open(log_path, "a") as log, op_mode(model, op_used):
        model.train()
        t0 = time.perf_counter()
        for batch in _batches(data, rows, start, cfg.steps, (dist.rank(), ranks)):
            record = _step(net, batch, cfg, device, amp)
            if not all(map(math.isfinite, record.values())):
                raise RuntimeError(f"train: non-finite loss at step {step + 1}: {record}")
            grad_norm, lrs = _optimizer_step(model, optimizer, scheduler, cfg.clip)
            step += 1
            step_s, t0 = time.perf_counter() - t0, time.perf_counter()
            wall += step_s
            record = {"step": step, **record, "lr": lrs["main"], "theta_lr": lrs.get("theta"),
                      "grad_norm": float(grad_norm), "lambda_mean": mean_lambda(model),
                      "tokens": step * rows * cfg.seq_len, "wall_s": round(wall, 3), "step_s": round(step_s, 3)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            if callback is not None:
                callback(record)
            stop = _stop_now(step, until_step, max_seconds, session_start)
            if step % cfg.save_every == 0 or step == cfg.steps or stop:
                _checkpoint(out_dir, step, model, optimizer, scheduler, cfg, wall, configured_op)
            if stop and step < cfg.steps:
                note(out_dir, f"stopped at step {step} of {cfg.steps}; call again to resume")
                return TrainResult(out_dir, step, False, None, None, wall, op_used)
    final_loss = None
    if dist.is_main():
        final_loss = export(model, cfg, data, out_dir, export_dir, read_log(out_dir), device, op_used)
        note(out_dir, f"done: {step} steps, final loss {final_loss:.4f}; exported to {export_dir}")
    final_loss = dist.gather_objects(final_loss)[0]
    return TrainResult(out_dir, step, True, export_dir, final_loss, wall, op_used)
