"""``qedprobe demo``: what it runs (:mod:`qedprobe.demo`; the parser is :mod:`qedprobe.cli.demo`)."""
from __future__ import annotations

from qedprobe.cliutil import fail
from qedprobe.demo import probe_table, worked_example


def run(args) -> int:
    if args.tokens < 1:
        return fail("demo", f"--tokens must be >= 1, got {args.tokens}")
    print("\n".join(worked_example()))
    print()
    print("\n".join(probe_table(T=args.tokens, seed=args.seed)))
    return 0
