"""The ``hotfit verify`` job: re-hash every installed model file against its receipt, and fail
(exit 4) naming each damaged file with both hashes — the stage removed it and its receipt, so
``hotfit pull NAME`` or ``hotfit auto`` fetches it again (docs/faults.md).
"""

from __future__ import annotations

from hotfit.core.errors import IntegrityError
from hotfit.core.settings import Settings
from hotfit.stages.verify import InstalledFile, recheck_models

__all__ = ["verify_installed"]


def verify_installed(settings: Settings, names: list[str] | None, *, wait: bool) -> list[InstalledFile]:
    """Every installed file of ``names`` (all models when empty), checked; raises
    :class:`IntegrityError` when any does not match its receipt."""
    checked = recheck_models(settings.models_dir, names, wait=wait)
    bad = [f for f in checked if not f.ok]
    if bad:
        models = sorted({f.model for f in bad})
        raise IntegrityError(
            f"{len(bad)} of {len(checked)} installed file(s) do not match their receipt: "
            + "; ".join(f"{f.path}: {f.algorithm} {f.actual or 'missing'}, receipt {f.expected}" for f in bad),
            hint="the damaged files and their receipts are removed; fetch them again with "
                 + " / ".join(f"`hotfit pull {m}`" for m in models) + " (or `hotfit auto`)",
            field="sha256", files=[f.to_json() for f in checked])
    return checked
