"""The live session's stages for the engine: load → probe-tool-call → re-check, one adapter each.

They share one running server (a llama-server, or an OpenVINO GenAI worker) and the engine skips or
runs them together (``session=SERVER_SESSION``). Each result decodes from its record, so a reused
session hands on the same types a fresh one does; only the live handle (``LoadResult.server``,
``OpenVinoLoadResult.session``) exists solely in the run that opened it — and since the session's
stages are reused as one, no stage that needs the handle ever runs against a reused load.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio

from backends.llama_server import Backend, find_llama_server
from core.decode import decode_record
from core.log import get_logger
from core.model_files import VerifyResult
from core.plan import Plan
from pipeline.engine import Stage, StageContext
from stages.load import LoadedServer, open_server
from stages.openvino_probe import OpenVinoProbeResult, probe_openvino_tool_call
from stages.openvino_recheck import OpenVinoAllocationReport, recheck_openvino_allocation
from stages.openvino_session import OpenVinoSession, open_openvino_session
from stages.probe_tool_call import ProbeToolCallResult, probe_tool_call
from stages.recheck import AllocationReport, recheck_allocation

log = get_logger()

SESSION_STAGES: tuple[str, ...] = ("load", "probe-tool-call", "re-check")
SERVER_SESSION = "llama-server"


@dataclass(frozen=True)
class TemplateRecord:
    kind: str  # stages.load.TemplateKind
    path: str | None


@dataclass(frozen=True)
class LoadResult:
    """The llama-server load: what its record keeps, and (in the run that started it) the live server."""

    pid: int
    base_url: str
    argv: tuple[str, ...]
    log_path: str
    stderr_path: str
    template: TemplateRecord
    load_seconds: float
    backend: dict[str, Any]  # backends.llama_server.Backend.to_json()
    # live, valid until the pipeline ends; None when decoded from a record
    server: LoadedServer | None = field(default=None, compare=False, repr=False)
    binary: Backend | None = field(default=None, compare=False, repr=False)

    @classmethod
    def started(cls, server: LoadedServer, binary: Backend) -> LoadResult:
        return cls.decode({**server.to_json(), "backend": binary.to_json()}).with_live(server, binary)

    def with_live(self, server: LoadedServer, binary: Backend) -> LoadResult:
        return LoadResult(self.pid, self.base_url, self.argv, self.log_path, self.stderr_path, self.template,
                          self.load_seconds, self.backend, server, binary)

    def live(self) -> LoadedServer:
        if self.server is None:  # the engine runs the session's stages together, so this is a wiring bug
            raise RuntimeError("load was reused from a record: no live llama-server in this run")
        return self.server

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "base_url": self.base_url, "argv": list(self.argv), "log_path": self.log_path,
                "stderr_path": self.stderr_path, "template": {"kind": self.template.kind, "path": self.template.path},
                "load_seconds": self.load_seconds, "backend": self.backend}

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> LoadResult:
        return decode_record(cls, record)


@dataclass(frozen=True)
class OpenVinoLoadResult:
    """The OpenVINO load: its record (worker pid, every pipeline setting, GenAI version) and the live session."""

    record: dict[str, Any]  # OpenVinoSession.to_json() + the backend's name and GenAI version
    session: OpenVinoSession | None = field(default=None, compare=False, repr=False)

    @classmethod
    def started(cls, session: OpenVinoSession) -> OpenVinoLoadResult:
        backend = {"name": "openvino", "genai_version": session.opened.get("genai_version")}
        return cls({**session.to_json(), "backend": backend}, session)

    def live(self) -> OpenVinoSession:
        if self.session is None:
            raise RuntimeError("load was reused from a record: no live OpenVINO session in this run")
        return self.session

    def to_json(self) -> dict[str, Any]:
        return dict(self.record)

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> OpenVinoLoadResult:
        decode_record(_OpenVinoLoadShape, {k: record.get(k) for k in ("pid", "config", "backend")})
        return cls(dict(record))


@dataclass(frozen=True)
class _OpenVinoLoadShape:
    """What an OpenVINO load record must hold (the manifest and the fingerprint read these; the
    rest is whatever the worker reported on opening)."""

    pid: int
    config: dict[str, Any]
    backend: dict[str, Any]


def decode_load(record: Mapping[str, Any]) -> LoadResult | OpenVinoLoadResult:
    return OpenVinoLoadResult.decode(record) if "config" in record else LoadResult.decode(record)


def decode_probe_call(record: Mapping[str, Any]) -> ProbeToolCallResult | OpenVinoProbeResult:
    if "family" in record:  # the OpenVINO probe names its tool-call parser family
        return decode_record(OpenVinoProbeResult, record)
    return decode_record(ProbeToolCallResult, record)


def decode_recheck(record: Mapping[str, Any]) -> AllocationReport | OpenVinoAllocationReport:
    if "opened_n_ctx_per_slot" in record:
        return decode_record(AllocationReport, record)
    return decode_record(OpenVinoAllocationReport, record)


async def _load_stage(ctx: StageContext) -> LoadResult | OpenVinoLoadResult:
    plan = ctx.require_plan()
    verified = ctx.result("verify", VerifyResult)
    if verified.weights_path is None:
        raise RuntimeError("verify handed no weights path")  # verify raises before that
    if plan.backend == "openvino":
        session = await ctx.enter_context(open_openvino_session(plan, Path(verified.weights_path), ctx.run_dir))
        return OpenVinoLoadResult.started(session)
    backend = await anyio.to_thread.run_sync(
        functools.partial(find_llama_server, ctx.settings, device_kind=plan.probe.device.kind))
    template_path = verified.chat_template_path
    server = await ctx.enter_context(open_server(
        plan, Path(verified.weights_path), binary=backend.server_path, run_dir=ctx.run_dir,
        template_path=Path(template_path) if template_path else None, build=backend.build,
        # what verify read from the GGUF header (once per run): load does not open the file again
        gguf_has_chat_template=verified.gguf_embeds_chat_template))
    return LoadResult.started(server, backend)


def _load_fingerprint(out: Mapping[str, Any]) -> Any:
    # the port, pid and timing change every start; the command line without the port does not
    if "config" in out:  # OpenVINO: every pipeline setting; the pid and timing are volatile
        return {"config": out.get("config")}
    argv = list(out.get("argv") or [])
    if "--port" in argv:
        i = argv.index("--port")
        del argv[i:i + 2]
    return {"argv": argv, "template": out.get("template")}


def _load_figures(result: LoadResult | OpenVinoLoadResult) -> dict[str, Any]:
    if isinstance(result, OpenVinoLoadResult):
        ov = result.live()
        return {"pid": ov.pid, "load_seconds": round(ov.load_seconds, 3), "backend": "openvino",
                "kv_precision": ov.config.kv_precision, "num_kv_blocks": ov.config.num_kv_blocks,
                "capacity_tokens": ov.config.capacity_tokens, "device": ov.config.device}
    s = result.live()
    binary = result.binary
    return {"pid": s.pid, "load_seconds": round(s.load_seconds, 3), "template": s.template.describe(),
            "llama_server": str(binary.server_path) if binary is not None else None}


async def _probe_tool_call_stage(ctx: StageContext) -> ProbeToolCallResult | OpenVinoProbeResult:
    load = ctx.results["load"]
    if isinstance(load, OpenVinoLoadResult):
        return await probe_openvino_tool_call(load.live())
    return await probe_tool_call(ctx.result("load", LoadResult).live())


def _probe_call_figures(result: ProbeToolCallResult | OpenVinoProbeResult) -> dict[str, Any]:
    # llama-server's ProbeResult and OpenVinoProbeResult share the verdict and the generation speed
    return {"passed": result.verdict.passed, "reason": result.verdict.reason, "tool": result.verdict.tool_name,
            "prompt_tokens_per_s": getattr(result, "prompt_tokens_per_s", None),
            "generation_tokens_per_s": result.generation_tokens_per_s}


def _probe_call_fingerprint(out: Mapping[str, Any]) -> Any:
    verdict = out.get("verdict") or {}
    return {"passed": verdict.get("passed"), "template": out.get("template")}


def opened_context_tokens(recheck: Mapping[str, Any]) -> int | None:
    """The window the re-check verified, from either backend's report: llama-server's smallest slot,
    or what OpenVINO's allocated bytes hold."""
    if "opened_n_ctx_per_slot" in recheck:
        slots = recheck.get("opened_n_ctx_per_slot") or []
        return min(slots) if slots else None
    value = recheck.get("opened_context_tokens")
    return int(value) if value is not None else None


