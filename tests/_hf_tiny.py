"""Tiny random transformers models of the families qedprobe.hf supports (built by transformers
itself; nothing downloaded) and transformers' own PyTorch reference for them.

Every model has hidden size 64, 4 decoder layers (linear attention at 0, 2, 3; softmax attention
at 1, so a layer's index differs from its rank among the linear ones), and grouped value heads
(2 q/k heads, 4 value heads). ``initializer_range`` is 0.1 (transformers'
0.02 makes a tiny model's recurrence contribute almost nothing, so a wrong one could pass).
"""
import contextlib

import torch

from qedprobe.hf import transformers_torch_path
from qedprobe.hf.families import modeling_module_name

VOCAB = 160
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, initializer_range=0.1,
              layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"])
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)


def _configs():
    from transformers import OlmoHybridConfig, Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig
    return {
        "qwen3_5": lambda: Qwen3_5TextConfig(**COMMON, head_dim=16, linear_value_head_dim=16),
        "qwen3_5_moe": lambda: Qwen3_5MoeTextConfig(**COMMON, **MOE, head_dim=16, linear_value_head_dim=16),
        "qwen3_next": lambda: Qwen3NextConfig(**COMMON, **MOE, head_dim=16, linear_value_head_dim=16),
        # OLMo-Hybrid: V = 2K and beta in (0, 2) (linear_allow_neg_eigval, its default).
        "olmo_hybrid": lambda: OlmoHybridConfig(**COMMON, linear_value_head_dim=32, pad_token_id=0,
                                                eos_token_id=1),
    }


FAMILY_NAMES = ("qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid")


def tiny_hf(family: str, seed: int = 0):
    """A tiny random ``...ForCausalLM`` of ``family`` in eval mode, float32."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(_configs()[family]()).eval()


def torch_reference(model):
    """transformers' own PyTorch recurrence for ``model``'s layers (not fla's kernels, which
    transformers would pick when fla is installed) while the block runs."""
    return transformers_torch_path(modeling_module_name(model.config.model_type))


@contextlib.contextmanager
def one_thread():
    """Run with one torch thread (two-core CI machines run tiny models faster that way)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


def token_ids(n: int = 2, t: int = 24, seed: int = 1) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, VOCAB, (n, t), generator=gen)
