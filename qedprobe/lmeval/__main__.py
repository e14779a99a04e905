"""``python -m qedprobe.lmeval ARGS``: lm-eval's own command line (as ``lm_eval ARGS``) with the
model ``qedprobe`` registered, e.g. ``python -m qedprobe.lmeval --model qedprobe --model_args
pretrained=DIR,strength=0.5 --tasks fda``."""
from lm_eval.__main__ import cli_evaluate

from . import QEDProbeLM  # noqa: F401  importing registers the model "qedprobe"

if __name__ == "__main__":
    cli_evaluate()
