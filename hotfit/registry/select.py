"""The planner's arithmetic, one import surface (pure: no I/O, integers only).

Spec sections "Selection and hot context", "The agentic baseline", "Exclusions and backend
differences": a device's budget and a model's fit (registry/budget.py), one candidate's verdict
(registry/verdict.py), the fail-closed refusal (registry/refusal.py), and the checked origin and
backend names. This module re-exports their public names; the pick itself — ranking the qualifying
candidates — is the planner's (planner/select.py, planner/rank.py).
"""

from __future__ import annotations

from hotfit.core.entry import DEFAULT_BACKEND, ORIGINS, backend_names
from hotfit.core.errors import UsageError

# The planner's surface: registry.select re-exports the budget, verdict and refusal names its
# callers (stages/plan.py, pipeline/worker.py, stages/probe.py, the tests) import from here.
from hotfit.registry.budget import (
    ACCEL_RESERVE_FLOOR_BYTES,
    ACCELERATOR_KINDS,
    DEVICE_KINDS,
    FRAGMENTATION_HEADROOM,
    HOST_KIND,
    HOST_RESERVE_FLOOR_BYTES,
    MAX_HOT_CONTEXT_TOKENS,
    MIN_AGENTIC_HOT_CONTEXT,
    RESERVE_CAP_FRACTION,
    RESERVE_FRACTION,
    RUNTIME_ALLOWANCE_FLOOR_BYTES,
    RUNTIME_ALLOWANCE_FRACTION,
    DeviceBudget,
    GiB,
    MiB,
    ModelFit,
    device_budget,
    fmt_bytes,
    headroom_bytes,
    model_fit,
    model_profile,
    required_device_bytes,
    required_free_bytes,
    reserve_bytes,
    runtime_allowance,
)
from hotfit.registry.refusal import (
    ORIGIN_ALL,
    Refusal,
    RequiredMemory,
    build_refusal,
    origins_with_agentic_models,
    required_memory,
    smallest_agentic,
)
from hotfit.registry.verdict import ReasonCode, Verdict, eligibility_problem, evaluate

__all__ = [
    "ACCEL_RESERVE_FLOOR_BYTES", "ACCELERATOR_KINDS", "DEVICE_KINDS", "FRAGMENTATION_HEADROOM", "HOST_KIND",
    "HOST_RESERVE_FLOOR_BYTES", "MAX_HOT_CONTEXT_TOKENS", "MIN_AGENTIC_HOT_CONTEXT", "ORIGIN_ALL",
    "RESERVE_CAP_FRACTION", "RESERVE_FRACTION", "RUNTIME_ALLOWANCE_FLOOR_BYTES", "RUNTIME_ALLOWANCE_FRACTION",
    "DeviceBudget", "GiB", "MiB", "ModelFit", "ReasonCode", "Refusal", "RequiredMemory", "Verdict",
    "build_refusal", "device_budget", "eligibility_problem", "evaluate", "fmt_bytes", "headroom_bytes",
    "model_fit", "model_profile", "normalize_backend", "normalize_origin", "origins_with_agentic_models",
    "required_device_bytes", "required_free_bytes", "required_memory", "reserve_bytes", "runtime_allowance",
    "smallest_agentic",
]


# --------------------------------------------------------------------------- inputs


def normalize_origin(raw: str | None) -> str | None:
    """None for 'all origins' (unset, empty, 'auto'); a valid origin; else a UsageError."""
    if raw is None or raw.strip() == "" or raw.strip().lower() == ORIGIN_ALL:
        return None
    key = raw.strip().lower()
    if key in ORIGINS:
        return key
    valid = ", ".join((ORIGIN_ALL, *ORIGINS))
    raise UsageError(f"unknown origin {raw!r} (valid: {valid})",
                     hint=f"use one of {valid}; 'auto' or no origin allows all", origin=raw, valid=[ORIGIN_ALL, *ORIGINS])


def normalize_backend(raw: str | None) -> str:
    key = (raw or DEFAULT_BACKEND).strip().lower()
    names = backend_names()
    if key in names:
        return key
    raise UsageError(f"unknown backend {raw!r} (valid: {', '.join(names)})",
                     hint=f"use --backend {' or --backend '.join(names)}", backend=raw, valid=list(names))
