"""``python -m qedprobe.train ...``: the ``qedprobe train`` command without the top-level CLI."""
import argparse
import sys

from .commands import register

parser = argparse.ArgumentParser(prog="python -m qedprobe.train")
register(parser.add_subparsers(dest="command", required=True))
args = parser.parse_args(["train", *sys.argv[1:]])
raise SystemExit(args.func(args))
