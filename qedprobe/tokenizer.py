"""Tokenizers for evaluation: the built-in byte tokenizer and local Hugging Face folders.

Every tokenizer here has the same small interface::

    tok.encode(text) -> list[int]      # no special tokens
    tok.decode(ids)  -> str            # special tokens dropped
    tok.bos_id, tok.eos_id, tok.pad_id # int or None
    tok.vocab_size                     # ids are in range(vocab_size)
    tok.name                           # "bytes" or the folder path
    tok.chat_template                  # the folder's chat template (a Jinja string) or None

:func:`chat_prompt` puts a text into a tokenizer's own chat template.

:func:`load_tokenizer` turns ``"bytes"`` or a folder path into one. Nothing is ever
downloaded: a Hugging Face folder is read with ``local_files_only=True``.
"""
from __future__ import annotations

import os

from tokenizers import Tokenizer

__all__ = ["ByteTokenizer", "HFTokenizer", "chat_prompt", "load_tokenizer", "TokenizerError"]


class TokenizerError(ValueError):
    """The tokenizer argument cannot be used (missing folder, unreadable files, ...)."""


class ByteTokenizer:
    """UTF-8 bytes as ids 0-255, plus ``BOS = 256``, ``EOS = 257``, ``PAD = 258``.

    ``vocab_size`` is 259: a model made for this tokenizer needs ``vocab_size >= 259``.
    Decoding drops special ids and replaces invalid UTF-8 with U+FFFD.
    """

    name = "bytes"
    BOS = 256
    EOS = 257
    PAD = 258
    vocab_size = 259

    bos_id = BOS
    eos_id = EOS
    pad_id = PAD
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer read from a local folder (``tokenizer.json`` or any format
    ``transformers.AutoTokenizer`` reads with ``local_files_only=True``).

    ``encode`` adds no special tokens; the BOS token, if the tokenizer has one, is prepended by
    the task generators through ``bos_id``.
    """

    def __init__(self, path: str):
        path = os.fspath(path)
        if not os.path.isdir(path):
            raise TokenizerError(f"tokenizer folder {path!r} does not exist (nothing is downloaded)")
        self.name = os.path.abspath(path)
        self._tok = None
        self._hf = None
        tj = os.path.join(path, "tokenizer.json")
        err = None
        try:
            from transformers import AutoTokenizer  # noqa: WPS433
            self._hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - fall back to the bare tokenizers file
            err = exc
        if self._hf is None:
            if not os.path.isfile(tj):
                raise TokenizerError(f"cannot load a tokenizer from {path!r}: {err}")
            try:
                self._tok = Tokenizer.from_file(tj)
            except Exception as exc:  # noqa: BLE001
                raise TokenizerError(f"cannot read {tj!r}: {exc}") from exc
        if self._hf is not None:
            h = self._hf
            self.bos_id = h.bos_token_id
            self.eos_id = h.eos_token_id
            self.pad_id = h.pad_token_id
            self.vocab_size = len(h)
            self._special = set(h.all_special_ids)
        else:
            t = self._tok
            self.vocab_size = t.get_vocab_size(with_added_tokens=True)
            vocab = t.get_vocab(with_added_tokens=True)
            self.bos_id = next((vocab[s] for s in ("<s>", "<|begin_of_text|>", "<bos>") if s in vocab), None)
            self.eos_id = next((vocab[s] for s in ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")
                                if s in vocab), None)
            self.pad_id = next((vocab[s] for s in ("<pad>", "<|pad|>") if s in vocab), None)
            self._special = {i for i in (self.bos_id, self.eos_id, self.pad_id) if i is not None}

    @property
    def chat_template(self) -> str | None:
        """The chat template transformers read from the folder (``tokenizer_config.json`` or
        ``chat_template.jinja``), or None (none there, or only a bare ``tokenizer.json`` read)."""
        return None if self._hf is None else self._hf.chat_template

    def chat(self, text: str) -> str:
        """``text`` as one user message in this tokenizer's chat template, followed by the
        template's opening of the assistant's turn (``apply_chat_template(...,
        add_generation_prompt=True)``, as text; the template writes its own special tokens)."""
        if self.chat_template is None:
            raise _no_chat_template(self.name)
        messages = [{"role": "user", "content": text}]
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def encode(self, text: str) -> list[int]:
        if self._hf is not None:
            return list(self._hf.encode(text, add_special_tokens=False))
        return list(self._tok.encode(text, add_special_tokens=False).ids)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids if int(i) not in self._special]
        if self._hf is not None:
            return self._hf.decode(ids, skip_special_tokens=True)
        return self._tok.decode(ids, skip_special_tokens=True)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.name!r})"


def _no_chat_template(name) -> TokenizerError:
    return TokenizerError(f"tokenizer {name!r} has no chat template (a Hugging Face tokenizer folder "
                          "defines one in tokenizer_config.json or chat_template.jinja)")


def chat_prompt(tokenizer, text: str) -> str:
    """``text`` in ``tokenizer``'s own chat template as the user's turn, the assistant's turn
    opened (:meth:`HFTokenizer.chat`); a tokenizer without a template is refused by name."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise _no_chat_template(getattr(tokenizer, "name", type(tokenizer).__name__))
    return tokenizer.chat(text)


def load_tokenizer(spec="bytes"):
    """``"bytes"`` (or ``None``) -> :class:`ByteTokenizer`; a folder path -> :class:`HFTokenizer`;
    an object that already has ``encode``/``decode`` is returned unchanged."""
    if spec is None or (isinstance(spec, str) and spec == "bytes"):
        return ByteTokenizer()
    if hasattr(spec, "encode") and hasattr(spec, "decode"):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        return HFTokenizer(spec)
    raise TokenizerError(f"tokenizer must be 'bytes' or a local folder path, got {spec!r}")
