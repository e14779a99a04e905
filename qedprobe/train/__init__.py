"""Train small frozen QED checkpoints: NIAH data mixture, WSD schedule, resumable trainer."""
from .config import PRESETS, TrainConfig
from .data import MIXTURES, TrainData
from .schedule import WSD
from .runlog import read_log
from .trainer import TrainResult, train

__all__ = ["MIXTURES", "PRESETS", "TrainConfig", "TrainData", "TrainResult", "WSD", "read_log", "train"]
