"""pipeline.engine: ordered stages, skip on unchanged inputs, invalidation, sessions, signals.

The stages here are small real async functions that write real files; nothing is mocked.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from hotfit.core import log as hlog
from hotfit.core.errors import Interrupted, TransferError
from hotfit.core.settings import Settings
from hotfit.pipeline.engine import Runner, Stage, StageContext
from hotfit.state.store import StateStore, SyncStateStore

TIER = "unit"

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class FakeSettings:
    home: Path

    @property
    def runs_dir(self) -> Path:
        return self.home / "runs"


def fake_settings(home: Path) -> Settings:
    """The one part of :class:`Settings` the engine reads (``runs_dir``), typed as the real thing."""
    return cast(Settings, FakeSettings(home))


@dataclass(frozen=True)
class TinyPlan:
    model: str
    window: int

    @property
    def plan_id(self) -> str:
        return f"{self.model}-{self.window}"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "window": self.window}


@dataclass(frozen=True)
class FileResult:
    path: str
    size_bytes: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size_bytes": self.size_bytes}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "FileResult":
        return cls(d["path"], d["size_bytes"])


class World:
    """What the stages see and do: the plan to choose, counters of real executions."""

    def __init__(self, home: Path) -> None:
        self.home = home
        self.model = "alpha"
        self.window = 40000
        self.calls: list[str] = []
        self.fail_in: str | None = None
        self.sessions_open = 0

    def stages(self) -> list[Stage]:
        async def probe(ctx: StageContext) -> dict[str, Any]:
            self.calls.append("probe")
            return {"free_bytes": 1000}

        async def plan(ctx: StageContext) -> TinyPlan:
            self.calls.append("plan")
            assert ctx.results["probe"]["free_bytes"] == 1000
            return TinyPlan(self.model, self.window)

        async def fetch(ctx: StageContext) -> FileResult:
            self.calls.append("fetch")
            if self.fail_in == "fetch":
                raise TransferError("hub said no", hint="try later")
            target = self.home / "models" / f"{ctx.plan.model}.bin"
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(b"w" * 64)
            return FileResult(str(target), 64)

        async def verify(ctx: StageContext) -> dict[str, Any]:
            self.calls.append("verify")
            fetched = ctx.results["fetch"]
            assert isinstance(fetched, FileResult)  # decoded on skip, live otherwise
            return {"ok": Path(fetched.path).stat().st_size == fetched.size_bytes}

        @asynccontextmanager
        async def session():
            self.sessions_open += 1
            try:
                yield "server-handle"
            finally:
                self.sessions_open -= 1

        async def load(ctx: StageContext) -> dict[str, Any]:
            self.calls.append("load")
            handle = await ctx.enter_context(session())
            return {"handle": handle, "window": ctx.plan.window}

        async def check(ctx: StageContext) -> dict[str, Any]:
            self.calls.append("check")
            assert self.sessions_open == 1  # the session stays open across its stages
            if self.fail_in == "check":
                raise TransferError("check failed")
            return {"window_opened": ctx.results["load"]["window"]}

        def fetch_inputs(ctx: StageContext) -> Any:
            return {"model": ctx.plan.model}  # the window does not change the file

        def still_on_disk(fetched: FileResult) -> bool:
            assert isinstance(fetched, FileResult)  # the decoded record, not the raw outputs
            p = Path(fetched.path)
            return p.is_file() and p.stat().st_size == fetched.size_bytes

        return [
            Stage("probe", probe, always_run=True),
            Stage("plan", plan, deps=("probe",), always_run=True),
            Stage("fetch", fetch, inputs=fetch_inputs, decode=FileResult.from_json, still_valid=still_on_disk),
            Stage("verify", verify, deps=("fetch",), inputs=fetch_inputs),
            Stage("load", load, deps=("verify",), session="server"),
            Stage("check", check, deps=("load",), session="server"),
        ]


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path / "home")


@pytest.fixture
def events() -> io.StringIO:
    stream = io.StringIO()
    hlog.configure("json", 0, None, stream=stream)
    return stream


async def run_once(world: World, **kw: Any):
    store = await StateStore.open(world.home / "state.db")
    try:
        runner = Runner(world.stages(), store, fake_settings(world.home), handle_signals=False, **kw)
        return await runner.run()
    finally:
        await store.aclose()


def parsed(stream: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


@pytest.mark.anyio
async def test_fresh_run_executes_every_stage_in_order(world: World, events: io.StringIO) -> None:
    outcome = await run_once(world)
    assert world.calls == ["probe", "plan", "fetch", "verify", "load", "check"]
    assert outcome.ran == ("probe", "plan", "fetch", "verify", "load", "check")
    assert outcome.plan == TinyPlan("alpha", 40000)
    assert outcome.results["check"] == {"window_opened": 40000}
    assert world.sessions_open == 0  # the session was closed at the end of the pipeline
    with pytest.raises(TypeError):
        outcome.results["x"] = 1
    store = SyncStateStore(world.home / "state.db")
    recs = store.stages(outcome.run_id)
    assert [r.status for r in recs] == ["done"] * 6
    assert all(r.attempts == 1 for r in recs)
    assert store.get_run(outcome.run_id).status == "done"
    assert store.get_run(outcome.run_id).plan_id == "alpha-40000"
    evs = parsed(events)
    names = [e["event"] for e in evs]
    assert names[0] == "run.start" and names[-1] == "run.done"
    assert names.count("stage.start") == 6 and names.count("stage.done") == 6
    assert all(e["run_id"] == outcome.run_id for e in evs)
    assert all("stage" in e for e in evs if e["event"].startswith("stage."))
    # plan_id is bound from the plan stage on
    fetch_start = next(e for e in evs if e["event"] == "stage.start" and e["stage"] == "fetch")
    assert fetch_start["plan_id"] == "alpha-40000"


@pytest.mark.anyio
async def test_rerun_skips_done_stages_and_logs_the_skip(world: World, events: io.StringIO) -> None:
    await run_once(world)
    world.calls.clear()
    outcome = await run_once(world)
    assert world.calls == ["probe", "plan"]  # everything else reused
    assert outcome.skipped == ("fetch", "verify", "load", "check")
    assert isinstance(outcome.results["fetch"], FileResult)
    skips = [e for e in parsed(events) if e["event"] == "stage.skip"]
    assert [e["stage"] for e in skips][-4:] == ["fetch", "verify", "load", "check"]
    store = SyncStateStore(world.home / "state.db")
    assert [r.status for r in store.stages(outcome.run_id)] == ["done", "done"] + ["skipped"] * 4


@pytest.mark.anyio
async def test_a_reused_record_is_decoded_once_and_still_valid_checks_that_result(world: World) -> None:
    """The engine decodes a record once per run and hands the decoded result to ``still_valid``:
    no reuse check decodes the record a second time."""
    await run_once(world)
    decoded: list[FileResult] = []
    checked: list[object] = []

    def counting_decode(record: Mapping[str, Any]) -> FileResult:
        decoded.append(FileResult.from_json(record))
        return decoded[-1]

    def still_there(fetched: FileResult) -> bool:
        checked.append(fetched)
        return Path(fetched.path).is_file()

    stages = [dataclasses.replace(s, decode=counting_decode, still_valid=still_there) if s.name == "fetch" else s
              for s in world.stages()]
    world.calls.clear()
    store = await StateStore.open(world.home / "state.db")
    try:
        outcome = await Runner(stages, store, fake_settings(world.home), handle_signals=False).run()
    finally:
        await store.aclose()
    assert "fetch" in outcome.skipped and "fetch" not in world.calls
    assert len(decoded) == 1  # one decode of the fetch record in this run
    assert len(checked) == 1 and checked[0] is decoded[0] is outcome.results["fetch"]


@pytest.mark.anyio
async def test_changed_plan_reruns_downstream_but_not_unaffected_files(world: World) -> None:
    await run_once(world)
    world.calls.clear()
    world.window = 50000  # same model, new window: the file stays, the session re-runs
    await run_once(world)
    assert world.calls == ["probe", "plan", "load", "check"]
    world.calls.clear()
    world.model = "beta"  # a new model: everything downstream runs
    await run_once(world)
    assert world.calls == ["probe", "plan", "fetch", "verify", "load", "check"]


@pytest.mark.anyio
async def test_missing_file_on_disk_is_fetched_again(world: World) -> None:
    first = await run_once(world)
    Path(first.results["fetch"].path).unlink()
    world.calls.clear()
    await run_once(world)
    assert "fetch" in world.calls


@pytest.mark.anyio
async def test_failure_is_recorded_and_rerun_resumes_same_run(world: World, events: io.StringIO) -> None:
    world.fail_in = "check"
    with pytest.raises(TransferError):
        await run_once(world)
    assert world.sessions_open == 0  # closed on failure too
    store = SyncStateStore(world.home / "state.db")
    run = store.latest_run()
    assert run.status == "failed" and run.error["code"] == "transfer"
    check = store.get_stage(run.run_id, "check")
    assert check.status == "failed" and check.error["message"] == "check failed"
    fail = [e for e in parsed(events) if e["event"] == "stage.fail"]
    assert fail and fail[0]["stage"] == "check" and fail[0]["error"]["code"] == "transfer"

    world.fail_in = None
    world.calls.clear()
    outcome = await run_once(world)
    assert outcome.run_id == run.run_id and outcome.resumed
    # fetch/verify reused; load re-runs because its session partner had not completed
    assert world.calls == ["probe", "plan", "load", "check"]
    assert store.get_stage(run.run_id, "check").attempts == 2
    assert store.get_run(run.run_id).status == "done"


@pytest.mark.anyio
async def test_forced_stages_run_again(world: World) -> None:
    await run_once(world)
    world.calls.clear()
    await run_once(world, force=("load", "check"))
    assert world.calls == ["probe", "plan", "load", "check"]


@pytest.mark.anyio
async def test_interrupted_run_with_changed_plan_resets_downstream(world: World, events: io.StringIO) -> None:
    world.fail_in = "fetch"
    with pytest.raises(TransferError):
        await run_once(world)
    world.fail_in = None
    world.model = "beta"
    outcome = await run_once(world)
    assert outcome.resumed
    changed = [e for e in parsed(events) if e["event"] == "plan.changed"]
    assert changed and changed[0]["previous_plan_id"] == "alpha-40000"
    assert "fetch" in changed[0]["invalidated"]


_SIGNAL_SCRIPT = textwrap.dedent("""
    import subprocess, sys
    from contextlib import asynccontextmanager
    from pathlib import Path
    import anyio
    from hotfit.core import log
    from hotfit.core.errors import Interrupted
    from hotfit.pipeline.engine import Runner, Stage
    from hotfit.state.store import StateStore

    home = Path(sys.argv[1])
    log.configure("json", 0, home / "log.jsonl")

    class S:
        runs_dir = home / "runs"

    @asynccontextmanager
    async def child():
        proc = subprocess.Popen(["sleep", "600"])
        (home / "child.pid").write_text(str(proc.pid))
        try:
            yield proc
        finally:
            proc.terminate()
            proc.wait()

    async def quick(ctx):
        return {"ok": True}

    async def hold(ctx):
        await ctx.enter_context(child())
        print("holding", flush=True)
        await anyio.sleep(600)
        return {"never": True}

    async def main():
        store = await StateStore.open(home / "state.db")
        stages = [Stage("quick", quick), Stage("hold", hold, deps=("quick",))]
        await Runner(stages, store, S()).run()

    try:
        anyio.run(main)
    except Interrupted as exc:
        print("interrupted", exc.exit_code, flush=True)
        sys.exit(exc.exit_code)
