"""Ready-made hook functions for QED models.

Imported as ``qedprobe.hooks`` (``from qedprobe.hooks import ProbeRecorder``), never as a bare
``hooks``: like ``kernels/``, the folder sits at the top of the repository, where a reader of the
mechanism looks for the hooks, and ``setup.py`` installs it inside the package so that the
installed distribution has one top-level name, ``qedprobe``. The hook points themselves are
declared in ``qedprobe/model/mixer.py`` and ``model.py``; these functions attach to them.

* :mod:`.recorders`: streaming per-head statistics of the probes (``e``, ``rho``, ``|Sd|``,
  ``|d|``, ``lambda``) without keeping every token.
* :mod:`.interventions`: lambda scaling and erase-direction replacement.
"""
from .interventions import DirectionReplacement, scale_lambda, zero_direction
from .recorders import ProbeRecorder, RunningStats

__all__ = ["DirectionReplacement", "ProbeRecorder", "RunningStats", "scale_lambda", "zero_direction"]
