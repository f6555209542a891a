"""The immutable plan passed from the plan stage to every later stage.

``Device``/``ProbeResult`` describe what the probe saw, ``BudgetBreakdown`` how the planner spent
it, and ``Plan`` what will be fetched and opened. ``plan_id`` is a content hash of the plan's
canonical JSON, so a changed input (hardware, registry, KV type) yields a new id and invalidates
downstream stage state.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal, Mapping

from core.decode import decode_record
from core.entry import Entry

# "vulkan": a GPU seen only through a Vulkan llama-server's device list (Intel, lavapipe, an AMD
# card without sysfs VRAM counters); its memory figures are what ggml's Vulkan backend reports.
DeviceKind = Literal["nvidia", "amd", "vulkan", "cpu"]


@dataclass(frozen=True)
class Device:
    index: int
    kind: DeviceKind
    name: str
    total_bytes: int
    free_bytes: int
    uuid: str | None = None  # NVIDIA: pin llama-server to this device (CUDA_VISIBLE_DEVICES=<uuid>)
    processes_used_bytes: int | None = None  # held by other processes (NVML), informational
    ggml_device: str | None = None  # llama-server's name for it ("Vulkan0", "CUDA0"): load pins -dev to it


@dataclass(frozen=True)
class ProbeResult:
    devices: tuple[Device, ...]
    selected: int  # index into devices of the one planned for
    notes: tuple[str, ...] = ()  # why a source was skipped (e.g. "NVML not installed")

    @property
    def device(self) -> Device:
        return next(d for d in self.devices if d.index == self.selected)

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": 1,
            "devices": [dataclasses.asdict(d) for d in self.devices],
            "selected": self.selected,
            "notes": list(self.notes),
        }

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> ProbeResult:
        """A stage record of this result (``to_json()``) back into it; StageRecordError names a damaged field."""
        return decode_record(cls, record, extra_keys=frozenset({"schema"}))


@dataclass(frozen=True)
class BudgetBreakdown:
    """Every subtraction the planner made, in bytes (spec: 'Selection and hot context')."""

    free_bytes: int
    reserve_bytes: int
    headroom_bytes: int
    usable_bytes: int  # free - reserve - headroom
    weights_bytes: int  # artifact + projector
    allowance_bytes: int  # max(weights / 4, 256 MiB)
    kv_budget_bytes: int  # usable - weights - allowance (may be negative: does not fit)
    hot_context_tokens: int


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), default=str)


@dataclass(frozen=True)
class Plan:
    entry: Entry
    probe: ProbeResult
    kv_cache_type: str
    kv_cache_type_source: Literal["env", "flag", "default"]
    hot_context_tokens: int
    estimated_kv_bytes: int  # KV bytes the opened window should allocate at kv_cache_type
    budget: BudgetBreakdown
    origin: str | None  # None = any
    reused_previous: bool = False
    explicit_model: bool = False  # --model NAME: tool-chat allowed, no fallback

    @property
    def backend(self) -> str:
        return self.entry.backend

    def to_json(self) -> dict[str, Any]:
        return {
            "entry": dataclasses.asdict(self.entry),
            "probe": self.probe.to_json(),
            "kv_cache_type": self.kv_cache_type,
            "kv_cache_type_source": self.kv_cache_type_source,
            "hot_context_tokens": self.hot_context_tokens,
            "estimated_kv_bytes": self.estimated_kv_bytes,
            "budget": dataclasses.asdict(self.budget),
            "origin": self.origin,
            "backend": self.backend,
            "reused_previous": self.reused_previous,
            "explicit_model": self.explicit_model,
        }

    @property
    def plan_id(self) -> str:
        """Stable content hash. Free-memory jitter in the probe does not change what is
        provisioned, so the id covers the decision (entry, KV type, window, device kind/total),
        not the raw free-byte reading."""
        d = self.probe.device
        decision = {
            "entry": dataclasses.asdict(self.entry),
            "kv_cache_type": self.kv_cache_type,
            "hot_context_tokens": self.hot_context_tokens,
            "device": {"kind": d.kind, "name": d.name, "total_bytes": d.total_bytes},
        }
        return hashlib.sha256(canonical_json(decision).encode()).hexdigest()[:16]
