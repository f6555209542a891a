"""The ``hotfit serve`` job: check the provisioned model against the device as it is now, and build
the server command (or the systemd unit) that serves it.

Before it starts anything, serve checks that the device still has the memory for the window
the last ``hotfit auto`` verified. The manifest holds that window as a measurement, not a
setting (contenox-auto-facts.md: a measured figure written down would freeze one reading of
free memory), so when the device has less free now, serve re-plans the window against the
device as it is — never below the 32768-token agentic floor — and says so; below the floor it
fails closed (exit 3).

The command comes from the Backend boundary (``Backend.serve_command``): llama-server's carries
the argv, environment and device pin the load stage opens the model with, and ``hotfit serve``
execs it (:func:`start_server`). A backend hotfit does not run itself (``Backend.serve_execs``
false: OpenVINO, whose official server, OpenVINO Model Server, ships only as release tarballs and
container images) gets its command printed with the verified settings (``--print-command``), and
otherwise its refusal (``Backend.serve_refusal``, exit 2). llama-server is started with the
registry name as its ``--alias`` and ``--metrics`` on, for the clients and the Prometheus of a
fleet; plain ``serve`` replaces itself with it (exec), so a supervisor sees and signals it directly.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import anyio

from hotfit.backends.base import Backend, ModelFiles, ServeCommand
from hotfit.backends.select import backend_for
from hotfit.core.errors import LoadError, NoModelQualifies, UsageError
from hotfit.core.log import get_logger
from hotfit.planner.plan import Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.core.settings import Settings
from hotfit.pipeline.endpoints import ServedEndpoint, endpoint_from_state
from hotfit.pipeline.manifest import Manifest, plan_from_json, read_manifest
from hotfit.pipeline.probe import probe_machine
from hotfit.pipeline.systemd_unit import UnitSpec, systemd_unit, unit_user
from hotfit.pipeline.worker import read_worker_record, record_for_self, stale_reason, write_worker_record
from hotfit.registry.kv import UnknownKV, parse_kv_cache_type
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT, device_budget, fmt_bytes, model_fit

__all__ = ["ServeJob", "ServeOptions", "WindowDecision", "client_endpoint", "decide_window", "prepare_serve",
           "start_server"]

log = get_logger()


@dataclass(frozen=True)
class ServeOptions:
    host: str
    port: int
    api_key_file: Path | None  # absolute: the unit and the worker record name it
    probe_file: Path | None  # check against this saved probe instead of probing now
    print_command: bool
    systemd_unit: bool
    unit_user: str | None


@dataclass(frozen=True)
class WindowDecision:
    context_tokens: int
    verified_tokens: int
    fits_now_tokens: int  # what the device as it is now could hold for this model
    replanned: bool
    message: str


@dataclass(frozen=True)
class ServeJob:
    """What ``hotfit serve`` does, decided: the unit to print, or the command to print or exec.

    ``decision`` is None where the window is not checked now: the unit (it checks at each start)
    and a backend hotfit does not run itself."""

    manifest: Manifest
    options: ServeOptions
    backend: str
    plan: Plan  # the plan served: its window re-planned when the device holds less now
    command: ServeCommand | None = None
    decision: WindowDecision | None = None
    unit: str | None = None

    def to_json(self) -> dict[str, Any]:
        """``hotfit serve --json``: the unit, or the command with what it was decided from."""
        m = self.manifest
        if self.unit is not None:
            return {"unit": self.unit}
        assert self.command is not None
        argv = list(self.command.argv)
        if self.decision is None:
            return {"model": m.entry_name, "backend": self.backend, "server": self.command.server, "argv": argv,
                    "kv_cache_type": m.kv_cache_type, "verified_context_tokens": m.opened_context_tokens}
        d = self.decision
        return {"model": m.entry_name, "context_tokens": d.context_tokens, "verified_context_tokens": d.verified_tokens,
                "replanned": d.replanned, "message": d.message, "kv_cache_type": m.kv_cache_type, "argv": argv,
                "env": dict(self.command.env)}


def decide_window(manifest: Manifest, plan: Plan, probe_now: ProbeResult) -> WindowDecision:
    """Pure: the window to open now. Verified window when the device still holds it; else the
    largest the device holds now, if that is ≥ the floor; else NoModelQualifies."""
    verified = manifest.opened_context_tokens or manifest.planned_hot_context_tokens
    device = _matching_device(probe_now, plan.placement.device)
    budget = device_budget(device.kind, device.total_bytes, device.free_bytes, device.name)
    cache_type = parse_kv_cache_type(manifest.kv_cache_type, source="manifest kv_cache_type")
    fit = model_fit(plan.entry, budget.usable_bytes, cache_type)
    if isinstance(fit, UnknownKV):  # cannot happen for a provisioned entry; fail closed anyway
        raise NoModelQualifies(f"{plan.entry.name}: cannot compute its window: {fit.reason}")
    holds = fit.hot_context_tokens
    if holds >= verified:
        return WindowDecision(verified, verified, holds, False,
                              f"device {device.name} still holds the verified window of {verified} tokens "
                              f"({fmt_bytes(device.free_bytes)} free)")
    if holds >= MIN_AGENTIC_HOT_CONTEXT:
        return WindowDecision(holds, verified, holds, True,
                              f"device {device.name} has {fmt_bytes(device.free_bytes)} free, no longer enough "
                              f"for the verified {verified} tokens: serving a re-planned window of {holds} tokens")
    raise NoModelQualifies(
        f"device {device.name} has {fmt_bytes(device.free_bytes)} free: {plan.entry.name} now holds {holds} tokens "
        f"at {cache_type.name}, below the {MIN_AGENTIC_HOT_CONTEXT}-token floor (verified: {verified})",
        hint="free memory on the device (another process holds it), or run `hotfit auto` to re-plan",
        model=plan.entry.name, holds_tokens=holds, verified_tokens=verified, free_bytes=device.free_bytes,
    )


def _matching_device(probe_now: ProbeResult, planned: Device) -> Device:
    # A UUID names one card whatever CUDA_VISIBLE_DEVICES renumbers (the systemd unit pins it).
    if getattr(planned, "uuid", None):
        for device in probe_now.devices:
            if device.kind == planned.kind and device.uuid == planned.uuid:
                return device
    for device in probe_now.devices:
        if device.kind == planned.kind and device.index == planned.index:
            return device
    for device in probe_now.devices:
        if device.kind == planned.kind and device.name == planned.name:
            return device
    raise NoModelQualifies(
        f"the device the model was verified on ({planned.kind} {planned.index}: {planned.name}) is not present now",
        hint="run `hotfit auto` to plan for the devices this machine has now",
    )


def _files(manifest: Manifest) -> ModelFiles:
    return ModelFiles(Path(manifest.model_path), Path(manifest.template_path) if manifest.template_path else None)


def _provisioned(settings: Settings) -> tuple[Manifest, Plan]:
    manifest = read_manifest(settings.manifest_path, strict=True)
    if manifest is None:
        raise UsageError(f"nothing is provisioned under {settings.home}",
                         hint="run `hotfit auto` first; it writes manifest.json when every stage passed")
    problems = manifest.files_in_place()
    if problems:
        raise UsageError(f"the provisioned files are not in place: {'; '.join(problems)}",
                         hint="run `hotfit auto` again; it re-fetches what is missing")
    plan = plan_from_json(manifest.plan, source=f"manifest {settings.manifest_path}")  # UsageError naming the field
    return manifest, plan


def _serve_command(backend: Backend, settings: Settings, plan: Plan, manifest: Manifest, opts: ServeOptions, *,
                   api_key_file: Path | None) -> ServeCommand:
    """The server for ``plan`` built by the Backend boundary: the load stage's argv, environment and
    device pin (CUDA_VISIBLE_DEVICES for NVIDIA, ``-dev`` for Vulkan devices)."""
    return anyio.run(functools.partial(
        backend.serve_command, plan, _files(manifest), host=opts.host, port=opts.port, api_key_file=api_key_file,
        binary=None, settings=settings, model_name=manifest.entry_name,
        verified={**manifest.measured, **manifest.extra}))


def _hotfit_command(settings: Settings, opts: ServeOptions, pinned: tuple[str, ...]) -> list[str]:
    exe = shutil.which("hotfit")
    base = [exe] if exe else [sys.executable, "-m", "hotfit"]
    cmd = base + ["--home", str(settings.home), *pinned]
    cmd += ["--log-format", "json", "serve", "--host", opts.host, "--port", str(opts.port)]
    if opts.api_key_file:
        cmd += ["--api-key-file", str(opts.api_key_file)]
    return cmd


def _unit_spec(backend: Backend, settings: Settings, opts: ServeOptions, manifest: Manifest, plan: Plan) -> UnitSpec:
    pin = backend.service_pin(plan, settings)
    argv = _hotfit_command(settings, opts, pin.options)
    env = {"CONTENOX_LLAMA_KV_CACHE_TYPE": manifest.kv_cache_type} | backend.device_env(plan)
    home = Path(settings.home).absolute()
    paths = tuple(Path(p) for p in (argv[0], os.path.realpath(argv[0]), sys.prefix) if p) + pin.paths
    return UnitSpec(hotfit_argv=argv, env=env, description=f"hotfit: {pin.server} serving {manifest.entry_name}",
                    user=unit_user(home, opts.unit_user), home=home, device_kind=plan.placement.device.kind,
                    paths=paths)


def prepare_serve(settings: Settings, opts: ServeOptions) -> ServeJob:
    """The job of ``hotfit serve`` up to the exec: the provisioned files in place, then the unit, the
    command of a backend hotfit does not run (or its refusal without ``--print-command``), or the
    window checked against the device now and the command that opens it."""
    manifest, plan = _provisioned(settings)
    backend = backend_for(manifest.backend)
    if not backend.serve_execs:
        command = _serve_command(backend, settings, plan, manifest, opts, api_key_file=None)
        refusal = backend.serve_refusal(manifest.entry_name, command)
        if refusal is not None and not opts.print_command:
            raise refusal
        return ServeJob(manifest, opts, backend.name, plan, command)
    if opts.unit_user and not opts.systemd_unit:
        raise UsageError("--unit-user names the account of the printed systemd unit",
                         hint="add --print-systemd-unit, or drop --unit-user")
    if opts.systemd_unit:
        return ServeJob(manifest, opts, backend.name, plan,
                        unit=systemd_unit(_unit_spec(backend, settings, opts, manifest, plan)))
    decision = decide_window(manifest, plan, probe_machine(settings, probe_file=opts.probe_file))
    serve_plan = dataclasses.replace(plan, hot_context_tokens=decision.context_tokens)
    command = _serve_command(backend, settings, serve_plan, manifest, opts, api_key_file=opts.api_key_file)
    event = "serve.replanned" if decision.replanned else "serve.window_ok"
    log.info(event, model=manifest.entry_name, context_tokens=decision.context_tokens,
             verified_tokens=decision.verified_tokens, fits_now_tokens=decision.fits_now_tokens)
    return ServeJob(manifest, opts, backend.name, serve_plan, command, decision)


def client_endpoint(settings: Settings, opts: ServeOptions, *, listen_given: bool) -> ServedEndpoint:
    """``serve --print-client-config``: the provisioned model's endpoint. The running ``hotfit serve``
    (its serve.pid record, still that process serving this model) gives host, port, key file and
    the window it opened, unless ``--host``/``--port`` were given; else the options (the endpoint
    ``serve`` with them would open, at the verified window)."""
    manifest, _ = _provisioned(settings)
    machine = socket.getfqdn()
    record = read_worker_record(settings.serve_pid_path)
    if record is not None and not listen_given and stale_reason(record, manifest) is None:
        return endpoint_from_state(manifest.to_json(), host=record.host, port=record.port,
                                   api_key_file=record.api_key_file, context_tokens=record.context_tokens,
                                   machine=machine)
    return endpoint_from_state(manifest.to_json(), host=opts.host, port=opts.port,
                               api_key_file=str(opts.api_key_file) if opts.api_key_file else None,
                               context_tokens=None, machine=machine)


def start_server(settings: Settings, job: ServeJob, *, announce: str | None) -> NoReturn:
    """Record this process as the worker, then exec the server (this pid becomes the server's, so a
    later ``hotfit auto`` recognises the model being served and keeps it). ``announce``: written to
    stderr just before the exec."""
    assert job.command is not None and job.decision is not None
    argv = list(job.command.argv)
    opts, manifest = job.options, job.manifest
    record = record_for_self(host=opts.host, port=opts.port, model_path=manifest.model_path,
                             entry_name=manifest.entry_name, context_tokens=job.decision.context_tokens,
                             kv_cache_type=manifest.kv_cache_type, device=job.plan.placement.device,
                             api_key_file=str(opts.api_key_file) if opts.api_key_file else None)
    try:
        write_worker_record(settings.serve_pid_path, record)
    except OSError as exc:  # serving matters more than the record; auto then treats it as absent
        log.warning("serve.pid_unwritable", path=str(settings.serve_pid_path), error=str(exc))
    log.info("serve.exec", argv=argv, pid=record.pid, pid_file=str(settings.serve_pid_path))
    if announce:
        sys.stderr.write(announce)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, job.command.environment(os.environ))
    except OSError as exc:  # gone or not executable since it was checked: exit 5, logged like any failure
        raise LoadError(f"cannot start {argv[0]}: {exc.strerror or exc}",
                        hint=f"run `hotfit auto --recheck` to find and check the {job.command.server} binary again",
                        argv=argv, errno=exc.errno) from None
    raise AssertionError("execve does not return")  # pragma: no cover
