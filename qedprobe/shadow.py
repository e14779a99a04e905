"""The top-level folders ``kernels/`` and ``hooks/`` under their bare names: handed over.

qedprobe installs those folders as ``qedprobe.kernels`` and ``qedprobe.hooks``. Where the
repository root is on ``sys.path`` (Python started there: ``python -m ...``, ``python -c``, a
REPL, Jupyter, ``torchrun``), a bare ``import kernels`` would find the folder instead of the
installed ``kernels`` package that transformers imports. Each folder's ``__init__.py``, when run
under its bare name, calls :func:`hand_over`, which puts the installed package of that name in
its place (the import system returns what ``sys.modules`` holds after the module ran), or fails
as Python would without this repository.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys


def hand_over(name: str, init_file: str) -> None:
    """Replace ``sys.modules[name]`` (the folder whose ``__init__.py`` is ``init_file``, run as
    the bare ``name``) with the package ``name`` found on ``sys.path`` without the repository
    root; raise ``ModuleNotFoundError("No module named 'name'")`` where none is installed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(init_file)))
    path = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
