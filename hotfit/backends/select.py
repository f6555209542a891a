"""Which :class:`~backends.base.Backend` serves a plan (the plan's ``backend`` field), and the
backend facts asked before any plan exists. With :mod:`backends.base`, the only part of
``backends/`` the packages above import (pyproject.toml's import-linter contracts)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from contextlib import AbstractAsyncContextManager

from hotfit.backends.base import Backend, DeviceListing
from hotfit.backends.http_chat import HttpChatEndpoint
from hotfit.backends.llama_server.backend import LlamaServerBackend
from hotfit.backends.openvino.backend import OpenVinoBackend
from hotfit.core.errors import UsageError
from hotfit.core.settings import Settings
from hotfit.grading.protocol import ChatEndpoint

__all__ = ["BACKENDS", "backend_for", "endpoint_at", "list_devices"]

# Typed as the protocol: mypy checks here that each implementation satisfies Backend.
BACKENDS: dict[str, Backend] = {"llama": LlamaServerBackend(), "openvino": OpenVinoBackend()}


def backend_for(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        raise UsageError(f"unknown backend {name!r}", hint=f"use one of {', '.join(BACKENDS)}") from None


def list_devices(settings: Settings, env: Mapping[str, str] | None = None) -> DeviceListing:
    """The GPUs every backend's runtimes see (the probe's source 3, stages/probe.py), asked before
    any plan names a backend (:meth:`Backend.list_devices`; blocking)."""
    listing = DeviceListing()
    for backend in BACKENDS.values():
        listing += backend.list_devices(settings, os.environ if env is None else env)
    return listing


def endpoint_at(url: str, *, api_key: str | None = None) -> AbstractAsyncContextManager[ChatEndpoint]:
    """The grade's endpoint on a server already running (``hotfit grade --endpoint``), whichever
    server it is: OpenAI-compatible chat completions over HTTP."""
    return HttpChatEndpoint(url, api_key=api_key)
