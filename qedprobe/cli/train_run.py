"""``qedprobe train``: what it runs (:mod:`qedprobe.train.trainer`; the parser, and the config
the flags make, are :mod:`qedprobe.cli.train`)."""
from __future__ import annotations

import argparse
import sys

import torch
from tqdm.auto import tqdm

from qedprobe import dist
from qedprobe.cliutil import check_out_folder, fail
from qedprobe.train.config import TrainConfig
from qedprobe.train.trainer import resolve_device, train

from .train import FIELDS, MODEL_FIELDS, command_line, config_from_args

FLAGS = {**{field: "--" + flag.replace("_", "-") for flag, field in {**FIELDS, **MODEL_FIELDS}.items()},
         "out_dir": "--out", "export_dir": "--export", "until_step": "--until-step",
         "max_seconds": "--max-seconds", "op_fallback": "--no-op-fallback"}
"""Python argument / config field -> CLI flag, for error messages."""


def _progress(cfg: TrainConfig, every: int, enabled: bool):
    """The per-step callback: a tqdm bar over the steps (elapsed, ETA) and, every ``every``
    steps, one line of statistics; returns ``(callback, close)``."""
    bar = None

    def show(rec: dict) -> None:
        nonlocal bar
        if bar is None and enabled:
            bar = tqdm(total=cfg.steps, initial=rec["step"] - 1, unit="step", desc="train", dynamic_ncols=True)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.4f}", refresh=False)
        if every and (rec["step"] % every == 0 or rec["step"] == cfg.steps):
            tqdm.write(f"step {rec['step']:>6}/{cfg.steps}  loss {rec['loss']:.4f}  answer {rec['answer_loss']:.4f} "
                       f"(acc {rec['answer_acc']:.3f}, key {rec['key_acc']:.3f})  lr {rec['lr']:.2e}  "
                       f"|g| {rec['grad_norm']:.2f}  lambda {rec['lambda_mean']:.4f}  {rec['step_s']:.2f}s/step",
                       file=sys.stdout)

    def close() -> None:
        if bar is not None:
            bar.close()
    return show, close


def _check_preset_device(args, cfg) -> None:
    """A preset made for CUDA (``small``) on a machine without one, with no ``--device`` given:
    say that the preset chose the device, and what to pass instead."""
    if args.device is None and cfg.device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--preset {args.preset} trains on CUDA and no CUDA device is available: pass "
                         "--preset micro (made for the CPU) or --device cpu")


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    show = close = None
    try:
        cfg = config_from_args(args)
        _check_preset_device(args, cfg)
        dist.init_from_env(resolve_device(cfg.device))
        check_out_folder(args.out, "--out")
        if args.export is not None:
            check_out_folder(args.export, "--export")
        show, close = _progress(cfg, args.print_every if dist.is_main() else 0,
                                dist.is_main() and not args.no_progress)
        result = train(cfg, args.out, export_dir=args.export, until_step=args.until_step,
                       max_seconds=args.max_seconds, callback=show, command=command_line(args))
    except ValueError as err:
        return fail("train", err, FLAGS)
    finally:
        if close is not None:
            close()
    if not dist.is_main():
        return 0
    if result.finished:
        print(f"done: {result.step} steps, final loss {result.final_loss:.4f}, {result.wall_s:.1f} s; "
              f"model in {result.export_dir}")
    else:
        print(f"stopped at step {result.step}/{cfg.steps}; run the same command again to resume")
    return 0