""")


def _start_holding(home: Path) -> tuple[subprocess.Popen[str], int]:
    """The signal script, run until its second stage holds a child process: (runner, child pid)."""
    home.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _SIGNAL_SCRIPT, str(home)], cwd=REPO,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "holding"
    return proc, int((home / "child.pid").read_text())


@pytest.mark.integration
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_reaps_child_and_marks_interrupted(tmp_path: Path, signum: int) -> None:
    home = tmp_path / "home"
    proc, child_pid = _start_holding(home)
    os.kill(proc.pid, signum)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)  # reaped, not merely signalled (a zombie would still answer)
    store = SyncStateStore(home / "state.db")
    run = store.latest_run()
    assert run.status == "interrupted"
    statuses = {r.stage: r.status for r in store.stages(run.run_id)}
    assert statuses == {"quick": "done", "hold": "interrupted"}
    events = [json.loads(line) for line in (home / "log.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events][-3:] == ["run.signal", "stage.interrupted", "run.done"]
    assert events[-1]["status"] == "interrupted"


@pytest.mark.integration
def test_kill_9_leaves_state_the_next_run_resumes(tmp_path: Path) -> None:
    home = tmp_path / "home"
    proc, child_pid = _start_holding(home)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    os.kill(child_pid, signal.SIGKILL)  # kill -9 cannot reap; the orphan is the test's to clean
    store = SyncStateStore(home / "state.db")
    run = store.latest_run()
    assert run.status == "running"
    assert store.get_stage(run.run_id, "hold").status == "running"

    calls: list[str] = []

    async def quick(ctx: StageContext) -> dict[str, Any]:
        calls.append("quick")
        return {"ok": True}

    async def hold(ctx: StageContext) -> dict[str, Any]:
        calls.append("hold")
        return {"done": True}

    async def again() -> Any:
        s = await StateStore.open(home / "state.db")
        try:
            return await Runner([Stage("quick", quick), Stage("hold", hold, deps=("quick",))], s,
                                fake_settings(home), handle_signals=False).run()
        finally:
            await s.aclose()

    outcome = anyio.run(again)
    assert outcome.run_id == run.run_id and outcome.resumed
    assert calls == ["hold"]  # quick was done before the kill
    assert store.get_stage(run.run_id, "hold").attempts == 2
    assert store.get_run(run.run_id).status == "done"


def test_interrupted_is_exit_130() -> None:
    assert Interrupted("x").exit_code == 130


_LOAD_SIGNAL_SCRIPT = textwrap.dedent("""
    import sys
    from pathlib import Path
    import anyio
    from hotfit.core import log
    from hotfit.backends.llama_server.discovery import find_llama_server
    from hotfit.core.errors import Interrupted
    from hotfit.planner.probe import Device, ProbeResult
    from hotfit.pipeline.engine import Runner, Stage
    from hotfit.core.settings import load_settings
    from hotfit.registry.kv import parse_kv_cache_type
    from hotfit.backends.llama_server.process import open_server
    from hotfit.stages.plan import build_plan
    from hotfit.state.store import StateStore
    from tests.e2e_support import GiB, fixture_entry, sha256_of
    from tests.gguf_fixtures import pinned_template, write_tool_call_model

    home = Path(sys.argv[1])
    log.configure("json", 0, home / "log.jsonl")
    settings = load_settings(home=home)
    info = write_tool_call_model(home / "m.gguf")
    entry = fixture_entry("fx", info, repo="a/b", revision="a" * 40, sha256=sha256_of(info.path), params_b=0.01,
                          template=None)
    probe = ProbeResult(devices=(Device(0, "cpu", "host", 16 * GiB, 8 * GiB),))
    plan = build_plan(probe, [entry], parse_kv_cache_type("f16")).plan
    template = home / "chat_template.jinja"
    template.write_text(pinned_template().read_text())

    async def planned(ctx):
        return plan

    async def load(ctx):
        server = await ctx.enter_context(open_server(
            ctx.plan, info.path, binary=find_llama_server(settings).server_path, run_dir=ctx.run_dir,
            template_path=template))
        (home / "server.pid").write_text(str(server.pid))
        print("loaded", flush=True)
        await anyio.sleep(600)  # a stage still using the server when the signal arrives
        return {"never": True}

    async def main():
        store = await StateStore.open(home / "state.db")
        await Runner([Stage("plan", planned), Stage("load", load, session="s")], store, settings).run()

    try:
        anyio.run(main)
    except Interrupted as exc:
        sys.exit(exc.exit_code)
