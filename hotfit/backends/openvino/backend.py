"""OpenVINO GenAI as a :class:`backends.base.Backend`: runtime check, session, and the OVMS command.

``hotfit serve`` cannot run an OpenVINO model itself: no maintained OpenAI-compatible server for
OpenVINO GenAI is on PyPI. :meth:`OpenVinoBackend.serve_command` gives the OpenVINO Model Server
(OVMS) command with the verified settings instead, for the operator to run.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import shlex
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hotfit.backends.base import (AllocationReport, BackendBinary, BuildNeed, BuildUnavailable, DeviceListing, ManifestFacts, ModelFiles, ServeCommand,
                           ServicePin)
from hotfit.backends.openvino.allocation import OpenVinoAllocationReport
from hotfit.backends.openvino.config import (OPENVINO_DEVICES, OPENVINO_GENAI_VERSION, openvino_device, openvino_kv_precision,
                                     require_openvino)
from hotfit.backends.openvino.session import OpenVinoSession, open_openvino_session
from hotfit.core.entry import Entry
from hotfit.core.errors import HotfitError, UsageError
from hotfit.core.records import decode_record, field_dict
from hotfit.planner.plan import Plan
from hotfit.planner.probe import Device
from hotfit.core.settings import Settings

__all__ = ["GB", "OVMS_TOOL_PARSERS", "OpenVinoBackend", "OpenVinoRuntime", "ovms_argv", "ovms_cache_size_gb"]

# OVMS's --tool_parser per hotfit tool-call family (backends.openvino.toolcall.tool_call_family), as
# OVMS names them (openvinotoolkit/model_server: src/llm/io_processing, demos' export_model.py choices).
OVMS_TOOL_PARSERS: dict[str, str] = {"hermes": "hermes3", "harmony": "gptoss", "qwen3_coder": "qwen3coder",
                                     "phi4": "phi4"}
GB = 1 << 30


def ovms_cache_size_gb(kv_bytes: int) -> int:
    """Pure: OVMS takes the KV cache in whole GB (``--cache_size``); rounded up, at least 1, so the
    verified window always fits (OVMS allocates that much, a little more than was verified)."""
    return max(1, -(-kv_bytes // GB))


def ovms_argv(*, model_name: str, model_path: str, device: str, kv_bytes: int, family: str | None,
              host: str, port: int) -> list[str]:
    """Pure: the ``ovms`` command line serving the verified OpenVINO snapshot with the verified
    settings: the snapshot directory, the device, one sequence (max_num_seqs 1, like hotfit's
    session), the KV cache in whole GB covering the verified bytes, and the family's tool parser."""
    argv = [
        "ovms", "--rest_bind_address", host, "--rest_port", str(port),
        "--model_name", model_name, "--model_path", model_path,
        "--task", "text_generation", "--target_device", device,
        "--cache_size", str(ovms_cache_size_gb(kv_bytes)), "--max_num_seqs", "1",
        "--enable_prefix_caching", "false",
    ]  # fmt: skip
    parser = OVMS_TOOL_PARSERS.get(str(family))
    if parser:
        argv += ["--tool_parser", parser]
    return argv


def installed_releases() -> tuple[str, str]:
    """(identity, description) of the installed GenAI and OpenVINO releases (wheels: the release is
    the build). Raises :class:`BuildUnavailable`."""
    try:
        releases = {name: importlib.metadata.version(name) for name in ("openvino-genai", "openvino")}
    except importlib.metadata.PackageNotFoundError as exc:
        raise BuildUnavailable(f"OpenVINO is not installed ({exc.name} is missing)",
                               hint="install hotfit's openvino extra: pip install 'hotfit[openvino]'") from None
    described = ", ".join(f"{name} {version}" for name, version in releases.items())
    return described, described


@dataclass(frozen=True)
class OpenVinoRuntime:
    """What the OpenVINO preflight checked (OpenVINO's :class:`backends.base.BackendBinary`)."""

    genai_version: str
    device: str
    kv_precision: str

    def to_json(self) -> dict[str, Any]:
        return {"name": "openvino", **field_dict(self)}  # "name": which backend's binary record this is

    def manifest_facts(self, *, report: AllocationReport, session: Mapping[str, Any], snapshot_commit: str | None,
                       call_facts: Mapping[str, Any]) -> ManifestFacts:
        recheck = report.to_json()  # backends.openvino.allocation's report
        return ManifestFacts(
            measured={k: recheck.get(k) for k in ("kv_precision", "kv_bytes_per_token", "predicted_kv_bytes",
                                                  "configured_kv_blocks", "block_tokens")},
            extra={"openvino": {"genai_version": self.genai_version, "session": session.get("config"),
                                "snapshot_commit": snapshot_commit, "tool_call_family": call_facts.get("family"),
                                # the tokenizer's prompt limit below the plan (worker._prompt_cap); None: none
                                "prompt_max_tokens": session.get("prompt_max_tokens")}})

    def build_identity(self) -> tuple[str, str]:
        return installed_releases()  # the wheels this process runs: the release is the build

    @classmethod
    def decode(cls, record: Mapping[str, Any], *, path: str = "") -> OpenVinoRuntime:
        """The runtime back from its :meth:`to_json` (the plan stage's record)."""
        return decode_record(cls, record, extra_keys=frozenset({"name"}), path=path)


