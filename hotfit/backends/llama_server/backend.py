"""llama-server as a :class:`backends.base.Backend`: discovery, start, and ``hotfit serve``'s command."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, Literal

import anyio

from hotfit.backends.base import BackendBinary, BuildUnavailable, ModelFiles, ServeCommand, ServicePin
from hotfit.backends.llama_server.allocation import AllocationReport
from hotfit.backends.llama_server.device_check import check_planned_device
from hotfit.backends.llama_server.discovery import ServerBinary, find_llama_server, gpu_listing_binaries
from hotfit.backends.llama_server.flags import API_KEY_ENV, child_env, device_env, llama_server_argv, probe_server_features
from hotfit.backends.llama_server.process import LoadedServer, open_server
from hotfit.core.entry import Entry
from hotfit.core.errors import HotfitError
from hotfit.core.plan import Plan
from hotfit.core.settings import Settings
from hotfit.registry.select import DEVICE_KINDS
from hotfit.state.receipts import sha256_file

__all__ = ["LlamaServerBackend"]


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
        device = plan.probe.device
        return find_llama_server(settings, device_kind=device.kind, gpu_capability=device.compute_capability)

    def decode_binary(self, record: Mapping[str, Any], *, path: str = "") -> ServerBinary:
        return ServerBinary.decode(record, path=path)

    def decode_allocation(self, record: Mapping[str, Any]) -> AllocationReport:
        return AllocationReport.decode(record)

    def device_listing_binaries(self, settings: Settings) -> tuple[Path, ...]:
        return gpu_listing_binaries(settings)

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

    def grade_build(self, entry: Entry, device_kind: str, settings: Settings) -> tuple[str, str]:
        """The llama-server the load stage would start (same search, same checks): its build facts
        and the binary's sha256 (a rebuild of the same version is another build: pipeline/evidence.py)."""
        try:
            binary = find_llama_server(settings, device_kind=device_kind)
        except HotfitError as exc:
            raise BuildUnavailable(f"no usable llama-server for a {device_kind} device: {exc.what}",
                                   hint=exc.hint) from None
        facts = binary.to_json()["build"]
        identity = hashlib.sha256(json.dumps({"build": facts, "binary_sha256": sha256_file(binary.server_path)},
                                             sort_keys=True).encode()).hexdigest()
        return identity, binary.build.describe()

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
