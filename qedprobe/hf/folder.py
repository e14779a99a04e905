"""A transformers model folder for ``qedprobe sweep`` / ``eig``: recognised, described (no
weights read), loaded with the QED term injected.

``--model DIR`` is a transformers folder when its ``config.json`` has a ``model_type`` (a
``QEDModel`` folder has none). :func:`folder_config` is the config the loaded model will have,
so a sweep's fingerprint is fixed before the weights are read.
"""
from __future__ import annotations

import json
import os

from .families import HFQEDConfig
from .inject import inject_qed, injected_config
from .model import HFQEDModel, adapt


def is_transformers_folder(path) -> bool:
    """Whether ``path`` is a folder whose ``config.json`` names a ``model_type``."""
    cfg = os.path.join(os.fspath(path), "config.json")
    try:
        with open(cfg, encoding="utf-8") as fh:
            return "model_type" in json.load(fh)
    except (OSError, ValueError):
        return False


def folder_config(path, *, qed_lambda: float | None = None, qed_arm: str = "full") -> HFQEDConfig:
    """The :class:`HFQEDConfig` of the folder's model with ``qed_lambda`` injected on every
    linear-attention head with ``qed_arm`` (None: the model as trained, arm ``gdn2``)."""
    from transformers import AutoConfig
    cfg = HFQEDConfig.from_transformers(AutoConfig.from_pretrained(os.fspath(path), local_files_only=True))
    return cfg if qed_lambda is None else injected_config(cfg, qed_lambda, qed_arm)


def load_folder(path, *, dtype, device, qed_lambda: float | None = None, qed_arm: str = "full",
                allow_extrapolation: bool = False) -> HFQEDModel:
    """The folder's model, adapted, in eval mode on ``device`` in ``dtype``, with the injection
    of :func:`folder_config`."""
    model = adapt(path, dtype=dtype, device=device)
    return model if qed_lambda is None else inject_qed(model, qed_lambda, qed_arm,
                                                       allow_extrapolation=allow_extrapolation)
