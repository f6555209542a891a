"""The worker of this home: the llama-server ``hotfit serve`` is running.

While it serves the provisioned model its weights and KV occupy the device, so a probe taken then
sees that memory as used, and a planner judging the previous model against it would decide the
model being served "no longer qualifies" and provision another one beside it. contenox keeps the
model its worker is serving; so does ``hotfit auto``: it recognises a running worker of its own
home and judges the previous model with that worker's memory counted as available to it.

Recognising it (effects, thin): ``hotfit serve`` writes ``<home>/serve.pid`` (JSON: pid, the
process's start time in clock ticks, listen address, model path, window, device) just before it
execs llama-server, so the pid is the server's. A record is trusted only while that pid is alive
*with the same start time* (a reused pid has another), runs a llama-server serving the manifest's
model, and answers ``/health``; the window it really opened comes from its ``/props`` (or
``/slots``), else the record.

Judging (pure): :func:`worker_held_bytes` — weights and projector, the KV of the window it opened
(the manifest's measured bytes when that is the verified window, else the estimate scaled by the
measured ratio), and the runtime allowance the plan budgeted for it — and
:func:`previous_device_free`, which adds that to the free memory of the previous model's device,
never beyond what the device has in use or its total (stages.plan.available_with_worker).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Mapping

from hotfit.core.errors import IntegrityError
from hotfit.core.lazy_import import lazy_module
from hotfit.core.log import get_logger
from hotfit.pipeline.manifest import Manifest, plan_from_json
from hotfit.planner.probe import Device, ProbeResult
from hotfit.core.records import parse_own_file
from hotfit.registry.kv import UnknownKV, kv_bytes, layer_profile, parse_kv_cache_type
from hotfit.registry.select import MAX_HOT_CONTEXT_TOKENS, runtime_allowance
from hotfit.planner.devices import available_with_worker, same_device
from hotfit.state.files import write_text_atomic

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

log = get_logger()

WORKER_SCHEMA = 1
HEALTH_TIMEOUT_S = 2.0


# --------------------------------------------------------------------------- the record serve writes


@dataclass(frozen=True)
class WorkerRecord:
    pid: int
    start_ticks: int  # /proc/<pid>/stat field 22: distinguishes this process from a later one with its pid
    host: str
    port: int
    model_path: str
    entry_name: str
    context_tokens: int  # the -c serve passed
    kv_cache_type: str
    device: Mapping[str, Any]  # index, kind, name, uuid of the device it runs on
    api_key_file: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema": WORKER_SCHEMA, **asdict(self), "device": dict(self.device)}

    @classmethod
    def decode(cls, text: str, *, path: Path | str) -> WorkerRecord:
        """The record in ``text`` (read from ``path``); IntegrityError naming the file and the field."""
        doc, f = parse_own_file(text, lambda why: _unreadable(path, why), kind="a worker record",
                                noun="worker record")
        keys = ("pid", "start_ticks", "host", "port", "model_path", "entry_name", "context_tokens",
                "kv_cache_type", "device")
        data = f.object(doc, "", ("schema", *keys), extra=True)
        f.equal(data["schema"], "schema", WORKER_SCHEMA, "it is ignored; `hotfit serve` writes a new one")
        counts = ("pid", "start_ticks", "port", "context_tokens")
        texts = ("host", "model_path", "entry_name", "kv_cache_type")
        return cls(**{k: f.integer(data[k], k, minimum=0) for k in counts},
                   **{k: f.string(data[k], k, blank=True) for k in texts},
                   device=f.mapping(data["device"], "device"),
                   api_key_file=f.string(data.get("api_key_file"), "api_key_file", nullable=True))


def _unreadable(path: Path | str, why: str) -> IntegrityError:
    return IntegrityError(f"worker record {path} is damaged: {why}",
                          hint="it is ignored: the worker it named is not trusted", path=str(path))


@dataclass(frozen=True)
class WorkerFacts:
    """A worker found running and healthy, and the window it really opened."""

    record: WorkerRecord
    opened_context_tokens: int
    source: Literal["props", "slots", "record"]


def process_start_ticks(pid: int, proc_root: Path = Path("/proc")) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (None: no such process)."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text()
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may hold spaces: split after its closing paren.
    rest = stat.rpartition(")")[2].split()
    try:
        return int(rest[19])  # field 22 overall: 3 is rest[0]
    except (IndexError, ValueError):
        return None


def write_worker_record(path: Path, record: WorkerRecord) -> None:
    write_text_atomic(path, json.dumps(record.to_json(), indent=2) + "\n")


def read_worker_record(path: Path) -> WorkerRecord | None:
    try:
        return WorkerRecord.decode(path.read_text(encoding="utf-8"), path=path)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, IntegrityError) as exc:
        log.info("worker.record_unreadable", path=str(path), error=str(exc))
        return None


def record_for_self(*, host: str, port: int, model_path: str, entry_name: str, context_tokens: int,
                    kv_cache_type: str, device: Device, api_key_file: str | None) -> WorkerRecord:
    """The record ``hotfit serve`` writes for the llama-server it is about to exec into."""
    pid = os.getpid()
    return WorkerRecord(pid=pid, start_ticks=process_start_ticks(pid) or 0, host=host, port=port,
                        model_path=model_path, entry_name=entry_name, context_tokens=context_tokens,
                        kv_cache_type=kv_cache_type, api_key_file=api_key_file,
                        device={"index": device.index, "kind": device.kind, "name": device.name,
                                "uuid": device.uuid})


# --------------------------------------------------------------------------- recognising it (effects)


def stale_reason(record: WorkerRecord, manifest: Manifest, proc_root: Path = Path("/proc")) -> str | None:
    """Why the record does not describe a live worker serving the manifest's model (None: it does)."""
    ticks = process_start_ticks(record.pid, proc_root)
    if ticks is None:
        return f"process {record.pid} is not running"
    if ticks != record.start_ticks:
        return f"pid {record.pid} belongs to another process now (started at tick {ticks}, not {record.start_ticks})"
    try:
        argv = (proc_root / str(record.pid) / "cmdline").read_bytes().split(b"\0")
    except OSError:
        return f"process {record.pid} cannot be inspected"
    args = [a.decode(errors="replace") for a in argv if a]
    if not args or "llama-server" not in Path(args[0]).name:
        return f"pid {record.pid} runs {args[0] if args else '?'}, not llama-server"
    if record.model_path != manifest.model_path or record.model_path not in args:
        return f"the worker serves {record.model_path}, not the provisioned {manifest.model_path}"
    return None


