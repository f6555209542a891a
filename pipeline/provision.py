"""hotfit's stage table for the engine: probe → plan → fetch-weights → fetch-template → verify →
load → probe-tool-call → re-check, one thin adapter per stage.

Each adapter pulls what its stage module needs out of the context and calls it; the stage modules
own the work, the engine (:mod:`pipeline.engine`) owns state, skip and cleanup. Every stage names a
``decode``, so a reused stage hands downstream the same frozen result a fresh one does. The live
session's stages (load, probe-tool-call, re-check) are in :mod:`pipeline.session_stages`.

Stage subsets: ``hotfit auto`` runs :func:`provisioning_stages`; ``auto --dry-run`` and the no-op
check run :func:`planning_stages`; ``hotfit pull`` runs :func:`fetch_stages` for one named entry.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Callable, Mapping
from contextlib import AbstractAsyncContextManager as AsyncContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from backends.base import BackendBinary
from backends.llama_server.discovery import ServerBinary, gpu_listing_binaries
from backends.openvino.backend import OpenVinoRuntime
from core.entry import Entry
from core.errors import NoModelQualifies
from core.log import get_logger
from core.model_files import FetchResult, TemplateResult, VerifyResult
from core.plan import Plan, ProbeResult
from core.records import Fields, stage_record_fail
from core.settings import Settings
from download import check_disk
from pipeline.engine import Stage, StageContext
from pipeline.evidence import admission
from pipeline.manifest import decode_plan as decode_plan_json
from pipeline.registry_file import load_registry
from pipeline.session_stages import SESSION_STAGES, session_stages
from registry.select import normalize_origin
from stages.fetch_template import fetch_template
from stages.fetch_weights import fetch_weights, fetched_still_on_disk
from stages.load import preflight
from stages.plan import PREFLIGHT_KEY, PlannedRun, PlanOutcome, PreviousModel, build_plan, resolve_kv_cache_type
from stages.probe import load_probe_file, probe_devices
from stages.verify import verify
from state.locks import FileLock

log = get_logger()

__all__ = [
    "SESSION_STAGES",
    "STAGE_NAMES",
    "AutoOptions",
    "FetchJob",
    "compute_plan",
    "fetch_stages",
    "planning_stages",
    "provisioning_stages",
]

STAGE_NAMES: tuple[str, ...] = (
    "probe", "plan", "fetch-weights", "fetch-template", "verify", "load", "probe-tool-call", "re-check",
)


@dataclass(frozen=True)
class AutoOptions:
    """What ``hotfit auto`` was asked for (the CLI parses it; the stages read it)."""

    origin: str | None = None
    model: str | None = None
    backend: str = "llama"
    kv_cache_type_flag: str | None = None
    probe_file: Path | None = None
    registry_file: Path | None = None
    refresh: bool = False
    recheck: bool = False
    dry_run: bool = False
    wait: bool = False
    device: str | None = None  # --device KIND|INDEX: plan only that device
    admit_graded: bool = False  # --admit-graded: tool-chat entries with valid grade evidence are candidates

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


# ------------------------------------------------------------------------ probe and plan


def compute_plan(opts: AutoOptions, settings: Settings, probe: ProbeResult,
                 previous: PreviousModel | None) -> PlanOutcome:
    """Selection for ``probe`` (stages.plan). Returns the ``PlanOutcome``; raises the fail-closed
    :class:`NoModelQualifies` (logged as ``plan.rejected``) when nothing qualifies."""
    registry = load_registry(opts.registry_file)
    cache_type, source = resolve_kv_cache_type(opts.kv_cache_type_flag, settings.kv_cache_type_raw)
    admitted = admission(settings, registry.entries, probe) if opts.admit_graded else None
    try:
        outcome = build_plan(probe, registry.entries, cache_type, source, origin=opts.origin,
                             backend=opts.backend, previous=previous, model=opts.model, device=opts.device,
                             admission=admitted)
        if outcome.plan is None:
            outcome.selection.raise_if_refused()
    except NoModelQualifies as exc:
        log.error("plan.rejected", kv_cache_type=cache_type.name, origin=opts.origin or "auto",
                  backend=opts.backend, model=opts.model, error=exc.to_json())
        raise
    return outcome


def plan_machine(settings: Settings, *, probe_file: str | None, kv_cache_type_flag: str | None,
                 origin: str | None, backend: str, registry_file: str | None, previous: str | None,
                 device: str | None, admit_graded: bool = False) -> PlanOutcome:
    """``hotfit plan``: probe (or read the saved probe) and select, returning the whole outcome —
    a refusal included, which the command prints with every candidate's verdict (blocking)."""
    cache_type, source = resolve_kv_cache_type(kv_cache_type_flag, settings.kv_cache_type_raw)
    origin = normalize_origin(origin)  # the cheap inputs are checked before the hardware is probed
    registry = load_registry(registry_file)
    probe = (load_probe_file(probe_file) if probe_file
             else probe_devices(ggml_binaries=gpu_listing_binaries(settings)))
    return build_plan(probe, registry.entries, cache_type, source, origin=origin, backend=backend,
                      previous=previous, device=device,
                      admission=admission(settings, registry.entries, probe) if admit_graded else None)


