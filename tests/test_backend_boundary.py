"""The Backend boundary: the stages drive any Backend, and serve pins like load.

A fake Backend (no process, no HTTP, no llama-server names) drives load, probe-tool-call and
re-check: what they write and raise comes from the stage logic over the boundary's types only.
The serve tests build llama-server's command through the same boundary as load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import anyio
import pytest

import hotfit.backends.llama_server.backend
import hotfit.backends.llama_server.discovery
import hotfit.backends.select
from hotfit.backends.base import (Backend, BuildUnavailable, DeviceListing, ManifestFacts,
                                  ModelFiles, ServeCommand, ServicePin)
from hotfit.backends.llama_server.backend import LlamaServerBackend
from hotfit.backends.llama_server.flags import API_KEY_ENV
from hotfit.core.entry import WEIGHTS_LAYOUTS
from hotfit.core.errors import AllocationMismatch, HotfitError, StageRecordError, ToolCallProbeFailed, UsageError
from hotfit.grading.protocol import ChatFailed, ChatReply
from hotfit.planner.plan import Placement
from hotfit.planner.probe import Device, ProbeResult
from hotfit.core.settings import load_settings
from hotfit.grading.protocol import SLOT_FRESH_PROMPT
from hotfit.registry.kv import parse_kv_cache_type
from hotfit.stages import load as load_stage
from hotfit.stages.plan import build_plan
from hotfit.stages.probe_tool_call import PROBE_FILE, PROBE_TOOL, PROBE_TOOL_NAME, probe_request, probe_tool_call
from hotfit.stages import recheck as recheck_stage
from hotfit.stages.recheck import RECHECK_FILE, recheck_allocation
from hotfit.pipeline.auto import ProvisionedResults, build_manifest
from hotfit.pipeline.cli import main
from hotfit.pipeline.engine import PipelineOutcome
from hotfit.pipeline.manifest import write_manifest
from tests.e2e_support import GiB, fixture_entry, sha256_of
from tests.gguf_fixtures import pinned_template, require_llama_server, write_tool_call_model
from tests.openvino_fixtures import open_ov_fixture
from tests.test_load import fixture_plan
from tests.test_stage_records import CALL as CALL_RESULT, FETCH, LOAD_RECORD, TEMPLATE, VERIFY

TIER = "unit"

pytestmark = pytest.mark.anyio

CALL = {"choices": [{"finish_reason": "tool_calls", "message": {"role": "assistant", "content": None, "tool_calls": [
    {"type": "function", "function": {"name": PROBE_TOOL_NAME, "arguments": '{"text": "ping"}'}}]}}]}
PROSE = {"choices": [{"finish_reason": "stop", "message": {"role": "assistant", "content": "Hello there."}}]}


@dataclasses.dataclass(frozen=True)
class FakeReport:
    verdict: str
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    planned_hot_context_tokens: int
    estimated_kv_bytes: int
    actual_kv_bytes: int | None
    ratio: float | None
    opened_context_tokens: int | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def opened_figure(self) -> Any:
        return {"fake_window": self.opened_context_tokens}  # its own shape: the re-check's figures show it as given

    def event_facts(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "backend": "fake"}

    def warning_event(self, warning: str) -> str:
        return "recheck.kv_below_estimate"


class FakeSession:
    backend: Any = "fake"  # no real backend's name: nothing outside backends/ may branch on it
    server_name = "fake server"
    prompt_max_tokens = None
    load_seconds = 0.25
    pid = 4242

    def __init__(self, plan: Any, run_dir: Path, *, answer: Any, report: FakeReport) -> None:
        self.plan, self.run_dir, self.log_path = plan, run_dir, run_dir / "fake.log"
        self._answer, self._report = answer, report
        self.requests: list[dict[str, Any]] = []

    def returncode(self) -> int | None:
        return None

    def describe_exit(self) -> str:
        return "still running"

    def to_json(self) -> dict[str, Any]:
        # its own record: a launch setting and a value that changes every start (like a port)
        return {"pid": self.pid, "fake_launch": {"threads": 3}, "fake_nonce": 917}

    def load_figures(self) -> dict[str, Any]:
        return {"pid": self.pid}

    async def call_tools(self, request: Mapping[str, Any], *, timeout_s: float, purpose: str) -> ChatReply:
        self.requests.append(dict(request))
        if isinstance(self._answer, ChatFailed):
            raise self._answer
        return ChatReply(body=self._answer, template="fake template", supports_tools=True,
                         generation_tokens_per_s=12.5, facts={"family": "fake-family"})

    def tool_call_fix(self, cause: str, answer: ChatReply | None) -> str:
        return f"fix the fake server ({cause})"

    def chat_endpoint(self) -> Any:
        raise NotImplementedError

    async def allocation_report(self, plan: Any, *, floor_tokens: int, tolerance: float,
                                timeout_s: float) -> FakeReport:
        return self._report


@dataclasses.dataclass(frozen=True)
class FakeBinary:
    path: str = "/opt/fake-server"
    build: tuple[str, str] = ("fake-build-1", "the fake server, build 1")  # what its build_identity answers

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path}

    def build_identity(self) -> tuple[str, str]:
        return self.build

    def manifest_facts(self, *, report: Any, session: Mapping[str, Any], snapshot_commit: str | None,
                       call_facts: Mapping[str, Any]) -> ManifestFacts:
        return ManifestFacts(measured={"fake_window": report.opened_context_tokens}, build={"path": self.path},
                             extra={"fake": {"launch": session.get("fake_launch")}})


class FakeBackend:
    """A third backend, registered by the test alone (``_use``): every member of the Backend protocol,
    with records no other backend has — nothing in stages/ or pipeline/ knows its shapes."""

    name: Any = "fake"
    device_kinds = frozenset({"cpu"})  # backends.base.Backend: the device kinds it serves
    serve_execs = False
    serve_hint = "fake-server --serve"

    def __init__(self, **session: Any) -> None:
        self.session_args = session
        self.build = ("fake-build-1", "the fake server, build 1")  # what build_identity answers
        self.preflights = 0
        self.opened: list[tuple[ModelFiles, Any]] = []

    def preflight(self, plan: Any, settings: Any) -> Any:
        self.preflights += 1
        return FakeBinary()

    def device_env(self, plan: Any) -> dict[str, str]:
        return {}

    def decode_binary(self, record: Mapping[str, Any], *, path: str = "") -> FakeBinary:
        return FakeBinary(**record)

    def decode_allocation(self, record: Mapping[str, Any]) -> FakeReport:
        if "fake_window" in record or "opened_context_tokens" not in record:
            raise StageRecordError("not a fake report", field="opened_context_tokens")
        fields: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in record.items()}
        return FakeReport(**fields)

    def decode_load(self, record: Mapping[str, Any]) -> None:
        if not isinstance(record.get("fake_launch"), dict):
            raise StageRecordError("fake_launch: is missing", field="fake_launch")

    def load_fingerprint(self, record: Mapping[str, Any]) -> Any:
        return {"fake_launch": record["fake_launch"]}  # not the pid, not the nonce

    def launch_flags(self, record: Mapping[str, Any]) -> Any:
        return record.get("fake_launch")

    def list_devices(self, settings: Any, env: Mapping[str, str]) -> DeviceListing:
        return DeviceListing()

    async def serve_command(self, plan: Any, files: ModelFiles, *, host: str, port: int, api_key_file: Path | None,
                            binary: Any, settings: Any, model_name: str = "",
                            verified: Mapping[str, Any] | None = None) -> ServeCommand:
        launch = (verified or {}).get("fake", {}).get("launch", {})
        return ServeCommand("fake server", ("/opt/fake-server", str(files.weights), "--threads",
                                            str(launch.get("threads")), "--port", str(port)))

    def serve_refusal(self, model_name: str, command: ServeCommand) -> HotfitError | None:
        return UsageError(f"{model_name}: run the fake server yourself", hint="hotfit serve --print-command")

    def service_pin(self, plan: Any, settings: Any) -> ServicePin:
        return ServicePin("fake server")

    def template_summary(self, template_path: str | None) -> str:
        return "the fake server's own"

    def build_for(self, device: Any, arch: str) -> Any:
        return None  # nothing built for the stub

    def grade_build(self, entry: Any, device_kind: str, settings: Any) -> tuple[str, str]:
        raise BuildUnavailable("the fake server keeps no grade evidence")

    def build_identity(self, device_kind: str, settings: Any) -> tuple[str, str]:
        return self.build

    @contextlib.asynccontextmanager
    async def open(self, plan: Any, files: ModelFiles, *, run_dir: Path, binary: Any,
                   settings: Any) -> AsyncIterator[FakeSession]:
        self.opened.append((files, binary))
        run_dir.mkdir(parents=True, exist_ok=True)
        yield FakeSession(plan, run_dir, **self.session_args)


def _report(verdict: str = "pass", problems: tuple[str, ...] = ()) -> FakeReport:
    return FakeReport(verdict, problems, (), 32768, 1000, 990, 0.99, 32768)


@pytest.fixture
def cpu_plan(tmp_path: Path) -> Any:
    info = write_tool_call_model(tmp_path / "m.gguf")
    entry = fixture_entry("fx-boundary", info, repo="hotfit-fixtures/fx-boundary-GGUF", revision="b" * 40,
                          sha256=sha256_of(info.path), params_b=0.02, template=None)
    probe = ProbeResult(devices=(Device(0, "cpu", "host memory", 64 * GiB, 48 * GiB),))
    plan = build_plan(probe, [entry], parse_kv_cache_type("f16")).plan
    assert plan is not None and plan.backend == "llama"
    return plan


def _fake(plan: Any) -> Any:
    return dataclasses.replace(plan, entry=dataclasses.replace(plan.entry, backend="fake"))


def _use(monkeypatch: pytest.MonkeyPatch, backend: FakeBackend) -> None:
    """Register the fake backend where CONTRIBUTING.md "Adding a backend" says a backend is
    registered, and nowhere else: backends/select.py's BACKENDS and core/entry.py's WEIGHTS_LAYOUTS."""
    monkeypatch.setitem(hotfit.backends.select.BACKENDS, "fake", backend)
    monkeypatch.setitem(WEIGHTS_LAYOUTS, "fake", WEIGHTS_LAYOUTS["llama"])  # one GGUF file


async def test_the_three_stages_drive_a_fake_backend(cpu_plan: Any, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeBackend(answer=CALL, report=_report())
    _use(monkeypatch, fake)
    plan = _fake(cpu_plan)
    binary = load_stage.preflight(plan, load_settings())
    files = ModelFiles(tmp_path / "m.gguf")
    async with load_stage.open_session(plan, files, run_dir=tmp_path / "run", settings=load_settings(),
                                       binary=binary) as session:
        assert isinstance(session, FakeSession)  # the fake backend's own session, with its requests
        probe = await probe_tool_call(session)
        report = await recheck_allocation(session)
        result = load_stage.LoadResult.opened(session, binary)
    assert fake.preflights == 1 and fake.opened == [(files, FakeBinary())]  # the preflight rode in
    assert probe.verdict.passed and probe.verdict.arguments == {"text": "ping"}
    assert probe.family == "fake-family" and probe.generation_tokens_per_s == 12.5
    assert session.requests[0]["tool_choice"] == "required" and session.requests[0]["tools"][0]["function"]["name"] \
        == PROBE_TOOL_NAME
    record = json.loads((tmp_path / "run" / PROBE_FILE).read_text())
    assert record["outcome"] == "pass" and record["family"] == "fake-family" and record["template"] == "fake template"
    assert report.verdict == "pass"
    assert json.loads((tmp_path / "run" / RECHECK_FILE).read_text())["actual_kv_bytes"] == 990
    assert result.to_json() == {"pid": 4242, "fake_launch": {"threads": 3}, "fake_nonce": 917,
                                "backend": {"path": "/opt/fake-server"}}


async def test_a_prose_answer_fails_with_the_backends_own_fix(cpu_plan: Any, tmp_path: Path) -> None:
    session = FakeSession(cpu_plan, tmp_path, answer=PROSE, report=_report())
    with pytest.raises(ToolCallProbeFailed) as err:
        await probe_tool_call(session)
    assert err.value.details["cause"] == "ignored_tools" and err.value.details["backend"] == "fake"
    assert "fix the fake server (ignored_tools)" in (err.value.hint or "")
    assert json.loads((tmp_path / PROBE_FILE).read_text())["outcome"] == "fail"


async def test_a_failed_call_keeps_the_backends_cause_and_details(cpu_plan: Any, tmp_path: Path) -> None:
    dead = ChatFailed("server_exited", "the fake server died during the tool-call probe", "look at it",
                      returncode=-9)
    session = FakeSession(cpu_plan, tmp_path, answer=dead, report=_report())
    with pytest.raises(ToolCallProbeFailed) as err:
        await probe_tool_call(session)
    assert str(err.value).startswith("the fake server died") and err.value.details["cause"] == "server_exited"
    assert err.value.details["returncode"] == -9 and not (tmp_path / PROBE_FILE).exists()


async def test_a_failed_allocation_fails_closed_naming_the_server(cpu_plan: Any, tmp_path: Path) -> None:
    session = FakeSession(cpu_plan, tmp_path, answer=CALL,
                          report=_report("fail", ("slot 0 opened 4096 tokens, below the planned 32768",)))
    with pytest.raises(AllocationMismatch) as err:
        await recheck_allocation(session)
    assert "the opened fake server session does not hold what was planned" in str(err.value)
    assert "4096 tokens" in str(err.value) and err.value.details["verdict"] == "fail"
    assert json.loads((tmp_path / RECHECK_FILE).read_text())["verdict"] == "fail"


# ----------------------------------------------------------------------------- a third backend's records


async def test_a_third_backends_load_record_round_trips_through_load_recheck_status_and_serve(
        cpu_plan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CONTRIBUTING.md "Adding a backend", proved: a backend registered by this test alone, with load
    and re-check records no other backend writes, goes through load, re-check, the manifest, ``hotfit
    status`` and ``hotfit serve --print-command`` — stages/ and pipeline/ ask it, never read its shapes."""
    fake: Backend = FakeBackend(answer=CALL, report=_report())  # mypy: every member of the protocol
    assert isinstance(fake, FakeBackend)
    _use(monkeypatch, fake)
    plan = _fake(cpu_plan)
    files = ModelFiles(tmp_path / "m.gguf")
    binary = load_stage.preflight(plan, load_settings())
    async with load_stage.open_session(plan, files, run_dir=tmp_path / "run", settings=load_settings(),
                                       binary=binary) as session:
        fresh_report = await recheck_allocation(session)
        loaded = load_stage.LoadResult.opened(session, binary)
    load_decl, recheck_decl = load_stage.DECLARATION, recheck_stage.DECLARATION
    assert load_decl.decode_for_plan is not None and recheck_decl.decode_for_plan is not None
    assert load_decl.fingerprint is not None and recheck_decl.figures is not None and load_decl.decode is not None
    # load: the record back through the plan's backend, equal, with the same fingerprint (its own: no nonce)
    reused = load_decl.decode_for_plan(json.loads(json.dumps(loaded.to_json())), plan)
    assert reused == loaded and reused.binary == FakeBinary()
    assert load_decl.fingerprint(reused) == load_decl.fingerprint(loaded) == {"fake_launch": {"threads": 3}}
    assert load_decl.decode(json.loads(json.dumps(loaded.to_json()))).backend == "fake"  # no plan: it accepts its own
    # re-check: its report back, and the figures show its own shape of the opened window
    report = recheck_decl.decode_for_plan(json.loads(json.dumps(fresh_report.to_json())), plan)
    assert report == fresh_report
    assert recheck_decl.figures(report)["opened_context_tokens"] == {"fake_window": 32768}
    # the manifest keeps what the backend says of its build and session, under neutral names
    verified = dataclasses.replace(VERIFY, weights_path=str(tmp_path / "m.gguf"),
                                   size_bytes=(tmp_path / "m.gguf").stat().st_size, chat_template_path=None)
    results: dict[str, Any] = {"fetch-weights": FETCH, "fetch-template": dataclasses.replace(TEMPLATE, path=None), "verify": verified,
               "load": reused, "probe-tool-call": CALL_RESULT, "re-check": report}
    outcome = PipelineOutcome("run1", False, plan, results, {k: v.to_json() for k, v in results.items()}, (),
                              tuple(results))
    home = tmp_path / "home"
    home.mkdir()
    write_manifest(home / "manifest.json", build_manifest(ProvisionedResults.of(outcome)))
    # status reads it back
    out = io.StringIO()
    assert await anyio.to_thread.run_sync(functools.partial(main, ["--home", str(home), "--json", "status"],
                                                            out=out)) == 0
    provisioned = json.loads(out.getvalue())["provisioned"]
    assert provisioned["backend"] == "fake" and provisioned["backend_build"] == {"path": "/opt/fake-server"}
    assert provisioned["extra"]["fake"] == {"launch": {"threads": 3}} and provisioned["measured"]["fake_window"] == 32768
    assert json.loads(out.getvalue())["provisioned_problems"] == []
    # serve --print-command: the backend's own command, from what its load record put in the manifest
    out = io.StringIO()
    assert await anyio.to_thread.run_sync(functools.partial(
        main, ["--home", str(home), "--json", "serve", "--print-command"], out=out)) == 0
    served = json.loads(out.getvalue())
    assert served["backend"] == "fake" and served["server"] == "fake server"
    assert served["argv"] == ["/opt/fake-server", str(tmp_path / "m.gguf"), "--threads", "3", "--port", "8080"]


