"""Reading a registry file: the bundled ``registry/data/curated.json`` or ``--registry FILE``.

registry/ is pure: it parses text (registry.catalog.parse_registry_text); the
file reads live here, with the effects. The bundled file is package data, read through
importlib.resources so an installed (zipped or not) hotfit finds it.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from hotfit.core.errors import RegistryError
from hotfit.registry.catalog import BUNDLED_RESOURCE, Registry, parse_registry_text
from hotfit.state.files import read_text_document

BUNDLED_LABEL = f"registry/{BUNDLED_RESOURCE} (bundled)"


def bundled_registry_path() -> Path:
    """Filesystem path of the bundled registry (what ``registry lock`` updates by default)."""
    return Path(str(resources.files("hotfit.registry").joinpath(BUNDLED_RESOURCE)))


def load_registry(path: Path | str | None = None) -> Registry:
    """Read and check a registry file; ``None`` = the bundled one."""
    if path is None:
        try:
            text = resources.files("hotfit.registry").joinpath(BUNDLED_RESOURCE).read_text(encoding="utf-8")
        except OSError as exc:
            raise RegistryError(f"{BUNDLED_LABEL}: cannot be read ({exc})",
                                hint="reinstall hotfit; the package data is missing", file=BUNDLED_LABEL) from None
        return parse_registry_text(text, BUNDLED_LABEL)
    label = str(path)

    def fail(problem: str, hint: str, **details: Any) -> RegistryError:
        return RegistryError(f"{label}: {problem}", hint="pass the registry JSON file with --registry",
                             file=label, **details)

    return parse_registry_text(read_text_document(Path(path), fail), label)
