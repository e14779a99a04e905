"""The ``qedprobe`` lm-eval model's arguments, checked, and the model and tokenizer they load.

Nothing here imports lm-eval: the ``qedprobe lm-eval`` command checks its ``--model-args`` with
:func:`parse_model_args` before it imports lm-eval or reads any weight.

``pretrained`` is a folder written by ``QEDModel.save_pretrained`` or a transformers folder of a
family :mod:`qedprobe.hf` supports (its ``config.json`` names a ``model_type``); nothing is
downloaded. ``tokenizer`` defaults to the model's own: the transformers folder, the QED folder's
``tokenizer.json`` when it ships one, else qedprobe's byte tokenizer.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

import torch

from qedprobe.model.strength import PHASES
from qedprobe.ops import ARMS

__all__ = ["ModelArgs", "ModelArgsError", "parse_model_args", "is_transformers_folder", "load_model",
           "resolve_device", "resolve_dtype", "DTYPES"]

DTYPES = ("auto", "float32", "bfloat16", "float16", "float64")
"""``dtype`` values; ``auto`` is bfloat16 on CUDA and float32 on CPU."""

QED_ARMS = tuple(a for a in ARMS if a != "gdn2")
"""``qed_arm`` values: every erase direction but ``gdn2`` (which has none)."""


class ModelArgsError(ValueError):
    """A model argument that cannot be used; the message names it."""


@dataclass(frozen=True)
class ModelArgs:
    """The checked ``model_args`` of the ``qedprobe`` lm-eval model (see :func:`parse_model_args`)."""

    pretrained: str
    tokenizer: str | None = None
    strength: float | None = None
    phase: str = "all"
    layers: tuple[int, ...] | None = None
    heads: tuple[int, ...] | None = None
    qed_lambda: float | None = None
    qed_arm: str = "full"
    dtype: str = "auto"
    device: str | None = None
    batch_size: int = 1
    max_length: int | None = None
    allow_extrapolation: bool = False
    eager: bool = False


def _bad(name, expected, value) -> ModelArgsError:
    return ModelArgsError(f"qedprobe model_args: `{name}` must be {expected}, got {value!r}")


def _number(name, value, *, optional=True):
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _bad(name, "a finite number" + (" or none" if optional else ""), value)
    return float(value)


def _positive_int(name, value, *, optional=False):
    if value is None and optional:
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise _bad(name, "an integer >= 1" + (" or none" if optional else ""), value)
    return value


def _index_list(name, value):
    """None, an int, a list of ints, or a string of ints joined by ``;`` (lm-eval's argument
    string separates arguments by commas) -> a tuple of ints."""
    if value is None:
        return None
    items = value.split(";") if isinstance(value, str) else [value] if isinstance(value, int) else value
    try:
        out = tuple(int(x) if isinstance(x, str) else x for x in items)
    except (TypeError, ValueError):
        out = None
    if not out or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in out):
        raise _bad(name, "none, an index >= 0 or indices joined by ';' (e.g. 0;2)", value)
    return out


def _choice(name, value, choices):
    if value not in choices:
        raise _bad(name, f"one of {', '.join(choices)}", value)
    return value


def _flag(name, value):
    if not isinstance(value, bool):
        raise _bad(name, "true or false", value)
    return value


def parse_model_args(**kwargs) -> ModelArgs:
    """Check every argument (``pretrained`` an existing folder, ``strength``/``qed_lambda``
    numbers, ``phase`` one of all/prefill/decode, ``layers``/``heads`` indices, ``dtype`` one of
    :data:`DTYPES`, ``batch_size`` and ``max_length`` integers >= 1, ...) and refuse unknown
    ones, each error naming the argument. Values may come typed (a dict) or as lm-eval's
    argument-string parser types them (``"1.5"`` -> 1.5, ``"true"`` -> True)."""
    known = {f.name for f in fields(ModelArgs)}
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ModelArgsError(f"qedprobe model_args: unknown argument(s) {', '.join(unknown)} "
                             f"(known: {', '.join(sorted(known))})")
    if "pretrained" not in kwargs:
        raise ModelArgsError("qedprobe model_args: `pretrained` (a model folder) is required")
    a = dict(kwargs)
    pretrained = a["pretrained"]
    if not isinstance(pretrained, str) or not Path(pretrained).is_dir():
        raise _bad("pretrained", "an existing model folder (nothing is downloaded)", pretrained)
    tokenizer = a.get("tokenizer")
    if tokenizer is not None and not (isinstance(tokenizer, str) and (tokenizer == "bytes" or Path(tokenizer).is_dir())):
        raise _bad("tokenizer", "'bytes' or an existing tokenizer folder", tokenizer)
    device = a.get("device")
    if device is not None and not isinstance(device, str):
        raise _bad("device", "a device name such as cpu, cuda or cuda:1", device)
    return ModelArgs(
        pretrained=pretrained, tokenizer=tokenizer, strength=_number("strength", a.get("strength")),
        phase=_choice("phase", a.get("phase", "all"), PHASES),
        layers=_index_list("layers", a.get("layers")), heads=_index_list("heads", a.get("heads")),
        qed_lambda=_number("qed_lambda", a.get("qed_lambda")), qed_arm=_choice("qed_arm", a.get("qed_arm", "full"), QED_ARMS),
        dtype=_choice("dtype", a.get("dtype", "auto"), DTYPES), device=device,
        batch_size=_positive_int("batch_size", a.get("batch_size", 1)),
        max_length=_positive_int("max_length", a.get("max_length"), optional=True),
        allow_extrapolation=_flag("allow_extrapolation", a.get("allow_extrapolation", False)),
        eager=_flag("eager", a.get("eager", False)))


def is_transformers_folder(path) -> bool:
    """Whether ``path``'s ``config.json`` names a ``model_type`` (a ``QEDModel`` folder's does not)."""
    try:
        with open(Path(path) / "config.json", encoding="utf-8") as fh:
            return "model_type" in json.load(fh)
    except (OSError, ValueError):
        return False


def resolve_device(device: str | None) -> torch.device:
    """``device`` (None: CUDA when available, else CPU) as a ``torch.device``; CUDA without a GPU
    is refused."""
    name = device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(name)
    except (RuntimeError, ValueError) as exc:
        raise _bad("device", f"a device name ({exc})", device) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelArgsError("qedprobe model_args: `device` cuda requested but CUDA is not available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """``dtype`` as a ``torch.dtype``: ``auto`` is bfloat16 on CUDA, float32 elsewhere."""
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else "float32"
    return getattr(torch, dtype)


def _load_weights(args: ModelArgs, device, dtype):
    from qedprobe.model import QEDModel
    if is_transformers_folder(args.pretrained):
        from qedprobe.hf import adapt, inject_qed
        model = adapt(args.pretrained, dtype=dtype, device=device)
        return model if args.qed_lambda is None else inject_qed(
            model, args.qed_lambda, args.qed_arm, allow_extrapolation=args.allow_extrapolation)
    if args.qed_lambda is not None:
        raise ModelArgsError("qedprobe model_args: `qed_lambda` applies to a transformers folder; "
                             f"{args.pretrained!r} is a QEDModel folder with its own lambda")
    return QEDModel.from_pretrained(args.pretrained, dtype=dtype, device=device)


def load_model(args: ModelArgs):
    """``(model, tokenizer)``: the model of ``pretrained`` in eval mode on ``device`` in ``dtype``
    (a transformers model adapted with ``qedprobe.hf.adapt``, QED injected with ``qed_lambda`` and
    ``qed_arm``), and its tokenizer (``tokenizer``, else the model's own: ``model.tokenizer``, the
    folder's; else bytes), checked to fit the vocabulary and set as ``model.tokenizer``.
    Loading failures are refused naming ``pretrained`` / ``tokenizer``."""
    from qedprobe.tokenizer import TokenizerError, load_tokenizer
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    try:
        model = _load_weights(args, device, dtype).eval()
    except ModelArgsError:
        raise
    except Exception as exc:  # noqa: BLE001 - any loading failure, reported as one line naming the argument
        raise ModelArgsError(f"qedprobe model_args: cannot load `pretrained` {args.pretrained!r}: "
                             f"{type(exc).__name__}: {exc}") from None
    try:
        tokenizer = load_tokenizer(args.tokenizer if args.tokenizer is not None else model.tokenizer or "bytes")
    except (TokenizerError, OSError) as exc:
        raise ModelArgsError(f"qedprobe model_args: `tokenizer`: {exc}") from None
    if tokenizer.vocab_size > model.cfg.vocab_size:
        raise ModelArgsError(f"qedprobe model_args: `tokenizer` {tokenizer.name!r} has {tokenizer.vocab_size} ids "
                             f"but the model's vocabulary has {model.cfg.vocab_size}")
    if tokenizer.eos_id is None and tokenizer.bos_id is None:
        raise ModelArgsError(f"qedprobe model_args: `tokenizer` {tokenizer.name!r} has neither an EOS nor a BOS "
                             "token (lm-eval conditions empty contexts on one)")
    model.tokenizer = tokenizer
    return model, tokenizer
