"""Ready-made hook functions for QED models (installed as ``qedprobe.hooks``).

* :mod:`.recorders`: streaming per-head statistics of the probes (``e``, ``rho``, ``|Sd|``,
  ``|d|``, ``lambda``) without keeping every token.
* :mod:`.interventions`: lambda scaling and erase-direction replacement.
"""
from .interventions import DirectionReplacement, scale_lambda, zero_direction
from .recorders import ProbeRecorder, RunningStats

__all__ = ["DirectionReplacement", "ProbeRecorder", "RunningStats", "scale_lambda", "zero_direction"]
