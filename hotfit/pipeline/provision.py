"""hotfit's stage order for the engine: probe → plan → fetch-weights → fetch-template → verify →
load → probe-tool-call → re-check, and what each job asks of them.

Each stage declares itself — work, result type, decoder, reuse check, fingerprint, figures,
version — in its ``stages/<name>.py`` (``DECLARATION``); this module only puts the declarations in
order and hands each its job (:meth:`~stages.declaration.StageDeclaration.with_job`): the saved
probe, the selection of ``hotfit auto``'s options, the fetch job. The engine
(:mod:`pipeline.engine`) owns state, skip and cleanup. The live session's stages (load,
probe-tool-call, re-check) are in :mod:`pipeline.session_stages`.

Stage subsets: ``hotfit auto`` runs :func:`provisioning_stages`; ``auto --dry-run`` and the no-op
check run :func:`planning_stages`; ``hotfit pull`` runs :func:`fetch_stages` for one named entry.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotfit.core.entry import DEFAULT_BACKEND
from hotfit.core.errors import NoModelQualifies
from hotfit.core.log import get_logger
from hotfit.planner.probe import ProbeResult
from hotfit.core.settings import Settings
from hotfit.pipeline.engine import Stage
from hotfit.pipeline.evidence import admission
from hotfit.pipeline.probe import probe_machine
from hotfit.pipeline.registry_file import load_registry
from hotfit.pipeline.session_stages import SESSION_STAGES, session_stages
from hotfit.registry.select import normalize_backend, normalize_origin
from hotfit.stages import fetch_template, fetch_weights, measure_speed, plan, probe, verify
from hotfit.stages.fetch_weights import FetchJob
from hotfit.planner.devices import KVSource, PlanOutcome, PreviousModel
from hotfit.registry.catalog import Registry
from hotfit.registry.kv import KVCacheType
from hotfit.registry.speed import DEFAULT_AGENT_PROMPT_TOKENS, SpeedFloors, SpeedPlanning
from hotfit.stages.measure_speed import SpeedCheckJob, calibration_build_now, read_calibration
from hotfit.stages.plan import PlanJob, build_plan, resolve_kv_cache_type
from hotfit.stages.probe import ProbeJob

log = get_logger()

__all__ = [
    "SESSION_STAGES",
    "STAGE_NAMES",
    "AutoOptions",
    "FetchJob",
    "PreparedSelection",
    "SelectionOptions",
    "compute_plan",
    "fetch_stages",
    "plan_machine",
    "plan_probe",
    "planning_stages",
    "prepare_selection",
    "provisioning_stages",
]

STAGE_NAMES: tuple[str, ...] = (
    "probe", "plan", "fetch-weights", "fetch-template", "verify", "load", "probe-tool-call", "re-check", "measure-speed",
)


@dataclass(frozen=True)
class AutoOptions:
    """What ``hotfit auto`` was asked for (the CLI parses it; the stages read it)."""

    origin: str | None = None
    model: str | None = None
    backend: str = DEFAULT_BACKEND
    kv_cache_type_flag: str | None = None
    probe_file: Path | None = None
    registry_file: Path | None = None
    refresh: bool = False
    recheck: bool = False
    dry_run: bool = False
    wait: bool = False
    device: str | None = None  # --device KIND|INDEX: plan only that device
    admit_graded: bool = False  # --admit-graded: tool-chat entries with valid grade evidence are candidates
    # speed (registry/speed.py): the agent prompt predicted for, and the opt-in floors as flags (None = unset:
    # the environment's HOTFIT_MIN_DECODE_TOKENS_PER_S / HOTFIT_MAX_FIRST_TOKEN_S, else no floor)
    agent_prompt_tokens: int = DEFAULT_AGENT_PROMPT_TOKENS
    min_decode_tokens_per_s: float | None = None
    max_first_token_s: float | None = None
    min_context_tokens: int | None = None
    skip_speed_check: bool = False  # --skip-speed-check: no measure-speed stage (never skipped otherwise)

    def speed_check(self) -> SpeedCheckJob:
        return SpeedCheckJob(self.agent_prompt_tokens, SpeedFloors(self.min_decode_tokens_per_s,
                                                                   self.max_first_token_s))

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


# ------------------------------------------------------------------------ probe and plan


def speed_planning(settings: Settings, probe: ProbeResult, *, backend: str = DEFAULT_BACKEND,
                   agent_prompt_tokens: int = DEFAULT_AGENT_PROMPT_TOKENS, min_decode_tokens_per_s: float | None = None,
                   max_first_token_s: float | None = None, min_context_tokens: int | None = None) -> SpeedPlanning:
    """The run's speed inputs: a flag wins over its environment variable (core/settings.py); this
    machine's calibration, with the build its backend would run now (it holds for that build only)."""
    calibration = read_calibration(settings.speed_calibration_path)
    planning = SpeedPlanning(agent_prompt_tokens, SpeedFloors(min_decode_tokens_per_s, max_first_token_s,
                                                              min_context_tokens)
                             .over(settings.min_decode_tokens_per_s, settings.max_first_token_s), calibration)
    if calibration is None or not any(calibration.applies_to(d) for d in probe.devices):
        return planning  # none, or another machine's devices (a fleet's probe file): no build to ask for
    planning = dataclasses.replace(planning, calibration_build_now=calibration_build_now(calibration, settings))
    why = planning.calibration_set_aside(normalize_backend(backend))
    if why is not None:
        log.info("speed.calibration_reset", path=str(settings.speed_calibration_path), reason=why,
                 provenance=calibration.provenance, hint="the next measure-speed stores one for this build")
    return planning


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
                             admission=admitted, speed=speed_planning(
                                 settings, probe, backend=opts.backend, agent_prompt_tokens=opts.agent_prompt_tokens,
                                 min_decode_tokens_per_s=opts.min_decode_tokens_per_s,
                                 max_first_token_s=opts.max_first_token_s, min_context_tokens=opts.min_context_tokens))
        if outcome.plan is None:
            outcome.selection.raise_if_refused()
    except NoModelQualifies as exc:
        log.error("plan.rejected", kv_cache_type=cache_type.name, origin=opts.origin or "auto",
                  backend=opts.backend, model=opts.model, error=exc.to_json())
        raise
    return outcome


