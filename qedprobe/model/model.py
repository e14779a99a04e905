r"""`QEDModel`: a hooked QED language model (TransformerLens ``HookedRootModule``), and its
block. One forward pass reads top to bottom: ``QEDModel`` -> ``QEDBlock`` (here) -> ``QEDMixer``
(``mixer.py``) -> ``RMSNorm``, ``ShortConvolution``, ``SwiGLUMLP`` (``layers.py``).

    x_0 = embed(ids)                                   hook_embed          [B, T, hidden]
    x_l = block_l(x_{l-1})                             blocks.{l}.hook_*   (QEDBlock below; mixer.py)
    logits = rms_norm(x_L) @ E^T   (E: the embedding, tied; or lm_head when untied)

``model(ids)`` is a prefill pass (for ``strength(..., phase=...)``); ``return_type="loss"`` gives
the next-token cross-entropy, as TransformerLens' ``forward`` does. ``run_with_cache`` returns a
:class:`~.cache.QEDActivationCache` (TransformerLens' ``ActivationCache`` with this model's
names); ``run_with_hooks`` and ``model.hooks(...)`` work as usual (hooks also fire inside
``generate``). ``W_U``, ``ln_final`` and ``tokens_to_residual_directions`` are what the cache's
residual helpers read. Parameter names follow fla's models without the
``model.`` prefix, with ``layers`` renamed ``blocks``.

Each :class:`QEDBlock` is pre-norm, with TransformerLens hook names::

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
import torch.nn.functional as F
from torch import nn
from transformer_lens.hook_points import HookPoint

from . import checkpoint, generate as generation
from .cache import QEDActivationCache
from .config import QEDConfig
from .fast import active_fast_path, fast_block_runner
from .hooked import HookedModel
from .layers import RMSNorm, ShortConvolution, SwiGLUMLP
from .mixer import MixerState, QEDMixer
from .strength import LambdaScale, active_lambda_scale

PHASES = ("prefill", "decode")
RETURN_TYPES = ("logits", "loss", "both", None)


def right_padded_lengths(attention_mask, shape, owner: str = "QEDModel") -> torch.Tensor | None:
    """``[B]`` token counts of a right-padded ``attention_mask`` ``[B, T]`` (each row ones then
    zeros); any other mask is refused by name, the error prefixed with ``owner`` (the model class
    the user called). None for no mask."""
    if attention_mask is None:
        return None
    m = torch.as_tensor(attention_mask)
    if tuple(m.shape) != tuple(shape) or m.is_floating_point() or not bool(((m == 0) | (m == 1)).all()):
        raise ValueError(f"{owner}: `attention_mask` must be 0/1 (or bool) of shape {tuple(shape)}, "
                         f"got {m.dtype} {tuple(m.shape)}")
    lengths = m.long().sum(1)
    prefix = torch.arange(m.shape[1], device=m.device) < lengths[:, None]
    if not torch.equal(prefix, m.bool()):
        raise ValueError(f"{owner}: `attention_mask` must pad on the right (each row ones, then zeros): "
                         "a recurrence reads left to right, so left pads or holes would enter the state")
    return lengths


def check_residual(x, hidden: int) -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() != 3 or x.shape[-1] != hidden:
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"QEDModel: with `start_at_layer`, `input` is the residual stream [B, T, {hidden}] "
                         f"(floating point), got {got}")


def next_token_loss(logits, tokens, lengths, per_token: bool, owner: str = "QEDModel") -> torch.Tensor:
    """Mean ``-log p(x_{t+1} | x_{<=t})`` over the targets inside each row's ``lengths`` (all,
    for None); ``per_token``: ``[B, T - 1]``, zero at the left-out targets. Errors are prefixed
    with ``owner``, the model class the user called."""
    if not isinstance(tokens, torch.Tensor) or tuple(tokens.shape) != tuple(logits.shape[:2]):
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else tokens
        raise ValueError(f"{owner}: the loss needs `tokens` [B, T] = {tuple(logits.shape[:2])} "
                         f"(pass tokens= with start_at_layer), got {got}")
    if tokens.shape[1] < 2:
        raise ValueError(f"{owner}: the loss needs at least 2 tokens per row, got `input_ids` of shape {tuple(tokens.shape)}")
    logp = logits[:, :-1].float().log_softmax(-1)
    loss = -logp.gather(-1, tokens[:, 1:, None].to(logits.device).long())[..., 0]
    if lengths is None:
        return loss if per_token else loss.mean()
    keep = torch.arange(1, tokens.shape[1], device=loss.device) < lengths.to(loss.device)[:, None]
    loss = loss.masked_fill(~keep, 0.0)
    return loss if per_token else loss.sum() / keep.sum()


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


class QEDModel(HookedModel):
    """Embedding, ``num_hidden_layers`` QED blocks, final RMSNorm, (tied) LM head."""

    cache_class = QEDActivationCache  # run_with_cache's cache: TL's helpers on this model's names
    supports_fast_path = True  # its blocks run on the fast path inside a `fast_path` block (fast.py)

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

    def forward(self, input, return_type: str | None = "logits", loss_per_token: bool = False, *,
                attention_mask: torch.Tensor | None = None, start_at_layer: int | None = None,
                stop_at_layer: int | None = None, tokens: torch.Tensor | None = None,
                prepend_bos: bool | None = None, lambda_scale: LambdaScale | None = None):
        """``input`` ``[B, T]`` token ids (or a text / list of texts, through :meth:`to_tokens`
        with ``prepend_bos``) -> logits ``[B, T, vocab_size]`` (a prefill pass).

        ``return_type`` as TransformerLens: ``"logits"``, ``"loss"`` (the mean next-token
        cross-entropy ``-log p(x_{t+1} | x_{<=t})``, a scalar, or ``[B, T - 1]`` with
        ``loss_per_token``), ``"both"`` (``(logits, loss)``) or ``None``. ``attention_mask``
        ``[B, T]`` (1 = token, 0 = pad) must pad on the right: the logits before the pads are
        those without pads (a recurrence is causal) and the loss leaves out every target that
        is a pad or follows one (TransformerLens' rule); left padding is refused, since the pads
        would enter the state. ``stop_at_layer=n`` runs blocks ``0 .. n - 1`` and returns the
        residual stream ``[B, T, hidden]`` (``hook_resid_pre`` of block ``n``; negative ``n``
        counts from the end); ``start_at_layer=n`` takes that residual as ``input`` and runs
        blocks ``n ..`` (the loss then needs the ``tokens`` ``[B, T]``). ``lambda_scale``: the
        strength factors of this pass (default: those of the ``strength`` blocks around it).
        """
        if return_type not in RETURN_TYPES:
            raise ValueError(f"QEDModel: `return_type` must be one of {RETURN_TYPES}, got {return_type!r}")
        if isinstance(input, (str, list, tuple)):
            input = self.to_tokens(input, prepend_bos=prepend_bos)
        start, stop = self.layer_span(start_at_layer, stop_at_layer, return_type)
        if start == 0:
            self._check_ids(input)
            tokens = input
        else:
            check_residual(input, self.cfg.hidden_size)
        lengths = right_padded_lengths(attention_mask, input.shape[:2])
        out = self.run_blocks(input, states=None, cu_seqlens=None, scales=self.lam_scales("prefill", lambda_scale),
                              want_state=False, start_at_layer=start, stop_at_layer=stop)[0]
        if stop is not None or return_type in ("logits", None):
            return None if return_type is None else out
        loss = next_token_loss(out, tokens, lengths, loss_per_token)
        return loss if return_type == "loss" else (out, loss)

    def layer_span(self, start_at_layer, stop_at_layer, return_type) -> tuple[int, int | None]:
        """``(start, stop)`` block indices from TransformerLens' arguments (negative from the end;
        ``stop`` None: through the head)."""
        n = self.cfg.num_hidden_layers

        def index(name, value):
            if value is None:
                return None
            if isinstance(value, bool) or not isinstance(value, int) or not -n <= value <= n:
                raise ValueError(f"QEDModel: `{name}` must be an int in [-{n}, {n}] or None, got {value!r}")
            return value % n if value < 0 else value

        start, stop = index("start_at_layer", start_at_layer) or 0, index("stop_at_layer", stop_at_layer)
        if stop is not None and stop < start:
            raise ValueError(f"QEDModel: `stop_at_layer` ({stop_at_layer}) comes before `start_at_layer` ({start_at_layer})")
        if stop is not None and return_type not in ("logits", None):
            raise ValueError(f"QEDModel: stop_at_layer={stop_at_layer} returns the residual stream, "
                             f"so return_type={return_type!r} has no logits to score; leave return_type at 'logits'")
        return start, stop

    def forward_with_state(self, input_ids: torch.Tensor, *, states: list[MixerState] | None = None,
                           cu_seqlens: torch.Tensor | None = None, phase: str = "prefill",
                           want_state: bool = False, logit_positions: torch.Tensor | None = None,
                           lambda_scale: LambdaScale | None = None):
        """Logits and, with ``want_state``, one :class:`MixerState` per layer to continue from.

        ``states`` continues N sequences; ``cu_seqlens`` ``[N + 1]`` packs N sequences in one
        row (B = 1); ``phase`` (``"prefill"`` / ``"decode"``) picks the strength factors of
        ``lambda_scale`` (default: the ``strength`` blocks around the call);
        ``logit_positions`` ``[P]`` computes logits ``[B, P, vocab]`` at those positions only.
        The id range check reads the ids on the host (a device synchronisation on CUDA).
        """
        if phase not in PHASES:
            raise ValueError(f"QEDModel: `phase` must be one of {PHASES}, got {phase!r}")
        self._check_ids(input_ids)
        return self.run_blocks(input_ids, states=states, cu_seqlens=cu_seqlens,
                               scales=self.lam_scales(phase, lambda_scale), want_state=want_state,
                               logit_positions=logit_positions)

    def lam_scales(self, phase: str, lambda_scale: LambdaScale | None = None) -> torch.Tensor | None:
        """The strength factors of ``phase`` as ``[L, H]`` float32 on the model's device, or None:
        ``lambda_scale``'s, or (None) those of the ``strength`` blocks around the call."""
        scale = active_lambda_scale(self) if lambda_scale is None else lambda_scale
        return scale.for_phase(phase, self.device)

    def run_blocks(self, input_ids: torch.Tensor, *, states: list[MixerState] | None, cu_seqlens,
                   scales: torch.Tensor | None, want_state: bool, logit_positions=None,
                   state_in_place: bool = False, start_at_layer: int = 0, stop_at_layer: int | None = None):
        """:meth:`forward_with_state` on ids already checked, with the lambda factors ``scales``
        ``[L, H]`` (device) given: no host synchronisation, so it can be captured in a CUDA graph.
        Inside a ``fast_path`` block the blocks run on the fast path where it applies (``fast.py``).
        ``state_in_place``: each layer's new state (recurrent and convolution caches) is written
        over ``states[l]`` (:meth:`QEDMixer.forward`). ``start_at_layer > 0``: ``input_ids`` is
        the residual ``[B, T, hidden]`` entering that block; ``stop_at_layer``: the residual
        leaving block ``stop_at_layer - 1`` is returned instead of logits (no states)."""
        if states is not None and len(states) != self.cfg.num_hidden_layers:
            raise ValueError(f"QEDModel: `states` must hold one MixerState per layer "
                             f"({self.cfg.num_hidden_layers}), got {len(states)}")
        x = self.hook_embed(self.embeddings(input_ids)) if start_at_layer == 0 else input_ids
        fp = active_fast_path(self, packed=cu_seqlens is not None, states=states)
        run_block = QEDBlock.__call__ if fp is None else \
            fast_block_runner(fp, cu_seqlens, x.shape[1], self.cfg.conv_size)
        new_states = []
        for l in range(start_at_layer, self.cfg.num_hidden_layers if stop_at_layer is None else stop_at_layer):
            x, state = run_block(self.blocks[l], x, lam_scale=None if scales is None else scales[l],
                                 state=None if states is None else states[l],
                                 cu_seqlens=cu_seqlens, want_state=want_state, state_in_place=state_in_place)
            new_states.append(state)
        if stop_at_layer is not None:
            return x, None
        if logit_positions is not None:
            x = x[:, logit_positions]
        x = self.norm(x)
        logits = F.linear(x, self.embeddings.weight) if self.lm_head is None else self.lm_head(x)
        return logits, (new_states if want_state else None)

    @property
    def W_E(self) -> torch.Tensor:
        """The embedding ``[vocab, d_model]``: ``hook_embed = W_E[ids]`` (no positional embedding)."""
        return self.embeddings.weight

    @property
    def W_U(self) -> torch.Tensor:
        """The unembedding ``[d_model, vocab]`` (the tied embedding transposed, or ``lm_head``'s):
        ``logits = ln_final(resid) @ W_U``."""
        return (self.embeddings.weight if self.lm_head is None else self.lm_head.weight).T

    @property
    def ln_final(self) -> RMSNorm:
        """The final RMSNorm (TransformerLens' name for ``self.norm``)."""
        return self.norm

    def tokens_to_residual_directions(self, tokens) -> torch.Tensor:
        """Token ids (an int or an integer tensor of any shape) -> their ``W_U`` columns,
        ``[*tokens.shape, d_model]``: the residual direction (after ``ln_final``) whose dot
        product is the token's logit."""
        if isinstance(tokens, str):
            tokens = self.to_single_token(tokens)
        t = torch.as_tensor(tokens, device=self.device)
        if t.dtype not in (torch.int32, torch.int64) or t.numel() == 0 \
                or int(t.min()) < 0 or int(t.max()) >= self.cfg.vocab_size:
            raise ValueError(f"QEDModel: `tokens` must be token ids in [0, {self.cfg.vocab_size}), got {tokens!r:.80}")
        return self.W_U.T[t]

    generate = generation.generate  # model.generate(prompts, max_new_tokens=16, ...): see that function

    def save_pretrained(self, path) -> None:
        """Write ``config.json`` and ``model.safetensors`` into directory ``path``."""
        checkpoint.save_pretrained(self, path)

    @classmethod
    def from_pretrained(cls, path, dtype: torch.dtype | None = None, device=None) -> "QEDModel":
        """Load a directory written by :meth:`save_pretrained`; see ``checkpoint.load_pretrained``."""
        return checkpoint.load_pretrained(cls, path, dtype=dtype, device=device)
