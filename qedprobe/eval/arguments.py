"""A sweep's error and its list arguments, in a module that imports nothing (the command line's
parsers use them: ``qedprobe eig --length 2K`` is read without loading torch).
:mod:`qedprobe.eval.spec` and :mod:`qedprobe.eval.store` re-export them."""
from __future__ import annotations

__all__ = ["SweepError", "parse_int_list", "parse_float_list"]


class SweepError(ValueError):
    """An argument, model, tokenizer or output folder that a sweep cannot use."""


def parse_int_list(text, name="list") -> list[int]:
    """``"1024,2K,4k"`` -> ``[1024, 2048, 4096]`` (K = 1024)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        mult = 1
        if part[-1] in "kK":
            part, mult = part[:-1], 1024
        try:
            out.append(int(part) * mult)
        except ValueError:
            raise SweepError(f"{name}: {part!r} is not an integer") from None
    if not out:
        raise SweepError(f"{name}: empty")
    return out


def parse_float_list(text, name="list") -> list[float]:
    try:
        out = [float(p) for p in str(text).split(",") if p.strip()]
    except ValueError:
        raise SweepError(f"{name}: {text!r} is not a comma-separated list of numbers") from None
    if not out:
        raise SweepError(f"{name}: empty")
    return out
