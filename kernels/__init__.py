"""Triton kernels of qedprobe and their PyTorch references, one folder per op (``qed/``).

Imported as ``qedprobe.kernels`` (``from qedprobe.kernels.qed import qed_chunk``). Run under
the bare name ``kernels`` (Python started in the repository root), it hands over to the
installed ``kernels`` package that transformers imports (``qedprobe.shadow``). The folder sits at the top of the repository, beside ``qedprobe/`` and ``hooks/``,
so the kernels are read, tested and benchmarked (``bench/``) on their own; ``setup.py`` installs
it inside the package (``package_dir``), so the installed distribution has one top-level name,
``qedprobe``, and no generic ``kernels`` module that could shadow or be shadowed by another
project's. Code outside the kernels reaches the ops through ``qedprobe.ops``.
"""

if __name__ == "kernels":  # the repository root is on sys.path: not this folder
    from qedprobe.shadow import hand_over
    hand_over(__name__, __file__)
