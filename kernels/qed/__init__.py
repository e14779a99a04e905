"""The QED op: reference (``naive``), chunked PyTorch path, chunked and recurrent Triton kernels."""
from .arms import PROJECTED_ARMS, erase_direction, erase_vector, project_out
from .chunk import qed_chunk
from .chunk_torch import qed_chunk_torch
from .fused_recurrent import qed_recurrent
from .inputs import ARMS, LAMBDA_BOUND, QEDOutput, QEDProblem, check_qed_inputs, value_checks
from .naive import l2_normalize, qed_naive

__all__ = [
    "ARMS", "LAMBDA_BOUND", "PROJECTED_ARMS", "QEDOutput", "QEDProblem", "check_qed_inputs", "value_checks",
    "erase_direction", "erase_vector", "project_out", "l2_normalize",
    "qed_naive", "qed_chunk_torch", "qed_chunk", "qed_recurrent",
]
