"""One progress bar for every long loop (sweep rows, eig batches, training steps, generated tokens).

``tqdm.auto`` draws a notebook widget when ``ipywidgets`` is installed and otherwise warns
(``TqdmWarning: IProgress not found``) on every bar in Jupyter; this picks the widget only where
it can be drawn and the plain text bar everywhere else, so no bar opens with a warning.
"""
from __future__ import annotations

import importlib.util


def tqdm_class():
    """``tqdm.auto.tqdm`` where ``ipywidgets`` is importable, else the plain ``tqdm.tqdm``."""
    if importlib.util.find_spec("ipywidgets") is not None:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm
    return tqdm


def progress_bar(**kwargs):
    """A tqdm bar (``kwargs`` as ``tqdm``'s) of :func:`tqdm_class`."""
    return tqdm_class()(**kwargs)
