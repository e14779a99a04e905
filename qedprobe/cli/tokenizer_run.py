"""``qedprobe train-tokenizer``: what it runs (:mod:`qedprobe.train.bpe`; the parser is
:mod:`qedprobe.cli.tokenizer`)."""
from __future__ import annotations

import argparse

from qedprobe.cliutil import check_out_folder, fail
from qedprobe.tokenizer import load_tokenizer
from qedprobe.train.bpe import train_tokenizer

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
