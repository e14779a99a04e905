r"""``qedprobe train-tokenizer``: a small byte-level BPE fitted to a training mixture's own text.

Bytes make every key and haystack word several tokens long, so a small model has to match keys
byte by byte. A BPE vocabulary trained on the mixture's documents turns the key words, the
question and the haystack sentences into a few tokens each, while digits stay one token each
(values are copied digit by digit, and the first digit is the one that depends on the asked key).

The tokenizer (``tokenizers`` library): pre-tokenization splits every digit off
(``Digits(individual_digits=True)``), then GPT-2 byte-level pieces (``ByteLevel``, no prefix
space); the model is BPE over the 256 byte symbols plus merges, and the special tokens
``<s>`` (BOS, id 0), ``</s>`` (EOS, id 1), ``<pad>`` (PAD, id 2). Every string round-trips.
The training text is the documents of :class:`qedprobe.train.data.TrainData` rows built with
the byte tokenizer (so they are sized in bytes), split at EOS.

Files written to the output folder: ``tokenizer.json`` and ``tokenizer_config.json`` (read by
:class:`qedprobe.tokenizer.HFTokenizer`, and by ``transformers.AutoTokenizer``). ``qedprobe
train --tokenizer FOLDER`` trains with it and copies both files into the exported model folder,
where ``qedprobe sweep`` and ``qedprobe eig`` find them.

    qedprobe train-tokenizer --mixture interference --vocab-size 2048 --out runs/tok-interference
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL = ("<s>", "</s>", "<pad>")
"""BOS, EOS, PAD: ids 0, 1, 2 of every tokenizer trained here."""
FILES = ("tokenizer.json", "tokenizer_config.json")
"""The files of a trained tokenizer (copied beside an exported model)."""
MIN_VOCAB = 256 + len(SPECIAL)


def mixture_texts(mixture: str, seq_len: int, rows: int, seed: int = 0) -> list[str]:
    """The documents of rows ``0 .. rows - 1`` of ``TrainData(seq_len, mixture, seed, "bytes")``
    as text (one string per document; BOS/EOS/PAD dropped)."""
    from .data import TrainData  # torch: imported here, so `qedprobe train-tokenizer --help` needs none
    data = TrainData(seq_len, mixture, seed, "bytes")
    tok = data.tokenizer
    texts = []
    for r in range(rows):
        ids = data.row(r)[0]
        doc = []
        for i in ids + [tok.eos_id]:
            if i == tok.eos_id:
                if doc:
                    texts.append(tok.decode(doc))
                doc = []
            elif i < 256:
                doc.append(i)
    return texts


def build_bpe(texts, vocab_size: int):
    """A ``tokenizers.Tokenizer`` (see the module docstring) trained on ``texts``."""

    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
        raise ValueError(f"train-tokenizer: `vocab_size` must be an int >= {MIN_VOCAB}, got {vocab_size!r}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, out) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (BOS/EOS/PAD named) to ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL[0], "eos_token": SPECIAL[1],
              "pad_token": SPECIAL[2], "clean_up_tokenization_spaces": False}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def train_tokenizer(out, *, mixture: str, vocab_size: int, seq_len: int, rows: int, seed: int = 0) -> Path:
    """Train on :func:`mixture_texts` and save to ``out``; returns the folder."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"train-tokenizer: `rows` must be a positive int, got {rows!r}")
    return save_tokenizer(build_bpe(mixture_texts(mixture, seq_len, rows, seed), vocab_size), out)