@dataclass(frozen=True)
class SelectionOptions:
    """What ``hotfit plan`` and ``hotfit fleet plan`` are asked to select with — the same options,
    read by one parser (pipeline/cli/plan.py, ``selection_from_args``) and applied by one function
    (:func:`plan_probe`), so a machine planned in a fleet gets exactly the plan ``hotfit plan``
    gives it. ``previous``: keep this model while it qualifies (any device)."""

    kv_cache_type_flag: str | None = None
    origin: str | None = None
    backend: str = DEFAULT_BACKEND
    registry_file: Path | None = None
    previous: str | None = None
    device: str | None = None  # --device KIND|INDEX: plan only that device
    admit_graded: bool = False  # --admit-graded: this home's grade evidence (one machine only)
    # speed (registry/speed.py): the agent prompt predicted for, and the opt-in floors (None = unset:
    # the environment's HOTFIT_MIN_DECODE_TOKENS_PER_S / HOTFIT_MAX_FIRST_TOKEN_S, else no floor)
    agent_prompt_tokens: int = DEFAULT_AGENT_PROMPT_TOKENS
    min_decode_tokens_per_s: float | None = None
    max_first_token_s: float | None = None
    min_context_tokens: int | None = None


@dataclass(frozen=True)
class PreparedSelection:
    """:class:`SelectionOptions` with its cheap inputs read and checked once — the registry file,
    the KV type, the origin — before any machine is probed or any saved probe read."""

    options: SelectionOptions
    registry: Registry
    cache_type: KVCacheType
    kv_cache_type_source: KVSource
    origin: str | None


