"""Triton kernels of qedprobe (installed as ``qedprobe.kernels``), one folder per op."""
