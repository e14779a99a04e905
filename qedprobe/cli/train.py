"""``qedprobe train``: train (or resume) one QED checkpoint from a preset plus overrides.

    qedprobe train --preset micro --arm full --out runs/micro-full --export checkpoints/micro-full
    qedprobe train --preset small --arm gdn2 --seed 1 --out runs/gdn2-s1 --export checkpoints/gdn2-s1

Running the same command again resumes from ``OUT/latest`` (the config must match).
On N GPUs: ``torchrun --nproc_per_node=N -m qedprobe.cli train ...`` (data parallel, the same
global batch ``batch_size x accum``; see :mod:`qedprobe.train.trainer`).
"""
from __future__ import annotations

import argparse
import shlex

from qedprobe.cliutil import COMMAND_HELP, PROGRESS_HELP, plain_text, runs
from qedprobe.constants import ARMS, MODES
from qedprobe.train.config import DEVICES, LOSSES, PRESETS, TrainConfig
from qedprobe.train.mixtures import MIXTURES

# CLI flag -> TrainConfig field (None values are not overrides)
FIELDS = {"arm": "arm", "seed": "seed", "seq_len": "seq_len", "batch_size": "batch_size",
          "accum": "accum", "steps": "steps", "lr": "lr", "theta_lr_mult": "theta_lr_mult", "warmup": "warmup_steps",
          "decay": "decay_steps", "min_lr_ratio": "min_lr_ratio", "weight_decay": "weight_decay",
          "clip": "clip", "loss": "loss", "key_weight": "key_weight", "mixture": "mixture",
          "tokenizer": "tokenizer", "save_every": "save_every", "device": "device", "init": "init",
          "theta_init": "theta_init"}
MODEL_FIELDS = {"hidden": "hidden_size", "layers": "num_hidden_layers", "heads": "num_heads",
                "head_dim": "head_dim", "conv_size": "conv_size", "lambda_max": "lambda_max", "op_mode": "op_mode",
                "decay_a": "decay_a_range", "decay_dt": "decay_dt_range"}


def _pair(text: str) -> tuple[float, float]:
    """``"0.5,2"`` -> ``(0.5, 2.0)``."""
    try:
        low, high = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected LOW,HIGH (two numbers), got {text!r}") from None
    return low, high


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """The preset with every given flag applied."""
    overrides = {f: getattr(args, a) for a, f in FIELDS.items() if getattr(args, a) is not None}
    model = {f: getattr(args, a) for a, f in MODEL_FIELDS.items() if getattr(args, a) is not None}
    if args.no_op_fallback:
        overrides["op_fallback"] = False
    return TrainConfig.from_preset(args.preset, model=model, **overrides)


def command_line(args: argparse.Namespace) -> str:
    """The ``qedprobe train`` command ``args`` stand for: the preset, every override given, the
    folders (not how it ran: threads, progress), for the model card."""
    parts = ["qedprobe", "train", "--preset", args.preset]
    for name in (*FIELDS, *MODEL_FIELDS):
        value = getattr(args, name)
        if value is not None:
            text = ",".join(f"{x:g}" for x in value) if isinstance(value, tuple) else str(value)
            parts += ["--" + name.replace("_", "-"), text]
    if args.no_op_fallback:
        parts.append("--no-op-fallback")
    parts += ["--out", args.out] + (["--export", args.export] if args.export is not None else [])
    return shlex.join(parts)


