"""Sub-commands ``sweep``, ``report`` and ``eig`` of the ``qedprobe`` CLI: what they run
(:mod:`qedprobe.eval`; the parsers are :mod:`qedprobe.cli.evaluation`).

Each ``run_x_cmd(args) -> int``. Every check that needs no model (task, lengths, strengths,
tokenizer, output path, the model folder's ``config.json``) runs before the weights are loaded;
a sweep folder's own ``config.json`` is compared after, as it records the weights' hash. Errors
are printed as one line ``qedprobe <cmd>: error: ...`` with exit status 2.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import torch

from qedprobe import dist
from qedprobe.cliutil import check_out_folder, fail
from qedprobe.eval import sweep
from qedprobe.eval.eig import run_eig, task_batches, text_batches
from qedprobe.eval.plots import task_label
from qedprobe.eval.report import build_report
from qedprobe.eval.spec import (SweepSpec, check_eval_seed, check_model, check_strengths_for, check_tokenizer_fits,
                                parse_float_list, parse_int_list, sweep_config)
from qedprobe.eval.store import SweepError, open_store
from qedprobe.hf.folder import folder_config, is_transformers_folder, load_folder
from qedprobe.hf.inject import injected_config
from qedprobe.model import QEDConfig, QEDModel
from qedprobe.model.checkpoint import CONFIG_NAME, WEIGHTS_NAME, check_recurrence, state_dict_sha256
from qedprobe.tasks import ForeignKeyTask, make_task
from qedprobe.tokenizer import TokenizerError, load_tokenizer

__all__ = ["run_sweep_cmd", "run_report_cmd", "run_eig_cmd", "summary_table", "eig_table", "tokenizer_spec",
           "set_threads"]


def _idx_list(text, name):
    if text is None:
        return None
    return parse_int_list(text, name)


_TASK_FLAGS = {"allow_extrapolation": "--allow-extrapolation", "lam": "--qed-lambda", "seed": "--seed", "max_new_tokens": "--max-new-tokens",
               "haystack_file": "--haystack-file", "num_needles": "--num-needles", "haystack": "--haystack",
               "chat_template": "--chat-template"}
FLAGS = {"sweep": {**_TASK_FLAGS, "s": "--strengths", "samples": "--samples", "lengths": "--lengths",
                   "strengths": "--strengths", "batch_size": "--batch-size", "batch_tokens": "--batch-tokens"}, "eig": {**_TASK_FLAGS, "s": "--strength"},
         "report": {"baseline": "--baseline", "labels": "--labels", "s": "--s"}}
"""Per command: Python argument -> CLI flag, for error messages."""


def _fail(cmd, msg) -> int:
    return fail(cmd, msg, FLAGS[cmd])


def _device_dtype(args):
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise SweepError(f"--device {device!r}: {exc}") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise SweepError("--device cuda requested but CUDA is not available")
    name = args.dtype
    if name == "auto":
        name = "bfloat16" if dev.type == "cuda" else "float32"
    return dev, getattr(torch, name)


def _is_transformers(args) -> bool:
    return is_transformers_folder(args.model)


def tokenizer_spec(args) -> str:
    """``--tokenizer`` as given; when not given, the ``--model`` folder if it is a transformers
    folder or holds a ``tokenizer.json`` (``qedprobe train --tokenizer`` ships it there), else
    ``"bytes"``."""
    if args.tokenizer is not None:
        return args.tokenizer
    own = _is_transformers(args) or (Path(args.model) / "tokenizer.json").is_file()
    return args.model if own else "bytes"


def _check_chat_template(args) -> None:
    """``--chat-template`` wraps task prompts of the ruler format: refused with ``--format
    legacy`` and with ``eig --text``."""
    if not args.chat_template:
        return
    if args.format != "ruler":
        raise SweepError(f"--chat-template applies to --format ruler, got --format {args.format}")
    if getattr(args, "text", None) is not None:
        raise SweepError("--chat-template applies to task prompts (--task), not to --text")


def set_threads(args) -> None:
    """``--threads`` -> ``torch.set_num_threads`` (before any work)."""
    if args.threads is None:
        return
    if args.threads < 1:
        raise SweepError(f"--threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)


def _rank_device_dtype(args):
    """:func:`_device_dtype`, with the process group started under torchrun and a CUDA device
    per rank (``qedprobe.dist``); ``--threads`` applied."""
    set_threads(args)
    dev, dtype = _device_dtype(args)
    dist.init_from_env(dev)
    return dist.rank_device(dev), dtype


def _model_config(path, args):
    p = Path(path)
    if not p.is_dir():
        raise SweepError(f"--model {path!r} is not a folder")
    if args.qed_lambda is not None and not _is_transformers(args):
        raise SweepError("--qed-lambda applies to a transformers --model folder; a QEDModel has its own lambda")
    try:
        cfg = folder_config(p) if _is_transformers(args) else _qed_config(p)
    except (FileNotFoundError, ValueError, TypeError) as exc:
        raise SweepError(f"--model {path!r}: {exc}") from None
    if args.qed_lambda is None:
        return cfg
    try:
        return injected_config(cfg, args.qed_lambda, args.qed_arm, allow_extrapolation=args.allow_extrapolation)
    except ValueError as exc:  # inject_qed's words -> the flags' (FLAGS: `lam` is --qed-lambda)
        raise SweepError(str(exc).removeprefix("inject_qed: ")) from None


def _qed_config(folder: Path) -> QEDConfig:
    """A QEDModel folder's config, checked against the recurrence its weights record (a header
    read, no tensor): a config that does not describe the weights is reported before any check
    of the flags against it."""
    cfg = QEDConfig.load(folder / CONFIG_NAME)
    if (folder / WEIGHTS_NAME).is_file():
        check_recurrence(cfg, folder / WEIGHTS_NAME)
    return cfg


def _check_out(path) -> None:
    try:
        check_out_folder(path)
    except ValueError as exc:
        raise SweepError(str(exc)) from None


def _load_model(path, dev, dtype, args):
    try:
        if _is_transformers(args):
            return load_folder(path, dtype=dtype, device=dev, qed_lambda=args.qed_lambda, qed_arm=args.qed_arm,
                               allow_extrapolation=args.allow_extrapolation)
        model = QEDModel.from_pretrained(path, dtype=dtype, device=dev)
    except Exception as exc:  # noqa: BLE001 - report any loading failure as one line
        raise SweepError(f"cannot load the model from {path!r}: {type(exc).__name__}: {exc}") from None
    return model.eval()


def run_sweep_cmd(args) -> int:
    store, kept = None, 0
    try:
        spec, cfg = _sweep_spec(args)
        dev, dtype = _rank_device_dtype(args)
        _check_out(args.out)
        model = _load_model(args.model, dev, dtype, args)  # the folder's config records the weights' hash
        config = sweep_config(spec, model_id=spec.model_id, model_cfg=cfg, dtype=str(dtype).replace("torch.", ""),
                              weights=state_dict_sha256(model))
        store = open_store(args.out, config)
        kept = len(store.rows)
        try:
            result = sweep.run_sweep(model, spec, out=store)
        finally:
            store.close()
    except SweepError as exc:
        return _fail("sweep", exc)
    except KeyboardInterrupt:  # Ctrl-C: the rows written so far are complete and kept
        return _interrupted(args.out, store, kept)
    if dist.is_main():
        _print_sweep(result, spec, cfg.arm, args.out, computed=len(store.rows) - kept, reused=kept)
    return 0


def _interrupted(out, store, kept: int) -> int:
    """One line on a Ctrl-C: what the folder keeps and that a rerun resumes; exit status 130."""
    if store is None:
        print("qedprobe sweep: interrupted before any row was computed; nothing was written", file=sys.stderr)
    else:
        print(f"qedprobe sweep: interrupted; {out} keeps {len(store.rows)} rows ({len(store.rows) - kept} from "
              "this run): run the same command again to resume from there", file=sys.stderr)
    return 130


def _print_sweep(result, spec, arm, out, computed: int, reused: int) -> None:
    """What the sweep was (model, task settings, prompts per cell), its table, and what ran: the
    model time, or that every row was already there."""
    print(sweep.sweep_title(spec, spec.model_id, arm))
    print(summary_table(result.summary))
    cells = f"wrote {Path(out) / 'summary.csv'} ({len(result.summary)} cells)"
    if computed == 0:
        print(f"{cells}; reused the {reused} rows already in {out}: nothing to compute")
        return
    timing = result.timing
    ranks = f" (rank 0 of {dist.world_size()})" if dist.world_size() > 1 else ""
    print(f"{cells}; {computed} rows computed, model time {timing['model_s']:.1f} s{ranks}, "
          f"{timing['prefill_tokens_per_s']:,.0f} prompt tokens/s, "
          f"{'fast path (' + result.fast_path + ')' if result.fast_path else 'plain path'}")


def _sweep_spec(args) -> tuple[SweepSpec, object]:
    """The sweep the flags describe, checked against the ``--model`` folder's config (no weights
    read), and that config."""
    if args.control is not None and (args.task != "mk-niah" or args.format != "legacy"):
        raise SweepError(f"--control {args.control} needs --format legacy --task mk-niah, "
                         f"got --format {args.format} --task {args.task}")
    _check_chat_template(args)
    spec = SweepSpec(task=_sweep_task(args), lengths=parse_int_list(args.lengths, "--lengths"),
                     strengths=parse_float_list(args.strengths, "--strengths"), samples=args.samples,
                     seed=args.seed, layers=_idx_list(args.layers, "--layers"), heads=_idx_list(args.heads, "--heads"),
                     phase=args.phase, allow_extrapolation=args.allow_extrapolation, ref_strength=args.ref_strength,
                     batch_size=args.batch_size, batch_tokens=args.batch_tokens,
                     cuda_graph=not (args.eager or args.eager_decode), fast_path=False if args.eager else None,
                     model_id=str(Path(args.model).resolve()), progress=not args.no_progress)
    if round(args.ref_strength, 6) not in {round(s, 6) for s in spec.strengths}:
        raise SweepError(f"--ref-strength {args.ref_strength:g} is not among --strengths {args.strengths}: "
                         "the paired tests need its rows (list it; rows already in --out are not recomputed)")
    cfg = _model_config(args.model, args)
    if getattr(cfg, "task_format", None) not in (None, args.format):
        print(f"qedprobe sweep: note: the model was trained on the {cfg.task_format} format, "
              f"this sweep uses --format {args.format}", file=sys.stderr)
    try:
        check_model(spec, cfg)
    except SweepError as exc:
        hint = ("pass --qed-lambda (and --qed-arm) to inject QED into this transformers model, or "
                "--strengths=1") if _is_transformers(args) else "pass --strengths=1"
        raise SweepError(f"{exc}; {hint}" if cfg.arm == "gdn2" and "gdn2" in str(exc) else exc) from None
    return spec, cfg


def _sweep_task(args):
    """The task generator of ``--task`` in ``--format`` (or its ``--control``)."""
    task_kw = dict(haystack_file=args.haystack_file, num_needles=args.num_needles,
                   max_new_tokens=args.max_new_tokens, haystack=args.haystack)
    try:
        if args.control:
            return ForeignKeyTask(args.task, tokenizer_spec(args), **task_kw)
        return make_task(args.task, tokenizer_spec(args), format=args.format, chat_template=args.chat_template,
                         **task_kw)
    except OSError as exc:  # the haystack file is the one file read here
        where = "" if args.haystack_file is None else f"--haystack-file {args.haystack_file!r}: "
        raise SweepError(f"{where}{exc.strerror or exc}") from None
    except (TokenizerError, ValueError) as exc:
        raise SweepError(str(exc)) from None


def summary_table(summary, *, by_task: bool = False) -> str:
    """The summary rows as a markdown table: accuracy, Wilson 95% interval, RULER's score (percent;
    only when a row is in RULER's format), McNemar vs the reference s (its own row says ``ref``),
    and a legend of ``b`` / ``c``. ``by_task``: a first column naming each row's task and the mean
    score as ``score %`` (an lm-eval folder, whose tasks have their own scores; a task without
    lengths shows ``-``)."""
    score = "score %" if by_task else "RULER score %" if any(r.get("format") == "ruler" for r in summary) else None
    cols = ["task"] * by_task + ["length", "s", "n", "accuracy", "95% CI"] + [score] * bool(score) + ["b", "c", "McNemar p"]
    lines = ["| " + " | ".join(cols) + " |", "|---" * len(cols) + "|"]
    for r in summary:
        cells = ([r["task"]] if by_task else []) + ["-" if r["length"] is None else r["length"], f"{r['s']:g}", r["n"],
                 f"{r['accuracy']:.3f}", f"{r['ci_low']:.3f}-{r['ci_high']:.3f}"]
        cells += [f"{r['score_pct']:.2f}"] * bool(score) + _paired_cells(r)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    ref = next((r["ref_s"] for r in summary if r.get("ref_s") is not None), None)
    if ref is not None:
        lines.append(f"b: prompts right at s and wrong at the reference s = {ref:g}; c: wrong at s and right "
                     "at the reference (the same prompts); McNemar p: exact two-sided test of b against c")
    return "\n".join(lines)


def _paired_cells(row) -> list[str]:
    """The ``b``, ``c`` and McNemar cells of a summary row: ``ref`` on the reference strength's
    own row, ``-`` where no paired test ran."""
    if row.get("ref_s") is not None and row["s"] == row["ref_s"]:
        return ["ref", "ref", "ref"]
    if row["mcnemar_p"] is None:
        return ["-", "-", "-"]
    return [str(row["b"]), str(row["c"]), f"{row['mcnemar_p']:.3g}"]


def run_report_cmd(args) -> int:
    try:
        labels = None if args.labels is None else [x.strip() for x in args.labels.split(",")]
        base = int(args.baseline) if str(args.baseline).isdigit() else args.baseline
        if args.out is not None:
            _check_out(args.out)
        md = build_report(args.sweeps, labels=labels, s=args.s, baseline=base, out=args.out,
                          title=args.title, warn=lambda m: print(f"qedprobe report: warning: {m}", file=sys.stderr))
    except (SweepError, json.JSONDecodeError, IndexError) as exc:
        return _fail("report", exc)
    except OSError as exc:  # reading a sweep folder or writing into --out
        writing = args.out is not None and str(exc.filename or "").startswith(str(args.out))
        return _fail("report", f"{'--out ' if writing else ''}{exc.filename!r}: {exc.strerror or exc}")
    print(md)
    return 0


def run_eig_cmd(args) -> int:
    try:
        layers, heads = _idx_list(args.layers, "--layers"), _idx_list(args.heads, "--heads")
        if args.samples < 1 or args.batch_size < 1 or args.length < 2:
            raise SweepError("--samples, --batch-size must be >= 1 and --length >= 2")
        check_eval_seed(args.seed)
        dev, dtype = _rank_device_dtype(args)
        shard = (dist.rank(), dist.world_size())
        tok, batches, label = _eig_inputs(args, shard)
        cfg = _model_config(args.model, args)
        check_strengths_for([args.strength], arm=cfg.arm, allow_extrapolation=args.allow_extrapolation)
        check_tokenizer_fits(tok, cfg.vocab_size)
        _check_out(args.out)  # created only once there is something to write
        model = _load_model(args.model, dev, dtype, args)
        total = len(range(0, args.samples, args.batch_size)[shard[0]::shard[1]])
        acc = run_eig(model, batches, s=args.strength, layers=layers, heads=heads,
                      allow_extrapolation=args.allow_extrapolation, progress=not args.no_progress,
                      total=total)
        acc.meta.update({"model": str(Path(args.model).resolve()), "task": args.task, "task_label": label,
                         "format": args.format,
                         "chat_template": args.chat_template, "text": args.text, "length": args.length,
                         "samples": args.samples, "qed_lambda": args.qed_lambda,
                         "qed_arm": None if args.qed_lambda is None else args.qed_arm})
        if not dist.is_main():
            return 0
        paths = acc.save(Path(args.out))
    except SweepError as exc:
        return _fail("eig", exc)
    except ValueError as exc:  # e.g. strength out of range
        return _fail("eig", exc)
    print(eig_table(acc.summary()))
    print(f"eig: {acc.tokens} tokens per head; wrote " + ", ".join(p.name for p in paths))
    return 0


def _eig_inputs(args, shard):
    """``(tokenizer, batches, label)`` of ``eig``'s inputs: ``--text`` or the task's prompts
    (``label``: the task with its settings, :func:`qedprobe.eval.plots.task_label`; None for text)."""
    try:
        _check_chat_template(args)
        tok = load_tokenizer(tokenizer_spec(args))
        if args.text is not None:
            if not Path(args.text).is_file():
                raise SweepError(f"--text {args.text!r} is not a file")
            return tok, text_batches(args.text, tok, length=args.length, samples=args.samples,
                                     batch_size=args.batch_size, shard=shard), None
        nt = make_task(args.task or "s-niah-1", tok, format=args.format, chat_template=args.chat_template)
        if args.length < nt.min_length():
            raise SweepError(f"--length {args.length} is too short for {nt.name} (need >= {nt.min_length()})")
        return tok, task_batches(nt, length=args.length, samples=args.samples, seed=args.seed,
                                 batch_size=args.batch_size, shard=shard), task_label(nt)
    except (TokenizerError, ValueError, OSError) as exc:
        raise SweepError(str(exc)) from None


def eig_table(summary: dict) -> str:
    """Per layer (over its heads) as a markdown table: the erase eigenvalue ``e_t`` (min, mean,
    max; token-heads outside ``(0, 1)``), the largest ``sigma_max(M_t)`` and the mean size of
    QED's output correction ``|lambda rho_t| scale ||S_bar_t^T d_t||`` (``corr``)."""
    lines = ["| layer | e min | e mean | e max | token-heads with e outside (0, 1) | sigma_max max | corr mean |",
             "|---|---|---|---|---|---|---|"]
    for layer in summary["layers"]:
        heads = layer["heads"]
        n = sum(h["n"] for h in heads)

        def mean(name):
            return sum(h[name]["mean"] * h["n"] for h in heads) / n if n else math.nan
        lines.append(f"| {layer['layer']} | {min(h['e']['min'] for h in heads):.4f} | {mean('e'):.4f} | "
                     f"{max(h['e']['max'] for h in heads):.4f} | {sum(h['e_out01'] for h in heads)} of {n} | "
                     f"{max(h['sigma']['max'] for h in heads):.4f} | {mean('corr'):.3g} |")
    return "\n".join(lines)
