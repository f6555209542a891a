"""The ``hotfit probe`` job, and the probe every other job takes when it probes outside the engine
(``hotfit serve``'s check of the window): this machine's devices now, or a saved probe.

The GPUs the backends' runtimes see come from the selector (:func:`backends.select.list_devices`):
the probe runs before any plan names a backend.
"""

from __future__ import annotations

from pathlib import Path

from hotfit.backends.select import list_devices
from hotfit.planner.probe import ProbeResult
from hotfit.core.settings import Settings
from hotfit.stages._host_speed import host_speed
from hotfit.stages.probe import load_probe_file, probe_devices, save_probe, this_machine

__all__ = ["probe_machine"]


def probe_machine(settings: Settings, *, probe_file: Path | None = None, save: Path | None = None,
                  remeasure: bool = False) -> ProbeResult:
    """Probe this machine (or read ``probe_file``, a saved probe); with ``save``, also write the
    probe JSON there (for ``--probe-file``); ``remeasure``: the host's bandwidth measured afresh."""
    result = load_probe_file(probe_file) if probe_file else probe_devices(
        listing=list_devices(settings), host_speed=host_speed(settings.host_speed_file, remeasure=remeasure))
    if save is not None:
        save_probe(result, save, this_machine())
    return result
