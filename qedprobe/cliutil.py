"""What every ``qedprobe`` sub-command shares: help that shows defaults, one-line errors in
the CLI's own words, output-folder checks, and negative number lists as option values."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import os
import re
import sys
import warnings
from pathlib import Path

__all__ = ["COMMAND_HELP", "HelpFormatter", "fail", "cli_words", "check_out_folder", "join_negative_values",
           "one_line_warnings", "plain_text", "runs"]

COMMAND_HELP = {
    "demo": "worked example + probe table of a random QED layer per arm",
    "convert": "convert an fla-style GDN-2 model checkpoint into a qedprobe model",
    "sweep": "NIAH accuracy vs inference-time strength s (resumable)",
    "report": "several sweeps side by side, with paired tests",
    "eig": "streaming histograms of e_t, rho_t, ||S^T d||, sigma_max(M_t)",
    "lm-eval": "lm-evaluation-harness tasks vs inference-time strength s (resumable)",
    "train": "train or resume a small QED checkpoint (NIAH mixtures)",
    "train-tokenizer": "train a small byte-level BPE on a training mixture's text",
}
"""Every sub-command's one-line help, in ``qedprobe --help`` order: ``qedprobe --help`` lists them
without importing the modules that define them (torch, TransformerLens)."""

PROGRESS_HELP = "no progress bar (the default draws one on stderr)"


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """``(default: X)`` after every option whose default is a value (not None, not a flag's
    False, not already stated in the help); descriptions keep their line breaks."""

    def _get_help_string(self, action):
        text = action.help or ""
        shown = action.option_strings and not (action.default is None or action.default is False
                                                or action.default == argparse.SUPPRESS)
        if shown and "default" not in text.lower():
            text += " (default: %(default)s)"
        return text


def runs(parser: argparse.ArgumentParser, target: str) -> None:
    """Make ``target`` (``"module:function"``, ``function(args) -> int``) the sub-command's
    ``func``, imported only when the command runs. A sub-command's parser module imports no torch,
    Triton or TransformerLens (seconds), so its ``--help`` and its usage errors need none; the
    run module imports what the work needs."""
    module, function = target.split(":")

    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    parser.set_defaults(func=run)


def plain_text(doc: str) -> str:
    """A docstring as ``--help`` text: reST literals and roles (````x````, ``:mod:`x```) as plain ``x``."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", doc).replace("``", "")


def cli_words(message, flags: dict) -> str:
    """``message`` with Python argument names (```name``` or ``name=True``) replaced by their
    CLI flags; ``flags`` maps argument name -> flag (``{"allow_extrapolation": "--allow-extrapolation"}``)."""
    text = str(message)
    for name, flag in flags.items():
        text = text.replace(f"{name}=True", flag).replace(f"`{name}`", flag)
    return text


def fail(cmd: str, message, flags: dict | None = None) -> int:
    """Print ``qedprobe CMD: error: MESSAGE`` (in CLI words, without a leading ``CMD: ``) to
    stderr; returns the exit status 2."""
    text = cli_words(message, flags or {}).removeprefix(f"{cmd}: ")
    print(f"qedprobe {cmd}: error: {text}", file=sys.stderr)
    return 2


@contextlib.contextmanager
def one_line_warnings(cmd: str):
    """Inside the block every warning prints as one line ``qedprobe CMD: warning: MESSAGE`` on
    stderr (not Python's ``file:line: Category`` and the source line)."""
    def show(message, category, filename, lineno, file=None, line=None):
        print(f"qedprobe {cmd}: warning: {message}", file=sys.stderr)
    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def check_out_folder(path, flag="--out") -> None:
    """Refuse (``ValueError``) an output folder that exists as something else, or that cannot
    be created or written: its nearest existing ancestor is not a writable folder."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag} {str(path)!r} exists and is not a folder")
    base = next(a for a in (p.absolute(), *p.absolute().parents) if a.exists())
    if not base.is_dir():
        raise ValueError(f"{flag} {str(path)!r}: {str(base)!r} is not a folder")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {str(path)!r}: {str(base)!r} is not writable")


_NEGATIVE_LIST = re.compile(r"^-\d[\d.eE+-]*(,\s*-?[\d.eE+-]+)+$")


def join_negative_values(argv) -> list[str]:
    """``["--strengths", "-1,0,1"]`` -> ``["--strengths=-1,0,1"]``: argparse takes a value that
    starts with ``-`` and is not a plain number for an option, so a negative list needs ``=``."""
    out = []
    for token in argv:
        if out and out[-1].startswith("--") and "=" not in out[-1] and _NEGATIVE_LIST.match(token):
            out[-1] = f"{out[-1]}={token}"
        else:
            out.append(token)
    return out
