"""``qedprobe demo``: the worked example and a probe table of a random QED layer per arm
(:mod:`qedprobe.demo`)."""
from __future__ import annotations

from qedprobe.cliutil import COMMAND_HELP, runs


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help=COMMAND_HELP["demo"])
    p.add_argument("--tokens", type=int, default=256, help="tokens per sequence in the probe table")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    runs(p, "qedprobe.cli.demo_run:run")
