"""The immutable plan passed from the plan stage to every later stage, and its one decoder.

``BudgetBreakdown`` is how the planner spent a device's memory, ``Placement`` where the model goes
(the device set and how the model is split across it), and ``Plan`` what will be fetched and opened.
``plan_id`` is a content hash of the decision, so a changed input (hardware, registry, KV type)
yields a new id and invalidates downstream stage state.

The plan's record (``Plan.to_json``) is schema 2: it names its placement. A record without a schema
(written before placements) decodes as a placement on one device, the one its probe's ``selected``
named — the manifests and stage records already on disk keep reading.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from hotfit.core.entry import Entry, entry_json
from hotfit.core.records import Fields, canonical_json, stage_record_fail
from hotfit.planner.probe import Device, ProbeResult, decode_probe, probed_index
from hotfit.registry.schema import decode_entry

PLAN_SCHEMA = 2  # 2: the placement is recorded; 1 (no "schema" key): one device, the probe's "selected"
# How a model is split across its devices: "none", the whole model on one device (llama.cpp's
# --split-mode names; "layer" and "row" come with placements over several devices).
SplitMode = Literal["none"]
SPLIT_MODES: tuple[str, ...] = ("none",)
KV_CACHE_TYPE_SOURCES = ("env", "flag", "default")
REPROVISION_HINT = "run `hotfit auto` to provision again; it rewrites the manifest and reuses completed downloads"


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


@dataclass(frozen=True)
class Placement:
    """Where the model runs: the devices (probe devices, in the order the model is split over them)
    and the split. Today one device holds the whole model (split "none")."""

    devices: tuple[Device, ...]
    split: SplitMode = "none"

    def __post_init__(self) -> None:
        if self.split == "none" and len(self.devices) != 1:  # a wiring bug, not an operator's problem
            raise ValueError(f"split 'none' places a model on one device, not {len(self.devices)}")

    @classmethod
    def single(cls, device: Device) -> Placement:
        return cls((device,))

    @property
    def device(self) -> Device:
        """The one device of an unsplit placement (every placement today)."""
        return self.devices[0]

    def to_json(self) -> dict[str, Any]:
        return {"devices": [d.index for d in self.devices], "split": self.split}

    def identity(self) -> dict[str, Any]:
        """What the plan id covers of the placement: each device's kind, name and total (not its
        free bytes, which jitter between probes)."""
        ids = [{"kind": d.kind, "name": d.name, "total_bytes": d.total_bytes} for d in self.devices]
        if self.split == "none":  # the key plan ids had before placements: unchanged, so state is reused
            return {"device": ids[0]}
        return {"devices": ids, "split": self.split}


@dataclass(frozen=True)
class Plan:
    entry: Entry
    probe: ProbeResult  # every device the probe found (the placement's among them)
    placement: Placement
    kv_cache_type: str
    kv_cache_type_source: Literal["env", "flag", "default"]
    hot_context_tokens: int
    estimated_kv_bytes: int  # KV bytes the opened window should allocate at kv_cache_type
    budget: BudgetBreakdown
    origin: str | None  # None = any
    reused_previous: bool = False
    explicit_model: bool = False  # --model NAME: tool-chat allowed, no fallback
    # registry/speed.py's prediction for the pick on its device (SpeedPrediction.to_json()); None = none
    # made. Not part of plan_id: a prediction informs the pick, it is not what is provisioned.
    speed_predicted: Mapping[str, Any] | None = None

    @property
    def backend(self) -> str:
        return self.entry.backend

    def to_json(self) -> dict[str, Any]:
        return {
            "schema": PLAN_SCHEMA,
            "entry": entry_json(self.entry),
            # "selected" names the plan's device, as in every record before placements: readers of
            # schema 1 (scripts, an older hotfit) still find the device the model runs on
            "probe": self.probe.to_json() | {"selected": self.placement.device.index},
            "placement": self.placement.to_json(),
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
        provisioned, so the id covers the decision (entry, KV type, window, the placement's device
        kind/name/total), not the raw free-byte reading."""
        decision = {
            "entry": entry_json(self.entry),
            "kv_cache_type": self.kv_cache_type,
            "hot_context_tokens": self.hot_context_tokens,
            **self.placement.identity(),
        }
        return hashlib.sha256(canonical_json(decision).encode()).hexdigest()[:16]