""")


@pytest.mark.llama
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_load_reaps_llama_server(tmp_path: Path, signum: int) -> None:
    from tests.gguf_fixtures import require_llama_server

    require_llama_server()
    home = tmp_path / "home"
    home.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", _LOAD_SIGNAL_SCRIPT, str(home)], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    assert line == "loaded", proc.stderr.read()[-2000:]
    server_pid = int((home / "server.pid").read_text())
    os.kill(server_pid, 0)  # running
    os.kill(proc.pid, signum)
    proc.communicate(timeout=60)
    assert proc.returncode == 130
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)  # stopped and reaped by the load stage's context, not orphaned
    store = SyncStateStore(home / "state.db")
    run = store.latest_run()
    assert run.status == "interrupted"
    assert store.get_stage(run.run_id, "load").status == "interrupted"
    names = [json.loads(line)["event"] for line in (home / "log.jsonl").read_text().splitlines()]
    assert "load.stopped" in names and names[-1] == "run.done"


def test_disk_check_needs_artifact_projector_and_margin(tmp_path: Path) -> None:
    import dataclasses

    from hotfit.core.errors import DiskSpaceError
    from hotfit.download import DISK_MARGIN_BYTES, check_disk, disk_needed_bytes
    from hotfit.core.entry import Artifact
    from tests.e2e_support import fixture_entry
    from tests.gguf_fixtures import write_tool_call_model

    info = write_tool_call_model(tmp_path / "m.gguf")
    entry = fixture_entry("fx", info, repo="a/b", revision="a" * 40, sha256="0" * 64, params_b=0.01, template=None)
    with_projector = dataclasses.replace(entry, projector=Artifact("a/c", "b" * 40, "p.gguf", 1000, None))
    assert disk_needed_bytes(entry, 0) == info.size_bytes + DISK_MARGIN_BYTES
    assert disk_needed_bytes(with_projector, 0) == info.size_bytes + 1000 + DISK_MARGIN_BYTES
    # what a previous attempt left in the model directory is not needed again
    assert disk_needed_bytes(with_projector, 600) == info.size_bytes + 400 + DISK_MARGIN_BYTES
    check_disk(entry, tmp_path / "models" / "fx")  # a few hundred KiB + 512 MiB: fits here
    assert entry.artifact is not None
    huge = dataclasses.replace(entry, artifact=dataclasses.replace(entry.artifact, size_bytes=1 << 60))
    with pytest.raises(DiskSpaceError) as err:
        check_disk(huge, tmp_path / "models" / "fx")
    assert err.value.exit_code == 4 and err.value.details["needed_bytes"] == (1 << 60) + DISK_MARGIN_BYTES


def test_recorded_template_is_reused_only_while_its_text_is_unchanged(tmp_path: Path) -> None:
    """A done fetch-template record names the sha256 of the text it wrote; a file edited or
    truncated behind hotfit's back must not be skipped over (verify and load would trust it)."""
    import hashlib

    from hotfit.pipeline.provision import AutoOptions, provisioning_stages

    stage = next(s for s in provisioning_stages(AutoOptions()) if s.name == "fetch-template")
    assert stage.still_valid is not None and stage.decode is not None
    path = tmp_path / "chat_template.jinja"
    text = "{% for tool in tools %}<tool_call>{% endfor %}"
    path.write_text(text)
    outputs = stage.decode({"entry": "fx", "path": str(path), "source": "org/m@main/chat_template.jinja",
                            "variant": "jinja", "sha256": hashlib.sha256(text.encode()).hexdigest(),
                            "tool_markers": []})
    assert stage.still_valid(outputs)
    path.write_text(text.replace("<tool_call>", "plain prose"))
    assert not stage.still_valid(outputs)
    path.unlink()
    assert not stage.still_valid(outputs)
    no_template = stage.decode({"entry": "fx", "path": None, "source": None, "variant": None, "sha256": None,
                                "tool_markers": []})
    assert stage.still_valid(no_template)  # the entry names no template


