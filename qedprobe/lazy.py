"""Packages whose ``__init__`` imports nothing heavy: their public names are imported from their
submodules on first use (PEP 562 module ``__getattr__``), so that importing one light submodule
(``qedprobe.train.config``, ``qedprobe.eval.arguments``, as the command line's parsers do)
does not load torch through the package's other modules."""
from __future__ import annotations

import importlib
import importlib.util


def lazy_exports(package: str, exports: dict[str, str]):
    """The module ``__getattr__`` of ``package``: ``name`` of ``exports`` (name -> submodule)
    comes from ``package.<submodule>``, imported then; any other name is tried as a submodule."""

    def __getattr__(name: str):
        if name in exports:
            return getattr(importlib.import_module(f"{package}.{exports[name]}"), name)
        if importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