_PLAN_FIELDS = ("entry", "probe", "kv_cache_type", "kv_cache_type_source", "hot_context_tokens",
                "estimated_kv_bytes", "budget", "origin")
_PLAN_OPTIONAL = ("schema", "placement", "backend", "reused_previous", "explicit_model", "speed_predicted")


def _decode_placement(doc: Mapping[str, Any], probe: ProbeResult, f: Fields) -> Placement:
    if "schema" not in doc:  # schema 1: one device, the one the probe's "selected" named
        return Placement.single(probed_index(doc["probe"].get("selected"), probe.devices, f.at("probe"), "selected"))
    f.equal(doc["schema"], "schema", PLAN_SCHEMA, REPROVISION_HINT)
    if "placement" not in doc:
        raise f.fail("placement", "is missing", REPROVISION_HINT)
    p = f.at("placement")
    obj = p.object(doc["placement"], "", ("devices", "split"))
    split = p.choice(obj["split"], "split", SPLIT_MODES)
    devices = tuple(probed_index(raw, probe.devices, p, f"devices[{i}]")
                    for i, raw in enumerate(p.items(obj["devices"], "devices", non_empty=True,
                                                    what="the placement's devices")))
    if len(devices) != 1:  # split "none" (the only split today): the whole model on one device
        raise p.fail("devices", f"lists {len(devices)} devices for split {split!r}, which places one",
                     REPROVISION_HINT)
    return Placement(devices, split)  # split: one of SPLIT_MODES (checked above)


def decode_plan_fields(data: Any, f: Fields) -> Plan:
    """The one decoder of ``Plan.to_json()`` (its ``plan_id`` comes out the same): the entry through
    the registry's own entry decoder, the probe through the probe file's; ``f`` names a damaged
    field the way the caller reports it (a stage record, the manifest)."""
    doc = f.object(data, "", _PLAN_FIELDS, optional=_PLAN_OPTIONAL)
    entry = decode_entry(doc["entry"], f.at("entry"), rules=False)
    b = f.at("budget")
    raw_budget = b.object(doc["budget"], "", tuple(BudgetBreakdown.__dataclass_fields__))
    budget = BudgetBreakdown(**{k: b.integer(raw_budget[k], k, minimum=None) for k in raw_budget})
    probe = decode_probe(doc["probe"], f.at("probe"))
    plan = Plan(
        entry=entry,
        probe=probe,
        placement=_decode_placement(doc, probe, f),
        kv_cache_type=f.string(doc["kv_cache_type"], "kv_cache_type"),
        kv_cache_type_source=f.choice(doc["kv_cache_type_source"], "kv_cache_type_source", KV_CACHE_TYPE_SOURCES),
        hot_context_tokens=f.integer(doc["hot_context_tokens"], "hot_context_tokens"),
        estimated_kv_bytes=f.integer(doc["estimated_kv_bytes"], "estimated_kv_bytes", minimum=0),
        budget=budget,
        origin=f.string(doc["origin"], "origin", nullable=True),
        reused_previous=f.boolean(doc.get("reused_previous", False), "reused_previous"),
        explicit_model=f.boolean(doc.get("explicit_model", False), "explicit_model"),
        speed_predicted=_speed_predicted(doc.get("speed_predicted"), f),
    )
    if doc.get("backend", entry.backend) != entry.backend:
        raise f.fail("backend", f"is {doc['backend']!r} but the entry's backend is {entry.backend!r}",
                     REPROVISION_HINT)
    return plan


def _speed_predicted(raw: Any, f: Fields) -> Mapping[str, Any] | None:
    """The plan's recorded speed prediction (registry/speed.py): an object, or absent in older records."""
    if raw is None:
        return None
    return f.object(raw, "speed_predicted", ("prompt_tokens", "prefill_tokens_per_s", "decode_tokens_per_s",
                                            "first_token_s", "basis"), extra=True)


def decode_plan(record: Mapping[str, Any]) -> Plan:
    """The plan's record (``Plan.to_json()``) back into the Plan; StageRecordError names a damaged field."""
    return decode_plan_fields(record, Fields(stage_record_fail, noun="plan"))
