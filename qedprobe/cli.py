"""The ``qedprobe`` command: one sub-command per module, each exposing ``register(subparsers)``."""
from __future__ import annotations

import argparse
import importlib

COMMAND_MODULES = ("qedprobe.demo", "qedprobe.model.convert", "qedprobe.eval.commands", "qedprobe.train.commands")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qedprobe", description="Look inside QED linear-attention models and intervene on them.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
