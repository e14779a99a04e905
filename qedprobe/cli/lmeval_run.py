"""Sub-command ``lm-eval`` of the ``qedprobe`` CLI, what it runs (:mod:`qedprobe.lmeval.run`):
lm-evaluation-harness tasks once per strength into a sweep folder (needs lm-eval: ``pip install
-e ".[lmeval]"``; nothing else of the CLI imports it). The parser is :mod:`qedprobe.cli.lmeval`.

The flags and the ``--model-args`` are checked before any task or weight is loaded; errors are
one line ``qedprobe lm-eval: error: ...`` naming the flag or model argument, exit status 2.
"""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from qedprobe import dist
from qedprobe.cliutil import check_out_folder, fail
from qedprobe.eval.spec import parse_float_list
from qedprobe.eval.store import SweepError

from .evaluation_run import set_threads, summary_table

__all__ = ["run_lmeval_cmd"]

FLAGS = {"strengths": "--strengths", "limit": "--limit", "s": "--strengths"}
"""Python argument -> CLI flag, for error messages."""


SHARED_FLAGS = {"device": "--device", "dtype": "--dtype", "batch_size": "--batch-size"}
"""Model arguments that also have a flag (as ``qedprobe sweep`` has them)."""


def _model_args(args) -> dict:
    """``--model-args`` parsed as lm-eval parses ``--model_args``, with ``--device``, ``--dtype``
    and ``--batch-size`` added; ``strength`` and an argument given both ways are refused."""
    from lm_eval.utils import simple_parse_args_string
    margs = simple_parse_args_string(args.model_args)
    if "strength" in margs:
        raise SweepError("--model-args strength: the strengths come from --strengths")
    for name, flag in SHARED_FLAGS.items():
        value = getattr(args, name)
        if value is not None and name in margs:
            raise SweepError(f"{flag} and --model-args {name} both given: pass one")
        if value is not None:
            margs[name] = value
    return margs


def _metadata(text) -> dict:
    if text is None:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SweepError(f"--metadata is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise SweepError(f"--metadata must be a JSON object, got {text!r}")
    return value


def _checked(args):
    """Everything that needs neither tasks nor weights: ``(model args, strengths, tasks, metadata)``."""
    from qedprobe.lmeval.load import parse_model_args, resolve_device
    from qedprobe.lmeval.run import check_grid
    set_threads(args)
    margs = _model_args(args)
    checked = parse_model_args(**margs)
    strengths = parse_float_list(args.strengths, "--strengths")
    check_grid(strengths, args.ref_strength, args.limit, allow_extrapolation=checked.allow_extrapolation)
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise SweepError("--tasks: empty")
    if args.include_path is not None and not Path(args.include_path).is_dir():
        raise SweepError(f"--include-path {args.include_path!r} is not a folder")
    if args.num_fewshot is not None and args.num_fewshot < 0:
        raise SweepError(f"--num-fewshot must be >= 0, got {args.num_fewshot}")
    try:
        check_out_folder(args.out)
    except ValueError as exc:
        raise SweepError(str(exc)) from None
    device = resolve_device(margs.get("device"))
    dist.init_from_env(device)
    margs["device"] = str(dist.rank_device(device))
    return margs, strengths, tasks, _metadata(args.metadata)


def run_lmeval_cmd(args) -> int:
    if importlib.util.find_spec("lm_eval") is None:
        return fail("lm-eval", "lm-eval is not installed: pip install -e \".[lmeval]\" (lm-eval >= 0.4.13)")
    from qedprobe.lmeval import ModelArgsError, QEDProbeLM, RequestError
    from qedprobe.lmeval.run import load_tasks, run_lmeval
    try:
        margs, strengths, names, metadata = _checked(args)
        tasks = load_tasks(names, include_path=args.include_path, metadata={**margs, **metadata},
                           num_fewshot=args.num_fewshot)
        lm = QEDProbeLM(**margs)
        title = f"{Path(lm.args.pretrained).name} (arm {lm.model.cfg.arm}), lm-eval"
        summary = run_lmeval(lm, tasks, strengths=strengths, out=args.out, ref_strength=args.ref_strength,
                             limit=args.limit, metric=args.metric, progress=not args.no_progress, title=title)
    except (SweepError, ModelArgsError, RequestError) as exc:
        return fail("lm-eval", str(exc).replace("qedprobe model_args: ", "--model-args "), FLAGS)
    if dist.is_main():
        print(summary_table(summary, by_task=True))
        print(f"wrote {Path(args.out) / 'summary.csv'} ({len(summary)} cells)")
    return 0
