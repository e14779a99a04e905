"""Ready-made hook functions for QED models.

Imported as ``qedprobe.hooks`` (``from qedprobe.hooks import ProbeRecorder``); run under the bare
name ``hooks`` (Python started in the repository root) it hands over to an installed ``hooks``
package, if any (``qedprobe.shadow``). Like ``kernels/``, the folder sits at the top of the
repository, where a reader of the mechanism looks for the hooks, and ``setup.py`` installs it
inside the package so that the installed distribution has one top-level name, ``qedprobe``. The
hook points themselves are declared in ``qedprobe/model/recurrence.py`` and ``model.py``; these
functions attach to them.

* :mod:`.recorders`: streaming per-head statistics of the probes (``e``, ``rho``, ``|Sd|``,
  ``|d|``, ``lambda``) without keeping every token.
* :mod:`.interventions`: lambda scaling and erase-direction replacement.
"""
if __name__ == "hooks":  # the repository root is on sys.path: not this folder
    from qedprobe.shadow import hand_over
    hand_over(__name__, __file__)
else:
    from .interventions import DirectionReplacement, scale_lambda, zero_direction
    from .recorders import ProbeRecorder, RunningStats

__all__ = ["DirectionReplacement", "ProbeRecorder", "RunningStats", "scale_lambda", "zero_direction"]