def register(subparsers) -> None:
    p = subparsers.add_parser("train", help=COMMAND_HELP["train"], description=plain_text(__doc__),
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="run folder (checkpoints, loss.jsonl, train.log)")
    p.add_argument("--export", default=None, help="where the final bf16 model + MODEL_CARD.md go (default OUT/final)")
    p.add_argument("--preset", choices=sorted(PRESETS), default="small",
                   help="micro: CPU, < 2 min; small: the GPU checkpoints (default: small)")
    p.add_argument("--arm", choices=ARMS, help="erase direction (README: the six arms)")
    p.add_argument("--seed", type=int, help="initialisation and data seed")
    p.add_argument("--init", help="start from this model folder's weights (same model config) instead of the seed's")
    g = p.add_argument_group("model (override the preset)")
    g.add_argument("--hidden", type=int, help="model width")
    g.add_argument("--layers", type=int, help="QED blocks")
    g.add_argument("--heads", type=int, help="recurrence heads per block")
    g.add_argument("--head-dim", type=int, help="key and value size per head")
    g.add_argument("--conv-size", type=int,
                   help="width of the causal short convolutions on q, k, v (default 4: tokens t-3..t)")
    g.add_argument("--lambda-max", type=float, help="lambda = lambda_max * sigmoid(theta) (default 0.25)")
    g.add_argument("--op-mode", choices=MODES, help="QED op the model calls (default auto)")
    g.add_argument("--decay-a", type=_pair, metavar="LOW,HIGH",
                   help="initial A range of the log-decay (default fla's 1,16)")
    g.add_argument("--decay-dt", type=_pair, metavar="LOW,HIGH",
                   help="initial dt range, log-uniform (default fla's 0.001,0.1)")
    g = p.add_argument_group("data and optimisation (override the preset)")
    g.add_argument("--mixture", choices=sorted(MIXTURES), help="training documents (docs/TRAINING.md)")
    g.add_argument("--loss", choices=LOSSES, help="all: every non-PAD token (default); answer: answer values only")
    g.add_argument("--key-weight", type=float,
                   help="loss weight of the key-dependent answer tokens (default 1: like every other)")
    g.add_argument("--tokenizer", help="'bytes' (default) or a tokenizer folder (qedprobe train-tokenizer); "
                                       "copied into the exported model folder")
    g.add_argument("--seq-len", type=int, help="tokens per training row")
    g.add_argument("--batch-size", type=int, help="rows per micro-batch")
    g.add_argument("--accum", type=int, help="micro-batches per step")
    g.add_argument("--steps", type=int, help="optimiser steps")
    g.add_argument("--lr", type=float, help="peak learning rate (theta gets --theta-lr-mult times it)")
    g.add_argument("--theta-lr-mult", type=float,
                   help="theta's learning rate as a multiple of --lr (default 10, the paper's; "
                        "0 holds lambda at its initial value)")
    g.add_argument("--theta-init", type=float,
                   help="start every head's theta here: lambda starts at lambda_max * sigmoid(THETA), "
                        "0 gives lambda_max / 2 (default -2, or the --init model's theta)")
    g.add_argument("--warmup", type=int, help="warmup steps")
    g.add_argument("--decay", type=int, help="decay steps at the end")
    g.add_argument("--min-lr-ratio", type=float, help="learning rate at the end of the decay, over --lr")
    g.add_argument("--weight-decay", type=float, help="AdamW weight decay")
    g.add_argument("--clip", type=float, help="gradient-norm clip")
    g.add_argument("--save-every", type=int, help="checkpoint every N steps")
    g = p.add_argument_group("running")
    g.add_argument("--device", choices=DEVICES, help="auto: CUDA when there is one, else the CPU")
    g.add_argument("--no-op-fallback", action="store_true",
                   help="stop (instead of using the slow PyTorch reference) when the op has no backward")
    g.add_argument("--threads", type=int, help="torch CPU threads")
    g.add_argument("--until-step", type=int, help="stop after this step (checkpointed; rerun to resume)")
    g.add_argument("--max-seconds", type=float, help="stop after this long (checkpointed; rerun to resume)")
    g.add_argument("--print-every", type=int, default=10, help="print a line of statistics every N steps (0: never)")
    g.add_argument("--no-progress", action="store_true", help=PROGRESS_HELP)
    _show_preset_defaults(p)
    runs(p, "qedprobe.cli.train_run:run")


def _show_preset_defaults(parser) -> None:
    """Each preset flag (default None: the preset decides) with its value in every preset added
    to its help, ``(default: micro 200, small 1500)``; a flag whose help states its default keeps it."""
    configs = {name: TrainConfig.from_preset(name) for name in sorted(PRESETS)}
    fields = {**FIELDS, **MODEL_FIELDS}
    for action in parser._actions:
        field = fields.get(action.dest)
        if field is None or action.default is not None or "default" in (action.help or ""):
            continue
        values = {name: getattr(cfg, field) if hasattr(cfg, field) else cfg.model.get(field)
                  for name, cfg in configs.items()}
        if None in values.values():
            continue
        shown = [f"{v:g}" if isinstance(v, float) else str(v) for v in values.values()]
        text = shown[0] if len(set(shown)) == 1 else ", ".join(f"{n} {v}" for n, v in zip(values, shown))
        action.help = f"{action.help} (default: {text})"
