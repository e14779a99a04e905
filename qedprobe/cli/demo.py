"""``qedprobe demo``: the worked example and a probe table of a random QED layer per arm
(:mod:`qedprobe.demo`)."""
from __future__ import annotations

from qedprobe.cliutil import COMMAND_HELP, fail
from qedprobe.demo import probe_table, worked_example


def run(args) -> int:
    if args.tokens < 1:
        return fail("demo", f"--tokens must be >= 1, got {args.tokens}")
    print("\n".join(worked_example()))
    print()
    print("\n".join(probe_table(T=args.tokens, seed=args.seed)))
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help=COMMAND_HELP["demo"])
    p.add_argument("--tokens", type=int, default=256, help="tokens per sequence in the probe table")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs")
    p.set_defaults(func=run)
