"""``qedprobe train-tokenizer``: a small byte-level BPE trained on a training mixture's text
(:mod:`qedprobe.train.bpe`)."""
from __future__ import annotations

import argparse

from qedprobe.cliutil import COMMAND_HELP, HelpFormatter, check_out_folder, fail, plain_text
from qedprobe.tokenizer import load_tokenizer
from qedprobe.train import bpe
from qedprobe.train.bpe import MIN_VOCAB, train_tokenizer
from qedprobe.train.data import MIXTURES

FLAGS = {"vocab_size": "--vocab-size", "rows": "--rows", "seq_len": "--seq-len", "seed": "--seed",
         "mixture": "--mixture"}
"""Python argument -> CLI flag, for error messages."""


def run(args: argparse.Namespace) -> int:
    try:
        check_out_folder(args.out, "--out")
        out = train_tokenizer(args.out, mixture=args.mixture, vocab_size=args.vocab_size,
                              seq_len=args.seq_len, rows=args.rows, seed=args.seed)
    except ValueError as err:
        return fail("train-tokenizer", err, FLAGS)
    tok = load_tokenizer(str(out))
    print(f"tokenizer with {tok.vocab_size} ids (BOS {tok.bos_id}, EOS {tok.eos_id}, PAD {tok.pad_id}) in {out}")
    return 0


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
    p.set_defaults(func=run)