def test_the_llama_backend_fingerprints_its_load_record_without_the_port() -> None:
    # what the load and grade stages hash of a llama-server session (the port changes every start)
    llama = LlamaServerBackend()
    record = {**LOAD_RECORD, "argv": ["/b/llama-server", "-c", "32768", "--port", "4711", "-np", "1"]}
    assert llama.load_fingerprint(record) == {"argv": ["/b/llama-server", "-c", "32768", "-np", "1"],
                                              "template": LOAD_RECORD["template"]}
    assert llama.launch_flags(record) == ["-c", "32768", "-np", "1"]
    llama.decode_load(record)
    with pytest.raises(StageRecordError):
        llama.decode_load({k: v for k, v in record.items() if k != "argv"})


# ----------------------------------------------------------------------------- serve's command and pin


def test_serve_environment_drops_overrides_and_a_stale_key_and_adds_the_pin() -> None:
    command = ServeCommand("llama-server", ("llama-server",), {"CUDA_VISIBLE_DEVICES": "GPU-1"},
                           unset=("LLAMA_ARG_*", API_KEY_ENV))
    base = {"PATH": "/bin", "LLAMA_ARG_CTX_SIZE": "4096", API_KEY_ENV: "stale", "CUDA_VISIBLE_DEVICES": "0"}
    assert command.environment(base) == {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "GPU-1"}


