r"""One pre-norm QED block with TransformerLens hook names::

    resid_pre  -> attn_out = attn(attn_norm(resid_pre))
    resid_mid  = resid_pre + attn_out
    mlp_out    = mlp(mlp_norm(resid_mid))
    resid_post = resid_mid + mlp_out

Hooks (all ``[B, T, hidden]``): ``hook_resid_pre``, ``hook_attn_out``, ``hook_resid_mid``,
``hook_mlp_out``, ``hook_resid_post``. Parameter names follow fla's blocks (``attn_norm``,
``attn``, ``mlp_norm``, ``mlp.{gate,up,down}_proj``).
"""
from __future__ import annotations

import torch
from torch import nn
from transformer_lens.hook_points import HookPoint

from .config import QEDConfig
from .mixer import MixerState, QEDMixer
from .mlp import SwiGLUMLP
from .norm import RMSNorm


class QEDBlock(nn.Module):
    """Mixer + SwiGLU MLP with residual connections."""

    def __init__(self, cfg: QEDConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = QEDMixer(cfg, layer_idx)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size)
        self.hook_resid_pre = HookPoint()  # [B, T, hidden] the block's input
        self.hook_attn_out = HookPoint()  # [B, T, hidden] the mixer's output
        self.hook_resid_mid = HookPoint()  # [B, T, hidden] resid_pre + attn_out
        self.hook_mlp_out = HookPoint()  # [B, T, hidden] the MLP's output
        self.hook_resid_post = HookPoint()  # [B, T, hidden] resid_mid + mlp_out

    def forward(self, x: torch.Tensor, **mixer_kwargs) -> tuple[torch.Tensor, MixerState | None]:
        """``x`` ``[B, T, hidden]`` -> ``(resid_post, mixer state)``; ``mixer_kwargs`` go to
        :meth:`QEDMixer.forward`."""
        resid_pre = self.hook_resid_pre(x)
        attn_out, state = self.attn(self.attn_norm(resid_pre), **mixer_kwargs)
        resid_mid = self.hook_resid_mid(resid_pre + self.hook_attn_out(attn_out))
        mlp_out = self.hook_mlp_out(self.mlp(self.mlp_norm(resid_mid)))
        return self.hook_resid_post(resid_mid + mlp_out), state