def _damage(db: Path, stage: str, outputs_json: str) -> None:
    import sqlite3

    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE stages SET outputs_json=? WHERE stage=?", (outputs_json, stage))


@pytest.mark.anyio
@pytest.mark.parametrize("damaged", ['{"size_bytes": 64}', '[1, 2]', '"text"'])
async def test_a_record_that_does_not_decode_is_named_and_its_stage_runs_again(
        world: World, events: io.StringIO, damaged: str) -> None:
    await run_once(world)
    _damage(world.home / "state.db", "fetch", damaged)
    world.calls.clear()
    outcome = await run_once(world)
    # fetch ran again and wrote the same file, so what depends on it is still reused
    assert world.calls == ["probe", "plan", "fetch"]
    assert "fetch" in outcome.ran and isinstance(outcome.results["fetch"], FileResult)
    stale = [e for e in parsed(events) if e["event"] == "stage.stale" and e.get("stage") == "fetch"]
    assert len(stale) == 1 and stale[0]["level"] == "warning"
    error = stale[0]["error"]
    assert error["code"] == "stage_record" and error["details"]["stage"] == "fetch"
    assert error["details"]["state_db"] == str(world.home / "state.db")
    assert "stage fetch" in error["message"] and str(world.home / "state.db") in error["message"]


