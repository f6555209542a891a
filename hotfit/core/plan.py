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
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hotfit.core.entry import Entry
from hotfit.core.records import Fields, stage_record_fail

# "vulkan": a GPU seen only through a Vulkan llama-server's device list (Intel, lavapipe, an AMD
# card without sysfs VRAM counters); its memory figures are what ggml's Vulkan backend reports.
DeviceKind = Literal["nvidia", "amd", "vulkan", "cpu"]
DEVICE_KINDS: tuple[str, ...] = typing.get_args(DeviceKind)
PROBE_SCHEMA = 1
_GGML_DEVICE_RE = re.compile(r"[A-Za-z]+\d+")  # 'Vulkan0', 'CUDA1': load passes it to -dev


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
    compute_capability: str | None = None  # NVIDIA: "8.9" (NVML): which CUDA builds have code for it
    # What speed depends on (registry/speed.py): the device's memory read bandwidth and where the
    # figure came from (host: measured by the probe; NVIDIA: NVML's memory clock x bus width), and
    # for host memory the threads llama-server runs. None = not probed (an older probe file).
    read_bandwidth_bytes_per_s: int | None = None
    bandwidth_basis: str | None = None
    compute_threads: int | None = None


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
            "schema": PROBE_SCHEMA,
            "devices": [dataclasses.asdict(d) for d in self.devices],
            "selected": self.selected,
            "notes": list(self.notes),
        }

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> ProbeResult:
        """The probe stage's record (``to_json()``) back into it, through the one probe decoder
        (:func:`decode_probe`); StageRecordError names a damaged field."""
        return decode_probe(record, Fields(stage_record_fail, noun="probe"))


_DEVICE_REQUIRED = ("index", "kind", "name", "total_bytes", "free_bytes")
_DEVICE_OPTIONAL = ("uuid", "processes_used_bytes", "ggml_device", "compute_capability",
                    "read_bandwidth_bytes_per_s", "bandwidth_basis", "compute_threads")
_CAPABILITY_RE = re.compile(r"\d+\.\d")


def decode_probe(data: Any, f: Fields) -> ProbeResult:
    """The one decoder of a probe's JSON (``ProbeResult.to_json``): a saved probe file
    (``hotfit probe --save``) and the probe inside a manifest's plan. Errors come from ``f``."""
    doc = f.object(data, "", ("schema", "devices", "selected"), optional=("notes",), extra=True)
    f.equal(doc["schema"], "schema", PROBE_SCHEMA, "write it with 'hotfit probe --save FILE'")
    devices: list[Device] = []
    for i, raw in enumerate(f.items(doc["devices"], "devices", non_empty=True, what="the probed devices")):
        d = f.at(f"devices[{i}]")
        obj = d.object(raw, "", _DEVICE_REQUIRED, optional=_DEVICE_OPTIONAL, extra=True)
        index = d.integer(obj["index"], "index", minimum=0)
        kind = d.choice(obj["kind"], "kind", DEVICE_KINDS)
        name = d.string(obj["name"], "name", blank=True)
        total = d.integer(obj["total_bytes"], "total_bytes")
        free = d.integer(obj["free_bytes"], "free_bytes", minimum=0)
        if free > total:
            raise d.fail("free_bytes", f"({free}) exceeds total_bytes ({total})", "a device frees at most its total")
        uuid = d.string(obj.get("uuid"), "uuid", nullable=True, blank=True)
        used = d.integer(obj.get("processes_used_bytes"), "processes_used_bytes", minimum=0, nullable=True)
        ggml_device = d.matching(obj.get("ggml_device"), "ggml_device", _GGML_DEVICE_RE,
                                 "a device name such as 'Vulkan0'", "write llama-server's device name, or null",
                                 nullable=True)
        capability = d.matching(obj.get("compute_capability"), "compute_capability", _CAPABILITY_RE,
                                "a CUDA compute capability such as '8.9'", "write NVML's value, or null",
                                nullable=True)
        bandwidth = d.integer(obj.get("read_bandwidth_bytes_per_s"), "read_bandwidth_bytes_per_s", minimum=1,
                              nullable=True)
        bandwidth_basis = d.string(obj.get("bandwidth_basis"), "bandwidth_basis", nullable=True, blank=True)
        threads = d.integer(obj.get("compute_threads"), "compute_threads", minimum=1, nullable=True)
        if any(x.index == index for x in devices):
            raise d.fail("index", f"{index} appears twice", "give every device its own index")
        devices.append(Device(index=index, kind=kind, name=name, total_bytes=total, free_bytes=free,
                              uuid=uuid, processes_used_bytes=used, ggml_device=ggml_device,
                              compute_capability=capability, read_bandwidth_bytes_per_s=bandwidth,
                              bandwidth_basis=bandwidth_basis, compute_threads=threads))
    selected = doc["selected"]
    if isinstance(selected, bool) or not isinstance(selected, int) or all(x.index != selected for x in devices):
        raise f.fail("selected", f"must be the index of a listed device, got {selected!r}",
                     f"use one of: {', '.join(str(x.index) for x in devices)}")
    return ProbeResult(devices=tuple(devices), selected=selected, notes=f.strings(doc.get("notes", []), "notes"))


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
    # registry/speed.py's prediction for the pick on its device (SpeedPrediction.to_json()); None = none made
    speed_predicted: Mapping[str, Any] | None = None

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
        } | ({} if self.speed_predicted is None else {"speed_predicted": dict(self.speed_predicted)})

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
