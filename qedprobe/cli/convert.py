"""``qedprobe convert``: an fla-style GDN-2 checkpoint into a qedprobe model
(:mod:`qedprobe.model.convert`)."""
from __future__ import annotations

from pathlib import Path

from qedprobe.cliutil import COMMAND_HELP, check_out_folder, fail
from qedprobe.kernels.qed import ARMS
from qedprobe.lam import LAMBDA_MAX, THETA_INIT
from qedprobe.model.convert import convert, read_checkpoint

FLAGS = {"theta": "--theta", "lambda_max": "--lambda-max", "rand_seed": "--rand-seed", "arm": "--arm"}
"""Python argument -> CLI flag, for error messages."""


def run(args) -> int:
    try:
        check_out_folder(args.output, "output")
        tensors, fla_config = read_checkpoint(Path(args.input))
        model = convert(tensors, fla_config, arm=args.arm, theta=args.theta, lambda_max=args.lambda_max,
                        rand_seed=args.rand_seed)
        model.save_pretrained(args.output)
    except (ValueError, OSError) as err:
        return fail("convert", err, FLAGS)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"converted {args.input} -> {args.output}: arm={model.cfg.arm}, "
          f"{model.cfg.num_hidden_layers} layers x {model.cfg.num_heads} heads, {n_params:,} parameters")
    return 0


def register(subparsers) -> None:
    """Add the ``convert`` sub-command."""
    p = subparsers.add_parser("convert", help=COMMAND_HELP["convert"],
                              description="Turn an fla-style GDN-2 model checkpoint into a qedprobe model.")
    p.add_argument("input", help="fla checkpoint: a directory (model.safetensors[.index.json] or "
                                 "pytorch_model.bin, optional config.json) or a single weights file")
    p.add_argument("output", help="output directory (config.json + model.safetensors)")
    p.add_argument("--arm", choices=ARMS, default="gdn2", help="arm of the converted model (default gdn2)")
    p.add_argument("--theta", type=float, default=THETA_INIT,
                   help=f"initial theta of every head for QED arms (default {THETA_INIT})")
    p.add_argument("--lambda-max", type=float, default=LAMBDA_MAX, help=f"lambda_max (default {LAMBDA_MAX})")
    p.add_argument("--rand-seed", type=int, default=0, help="seed of the rand arm's directions")
    p.set_defaults(func=run)