@pytest.mark.anyio
async def test_a_field_of_the_wrong_kind_names_the_field(world: World, events: io.StringIO) -> None:
    """A decoder from core.records names the damaged field's path in the logged error."""
    from hotfit.core.records import decode_record

    stages = world.stages()
    fetch = next(s for s in stages if s.name == "fetch")
    strict = [Stage(s.name, s.fn, s.deps, s.inputs, s.always_run, s.session,
                    (lambda d: decode_record(FileResult, d)) if s is fetch else s.decode, s.still_valid)
              for s in stages]
    store = await StateStore.open(world.home / "state.db")
    try:
        await Runner(strict, store, fake_settings(world.home), handle_signals=False).run()
        await store.aclose()
        _damage(world.home / "state.db", "fetch", '{"path": "/x", "size_bytes": "64"}')
        store = await StateStore.open(world.home / "state.db")
        world.calls.clear()
        await Runner(strict, store, fake_settings(world.home), handle_signals=False).run()
    finally:
        await store.aclose()
    assert "fetch" in world.calls
    stale = next(e for e in parsed(events) if e["event"] == "stage.stale" and e.get("stage") == "fetch")
    assert stale["error"]["details"]["field"] == "size_bytes"
    assert "size_bytes: must be a whole number, got str" in stale["error"]["message"]