def prepare_selection(settings: Settings, opts: SelectionOptions) -> PreparedSelection:
    """Read the registry and resolve the KV type and origin (UsageError/RegistryError on bad input)."""
    cache_type, source = resolve_kv_cache_type(opts.kv_cache_type_flag, settings.kv_cache_type_raw)
    origin = normalize_origin(opts.origin)
    return PreparedSelection(opts, load_registry(opts.registry_file), cache_type, source, origin)


def plan_probe(settings: Settings, prepared: PreparedSelection, probe: ProbeResult, *,
               previous: PreviousModel | None = None) -> PlanOutcome:
    """The one selection ``hotfit plan`` and ``hotfit fleet plan`` make for a probe: the whole
    outcome, a refusal included (never raises for 'no fit'). ``previous`` (a saved manifest's
    model and device) wins over the options' ``previous`` name."""
    opts = prepared.options
    entries = prepared.registry.entries
    return build_plan(probe, entries, prepared.cache_type, prepared.kv_cache_type_source,
                      origin=prepared.origin, backend=opts.backend,
                      previous=previous if previous is not None else opts.previous, device=opts.device,
                      admission=admission(settings, entries, probe) if opts.admit_graded else None,
                      speed=speed_planning(settings, probe, backend=opts.backend,
                                           agent_prompt_tokens=opts.agent_prompt_tokens,
                                           min_decode_tokens_per_s=opts.min_decode_tokens_per_s,
                                           max_first_token_s=opts.max_first_token_s,
                                           min_context_tokens=opts.min_context_tokens))


def plan_machine(settings: Settings, opts: SelectionOptions, *, probe_file: str | None) -> PlanOutcome:
    """``hotfit plan``: probe (or read the saved probe) and select, returning the whole outcome —
    a refusal included, which the command prints with every candidate's verdict (blocking)."""
    prepared = prepare_selection(settings, opts)  # the cheap inputs are checked before the hardware is probed
    probe = probe_machine(settings, probe_file=Path(probe_file) if probe_file else None)
    return plan_probe(settings, prepared, probe)


def planning_stages(opts: AutoOptions, previous: PreviousModel | None = None, *,
                    on_plan: Callable[[PlanOutcome], None] | None = None,
                    check_backend: bool = True) -> list[Stage[Any]]:
    """probe → plan. ``on_plan`` sees the whole selection (every device and candidate), which the
    dry run prints; the stage's result is the winning Plan with the backend its preflight found
    (:class:`~stages.plan.PlannedRun`, read by load). ``check_backend`` False (the dry run and the
    no-op check): only plan; the binary is checked when a run would use it."""
    select = functools.partial(compute_plan, opts, previous=previous)
    return [probe.DECLARATION.with_job(ProbeJob(opts.probe_file)),
            plan.DECLARATION.with_job(PlanJob(select, on_plan=on_plan, check_backend=check_backend))]


# ------------------------------------------------------------------------ fetch and verify


def fetch_stages(job: FetchJob) -> list[Stage[Any]]:
    """fetch-weights → fetch-template → verify for ``job``'s entry."""
    return [fetch_weights.for_job(job), fetch_template.DECLARATION.with_job(job), verify.DECLARATION.with_job(job)]


def provisioning_stages(opts: AutoOptions, previous: PreviousModel | None = None, *,
                        on_plan: Callable[[PlanOutcome], None] | None = None) -> list[Stage[Any]]:
    """The pipeline of ``hotfit auto``, in order; ``on_plan`` sees the plan stage's outcome."""
    return [*planning_stages(opts, previous, on_plan=on_plan),
            *fetch_stages(FetchJob(wait=opts.wait, rehash_installed=opts.recheck)),
            *session_stages(),
            *([] if opts.skip_speed_check else [measure_speed.DECLARATION.with_job(opts.speed_check())])]
