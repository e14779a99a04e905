"""``qedprobe train-tokenizer``: a small byte-level BPE trained on a training mixture's text
(:mod:`qedprobe.train.bpe`)."""
from __future__ import annotations

from qedprobe.cliutil import COMMAND_HELP, HelpFormatter, plain_text, runs
from qedprobe.train import bpe
from qedprobe.train.bpe import MIN_VOCAB
from qedprobe.train.mixtures import MIXTURES


def register(subparsers) -> None:
    p = subparsers.add_parser("train-tokenizer", help=COMMAND_HELP["train-tokenizer"],
                              description=plain_text(bpe.__doc__), formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="folder for tokenizer.json and tokenizer_config.json")
    p.add_argument("--mixture", choices=sorted(MIXTURES), default="interference", help="mixture whose text it learns")
    p.add_argument("--vocab-size", type=int, default=2048, help=f"ids in all, >= {MIN_VOCAB}")
    p.add_argument("--seq-len", type=int, default=8192,
                   help="bytes per training-text row (long enough for the mixture's largest document)")
    p.add_argument("--rows", type=int, default=1000, help="rows of text to train on")
    p.add_argument("--seed", type=int, default=0, help="data seed of the text rows")
    runs(p, "qedprobe.cli.tokenizer_run:run")
