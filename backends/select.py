"""Which :class:`~backends.base.Backend` serves a plan (the plan's ``backend`` field)."""

from __future__ import annotations

from backends.base import Backend
from backends.llama_server.backend import LlamaServerBackend
from backends.openvino.backend import OpenVinoBackend
from core.errors import UsageError

__all__ = ["BACKENDS", "backend_for"]

BACKENDS: dict[str, Backend] = {"llama": LlamaServerBackend(), "openvino": OpenVinoBackend()}


def backend_for(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}", hint=f"use one of {', '.join(BACKENDS)}") from None
