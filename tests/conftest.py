import os
import sys

import pytest
import torch

# Triton kernels run in the interpreter on machines without a GPU (CI).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))

from helpers import one_thread  # noqa: E402 (the path above first)


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch thread for a module of tiny models (``pytestmark = pytest.mark.usefixtures(
    "one_torch_thread")``): they gain nothing from threads, and on a busy machine OpenMP spinning
    makes them slow."""
    with one_thread():
        yield
