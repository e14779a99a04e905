"""Train small frozen QED checkpoints: NIAH data mixture, WSD schedule, resumable trainer.

Its names are imported from their modules on first use (:mod:`qedprobe.lazy`): the command
line's parser reads :mod:`qedprobe.train.config` without loading torch."""
from qedprobe.lazy import lazy_exports

__all__ = ["MIXTURES", "PRESETS", "TrainConfig", "TrainData", "TrainResult", "WSD", "read_log", "train"]

__getattr__ = lazy_exports(__name__, {"PRESETS": "config", "TrainConfig": "config", "MIXTURES": "mixtures",
                                      "TrainData": "data", "WSD": "schedule", "read_log": "runlog",
                                      "TrainResult": "trainer", "train": "trainer"})