@pytest.mark.anyio
async def test_an_ephemeral_run_writes_nothing_reuses_nothing_and_logs_no_lifecycle(
        world: World, events: io.StringIO) -> None:
    """No store: the sequencing of a real run (pull, the dry run), with no state.db, no skip, no run.* events."""
    await run_once(world)  # a recorded run whose records an ephemeral one must not reuse
    before = (world.home / "state.db").read_bytes()
    world.calls.clear()
    mark = len(parsed(events))
    outcome = await Runner(world.stages(), None, fake_settings(world.home), handle_signals=False).run()
    assert world.calls == ["probe", "plan", "fetch", "verify", "load", "check"]
    assert outcome.skipped == () and isinstance(outcome.results["fetch"], FileResult)
    assert (world.home / "state.db").read_bytes() == before
    names = [e["event"] for e in parsed(events)[mark:]]
    assert not [n for n in names if n.startswith(("run.", "stage."))]
    assert world.sessions_open == 0


@pytest.mark.anyio
async def test_an_ephemeral_run_raises_a_stage_failure_unchanged(world: World) -> None:
    world.fail_in = "fetch"
    with pytest.raises(TransferError, match="hub said no"):
        await Runner(world.stages(), None, fake_settings(world.home), handle_signals=False).run()
    assert not (world.home / "state.db").exists()
