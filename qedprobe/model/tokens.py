r"""TransformerLens' text conventions for every hooked model: ``tokenizer``, ``to_tokens``,
``to_string``, ``to_str_tokens``, ``to_single_token``.

    model = QEDModel.from_pretrained("checkpoints/interference-full-s0")   # the folder's tokenizer.json
    ids = model.to_tokens("The special magic number is")                   # [1, T] LongTensor, BOS first
    model.to_string(model.generate(ids, 8)[0])                             # text, special tokens dropped

``model.tokenizer`` is a :mod:`qedprobe.tokenizer` object (``encode`` / ``decode`` / ``bos_id`` /
``pad_id``): the folder's own tokenizer for a model loaded from a folder that has one, else
None until set (``model.tokenizer = "bytes"``, a tokenizer folder, or any object with
``encode`` and ``decode``). A folder is read on first use, not at load time, so loading a model
stays as fast without it. Without a tokenizer the text methods raise a ``ValueError`` that says
how to set one.

``to_tokens`` prepends the BOS id when the tokenizer has one (``prepend_bos=None``), as the
evaluation tasks and training did for the shipped checkpoints. Several texts are padded on the
right with the tokenizer's pad id: a recurrence reads its inputs in order, so pads on the left
would enter every row's state; ``padding_side="left"`` is refused by name. Pass
``attention_mask=(ids != model.tokenizer.pad_id)`` to the forward when padding matters (the
right-padded rows' logits before the pads are exact).
"""
from __future__ import annotations

import torch

from qedprobe.tokenizer import load_tokenizer


def _as_rows(tokens) -> tuple[list[list[int]], bool]:
    """Token ids (a tensor, array or nested list, 1-D or 2-D) -> ``(rows, was_2d)``."""
    t = torch.as_tensor(tokens)
    if t.dim() > 2 or t.is_floating_point():
        raise ValueError(f"to_string: `tokens` must be integer ids [T] or [B, T], got {t.dtype} {tuple(t.shape)}")
    return (t.tolist(), True) if t.dim() == 2 else ([t.reshape(-1).tolist()], False)


class TokenMethods:
    """The text side of a hooked model (mixed into ``HookedModel``): see the module docstring.
    The model provides ``device``."""

    _tokenizer_spec = None  # what `tokenizer` was set to (loaded on first use)
    _tokenizer_obj = None

    @property
    def tokenizer(self):
        """The model's tokenizer (a :mod:`qedprobe.tokenizer` object), or None."""
        if self._tokenizer_obj is None and self._tokenizer_spec is not None:
            self._tokenizer_obj = load_tokenizer(self._tokenizer_spec)
        return self._tokenizer_obj

    @tokenizer.setter
    def tokenizer(self, spec) -> None:
        """``None``, ``"bytes"``, a local tokenizer folder, or a tokenizer object."""
        is_object = hasattr(spec, "encode") and hasattr(spec, "decode")
        self._tokenizer_spec, self._tokenizer_obj = (None, spec) if is_object else (spec, None)

    def _need_tokenizer(self, method: str):
        tok = self.tokenizer
        if tok is None:
            raise ValueError(f"{type(self).__name__}.{method}: this model has no tokenizer (none in its folder, "
                             "or built from a config); set one: model.tokenizer = 'bytes' or a tokenizer folder")
        return tok

    def to_tokens(self, input, prepend_bos: bool | None = None, padding_side: str | None = None,
                  move_to_device: bool = True) -> torch.Tensor:
        """A text (or a list of texts) -> token ids ``[B, T]`` (LongTensor, ``B = 1`` for one
        text): BOS first when ``prepend_bos`` (default: when the tokenizer has a BOS id), texts
        of different lengths padded on the right with the pad id (else the EOS id, else 0)."""
        tok = self._need_tokenizer("to_tokens")
        if padding_side not in (None, "right"):
            raise ValueError(f"to_tokens: `padding_side` must be 'right' (or None), got {padding_side!r}: "
                             "a recurrence reads left to right, so left pads would enter the state")
        texts = [input] if isinstance(input, str) else input
        if not isinstance(texts, (list, tuple)) or not texts or not all(isinstance(s, str) for s in texts):
            raise ValueError(f"to_tokens: `input` must be a string or a non-empty list of strings, got {input!r:.80}")
        bos = tok.bos_id if prepend_bos is None or prepend_bos else None
        if prepend_bos and bos is None:
            raise ValueError(f"to_tokens: prepend_bos=True but the tokenizer {tok.name!r} has no BOS token")
        rows = [([bos] if bos is not None else []) + tok.encode(s) for s in texts]
        pad = next((i for i in (tok.pad_id, tok.eos_id) if i is not None), 0)
        width = max(map(len, rows))
        out = torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long)
        return out.to(self.device) if move_to_device else out

    def to_string(self, tokens) -> str | list[str]:
        """Token ids ``[T]`` -> a text; ``[B, T]`` -> one text per row (special tokens dropped)."""
        tok = self._need_tokenizer("to_string")
        rows, two_d = _as_rows(tokens)
        texts = [tok.decode(r) for r in rows]
        return texts if two_d else texts[0]

    def to_str_tokens(self, input, prepend_bos: bool | None = None) -> list[str]:
        """A text or ids ``[T]`` -> each token as its text (``"<bos>"``, ``"<eos>"``, ``"<pad>"``
        for the special ids, which decode to nothing)."""
        tok = self._need_tokenizer("to_str_tokens")
        ids = self.to_tokens(input, prepend_bos=prepend_bos)[0] if isinstance(input, str) else input
        rows, two_d = _as_rows(ids)
        if two_d and len(rows) != 1:
            raise ValueError(f"to_str_tokens: `input` must be one text or one row of ids, got {len(rows)} rows")
        names = {tok.bos_id: "<bos>", tok.eos_id: "<eos>", tok.pad_id: "<pad>"}
        return [names[i] if i in names and i is not None else tok.decode([i]) for i in rows[0]]

    def to_single_token(self, string: str) -> int:
        """The id of the one token ``string`` encodes to; a text of several tokens is refused."""
        tok = self._need_tokenizer("to_single_token")
        ids = tok.encode(string)
        if len(ids) != 1:
            raise ValueError(f"to_single_token: {string!r} is {len(ids)} tokens, not one: {ids}")
        return ids[0]