@pytest.mark.llama
@pytest.mark.parametrize(("device", "env", "argv_pin"), [
    (Device(1, "nvidia", "big card", 24 * GiB, 20 * GiB, uuid="GPU-8a1c2f0e-1"),
     {"CUDA_VISIBLE_DEVICES": "GPU-8a1c2f0e-1"}, None),
    (Device(1, "vulkan", "second gpu", 24 * GiB, 20 * GiB, ggml_device="Vulkan1"), {}, ["-dev", "Vulkan1"]),
    (Device(0, "cpu", "host memory", 64 * GiB, 48 * GiB), {}, ["-dev", "none"]),
])
async def test_serve_pins_the_device_the_way_load_does(cpu_plan: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       device: Device, env: dict[str, str],
                                                       argv_pin: list[str] | None) -> None:
    binary = require_llama_server()
    # Stand-in: this machine has only the CPU build, which a GPU plan rightly refuses (and which lists
    # no GPU: the device check refuses it too); the pin under test does not depend on the build, so
    # both checks are waived here (tests/test_device_check.py has its own).
    monkeypatch.setattr(hotfit.backends.llama_server.discovery, "compatibility_problem", lambda *a, **k: None)
    monkeypatch.setattr(hotfit.backends.llama_server.backend, "check_planned_device", lambda *a, **k: None)
    monkeypatch.setenv("HOTFIT_LLAMA_SERVER", str(binary))
    probe = dataclasses.replace(cpu_plan.probe, devices=(device,))
    plan = dataclasses.replace(cpu_plan, probe=probe, placement=Placement.single(device))
    llama = LlamaServerBackend()
    command = await llama.serve_command(plan, ModelFiles(tmp_path / "m.gguf"), host="127.0.0.1", port=8080,
                                        api_key_file=tmp_path / "key", binary=None, settings=load_settings())
    assert dict(command.env) == env == llama.device_env(plan)
    argv = list(command.argv)
    assert argv[0] == str(binary.absolute()) and argv[argv.index("--api-key-file") + 1] == str(tmp_path / "key")
    if argv_pin is None:
        assert "-dev" not in argv
    else:
        i = argv.index("-dev")
        assert argv[i:i + 2] == argv_pin


