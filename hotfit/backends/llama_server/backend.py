"""llama-server as a :class:`backends.base.Backend`: discovery, start, and ``hotfit serve``'s command."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import anyio

from hotfit.backends.base import BackendBinary, BuildNeed, BuildUnavailable, DeviceListing, ModelFiles, ServeCommand, ServicePin
from hotfit.backends.llama_server.devices import list_ggml_devices
from hotfit.backends.llama_server.allocation import AllocationReport
from hotfit.backends.llama_server.device_check import check_planned_device
from hotfit.backends.llama_server.discovery import SERVES, ServerBinary, find_llama_server, gpu_listing_binaries
from hotfit.backends.llama_server.flags import API_KEY_ENV, child_env, device_env, llama_server_argv, probe_server_features
from hotfit.backends.llama_server.process import LoadedServer, open_server
from hotfit.core.entry import Entry
from hotfit.core.errors import HotfitError
from hotfit.core.cuda_arch import capability_number
from hotfit.core.records import decode_record
from hotfit.planner.plan import Plan
from hotfit.planner.probe import Device
from hotfit.core.settings import Settings
from hotfit.registry.select import DEVICE_KINDS

__all__ = ["LlamaServerBackend"]


@dataclass(frozen=True)
class _TemplateShape:
    kind: str  # backends.llama_server.process.TemplateKind
    path: str | None


@dataclass(frozen=True)
class _LoadShape:
    """What a llama-server load record must hold (the manifest, the fingerprint and serve read it)."""

    pid: int
    base_url: str
    argv: tuple[str, ...]
    log_path: str
    stderr_path: str
    template: _TemplateShape
    load_seconds: float
    backend: dict[str, Any]  # the binary's to_json()


def _argv_without_port(record: Mapping[str, Any]) -> list[str]:
    """The command line a load record ran, without ``--port N`` (a new one every start)."""
    argv = list(record.get("argv") or [])
    if "--port" in argv:
        i = argv.index("--port")
        del argv[i:i + 2]
    return argv


class LlamaServerBackend:
    name: Literal["llama"] = "llama"
    device_kinds: frozenset[str] = DEVICE_KINDS  # host memory, and each GPU kind through its build

    def preflight(self, plan: Plan, settings: Settings) -> ServerBinary:
        """The binary that will serve ``plan`` must exist, answer ``--version``, suit this CPU and
        the plan's device, and run on that very device (device_check); blocking (run it in a thread)."""
        found = self._find(plan, settings)
        check_planned_device(plan, found.server_path)
        return found

    def _find(self, plan: Plan, settings: Settings) -> ServerBinary:
        device = plan.placement.device
        return find_llama_server(settings, device_kind=device.kind, gpu_capability=device.compute_capability)

    def decode_binary(self, record: Mapping[str, Any], *, path: str = "") -> ServerBinary:
        return ServerBinary.decode(record, path=path)

    def decode_allocation(self, record: Mapping[str, Any]) -> AllocationReport:
        return AllocationReport.decode(record)

    def decode_load(self, record: Mapping[str, Any]) -> None:
        decode_record(_LoadShape, record)

    def load_fingerprint(self, record: Mapping[str, Any]) -> Any:
        # the port, pid and timing change every start; the command line without the port does not
        return {"argv": _argv_without_port(record), "template": record.get("template")}

    def launch_flags(self, record: Mapping[str, Any]) -> Any:
        return _argv_without_port(record)[1:]  # the flags, without the program's path

    def list_devices(self, settings: Settings, env: Mapping[str, str]) -> DeviceListing:
        listing = DeviceListing()
        for binary in gpu_listing_binaries(settings):  # the GPU builds hotfit would run
            listing += list_ggml_devices(binary, env)
        return listing

    async def _binary(self, plan: Plan, settings: Settings, binary: BackendBinary | None) -> ServerBinary:
        if isinstance(binary, ServerBinary):
            return binary  # the plan stage's preflight: found once per run
        return await anyio.to_thread.run_sync(functools.partial(self.preflight, plan, settings))

    def device_env(self, plan: Plan) -> dict[str, str]:
        return device_env(plan)

    serve_execs = True  # hotfit serve checks the window, then execs llama-server
    serve_hint = "hotfit serve   (or --print-systemd-unit)"

    def serve_refusal(self, model_name: str, command: ServeCommand) -> HotfitError | None:
        return None

    def service_pin(self, plan: Plan, settings: Settings) -> ServicePin:
        """The llama-server the unit pins: the one named, else the one found now; none found — the
        unit then searches at each start."""
        server: Path | None
        if settings.llama_server is not None:
            server = Path(settings.llama_server).absolute()
        else:
            try:  # the binary only: a unit may be printed away from the device it will run on
                server = self._find(plan, settings).server_path
            except HotfitError:
                server = None
        if server is None:
            return ServicePin("llama-server")
        return ServicePin("llama-server", ("--llama-server", str(server)), (server, server.resolve()))

    def template_summary(self, template_path: str | None) -> str:
        return template_path or "(none: the GGUF template)"

    def build_for(self, device: Device, arch: str) -> BuildNeed:
        """The build ``scripts/install-llama-server`` makes for this device: the best the device kind
        is served by (discovery.SERVES), for the machine's CPU (``--arch``: the cross build, docs/builds.md
        "Arm64"), with the GPU's compute capability for the union a CUDA build needs (HOTFIT_CUDA_ARCHS)."""
        kind = SERVES.get(device.kind, ("cpu",))[0]
        native = arch == "x86_64"
        return BuildNeed(flavour=kind if native else f"{kind}-{arch}", arch=arch,
                         install_flags=f"--backend {kind}" + ("" if native else f" --arch {arch}"),
                         per_gpu_code=kind == "cuda",
                         cuda_capability=capability_number(device.compute_capability or "") if kind == "cuda" else None)

    def build_identity(self, device_kind: str, settings: Settings) -> tuple[str, str]:
        """The llama-server the load stage would start (same search, same checks): its
        :meth:`ServerBinary.build_identity`. The search logs nothing: the run's preflight announces the
        binary it runs."""
        try:
            binary = find_llama_server(settings, device_kind=device_kind, announce=False)
        except HotfitError as exc:
            raise BuildUnavailable(f"no usable llama-server for a {device_kind} device: {exc.what}",
                                   hint=exc.hint) from None
        return binary.build_identity()

    def grade_build(self, entry: Entry, device_kind: str, settings: Settings) -> tuple[str, str]:
        return self.build_identity(device_kind, settings)  # the same build whichever model it serves

    @contextlib.asynccontextmanager
    async def open(self, plan: Plan, files: ModelFiles, *, run_dir: Path, binary: BackendBinary | None,
                   settings: Settings) -> AsyncIterator[LoadedServer]:
        found = await self._binary(plan, settings, binary)
        async with open_server(plan, files.weights, binary=found.server_path, run_dir=run_dir,
                               template_path=files.template, build=found.build,
                               embedded_template=files.embedded_template) as server:
            yield server

    async def serve_command(self, plan: Plan, files: ModelFiles, *, host: str, port: int,
                            api_key_file: Path | None, binary: BackendBinary | None, settings: Settings,
                            model_name: str = "", verified: Mapping[str, Any] | None = None) -> ServeCommand:
        """llama-server with the load stage's argv and environment (device pin included); the key
        comes from ``api_key_file`` (never argv), so the environment carries none."""
        found = await self._binary(plan, settings, binary)
        features = await probe_server_features(found.server_path)
        argv = llama_server_argv(plan, files.weights, files.template, port, binary=found.server_path,
                                 features=features, host=host, api_key_file=api_key_file,
                                 alias=model_name or None, metrics=True)
        # child_env with an empty base: exactly the variables hotfit sets (the device pin)
        return ServeCommand("llama-server", tuple(argv), child_env(plan, None, {}),
                            unset=("LLAMA_ARG_*", API_KEY_ENV))
