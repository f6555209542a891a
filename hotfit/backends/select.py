"""Which :class:`~backends.base.Backend` serves a plan (the plan's ``backend`` field), and the
backend facts asked before any plan exists. With :mod:`backends.base`, the only part of
``backends/`` the packages above import (pyproject.toml's import-linter contracts)."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from pathlib import Path

from hotfit.backends.base import Backend
from hotfit.backends.http_chat import HttpChatEndpoint
from hotfit.backends.llama_server.backend import LlamaServerBackend
from hotfit.backends.openvino.backend import OpenVinoBackend
from hotfit.core.errors import UsageError
from hotfit.core.settings import Settings
from hotfit.grading.protocol import ChatEndpoint

__all__ = ["BACKENDS", "backend_for", "endpoint_at", "gpu_listing_binaries"]

# Typed as the protocol: mypy checks here that each implementation satisfies Backend.
BACKENDS: dict[str, Backend] = {"llama": LlamaServerBackend(), "openvino": OpenVinoBackend()}


def backend_for(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}", hint=f"use one of {', '.join(BACKENDS)}") from None


def gpu_listing_binaries(settings: Settings) -> tuple[Path, ...]:
    """The binaries the probe asks which GPUs they see (stages/probe.py, ``--list-devices``), before
    any plan names a backend: each backend names its own (:meth:`Backend.device_listing_binaries`)."""
    return tuple(p for backend in BACKENDS.values() for p in backend.device_listing_binaries(settings))


def endpoint_at(url: str, *, api_key: str | None = None) -> AbstractAsyncContextManager[ChatEndpoint]:
    """The grade's endpoint on a server already running (``hotfit grade --endpoint``), whichever
    server it is: OpenAI-compatible chat completions over HTTP."""
    return HttpChatEndpoint(url, api_key=api_key)
