"""``qedprobe convert``: what it runs (:mod:`qedprobe.model.convert`; the parser is
:mod:`qedprobe.cli.convert`)."""
from __future__ import annotations

from pathlib import Path

from qedprobe.cliutil import check_out_folder, fail
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
