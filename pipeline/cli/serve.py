"""hotfit serve: start llama-server with the verified parameters (issue 6, item 7).

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
runs ``hotfit serve`` itself, so the memory check happens at every start. Plain ``serve``
replaces itself with llama-server (exec), so a supervisor sees and signals llama-server directly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from backends.base import ModelFiles, ServeCommand
from backends.llama_server.discovery import gpu_listing_binaries
from backends.select import backend_for
from core.errors import LoadError, NoModelQualifies, UsageError
from core.log import get_logger
from pipeline.cli.context import CliContext
from pipeline.manifest import Manifest, plan_from_json, read_manifest
from pipeline.worker import record_for_self, write_worker_record
from registry.kv import parse_kv_cache_type
from registry.select import MIN_AGENTIC_HOT_CONTEXT, UnknownKV, device_budget, fmt_bytes, model_fit
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


def systemd_unit(hotfit_argv: list[str], env: dict[str, str], description: str) -> str:
    """Pure: a unit that runs `hotfit serve` (the memory check repeats at every start)."""
    lines = [
        "[Unit]",
        f"Description={description}",
        "After=network-online.target",
        "",
        "[Service]",
        "Type=exec",
        *(f"Environment={shlex.quote(f'{k}={v}')}" for k, v in sorted(env.items())),
        f"ExecStart={shlex.join(hotfit_argv)}",
        "Restart=on-failure",
        "RestartSec=5",
        # exit 3: the device no longer holds the floor; restarting would not change that
        "RestartPreventExitStatus=3",
        "KillSignal=SIGTERM",
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def _hotfit_command(ctx: CliContext, args: argparse.Namespace) -> list[str]:
    exe = shutil.which("hotfit")
    base = [exe] if exe else [sys.executable, "-m", "pipeline"]
    cmd = base + ["--home", str(ctx.settings.home)]
    if ctx.settings.llama_server is not None:
        cmd += ["--llama-server", str(ctx.settings.llama_server)]
    cmd += ["--log-format", "json", "serve", "--host", args.host, "--port", str(args.port)]
    if args.api_key_file:
        cmd += ["--api-key-file", str(Path(args.api_key_file).resolve())]
    return cmd


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
    # What hotfit sets for the child beyond the inherited environment: the device pin, built by
    # the Backend that the load stage opens the model with.
    api_key_file = Path(args.api_key_file).resolve() if args.api_key_file else None
    if args.print_systemd_unit:
        pin_env = backend_for("llama").device_env(plan)
        env = {"CONTENOX_LLAMA_KV_CACHE_TYPE": manifest.kv_cache_type} | pin_env
        unit = systemd_unit(_hotfit_command(ctx, args), env,
                            f"hotfit: llama-server serving {manifest.entry_name}")
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
    # The worker record (issue 10 item 1): this pid becomes llama-server's at exec, so a later
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
