"""One candidate's verdict on one device: why an entry qualifies for automatic selection or not (pure).

A model qualifies when it is agentic, auto-eligible (and of a permissive licence), of the planned
backend and origin, with known metadata, and holds ≥ 32768 hot tokens (spec, "Selection and hot
context", "The agentic baseline", "Exclusions and backend differences").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from hotfit.core.entry import PERMISSIVE_LICENSES, Entry
from hotfit.registry.budget import MIN_AGENTIC_HOT_CONTEXT, DeviceBudget, ModelFit, fmt_bytes, model_fit
from hotfit.registry.kv import KVCacheType, UnknownKV
from hotfit.registry.speed import SpeedPrediction

ReasonCode = Literal[
    "ok", "backend", "origin", "tier", "eligibility", "unknown_metadata", "memory", "context_floor", "speed"
]



# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True)
class Verdict:
    entry: Entry
    verdict: Literal["selected", "qualifies", "excluded"]
    reason_code: ReasonCode
    reason: str
    fit: ModelFit | None
    speed: SpeedPrediction | None = None  # predicted for an agent prompt (registry/speed.py); None = not predicted

    @property
    def hot_context_tokens(self) -> int | None:
        return None if self.fit is None else self.fit.hot_context_tokens

    def to_json(self) -> dict[str, object]:
        f = self.fit
        return {
            "name": self.entry.name,
            "verdict": self.verdict,
            "reason": self.reason,
            "reason_code": self.reason_code,
            "hot_context": None if f is None else f.hot_context_tokens,
            "agentic_tier": self.entry.agentic_tier,
            "origin": self.entry.origin,
            "backend": self.entry.backend,
            "params_total_b": self.entry.params_total_b,
            "weights_bytes": None if f is None else f.weights_bytes,
            "allowance_bytes": None if f is None else f.allowance_bytes,
            "kv_budget_bytes": None if f is None else f.kv_budget_bytes,
            "speed": {"predicted": None if self.speed is None else self.speed.to_json()},
        }


def eligibility_problem(entry: Entry) -> str | None:
    if not entry.auto_eligible:
        return f"not auto-eligible: {entry.ineligible_reason or 'no reason recorded'}"
    if entry.license not in PERMISSIVE_LICENSES:
        return f"licence {entry.license!r} is not {' or '.join(PERMISSIVE_LICENSES)}"
    return None


def evaluate(entry: Entry, budget: DeviceBudget, cache_type: KVCacheType, *,
             origin: str | None, backend: str) -> Verdict:
    """Why ``entry`` does or does not qualify for automatic selection (verdict 'qualifies'/'excluded')."""
    fit = model_fit(entry, budget.usable_bytes, cache_type)
    known = fit if isinstance(fit, ModelFit) else None

    def excluded(code: ReasonCode, reason: str) -> Verdict:
        return Verdict(entry, "excluded", code, reason, known)

    if entry.backend != backend:
        return excluded("backend", f"backend {entry.backend}, planning for {backend}")
    if origin is not None and entry.origin != origin:
        return excluded("origin", f"origin {entry.origin}, planning for {origin} (explicit origins never fall back)")
    if entry.agentic_tier != "agentic":
        return excluded("tier", f"tier {entry.agentic_tier}: only agentic models are picked automatically "
                                f"(installable by name)")
    problem = eligibility_problem(entry)
    if problem:
        return excluded("eligibility", problem)
    if isinstance(fit, UnknownKV):
        return excluded("unknown_metadata", f"unknown metadata: {fit.reason}")
    if entry.params_total_b is None:
        return excluded("unknown_metadata", "unknown metadata: parameter count not recorded")
    assert known is not None
    if known.ceiling_tokens < MIN_AGENTIC_HOT_CONTEXT:
        return excluded("context_floor", f"context ceiling {known.ceiling_tokens} is below the "
                                         f"{MIN_AGENTIC_HOT_CONTEXT}-token floor at any budget")
    if known.hot_context_tokens == 0:
        if known.kv_budget_bytes < 0:
            return excluded("memory", f"weights {fmt_bytes(known.weights_bytes)} + runtime allowance "
                                      f"{fmt_bytes(known.allowance_bytes)} exceed the usable "
                                      f"{fmt_bytes(budget.usable_bytes)}")
        return excluded("memory", f"KV budget {fmt_bytes(known.kv_budget_bytes)} holds no tokens "
                                  f"at {cache_type.name}")
    if known.hot_context_tokens < MIN_AGENTIC_HOT_CONTEXT:
        return excluded("context_floor", f"holds {known.hot_context_tokens} hot tokens at {cache_type.name}, "
                                         f"below the {MIN_AGENTIC_HOT_CONTEXT}-token floor")
    return Verdict(entry, "qualifies", "ok", f"holds {known.hot_context_tokens} hot tokens at {cache_type.name}",
                   known)
