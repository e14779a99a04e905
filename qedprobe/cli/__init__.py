"""The ``qedprobe`` command: one sub-command per module, each exposing ``register(subparsers)``.

Every sub-command's ``--help`` shows the defaults (:class:`qedprobe.cliutil.HelpFormatter`), and
a negative list may follow its flag without ``=`` (``--strengths -1,0,1``).
"""
from __future__ import annotations

import argparse
import sys

from qedprobe.cliutil import HelpFormatter, join_negative_values

from . import convert, demo, evaluation, lmeval, tokenizer, train

COMMAND_MODULES = (demo, convert, evaluation, lmeval, train, tokenizer)
"""The modules whose ``register(subparsers)`` adds their sub-commands, in ``--help`` order."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qedprobe", description="Look inside QED linear-attention models and intervene on them.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMAND_MODULES:
        module.register(subparsers)
    for sub in subparsers.choices.values():
        sub.formatter_class = HelpFormatter
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed command line (``sys.argv[1:]`` when ``argv`` is None)."""
    return build_parser().parse_args(join_negative_values(sys.argv[1:] if argv is None else argv))


def main(argv=None) -> int:
    args = parse_args(argv)
    return args.func(args)

