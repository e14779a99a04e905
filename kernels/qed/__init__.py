"""The QED op: reference (``naive``), chunked and recurrent Triton kernels, shared checks."""
from .arms import PROJECTED_ARMS, erase_direction, erase_vector, project_out
from .inputs import ARMS, QEDProblem, check_qed_inputs, value_checks
from .naive import l2_normalize, qed_naive

__all__ = [
    "ARMS", "PROJECTED_ARMS", "QEDProblem", "check_qed_inputs", "value_checks",
    "erase_direction", "erase_vector", "project_out", "l2_normalize", "qed_naive",
]