async def _recheck_stage(ctx: StageContext) -> AllocationReport | OpenVinoAllocationReport:
    plan: Plan = ctx.require_plan()
    load = ctx.results["load"]
    report: AllocationReport | OpenVinoAllocationReport
    if isinstance(load, OpenVinoLoadResult):
        report = await recheck_openvino_allocation(load.live())
    else:
        report = await recheck_allocation(ctx.result("load", LoadResult).live(), plan)
    opened = opened_context_tokens(report.to_json())
    # contenox `auto`: an opened session holding less than half the estimate is worth a warning
    if opened is not None and opened * 2 < plan.hot_context_tokens:
        log.warning("recheck.below_half_estimate", opened_context_tokens=opened,
                    planned_hot_context_tokens=plan.hot_context_tokens)
    return report


def _recheck_figures(report: AllocationReport | OpenVinoAllocationReport) -> dict[str, Any]:
    opened: Any  # llama-server: the window per slot; OpenVINO: the one window its bytes hold
    if isinstance(report, AllocationReport):
        opened = list(report.opened_n_ctx_per_slot)
    else:
        opened = report.opened_context_tokens
    return {"verdict": report.verdict, "opened_context_tokens": opened,
            "planned_hot_context_tokens": report.planned_hot_context_tokens,
            "estimated_kv_bytes": report.estimated_kv_bytes, "actual_kv_bytes": report.actual_kv_bytes,
            "ratio": round(report.ratio, 6) if report.ratio is not None else None}


def session_stages() -> list[Stage[Any]]:
    """load → probe-tool-call → re-check, skipped or run as one."""
    return [
        Stage("load", _load_stage, deps=("verify",), session=SERVER_SESSION, decode=decode_load,
              fingerprint=_load_fingerprint, figures=_load_figures),
        Stage("probe-tool-call", _probe_tool_call_stage, deps=("load",), session=SERVER_SESSION,
              decode=decode_probe_call, fingerprint=_probe_call_fingerprint, figures=_probe_call_figures),
        Stage("re-check", _recheck_stage, deps=("load", "probe-tool-call"), session=SERVER_SESSION,
              decode=decode_recheck, figures=_recheck_figures),
    ]
