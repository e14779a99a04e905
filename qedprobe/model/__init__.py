"""The hooked QED language model: config, model, strength, generation, checkpoints."""
from .config import QEDConfig
from .hooked import hook_name
from .mixer import MixerState, QEDMixer
from .model import QEDModel
from .strength import strength

__all__ = ["MixerState", "QEDConfig", "QEDMixer", "QEDModel", "hook_name", "strength"]
