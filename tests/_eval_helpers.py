"""Tiny byte-vocabulary QED models for the eval tests (CPU token loop: keep inputs short).

Built with the shared ``tests/_tiny.py`` (distinct per-head lambda ~0.15-0.2) and a vocabulary
that holds the byte tokenizer's 259 ids.
"""
from _tiny import tiny

from qedprobe.tokenizer import ByteTokenizer


def tiny_model(arm="full", seed=0):
    return tiny(arm, seed, vocab_size=ByteTokenizer.vocab_size)


def saved_tiny_model(folder, arm="full", seed=0):
    tiny_model(arm, seed).save_pretrained(folder)
    return str(folder)
