"""qedprobe: look inside QED linear-attention models and intervene on them.

``qedprobe.ops`` holds the recurrence (reference, PyTorch and Triton); the hooked model and the
strength intervention (``QEDConfig``, ``QEDModel``, ``strength``) load lazily, so the ops work
without TransformerLens being imported.
"""
__version__ = "0.1.0"

_MODEL_EXPORTS = ("QEDConfig", "QEDModel", "strength")

__all__ = ["__version__", *_MODEL_EXPORTS]


def __getattr__(name):
    if name in _MODEL_EXPORTS:
        from qedprobe import model

        return getattr(model, name)
    raise AttributeError(f"module 'qedprobe' has no attribute {name!r}")
