"""What the probe saw: every device with its memory (``Device``, ``ProbeResult``) and the one decoder
of a probe's JSON (a saved probe file, the probe inside a plan's record).

The probe reports devices; it does not choose where a model goes (that is the plan's
:class:`~hotfit.planner.plan.Placement`). ``ProbeResult.preferred`` is only the device the probe alone
would plan for — the largest usable budget, an accelerator before host memory — which ``hotfit
probe`` marks and the probe file writes as ``selected`` (schema 1, unchanged).
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hotfit.core.records import Fields, stage_record_fail
from hotfit.registry.budget import HOST_KIND, device_budget

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


def preferred_device(devices: tuple[Device, ...]) -> Device:
    """The device the probe alone would plan for: the largest usable budget (registry/budget.py), an
    accelerator before host memory, the lower index on a tie. Not the plan's device (its placement)."""
    accelerators = [d for d in devices if d.kind != HOST_KIND]
    pool = accelerators or list(devices)
    return max(pool, key=lambda d: (device_budget(d.kind, d.total_bytes, d.free_bytes).usable_bytes, -d.index))


@dataclass(frozen=True)
class ProbeResult:
    devices: tuple[Device, ...]
    notes: tuple[str, ...] = ()  # why a source was skipped (e.g. "NVML not installed")

    @property
    def preferred(self) -> Device:
        """:func:`preferred_device` of this probe (``hotfit probe`` marks it)."""
        return preferred_device(self.devices)

    def to_json(self) -> dict[str, Any]:
        # "selected" stays in the file (schema 1): what older readers and `hotfit probe --json` show
        return {
            "schema": PROBE_SCHEMA,
            "devices": [dataclasses.asdict(d) for d in self.devices],
            "selected": self.preferred.index,
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
    doc = f.object(data, "", ("schema", "devices"), optional=("selected", "notes"), extra=True)
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
    if "selected" in doc:  # written by every probe; a plan record of schema 1 places its model there
        probed_index(doc["selected"], tuple(devices), f, "selected")
    return ProbeResult(devices=tuple(devices), notes=f.strings(doc.get("notes", []), "notes"))


def probed_index(raw: Any, devices: tuple[Device, ...], f: Fields, field: str) -> Device:
    """``raw``, the index of one of ``devices``, as that device; else ``f``'s error on ``field``."""
    found = None if isinstance(raw, bool) or not isinstance(raw, int) else next(
        (d for d in devices if d.index == raw), None)
    if found is None:
        raise f.fail(field, f"must be the index of a listed device, got {raw!r}",
                     f"use one of: {', '.join(str(x.index) for x in devices)}")
    return found