def _base_url(record: WorkerRecord) -> str:
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(record.host, record.host)
    return f"http://[{host}]:{record.port}" if ":" in host else f"http://{host}:{record.port}"


def _opened_window(client: httpx.Client, record: WorkerRecord) -> tuple[int, Literal["props", "slots", "record"]]:
    try:
        resp = client.get("/props")
        if resp.status_code == 200:
            n_ctx = (resp.json().get("default_generation_settings") or {}).get("n_ctx")
            if isinstance(n_ctx, int) and n_ctx > 0:
                return n_ctx, "props"
        resp = client.get("/slots")
        if resp.status_code == 200 and isinstance(resp.json(), list) and resp.json():
            slots = [s.get("n_ctx") for s in resp.json() if isinstance(s, dict)]
            n_ctxs = [n for n in slots if isinstance(n, int) and n > 0]
            if slots and len(n_ctxs) == len(slots):
                return sum(n_ctxs), "slots"
    except (httpx.HTTPError, ValueError):
        pass
    return record.context_tokens, "record"


def find_worker(path: Path, manifest: Manifest | None, *, proc_root: Path = Path("/proc"),
                timeout_s: float = HEALTH_TIMEOUT_S) -> WorkerFacts | None:
    """The live, healthy worker serving ``manifest``'s model, or None (logged: why not)."""
    record = read_worker_record(path)
    if record is None or manifest is None:
        return None
    why = stale_reason(record, manifest, proc_root)
    if why is None:
        headers = {}
        if record.api_key_file:
            try:
                headers["Authorization"] = "Bearer " + Path(record.api_key_file).read_text().strip()
            except OSError:
                pass  # /health is public; the window then comes from the record
        try:
            with httpx.Client(base_url=_base_url(record), timeout=timeout_s, trust_env=False,
                              headers=headers) as client:
                health = client.get("/health")
                if health.status_code != 200:
                    why = f"its /health answers {health.status_code}"
                else:
                    opened, source = _opened_window(client, record)
                    log.info("worker.found", pid=record.pid, port=record.port, model=record.entry_name,
                             opened_context_tokens=opened, source=source)
                    return WorkerFacts(record, opened, source)
        except httpx.HTTPError as exc:
            why = f"{_base_url(record)} does not answer ({type(exc).__name__})"
    log.info("worker.stale", path=str(path), pid=record.pid, reason=why)
    return None


# --------------------------------------------------------------------------- judging (pure)


def worker_held_bytes(manifest: Manifest, worker: WorkerFacts) -> int:
    """Pure: what the worker holds on its device for the previous model — weights (+ projector),
    the KV of the window it opened, and the runtime allowance the plan budgeted beside them."""
    entry = plan_from_json(manifest.plan).entry
    weights = entry.weights_bytes or manifest.model_size_bytes or 0
    opened = worker.opened_context_tokens
    measured = manifest.measured
    actual = measured.get("actual_kv_bytes")
    if isinstance(actual, int) and opened == manifest.opened_context_tokens:
        kv = actual
    else:
        profile = layer_profile(entry, MAX_HOT_CONTEXT_TOKENS)
        cache_type = parse_kv_cache_type(worker.record.kv_cache_type or manifest.kv_cache_type,
                                         source="worker kv_cache_type")
        kv = 0 if isinstance(profile, UnknownKV) else kv_bytes(profile, opened, cache_type)
        ratio = measured.get("kv_ratio")
        if isinstance(ratio, (int, float)) and ratio > 0:
            kv = int(kv * ratio)  # what this build really allocated per estimated byte
    return weights + kv + runtime_allowance(weights)


def previous_device_free(probe: ProbeResult, manifest: Manifest, worker: WorkerFacts | None) -> tuple[int, int] | None:
    """Pure: (index, free bytes) of the previous model's device with the worker's memory counted
    as available to that model; None when there is no worker or its device is not in the probe."""
    if worker is None:
        return None
    planned = plan_from_json(manifest.plan).placement.device
    device = next((d for d in probe.devices if same_device(d, planned)), None)
    if device is None:
        return None
    return device.index, available_with_worker(device, worker_held_bytes(manifest, worker))
