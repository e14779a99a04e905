"""The hooked QED language model: config, model, strength, generation, checkpoints."""
from .config import QEDConfig
from .fast import fast_path
from .hooked import hook_name
from .mixer import MixerState, QEDMixer
from .model import QEDModel
from .strength import LambdaScale, strength

__all__ = ["LambdaScale", "MixerState", "QEDConfig", "QEDMixer", "QEDModel", "fast_path", "hook_name", "strength"]