@dataclass(frozen=True)
class _LoadShape:
    """What an OpenVINO load record must hold; the rest is what the worker reported on opening."""

    pid: int
    config: dict[str, Any]
    backend: dict[str, Any]


class OpenVinoBackend:
    name: Literal["openvino"] = "openvino"
    device_kinds: frozenset[str] = frozenset(OPENVINO_DEVICES)

    def decode_binary(self, record: Mapping[str, Any], *, path: str = "") -> OpenVinoRuntime:
        return OpenVinoRuntime.decode(record, path=path)

    def decode_allocation(self, record: Mapping[str, Any]) -> OpenVinoAllocationReport:
        return OpenVinoAllocationReport.decode(record)

    def decode_load(self, record: Mapping[str, Any]) -> None:
        decode_record(_LoadShape, {k: record.get(k) for k in ("pid", "config", "backend")})

    def load_fingerprint(self, record: Mapping[str, Any]) -> Any:
        return {"config": record.get("config")}  # every pipeline setting; the pid and timing are volatile

    def launch_flags(self, record: Mapping[str, Any]) -> Any:
        return record.get("config")  # the pipeline's settings

    def list_devices(self, settings: Settings, env: Mapping[str, str]) -> DeviceListing:
        return DeviceListing()  # plans host memory only (device_kinds); the probe's GPUs come from the others

    def preflight(self, plan: Plan, settings: Settings) -> OpenVinoRuntime:
        """The extra importable, a device and a KV precision the session takes — each refused
        here with its fix rather than after the download."""
        require_openvino()
        try:  # the installed release (the record names what ran, not what was pinned)
            version = importlib.metadata.version("openvino-genai")
        except importlib.metadata.PackageNotFoundError:
            version = OPENVINO_GENAI_VERSION
        return OpenVinoRuntime(version, openvino_device(plan), openvino_kv_precision(plan.kv_cache_type))

    def device_env(self, plan: Plan) -> dict[str, str]:
        return {}  # the device is a pipeline argument (openvino_device), not an environment variable

    serve_execs = False  # the module docstring: hotfit serve prints the OVMS command instead
    serve_hint = "hotfit serve --print-command   (OpenVINO Model Server; see the README)"

    def serve_refusal(self, model_name: str, command: ServeCommand) -> HotfitError | None:
        argv = shlex.join(command.argv)
        return UsageError(
            f"{model_name} is an OpenVINO model: hotfit serve runs llama-server only, and no maintained "
            "OpenAI-compatible server for OpenVINO GenAI is on PyPI",
            hint="serve it with OpenVINO Model Server (release tarball or container image, not on PyPI): "
                 f"`hotfit serve --print-command` prints the command with the verified settings: {argv}",
            backend=self.name, argv=list(command.argv),
        )

    def service_pin(self, plan: Plan, settings: Settings) -> ServicePin:
        return ServicePin("ovms")  # never asked: no unit runs hotfit serve for an OpenVINO model

    def template_summary(self, template_path: str | None) -> str:
        # GenAI (and OVMS) render the export's own template; the tool-call probe proved it
        return "the export's own" + (f" (registry copy checked: {template_path})" if template_path else "")

    def build_for(self, device: Device, arch: str) -> BuildNeed | None:
        return None  # OpenVINO GenAI is a wheel from PyPI (pyproject's openvino extra): nothing to build

    def build_identity(self, device_kind: str, settings: Settings) -> tuple[str, str]:
        return installed_releases()

    def grade_build(self, entry: Entry, device_kind: str, settings: Settings) -> tuple[str, str]:
        raise BuildUnavailable(f"{entry.name} is an {entry.backend} entry: grade evidence is kept for "
                               "llama-server models only (an OpenVINO snapshot has no single model sha256)")

    @contextlib.asynccontextmanager
    async def open(self, plan: Plan, files: ModelFiles, *, run_dir: Path, binary: BackendBinary | None,
                   settings: Settings) -> AsyncIterator[OpenVinoSession]:
        async with open_openvino_session(plan, files.weights, run_dir) as session:
            yield session

    async def serve_command(self, plan: Plan, files: ModelFiles, *, host: str, port: int,
                            api_key_file: Path | None, binary: BackendBinary | None, settings: Settings,
                            model_name: str = "", verified: Mapping[str, Any] | None = None) -> ServeCommand:
        """The OVMS command (``verified``: the manifest's ``measured`` figures and its ``openvino``
        record: session settings and tool-call family)."""
        verified = verified or {}
        openvino = dict(verified.get("openvino") or {})
        session = dict(openvino.get("session") or {})
        kv_bytes = int(verified.get("actual_kv_bytes") or plan.estimated_kv_bytes)
        argv = ovms_argv(model_name=model_name or plan.entry.name, model_path=str(files.weights),
                         device=session.get("device") or "CPU", kv_bytes=kv_bytes,
                         family=openvino.get("tool_call_family"), host=host, port=port)
        return ServeCommand("ovms", tuple(argv))
