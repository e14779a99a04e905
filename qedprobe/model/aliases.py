"""TransformerLens-style config aliases (``ActivationCache`` reads ``model.cfg.n_layers`` etc.),
shared by ``QEDConfig`` and ``qedprobe.hf.HFQEDConfig``: each reads the config's own field."""
from __future__ import annotations


class TLAliases:
    """``n_layers``, ``n_heads``, ``d_model``, ``d_head``, ``d_vocab`` from ``num_hidden_layers``,
    ``num_heads``, ``hidden_size``, ``head_dim``, ``vocab_size``."""

    @property
    def n_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def n_heads(self) -> int:
        return self.num_heads

    @property
    def d_model(self) -> int:
        return self.hidden_size

    @property
    def d_head(self) -> int:
        return self.head_dim

    @property
    def d_vocab(self) -> int:
        return self.vocab_size
