import os
import sys

import torch

# Triton kernels run in the interpreter on machines without a GPU (CI).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(__file__))
