"""Tiny byte-vocabulary QED models for the eval tests (CPU token loop: keep inputs short)."""
import torch

from qedprobe.model import QEDConfig, QEDModel
from qedprobe.tokenizer import ByteTokenizer


def tiny_model(arm="full", seed=0):
    torch.manual_seed(seed)
    cfg = QEDConfig(vocab_size=ByteTokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
                    num_heads=2, head_dim=16, arm=arm)
    return QEDModel(cfg).eval()


def saved_tiny_model(folder, arm="full", seed=0):
    m = tiny_model(arm, seed)
    m.save_pretrained(folder)
    return str(folder)
