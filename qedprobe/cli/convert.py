"""``qedprobe convert``: an fla-style GDN-2 checkpoint into a qedprobe model
(:mod:`qedprobe.model.convert`)."""
from __future__ import annotations

from qedprobe.cliutil import COMMAND_HELP, runs
from qedprobe.constants import ARMS, LAMBDA_MAX, THETA_INIT


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
    runs(p, "qedprobe.cli.convert_run:run")
