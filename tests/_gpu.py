"""Set-up shared by the checks of ``qed_chunk``'s forward (``test_chunk.py``) and backward
(``test_chunk_bwd.py``): the CUDA skip, the long-sequence GPU check's parametrisation, and the
low-precision inputs with their float64 reference."""
import pytest
import torch

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU checks run the compiled kernels")
LONG_ARMS = ("full", "nogate_noproj")


def long_check(bounds):
    """``@gpu``, parametrised over ``(dtype, bound)`` in ``bounds`` and over ``arm`` in ``LONG_ARMS``."""
    def mark(test):
        test = pytest.mark.parametrize("arm", LONG_ARMS)(test)
        return gpu(pytest.mark.parametrize("dtype,bound", bounds)(test))
    return mark


def low_precision(x64, dtype):
    """``(x, ref_in)``: ``x64``'s tensors in ``dtype`` (the log-decay ``g`` in float32, as models
    pass it) and the reference inputs: the same rounded values in float64."""
    x = {n: t.to(dtype) for n, t in x64.items()}
    x["g"] = x64["g"].float()
    return x, {n: t.double() for n, t in x.items()}
