"""Names and numbers shared by the library and the command line's parsers, in a module that
imports nothing: ``qedprobe <command> --help`` shows them (choices, defaults) without loading
torch, Triton or TransformerLens. Their old homes (``qedprobe.kernels.qed``, ``qedprobe.ops``,
``qedprobe.lam``) import them from here."""

ARMS = ("gdn2", "nogate_noproj", "nogate", "full", "rand", "noproj")
"""The six arms. ``a_t = b_t*k_t + lam * d_t`` with ``d_t`` per arm (see ``kernels/qed/arms.py``)."""

MODES = ("auto", "naive", "torch", "chunk", "recurrent")
"""The QED ops :func:`qedprobe.ops.qed_attention` can call by name (``auto``: the best for the device)."""

LAMBDA_MAX = 0.25
"""Upper bound of ``lambda = lambda_max * sigmoid(theta)``."""
THETA_INIT = -2.0
"""Initial ``theta`` of every head (``lambda ~= 0.0298``)."""
THETA_LR_MULT = 10.0
"""``theta``'s learning rate as a multiple of the base one (the paper's)."""
