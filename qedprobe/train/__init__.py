"""Train small frozen QED checkpoints: NIAH data mixture, WSD schedule, resumable trainer."""
from .config import PRESETS, TrainConfig
from .data import MIXTURES, TrainData
from .schedule import WSD
from .trainer import TrainResult, read_log, train

__all__ = ["MIXTURES", "PRESETS", "TrainConfig", "TrainData", "TrainResult", "WSD", "read_log", "train"]
