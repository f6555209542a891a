"""hotfit serve: start llama-server with the verified parameters.

Before it starts anything, serve checks that the device still has the memory for the window
the last ``hotfit auto`` verified. The manifest holds that window as a measurement, not a
setting (contenox-auto-facts.md: a measured figure written down would freeze one reading of
free memory), so when the device has less free now, serve re-plans the window against the
device as it is — never below the 32768-token agentic floor — and says so; below the floor it
fails closed (exit 3).

An OpenVINO manifest is not served by hotfit: no maintained OpenAI-compatible server for OpenVINO
GenAI is on PyPI, and the official one, OpenVINO Model Server (``ovms``), ships only as release
tarballs and container images. ``serve`` exits 2 saying so, and ``--print-command`` prints the
``ovms`` command line with the verified settings (:func:`backends.openvino.backend.ovms_argv`) for the
operator to run. Both commands come from the Backend boundary (``Backend.serve_command``): the
llama-server one carries the argv, environment and device pin the load stage opens the model with.

``--print-command`` and ``--print-systemd-unit`` hand the result to a service manager. The unit
runs ``hotfit serve`` itself, so the memory check happens at every start, as an unprivileged
account in a sandbox that still reaches the plan's GPU, and does not restart on hotfit's permanent
exit codes (docs/recipes.md, "systemd"). llama-server is started with the registry name as its
``--alias`` and ``--metrics`` on, for the clients and the Prometheus of a fleet. Plain ``serve``
replaces itself with llama-server (exec), so a supervisor sees and signals llama-server directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import pwd
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from backends.base import ModelFiles, ServeCommand
from backends.llama_server.discovery import find_llama_server, gpu_listing_binaries
from backends.select import backend_for
from core.errors import HotfitError, LoadError, NoModelQualifies, UsageError
from core.log import get_logger
from pipeline.cli.context import CliContext
from pipeline.manifest import Manifest, plan_from_json, read_manifest
from pipeline.worker import record_for_self, write_worker_record
from registry.kv import UnknownKV, parse_kv_cache_type
from registry.select import MIN_AGENTIC_HOT_CONTEXT, device_budget, fmt_bytes, model_fit
from stages import probe as probe_stage

log = get_logger()


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", parents=parents, help="serve the provisioned model with llama-server",
                       description="Start llama-server with the parameters `hotfit auto` verified, after "
                                   "checking the device still has the memory for them.")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--print-command", action="store_true", help="print the llama-server command line and exit")
    p.add_argument("--print-systemd-unit", action="store_true", help="print a systemd unit and exit")
    p.add_argument("--unit-user", metavar="USER",
                   help="with --print-systemd-unit: the account the service runs as "
                        "(default: the home's owner, or `hotfit` when root owns it)")
    p.add_argument("--probe-file", metavar="FILE",
                   help="check against a saved probe (hotfit probe --json) instead of probing now")
    p.add_argument("--api-key-file", metavar="FILE", help="require the API key in FILE (passed to llama-server)")
    p.set_defaults(handler=handler)


@dataclass(frozen=True)
class WindowDecision:
    context_tokens: int
    verified_tokens: int
    fits_now_tokens: int  # what the device as it is now could hold for this model
    replanned: bool
    message: str


def decide_window(manifest: Manifest, plan: Any, probe_now: Any) -> WindowDecision:
    """Pure: the window to open now. Verified window when the device still holds it; else the
    largest the device holds now, if that is ≥ the floor; else NoModelQualifies."""
    verified = manifest.opened_context_tokens or manifest.planned_hot_context_tokens
    device = _matching_device(probe_now, plan.probe.device)
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


def _matching_device(probe_now: Any, planned: Any) -> Any:
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


def _probe_now(args: argparse.Namespace, settings: Any) -> Any:
    if args.probe_file:
        return probe_stage.load_probe_file(Path(args.probe_file))
    return probe_stage.probe_devices(ggml_binaries=gpu_listing_binaries(settings))


# Exit codes of `hotfit serve` that a restart cannot change (core/errors.py): 2 nothing provisioned
# or a bad setting, 3 the device no longer holds the floor (or is gone), 5 no usable llama-server.
# 7 (the hardware probe failed) stays restartable: at boot the GPU driver may come up late.
PERMANENT_EXIT_CODES = (2, 3, 5)
# Past this many starts in this interval systemd stops trying (a crash loop of llama-server itself).
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_S = 600
RESTART_SEC = 10
# Device-node groups (/proc/devices) a plan's accelerator is opened through; DevicePolicy=closed
# allows nothing else. NVIDIA: the cards, nvidiactl and modeset share "nvidia-frontend", UVM is
# CUDA's memory manager, "nvidia-caps" the MIG capabilities. AMD/Vulkan: DRM render nodes
# (/dev/dri), and /dev/kfd for ROCm builds.
GPU_DEVICE_ALLOW: dict[str, tuple[str, ...]] = {
    "nvidia": ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"),
    "amd": ("char-drm rw", "/dev/kfd rw"),
    "vulkan": ("char-drm rw", "/dev/kfd rw"),
    "cpu": (),
}
# Home directories ProtectHome= hides; a path under them needs ProtectHome=read-only.
_HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))
_STATE_ROOT = Path("/var/lib")


@dataclass(frozen=True)
class UnitSpec:
    """What the printed unit depends on (built from the provisioned home; rendered purely)."""

    hotfit_argv: list[str]
    env: dict[str, str]
    description: str
    user: str
    home: Path
    device_kind: str
    paths: tuple[Path, ...] = ()  # files the service reads outside the home: hotfit, llama-server


def under_home_dirs(path: Path) -> bool:
    return any(path == root or root in path.parents for root in _HOME_ROOTS)


def systemd_unit(spec: UnitSpec) -> str:
    """Pure: a hardened unit that runs `hotfit serve` (the memory check repeats at every start).

    The service runs as ``spec.user`` (not root) with no capabilities, a read-only system, a
    system-call filter and a closed device policy that still admits the plan's accelerator
    (docs/recipes.md, "systemd"). A home under /var/lib is the unit's StateDirectory (systemd
    creates it and hands it to the user); elsewhere it is the one writable path."""
    home = spec.home
    state_dir = str(home.relative_to(_STATE_ROOT)) if _STATE_ROOT in home.parents else None
    hidden = any(under_home_dirs(p) for p in (home, *spec.paths))
    kind = spec.device_kind
    devices = GPU_DEVICE_ALLOW.get(kind, GPU_DEVICE_ALLOW["vulkan"])
    lines = [
        "[Unit]",
        f"Description={spec.description}",
        "Wants=network-online.target",
        "After=network-online.target",
        # a crash loop ends: after START_LIMIT_BURST starts in the interval the unit stays failed
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_S}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=exec",
        f"User={spec.user}",
        *(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(spec.env.items())),
        f"ExecStart={shlex.join(spec.hotfit_argv)}",
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}",
        f"RestartPreventExitStatus={' '.join(map(str, PERMANENT_EXIT_CODES))}",
        "KillSignal=SIGTERM",
        *([f"StateDirectory={state_dir}", "StateDirectoryMode=0750"] if state_dir else [f"ReadWritePaths={home}"]),
        "ProtectSystem=strict",
        # hotfit, llama-server or the home under /home or /root: readable, not writable (but the home)
        "ProtectHome=read-only" if hidden else "ProtectHome=yes",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "PrivateUsers=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        # a call outside the filter fails with EPERM instead of killing the server (SIGSYS)
        "SystemCallErrorNumber=EPERM",
        "UMask=0027",
        # PrivateDevices= would hide the GPU: a closed policy with the accelerator's nodes instead
        "DevicePolicy=closed",
        *(f"DeviceAllow={d}" for d in devices),
        # render nodes are group-owned (render, video on older systems)
        *(["SupplementaryGroups=render video"] if any("drm" in d for d in devices) else []),
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def unit_user(home: Path, named: str | None) -> str:
    """``--unit-user``, else the owner of the home when that is not root, else ``hotfit``."""
    if named:
        return named
    try:
        uid = home.stat().st_uid
    except OSError:
        return DEFAULT_UNIT_USER
    if uid == 0:
        return DEFAULT_UNIT_USER
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


DEFAULT_UNIT_USER = "hotfit"


def _hotfit_command(ctx: CliContext, args: argparse.Namespace, server: Path | None) -> list[str]:
    exe = shutil.which("hotfit")
    base = [exe] if exe else [sys.executable, "-m", "pipeline"]
    cmd = base + ["--home", str(ctx.settings.home)]
    if server is not None:
        cmd += ["--llama-server", str(server)]
    cmd += ["--log-format", "json", "serve", "--host", args.host, "--port", str(args.port)]
    if args.api_key_file:
        cmd += ["--api-key-file", str(Path(args.api_key_file).resolve())]
    return cmd


def _unit_server(settings: Any, plan: Any) -> Path | None:
    """The llama-server the unit pins: the one named, else the one found now (the service user's
    own build cache may hold none); None when none is found — the unit then searches at start."""
    if settings.llama_server is not None:
        return Path(settings.llama_server).absolute()
    try:
        return find_llama_server(settings, device_kind=plan.probe.device.kind).server_path
    except HotfitError:
        return None


def _unit_spec(ctx: CliContext, args: argparse.Namespace, manifest: Manifest, plan: Any) -> UnitSpec:
    settings = ctx.settings
    server = _unit_server(settings, plan)
    argv = _hotfit_command(ctx, args, server)
    env = {"CONTENOX_LLAMA_KV_CACHE_TYPE": manifest.kv_cache_type} | backend_for("llama").device_env(plan)
    home = Path(settings.home).absolute()
    paths = tuple(Path(p) for p in (argv[0], os.path.realpath(argv[0]), sys.prefix) if p) + (
        (server, server.resolve()) if server is not None else ())
    return UnitSpec(hotfit_argv=argv, env=env, description=f"hotfit: llama-server serving {manifest.entry_name}",
                    user=unit_user(home, args.unit_user), home=home, device_kind=plan.probe.device.kind,
                    paths=paths)


def _files(manifest: Manifest) -> ModelFiles:
    return ModelFiles(Path(manifest.model_path), Path(manifest.template_path) if manifest.template_path else None)


def _openvino_handler(args: argparse.Namespace, ctx: CliContext, manifest: Manifest, plan: Any) -> int:
    """OpenVINO: print the OVMS command (--print-command), else exit 2 saying what to run."""
    command = anyio.run(functools.partial(
        backend_for("openvino").serve_command, plan, _files(manifest), host=args.host, port=args.port,
        api_key_file=None, binary=None, settings=ctx.settings, model_name=manifest.entry_name,
        verified={**manifest.measured, "openvino": manifest.extra.get("openvino") or {}}))
    argv = list(command.argv)
    data: dict[str, Any] = {"model": manifest.entry_name, "backend": "openvino", "server": command.server, "argv": argv,
                            "kv_cache_type": manifest.kv_cache_type,
                            "verified_context_tokens": manifest.opened_context_tokens}
    if args.print_command:
        ctx.emit(data, shlex.join(argv))
        return 0
    raise UsageError(
        f"{manifest.entry_name} is an OpenVINO model: hotfit serve runs llama-server only, and no maintained "
        "OpenAI-compatible server for OpenVINO GenAI is on PyPI",
        hint="serve it with OpenVINO Model Server (release tarball or container image, not on PyPI): "
             f"`hotfit serve --print-command` prints the command with the verified settings: {shlex.join(argv)}",
        backend="openvino", argv=argv,
    )


def serve_command(settings: Any, plan: Any, manifest: Manifest, *, host: str, port: int,
                  api_key_file: Path | None) -> ServeCommand:
    """llama-server for ``plan`` built by the Backend boundary: the load stage's argv, environment
    and device pin (CUDA_VISIBLE_DEVICES for NVIDIA, ``-dev`` for Vulkan devices)."""
    return anyio.run(functools.partial(
        backend_for("llama").serve_command, plan, _files(manifest), host=host, port=port,
        api_key_file=api_key_file, binary=None, settings=settings, model_name=manifest.entry_name))


def handler(args: argparse.Namespace, ctx: CliContext) -> int:
    settings = ctx.settings
    manifest = read_manifest(settings.manifest_path, strict=True)
    if manifest is None:
        raise UsageError(f"nothing is provisioned under {settings.home}",
                         hint="run `hotfit auto` first; it writes manifest.json when every stage passed")
    problems = manifest.files_in_place()
    if problems:
        raise UsageError(f"the provisioned files are not in place: {'; '.join(problems)}",
                         hint="run `hotfit auto` again; it re-fetches what is missing")
    plan = plan_from_json(manifest.plan, source=f"manifest {settings.manifest_path}")  # UsageError naming the field
    if manifest.backend == "openvino":
        return _openvino_handler(args, ctx, manifest, plan)
    if args.unit_user and not args.print_systemd_unit:
        raise UsageError("--unit-user names the account of the printed systemd unit",
                         hint="add --print-systemd-unit, or drop --unit-user")
    # What hotfit sets for the child beyond the inherited environment: the device pin, built by
    # the Backend that the load stage opens the model with.
    api_key_file = Path(args.api_key_file).resolve() if args.api_key_file else None
    if args.print_systemd_unit:
        unit = systemd_unit(_unit_spec(ctx, args, manifest, plan))
        ctx.emit({"unit": unit}, unit)
        return 0

    decision = decide_window(manifest, plan, _probe_now(args, settings))
    serve_plan = dataclasses.replace(plan, hot_context_tokens=decision.context_tokens)
    command = serve_command(settings, serve_plan, manifest, host=args.host, port=args.port,
                            api_key_file=api_key_file)
    argv = list(command.argv)
    pin_env = dict(command.env)
    event = "serve.replanned" if decision.replanned else "serve.window_ok"
    log.info(event, model=manifest.entry_name, context_tokens=decision.context_tokens,
             verified_tokens=decision.verified_tokens, fits_now_tokens=decision.fits_now_tokens)
    if decision.replanned:
        sys.stderr.write(f"hotfit: {decision.message}\n")
    data: dict[str, Any] = {
        "model": manifest.entry_name,
        "context_tokens": decision.context_tokens,
        "verified_context_tokens": decision.verified_tokens,
        "replanned": decision.replanned,
        "message": decision.message,
        "kv_cache_type": manifest.kv_cache_type,
        "argv": argv,
        "env": pin_env,
    }
    if args.print_command:
        prefix = ["env", *(f"{k}={v}" for k, v in sorted(pin_env.items()))] if pin_env else []
        ctx.emit(data, shlex.join(prefix + argv))
        return 0
    # The worker record: this pid becomes llama-server's at exec, so a later
    # `hotfit auto` recognises the model being served and keeps it.
    record = record_for_self(host=args.host, port=args.port, model_path=manifest.model_path,
                             entry_name=manifest.entry_name, context_tokens=decision.context_tokens,
                             kv_cache_type=manifest.kv_cache_type, device=serve_plan.probe.device,
                             api_key_file=str(Path(args.api_key_file).resolve()) if args.api_key_file else None)
    try:
        write_worker_record(settings.serve_pid_path, record)
    except OSError as exc:  # serving matters more than the record; auto then treats it as absent
        log.warning("serve.pid_unwritable", path=str(settings.serve_pid_path), error=str(exc))
    log.info("serve.exec", argv=argv, pid=record.pid, pid_file=str(settings.serve_pid_path))
    if not ctx.json:
        sys.stderr.write(f"hotfit: {decision.message}\nhotfit: exec {shlex.join(argv)}\n")
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(argv[0], argv, command.environment(os.environ))
    except OSError as exc:  # gone or not executable since it was checked: exit 5, logged like any failure
        raise LoadError(f"cannot start {argv[0]}: {exc.strerror or exc}",
                        hint="run `hotfit auto --recheck` to find and check the llama-server binary again",
                        argv=argv, errno=exc.errno) from None
    return 0  # pragma: no cover - execve does not return