# ----------------------------------------------------------------------------- the grade's endpoint


def _call_messages() -> list[dict[str, Any]]:
    return probe_request()["messages"]


@pytest.mark.llama
async def test_a_llama_session_serves_the_grades_chat_endpoint(tmp_path: Path) -> None:
    info = write_tool_call_model(tmp_path / "tc.gguf")
    plan = fixture_plan(info, 32768)
    files = ModelFiles(info.path, pinned_template(), False)
    async with LlamaServerBackend().open(plan, files, run_dir=tmp_path / "run",
                                         binary=None, settings=load_settings()) as session:
        async with session.chat_endpoint() as endpoint:
            reply = await endpoint.chat(_call_messages(), [PROBE_TOOL], tool_choice="required", temperature=0,
                                        max_tokens=128)
            facts = await endpoint.describe()
    assert [c["function"]["name"] for c in reply.tool_calls] == [PROBE_TOOL_NAME]
    assert facts.supports_tools is True and facts.slots == 1 and facts.context_tokens == 32768


@pytest.mark.openvino
async def test_an_openvino_session_serves_the_grades_chat_endpoint(tmp_path: Path) -> None:
    async with open_ov_fixture(tmp_path) as session:
        async with session.chat_endpoint() as endpoint:
            reply = await endpoint.chat(_call_messages(), [PROBE_TOOL], tool_choice="required", max_tokens=64)
            facts = await endpoint.describe()
            assert await endpoint.reset() == SLOT_FRESH_PROMPT  # prefix caching is off: nothing to erase
    assert [c["function"]["name"] for c in reply.tool_calls] == [PROBE_TOOL_NAME]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"])["text"] is not None
    assert facts.slots == 1 and facts.context_tokens is not None and facts.context_tokens >= 32768
