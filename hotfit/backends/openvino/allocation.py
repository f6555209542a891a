"""OpenVINO's hot allocation: what the opened pipeline really allocated, against the plan.

GenAI allocates the paged KV cache lazily: ``get_metrics().kv_cache_size_in_bytes`` is 0 until
the first generation step and then equals blocks x bytes per block (measured: tests/test_openvino.py).
So this is read after the tool-call probe (by the re-check stage, :mod:`stages.recheck`), and the
token capacity is derived from it with the IR's own KV geometry (``ReadValue`` states of
``openvino_model.xml``) at the planned precision — never from the configured block count, and
never reporting the estimate as the allocation. The verdict has a problem (the stage fails
closed) when:

- nothing is allocated (0 bytes), or the bytes are not whole blocks at the planned precision
  (the precision fell back, or the geometry differs from the IR's);
- the capacity is below the plan or below the agentic floor (32768);
- the bytes exceed the plan's estimate beyond the tolerance (the budget would be overrun).

Pure: :func:`judge_openvino_allocation`. Effect: :func:`read_allocation`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio

from hotfit.backends.base import KV_EXCESS_TOLERANCE, KV_SHORTFALL_WARN_RATIO, AllocationVerdict
from hotfit.backends.openvino.config import (KV_PRECISIONS, PROMPT_CAP_LEAD, KvShape, SessionConfig, kv_bytes_per_token,
                                             parse_ir_kv_shape, prompt_cap_problem)
from hotfit.backends.openvino.protocol import WorkerGone
from hotfit.core.errors import AllocationMismatch
from hotfit.planner.plan import Plan
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT

if TYPE_CHECKING:  # annotations only: session.py imports this module
    from hotfit.backends.openvino.session import OpenVinoSession

__all__ = ["METRICS_TIMEOUT_S", "OpenVinoAllocationReport", "judge_openvino_allocation", "read_allocation"]

METRICS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class OpenVinoAllocationReport(AllocationVerdict):
    """The verified allocation (``actual_*``, ``opened_*``) beside the plan's estimate — never merged."""

    opened_context_tokens: int | None  # derived from actual_kv_bytes, not from the configuration
    configured_kv_blocks: int
    block_tokens: int
    kv_cache_type: str
    kv_precision: str
    kv_bytes_per_token: int  # at kv_precision, from the IR's KV states
    estimated_kv_bytes: int  # the plan's figure
    predicted_kv_bytes: int  # configured blocks x bytes per block: what GenAI should allocate
    actual_kv_bytes: int  # GenAI's metrics after the first step
    ratio: float | None  # actual / estimate
    max_cache_usage_percent: float | None
    kv_states: int
    tolerance: float

    def opened_figure(self) -> int | None:
        return self.opened_context_tokens  # the one window its bytes hold

    def event_facts(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "planned_hot_context_tokens": self.planned_hot_context_tokens,
            "opened_context_tokens": self.opened_context_tokens,
            "estimated_kv_bytes": self.estimated_kv_bytes,
            "actual_kv_bytes": self.actual_kv_bytes,
            "ratio": round(self.ratio, 6) if self.ratio else None,
            "kv_precision": self.kv_precision,
            "backend": "openvino",
        }

    def warning_event(self, warning: str) -> str:
        return "recheck.prompt_cap" if warning.startswith(PROMPT_CAP_LEAD) else "recheck.kv_below_estimate"


def _fallback_precision(actual: int, shape: KvShape, config: SessionConfig) -> str | None:
    """Another precision whose configured blocks give exactly ``actual`` bytes (None if the planned one does)."""
    for precision in sorted(set(KV_PRECISIONS.values()) - {config.kv_precision}):
        if actual == kv_bytes_per_token(shape, precision) * config.block_tokens * config.num_kv_blocks:
            planned = kv_bytes_per_token(shape, config.kv_precision) * config.block_tokens * config.num_kv_blocks
            return precision if planned != actual else None
    return None


