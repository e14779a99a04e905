r"""Pretrained linear-attention models from Hugging Face transformers, probed and intervened on
inside their recurrence: every delta-rule family of transformers 5.25 (Gated DeltaNet: Qwen3.5
dense and MoE, Qwen3-Next, OLMo-Hybrid, Qwen4-Exp, Lara-Mini; Kimi Delta Attention: Kimi-Linear,
Bailing-Hybrid, GLM-5-Next).

    from qedprobe.hf import adapt, inject_qed
    model = adapt("path/to/Qwen3.5-0.8B")            # or adapt(a transformers model object)
    inject_qed(model, 0.1, arm="full")               # training-free QED; strength() then scales it

See :mod:`.model` (the adapted model), :mod:`.route` (how the recurrence is reached),
:mod:`.recurrence` (hooks and shapes), :mod:`.cache` (``run_with_cache``'s cache),
:mod:`.inject` (the QED term), :mod:`.families`.
Needs ``transformers`` (5.x); nothing is downloaded.
"""
from .families import SUPPORTED, HFQEDConfig, UnsupportedModelError
from .inject import inject_qed
from .model import HFQEDModel, adapt, load_transformers
from .route import transformers_torch_path

__all__ = ["SUPPORTED", "HFQEDConfig", "HFQEDModel", "UnsupportedModelError", "adapt", "inject_qed",
           "load_transformers", "transformers_torch_path"]
