"""The ``qedprobe`` command: one sub-command per module, each exposing ``register(subparsers)``.

Every sub-command's ``--help`` shows the defaults (:class:`qedprobe.cliutil.HelpFormatter`), and
a negative list may follow its flag without ``=`` (``--strengths -1,0,1``).

Only the module of the sub-command named on the command line is imported (by name, through
:data:`COMMAND_MODULES`), and it holds only the parser: what the command runs (``X_run``,
importing torch, Triton and TransformerLens, which take seconds) is imported when it runs
(:func:`qedprobe.cliutil.runs`), so no ``--help`` and no usage error needs them. The other
sub-commands are listed with their one-line help (:data:`qedprobe.cliutil.COMMAND_HELP`).
"""
from __future__ import annotations

import argparse
import importlib
import sys

from qedprobe.cliutil import COMMAND_HELP, HelpFormatter, join_negative_values, one_line_warnings

COMMAND_MODULES = {"demo": "demo", "convert": "convert", "sweep": "evaluation", "report": "evaluation",
                   "eig": "evaluation", "lm-eval": "lmeval", "train": "train", "train-tokenizer": "tokenizer"}
"""Sub-command -> the module of ``qedprobe.cli`` whose ``register(subparsers)`` adds it."""


def build_parser(commands=None) -> argparse.ArgumentParser:
    """The parser with the full sub-parsers of ``commands`` (default: every sub-command; their
    modules are imported) and a one-line entry for each other sub-command."""
    parser = argparse.ArgumentParser(prog="qedprobe", description="Look inside QED linear-attention models and intervene on them.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    wanted = COMMAND_MODULES if commands is None else commands
    for module in dict.fromkeys(COMMAND_MODULES[c] for c in wanted):
        importlib.import_module(f"{__name__}.{module}").register(subparsers)
    for name, text in COMMAND_HELP.items():
        if name not in subparsers.choices:
            subparsers.add_parser(name, help=text)
    for sub in subparsers.choices.values():
        sub.formatter_class = HelpFormatter
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """The parsed command line (``sys.argv[1:]`` when ``argv`` is None), with only the named
    sub-command's module imported."""
    argv = join_negative_values(sys.argv[1:] if argv is None else argv)
    named = next((a for a in argv if not a.startswith("-")), None)
    return build_parser([named] if named in COMMAND_MODULES else []).parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with one_line_warnings(args.command):
        return args.func(args)