def _probe_figures(probe: ProbeResult) -> dict[str, Any]:
    d = probe.device
    return {"device_kind": d.kind, "device_name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes}


def _plan_figures(plan: Plan) -> dict[str, Any]:
    return {"model": plan.entry.name, "hot_context_tokens": plan.hot_context_tokens,
            "kv_cache_type": plan.kv_cache_type, "kv_cache_type_source": plan.kv_cache_type_source,
            "estimated_kv_bytes": plan.estimated_kv_bytes, "usable_bytes": plan.budget.usable_bytes,
            "reused_previous": plan.reused_previous, "explicit_model": plan.explicit_model}


def decode_plan(record: Mapping[str, Any]) -> Plan:
    """The plan stage's record (``Plan.to_json()``) back into the Plan, through the manifest's (one)
    plan decoder; StageRecordError names a damaged field."""
    return decode_plan_json(record, Fields(stage_record_fail, noun="plan"))


_PREFLIGHT_DECODERS: dict[str, Callable[..., BackendBinary]] = {
    "llama": ServerBinary.decode, "openvino": OpenVinoRuntime.decode}


def decode_planned(record: Mapping[str, Any]) -> PlannedRun:
    """The plan stage's record (``PlannedRun.to_json()``): the plan, and the preflight's binary
    decoded as the plan's backend writes it; StageRecordError names a damaged field."""
    if not isinstance(record, Mapping):
        return PlannedRun(decode_plan(record))  # the plan's decoder names what is wrong
    plan = decode_plan({k: v for k, v in record.items() if k != PREFLIGHT_KEY})
    found = record.get(PREFLIGHT_KEY)
    if found is None:
        return PlannedRun(plan)
    decoder = _PREFLIGHT_DECODERS.get(plan.backend)
    if decoder is None:
        raise stage_record_fail(PREFLIGHT_KEY, f"is recorded for backend {plan.backend!r}, which has no preflight", "")
    return PlannedRun(plan, decoder(found, path=PREFLIGHT_KEY))


def planning_stages(opts: AutoOptions, previous: PreviousModel | None = None, *,
                    on_plan: Callable[[PlanOutcome], None] | None = None,
                    check_backend: bool = True) -> list[Stage[Any]]:
    """probe → plan. ``on_plan`` sees the whole selection (every device and candidate), which the
    dry run prints; the stage's result is the winning Plan with the backend its preflight found
    (:class:`~stages.plan.PlannedRun`, read by load). ``check_backend`` False (the dry run and the
    no-op check): only plan; the binary is checked when a run would use it."""

    async def probe_stage(ctx: StageContext) -> ProbeResult:
        if opts.probe_file is not None:
            return await anyio.to_thread.run_sync(load_probe_file, opts.probe_file)
        binaries = gpu_listing_binaries(ctx.settings)
        return await anyio.to_thread.run_sync(functools.partial(probe_devices, ggml_binaries=binaries))

    async def plan_stage(ctx: StageContext) -> PlannedRun:
        outcome = compute_plan(opts, ctx.settings, ctx.result("probe", ProbeResult), previous)
        if on_plan is not None:
            on_plan(outcome)
        plan = outcome.plan
        assert plan is not None  # compute_plan raised the refusal otherwise
        if not check_backend:
            return PlannedRun(plan)
        # The backend that will serve this plan must be usable here before a single weight byte is
        # fetched: llama-server found, answering, suiting this CPU and the device;
        # OpenVINO importable with the plan's device and KV precision. Found once: load reuses it.
        return PlannedRun(plan, await anyio.to_thread.run_sync(preflight, plan, ctx.settings))

    return [
        Stage("probe", probe_stage, always_run=True, decode=ProbeResult.decode, figures=_probe_figures),
        Stage("plan", plan_stage, deps=("probe",), always_run=True, decode=decode_planned,
              figures=lambda planned: _plan_figures(planned.plan), plan_of=lambda planned: planned.plan),
    ]


# ------------------------------------------------------------------------ fetch and verify


@dataclass(frozen=True)
class FetchJob:
    """How the fetch stages run: for the plan's entry (``auto``) or one named entry (``pull``)."""

    entry: Entry | None = None  # None: the plan's entry
    wait: bool = False  # queue behind another process holding the model directory's lock
    connections: int | None = None  # parallel byte ranges (None: fetch_weights' default)
    progress: bool = True
    # auto takes the model directory's lock per stage; pull holds it around all three itself
    lock_each_stage: bool = True
    check_disk: bool = True  # auto checks free disk before fetching (contenox `auto`)
    # pull and `auto --recheck`: re-hash a file already in place before trusting its receipt (a
    # byte flipped in place keeps the size; only its hash tells)
    rehash_installed: bool = False

    def entry_of(self, ctx: StageContext) -> Entry:
        return self.entry if self.entry is not None else ctx.require_plan().entry


def _file_fp(f: Mapping[str, Any] | None) -> Any:
    return None if f is None else {k: f.get(k) for k in ("path", "size_bytes", "sha256")}


def _fetch_fingerprint(out: Mapping[str, Any]) -> Any:
    snap = out.get("snapshot")
    return {"weights": _file_fp(out.get("weights")), "projector": _file_fp(out.get("projector")),
            "snapshot": None if snap is None else {k: snap.get(k) for k in ("commit", "directory", "size_bytes")}}


def _fetch_figures(result: FetchResult) -> dict[str, Any]:
    w = result.weights
    if w is None:
        return {"vision": result.vision}
    return {"file": w.file, "size_bytes": w.size_bytes, "bytes_transferred": w.bytes_transferred,
            "resumed_from_bytes": w.resumed_from_bytes, "already_present": w.already_present,
            "hf_cache": w.hf_cache, "sha256": w.sha256, "vision": result.vision}


def _template_fingerprint(out: Mapping[str, Any]) -> Any:
    return {k: out.get(k) for k in ("path", "sha256", "source")}


def _template_still_there(template: TemplateResult) -> bool:
    """The template is a few KiB: hash it, so text edited behind our back is fetched again
    instead of being trusted by verify and load through a skipped record."""
    if template.path is None:
        return True
    try:
        data = Path(template.path).read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == template.sha256


def _verify_fingerprint(out: Mapping[str, Any]) -> Any:
    return {k: out.get(k) for k in ("weights_path", "size_bytes", "sha256", "chat_template_path")}


def _verify_still_there(verified: VerifyResult) -> bool:
    if verified.weights_path is None:
        return False
    p = Path(verified.weights_path)
    if p.is_dir():
        return True
    return p.is_file() and p.stat().st_size == verified.size_bytes


def fetch_stages(job: FetchJob) -> list[Stage[Any]]:
    """fetch-weights → fetch-template → verify for ``job``'s entry."""

    def model_lock(ctx: StageContext) -> AsyncContextManager[Any]:
        dest = ctx.settings.model_dir(job.entry_of(ctx).name)
        # the lock `hotfit pull` takes, so a pull of the same entry never writes beside us
        return FileLock(dest / ".partial" / "pull.lock", wait=job.wait, what=f"model directory {dest}").async_held()

    async def locked(ctx: StageContext, work: Callable[[], Any]) -> Any:
        if not job.lock_each_stage:
            return await work()
        async with model_lock(ctx):
            return await work()

    def pins(ctx: StageContext) -> dict[str, Any]:
        """What the downloaded bytes depend on: the pinned artifacts, not the window or budget."""
        entry = job.entry_of(ctx)
        return {
            "entry": entry.name,
            "artifact": dataclasses.asdict(entry.artifact) if entry.artifact else None,
            "projector": dataclasses.asdict(entry.projector) if entry.projector else None,
            "models_dir": str(ctx.settings.models_dir),
        }

    def template_pin(ctx: StageContext) -> dict[str, Any]:
        entry = job.entry_of(ctx)
        return {"entry": entry.name,
                "chat_template": dataclasses.asdict(entry.chat_template) if entry.chat_template else None,
                "models_dir": str(ctx.settings.models_dir)}

    def verify_inputs(ctx: StageContext) -> dict[str, Any]:
        entry = job.entry_of(ctx)
        # verify cross-checks the GGUF header against the entry's architecture facts too
        return {**pins(ctx), "architecture": entry.architecture, "config": dataclasses.asdict(entry.config),
                "context_limit": entry.context_limit}

    async def fetch_weights_stage(ctx: StageContext) -> FetchResult:
        entry = job.entry_of(ctx)
        dest = ctx.settings.model_dir(entry.name)
        if job.check_disk:
            await anyio.to_thread.run_sync(check_disk, entry, dest)
        return await locked(ctx, lambda: fetch_weights(entry, dest, settings=ctx.settings, connections=job.connections,
                                                       progress=job.progress, wait=job.wait,
                                                       rehash_installed=job.rehash_installed))

    async def fetch_template_stage(ctx: StageContext) -> TemplateResult:
        entry = job.entry_of(ctx)
        # a template that is a file of the OpenVINO snapshot is read from what fetch-weights brought
        snapshot = ctx.result("fetch-weights", FetchResult).snapshot
        return await locked(ctx, lambda: fetch_template(entry, ctx.settings.model_dir(entry.name),
                                                        settings=ctx.settings, wait=job.wait, snapshot=snapshot))

    async def verify_stage(ctx: StageContext) -> VerifyResult:
        entry = job.entry_of(ctx)
        return await locked(ctx, lambda: verify(entry, ctx.settings.model_dir(entry.name),
                                                fetched=ctx.result("fetch-weights", FetchResult),
                                                template=ctx.result("fetch-template", TemplateResult)))

    return [
        Stage("fetch-weights", fetch_weights_stage, inputs=pins, decode=FetchResult.decode,
              still_valid=functools.partial(fetched_still_on_disk, rehash=job.rehash_installed),
              fingerprint=_fetch_fingerprint, figures=_fetch_figures),
        Stage("fetch-template", fetch_template_stage, deps=("fetch-weights",), inputs=template_pin,
              decode=TemplateResult.decode, still_valid=_template_still_there, fingerprint=_template_fingerprint),
        Stage("verify", verify_stage, deps=("fetch-weights", "fetch-template"), inputs=verify_inputs,
              decode=VerifyResult.decode, still_valid=_verify_still_there, fingerprint=_verify_fingerprint),
    ]


def provisioning_stages(opts: AutoOptions, previous: PreviousModel | None = None, *,
                        on_plan: Callable[[PlanOutcome], None] | None = None) -> list[Stage[Any]]:
    """The pipeline of ``hotfit auto``, in order; ``on_plan`` sees the plan stage's outcome."""
    return [*planning_stages(opts, previous, on_plan=on_plan),
            *fetch_stages(FetchJob(wait=opts.wait, rehash_installed=opts.recheck)),
            *session_stages()]
