"""qedprobe as an lm-evaluation-harness model: ``import qedprobe.lmeval`` registers the model
``qedprobe`` (:class:`QEDProbeLM`); needs lm-eval (``pip install -e ".[lmeval]"``).

    import lm_eval, qedprobe.lmeval
    lm_eval.simple_evaluate(model="qedprobe", model_args="pretrained=DIR,strength=0.5", tasks=["fda"])

:mod:`.load` (the model arguments and loading; no lm-eval import), :mod:`.model` (the ``LM``).
"""
from .load import ModelArgs, ModelArgsError, parse_model_args
from .model import QEDProbeLM, RequestError

__all__ = ["QEDProbeLM", "ModelArgs", "ModelArgsError", "RequestError", "parse_model_args"]
