"""Tiny QED models and token ids for the model tests (CPU, reference recurrence)."""
import torch

from qedprobe.model import QEDConfig, QEDModel

TINY = dict(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_heads=2, head_dim=16,
            initializer_range=0.1)


def tiny(arm="full", seed=0, theta=1.0, **kw):
    torch.manual_seed(seed)
    model = QEDModel(QEDConfig(**{**TINY, "arm": arm, **kw}))
    with torch.no_grad():
        for block in model.blocks:
            if block.attn.theta is not None:  # distinct per-head strengths, lambda ~ 0.15 .. 0.2
                block.attn.theta.copy_(theta + torch.linspace(-0.5, 0.5, model.cfg.num_heads))
    return model.eval()


def ids(B=2, T=11, seed=1, vocab=97):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))
