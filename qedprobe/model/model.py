r"""`QEDModel`: a hooked QED language model (TransformerLens ``HookedRootModule``).

    x_0 = embed(ids)                                   hook_embed          [B, T, hidden]
    x_l = block_l(x_{l-1})                             blocks.{l}.hook_*   (see block.py, mixer.py)
    logits = rms_norm(x_L) @ E^T   (E: the embedding, tied; or lm_head when untied)

``model(ids)`` is a prefill pass (for ``strength(..., phase=...)``). ``run_with_cache`` returns a
TransformerLens ``ActivationCache``; ``run_with_hooks`` and ``model.hooks(...)`` work as usual
(hooks also fire inside ``generate``). Parameter names follow fla's models without the
``model.`` prefix, with ``layers`` renamed ``blocks``.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from . import checkpoint, generate as generation
from .block import QEDBlock
from .config import QEDConfig
from .conv import ShortConvolution
from .hooked import HookedModel
from .mixer import MixerState
from .norm import RMSNorm
from .strength import lambda_scales

PHASES = ("prefill", "decode")


class QEDModel(HookedModel):
    """Embedding, ``num_hidden_layers`` QED blocks, final RMSNorm, (tied) LM head."""

    def __init__(self, cfg: QEDConfig):
        super().__init__()
        if not isinstance(cfg, QEDConfig):
            raise ValueError(f"QEDModel: `cfg` must be a QEDConfig, got {type(cfg).__name__}")
        self.cfg = cfg
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.hook_embed = HookPoint()
        self.blocks = nn.ModuleList(QEDBlock(cfg, l) for l in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.strength_factors = []  # the active `strength` blocks (StrengthFactor), see strength.py
        self.decode_graphs = OrderedDict()  # captured decode steps, see decode_step.py
        self.apply(self._init_module)
        self.setup()

    def _init_module(self, module: nn.Module) -> None:
        """fla's initialisation: normal(0, initializer_range) weights, zero biases."""
        if isinstance(module, (nn.Linear, nn.Embedding, ShortConvolution)):
            nn.init.normal_(module.weight, mean=0.0, std=self.cfg.initializer_range)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)

    @property
    def mixer_layers(self) -> list[int]:
        """Every layer runs the QED recurrence (hooks ``blocks.{l}.attn.hook_*``)."""
        return list(range(self.cfg.num_hidden_layers))

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    def _check_ids(self, input_ids) -> None:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.int32, torch.int64):
            got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
            raise ValueError(f"QEDModel: `input_ids` must be an integer tensor [B, T], got {got}")
        if input_ids.numel() == 0:
            raise ValueError(f"QEDModel: `input_ids` is empty, shape {tuple(input_ids.shape)}")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"QEDModel: token ids must lie in [0, {self.cfg.vocab_size}), got {lo}..{hi}")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``input_ids`` ``[B, T]`` -> logits ``[B, T, vocab_size]`` (a prefill pass)."""
        return self.forward_with_state(input_ids)[0]

    def forward_with_state(self, input_ids: torch.Tensor, *, states: list[MixerState] | None = None,
                           cu_seqlens: torch.Tensor | None = None, phase: str = "prefill",
                           want_state: bool = False, logit_positions: torch.Tensor | None = None):
        """Logits and, with ``want_state``, one :class:`MixerState` per layer to continue from.

        ``states`` continues N sequences; ``cu_seqlens`` ``[N + 1]`` packs N sequences in one
        row (B = 1); ``phase`` (``"prefill"`` / ``"decode"``) picks the strength factors;
        ``logit_positions`` ``[P]`` computes logits ``[B, P, vocab]`` at those positions only.
        The id range check reads the ids on the host (a device synchronisation on CUDA).
        """
        if phase not in PHASES:
            raise ValueError(f"QEDModel: `phase` must be one of {PHASES}, got {phase!r}")
        self._check_ids(input_ids)
        return self.run_blocks(input_ids, states=states, cu_seqlens=cu_seqlens,
                               scales=self.lam_scales(phase), want_state=want_state,
                               logit_positions=logit_positions)

    def lam_scales(self, phase: str) -> torch.Tensor | None:
        """The active strength factors of ``phase`` as ``[L, H]`` float32 on the model's device, or None."""
        scales = lambda_scales(self.strength_factors, phase)
        return None if scales is None else scales.to(self.device)

    def run_blocks(self, input_ids: torch.Tensor, *, states: list[MixerState] | None, cu_seqlens,
                   scales: torch.Tensor | None, want_state: bool, logit_positions=None):
        """:meth:`forward_with_state` on ids already checked, with the lambda factors ``scales``
        ``[L, H]`` (device) given: no host synchronisation, so it can be captured in a CUDA graph."""
        if states is not None and len(states) != self.cfg.num_hidden_layers:
            raise ValueError(f"QEDModel: `states` must hold one MixerState per layer "
                             f"({self.cfg.num_hidden_layers}), got {len(states)}")
        x = self.hook_embed(self.embeddings(input_ids))
        new_states = []
        for l, block in enumerate(self.blocks):
            x, state = block(x, lam_scale=None if scales is None else scales[l],
                             state=None if states is None else states[l],
                             cu_seqlens=cu_seqlens, want_state=want_state)
            new_states.append(state)
        if logit_positions is not None:
            x = x[:, logit_positions]
        x = self.norm(x)
        logits = F.linear(x, self.embeddings.weight) if self.lm_head is None else self.lm_head(x)
        return logits, (new_states if want_state else None)

    def generate(self, prompts, max_new_tokens: int, *, eos_token_id: int | None = None,
                 do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None,
                 generator: torch.Generator | None = None, cuda_graph: bool = True) -> list[list[int]]:
        """New tokens per prompt; see :func:`qedprobe.model.generate.generate`."""
        return generation.generate(self, prompts, max_new_tokens, eos_token_id=eos_token_id,
                                   do_sample=do_sample, temperature=temperature, top_k=top_k,
                                   generator=generator, cuda_graph=cuda_graph)

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into directory ``path``."""
        checkpoint.save_pretrained(self, path)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None) -> "QEDModel":
        """Load a directory written by :meth:`save_pretrained`; see ``checkpoint.load_pretrained``."""
        return checkpoint.load_pretrained(cls, path, dtype=dtype, device=device)