def judge_openvino_allocation(
    *,
    config: SessionConfig,
    shape: KvShape,
    estimated_kv_bytes: int,
    actual_kv_bytes: int,
    floor_tokens: int = MIN_AGENTIC_HOT_CONTEXT,
    tolerance: float = KV_EXCESS_TOLERANCE,
    max_cache_usage: float | None = None,
    prompt_max_tokens: int | None = None,
) -> OpenVinoAllocationReport:
    """Pure: the report; any problem fails the stage. ``prompt_max_tokens``: the tokenizer's prompt
    limit the worker found (a warning: the cache holds the window, a prompt that long is refused)."""
    problems: list[str] = []
    warnings: list[str] = []
    per_token = kv_bytes_per_token(shape, config.kv_precision) if shape.states else 0
    per_block = per_token * config.block_tokens
    opened: int | None = None
    if not shape.states:
        problems.append("the IR has no KV states (ReadValue) to size the cache from: the allocation cannot be verified")
    if actual_kv_bytes <= 0:
        problems.append("OpenVINO reports 0 KV bytes allocated: the cache was never allocated (no generation step "
                        "ran), so the hot context cannot be verified")
    elif per_block:
        fallback = _fallback_precision(actual_kv_bytes, shape, config)
        if fallback is not None:
            problems.append(
                f"OpenVINO allocated {actual_kv_bytes} KV bytes: {config.num_kv_blocks} blocks at {fallback}, not at "
                f"the planned {config.kv_precision} (the precision fell back)"
            )
        elif actual_kv_bytes % per_block:
            problems.append(
                f"OpenVINO allocated {actual_kv_bytes} KV bytes, not whole {config.block_tokens}-token blocks of "
                f"{per_block} bytes at {config.kv_precision} (the KV geometry differs from the IR's)"
            )
        else:
            opened = actual_kv_bytes // per_token
            if opened != config.capacity_tokens:
                warnings.append(f"OpenVINO opened {opened} tokens of cache, the configuration asked for "
                                f"{config.capacity_tokens}")
            if opened < config.planned_tokens:
                problems.append(f"the opened cache holds {opened} tokens, below the planned {config.planned_tokens}")
            if opened < floor_tokens:
                problems.append(f"the opened cache holds {opened} tokens, below the agentic floor of {floor_tokens}")
    if prompt_max_tokens is not None and prompt_max_tokens < config.planned_tokens:
        warnings.append(prompt_cap_problem(prompt_max_tokens, config.planned_tokens))
    ratio = actual_kv_bytes / estimated_kv_bytes if estimated_kv_bytes > 0 and actual_kv_bytes > 0 else None
    if estimated_kv_bytes <= 0:
        problems.append(f"the plan carries no KV estimate ({estimated_kv_bytes} bytes) to check against")
    elif ratio is not None:
        if ratio > 1 + tolerance:
            problems.append(
                f"OpenVINO allocated {actual_kv_bytes} KV bytes, {ratio:.4f}x the plan's estimate of "
                f"{estimated_kv_bytes} (tolerance {tolerance:.0%}): the budget would be overrun"
            )
        elif ratio < KV_SHORTFALL_WARN_RATIO:
            warnings.append(f"OpenVINO allocated {actual_kv_bytes} KV bytes, only {ratio:.3f}x the estimate of "
                            f"{estimated_kv_bytes}")
    return OpenVinoAllocationReport.judged(
        problems,
        warnings,
        planned_hot_context_tokens=config.planned_tokens,
        floor_tokens=floor_tokens,
        opened_context_tokens=opened,
        configured_kv_blocks=config.num_kv_blocks,
        block_tokens=config.block_tokens,
        kv_cache_type=config.kv_cache_type,
        kv_precision=config.kv_precision,
        kv_bytes_per_token=per_token,
        estimated_kv_bytes=estimated_kv_bytes,
        predicted_kv_bytes=per_block * config.num_kv_blocks,
        actual_kv_bytes=actual_kv_bytes,
        ratio=ratio,
        max_cache_usage_percent=max_cache_usage,
        kv_states=len(shape.states),
        tolerance=tolerance,
    )


async def read_allocation(
    session: OpenVinoSession,
    plan: Plan,
    *,
    floor_tokens: int = MIN_AGENTIC_HOT_CONTEXT,
    tolerance: float = KV_EXCESS_TOLERANCE,
    timeout_s: float = METRICS_TIMEOUT_S,
) -> OpenVinoAllocationReport:
    """Read the metrics of ``session`` (after at least one generation: the probe) and judge them
    against ``plan``. Raises :class:`AllocationMismatch` only when the metrics cannot be read."""
    try:
        metrics = await session.request("metrics", timeout_s)
    except (TimeoutError, WorkerGone) as exc:
        raise AllocationMismatch(
            f"could not read the OpenVINO pipeline's metrics (worker {session.describe_exit()}): {exc!r}",
            hint=f"the session cannot be verified; see the worker log {session.log_path}",
            log_path=str(session.log_path),
        ) from None
    xml = await anyio.to_thread.run_sync(
        lambda: (session.ir_dir / "openvino_model.xml").read_text(encoding="utf-8", errors="replace"))
    return judge_openvino_allocation(
        config=session.config,
        shape=parse_ir_kv_shape(xml),
        estimated_kv_bytes=plan.estimated_kv_bytes,
        actual_kv_bytes=int(metrics.get("kv_cache_size_in_bytes", 0)),
        floor_tokens=floor_tokens,
        tolerance=tolerance,
        max_cache_usage=metrics.get("max_cache_usage"),
        prompt_max_tokens=session.prompt_max_tokens,
    )
