"""Grading a model of this home through the Backend boundary: `hotfit grade`
without --endpoint, `hotfit grade --model NAME`, and `hotfit auto --grade`.

Fake-backend tests: a session of tests/test_backend_boundary.py's fake Backend whose
``chat_endpoint()`` is a scripted server (tests/grade_scripts.py) — the grade goes through the
boundary only, and the stage record decodes back into the same result. The ``llama`` tests run the
real llama-server on the tool-call fixture models from the local Hub: that fixture calls when a call
is forced (the tool-call probe passes) and ends its turn at once under ``tool_choice: "auto"``, so
its grade is a model failure (``fail``, every scenario ``wrong_state``) — plumbing, not quality.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from hotfit.backends.http_chat import HttpChatEndpoint
from hotfit.core.errors import StageRecordError, UsageError
from hotfit.pipeline.cli import main
from hotfit.pipeline.manifest import read_manifest
from hotfit.pipeline.session_stages import GRADE_STAGE
from hotfit.stages.grade import GradeResult, grade_session
from tests import grade_scripts as gs
from tests.e2e_support import LARGE, SMALL, World, write_probe
from tests.hubserver import LocalHub
from tests.openvino_fixtures import open_ov_fixture
from tests.test_auto_e2e import REPO, ROOMY_FREE_BYTES, auto, env_for, events
from tests.test_backend_boundary import CALL, FakeBackend, FakeSession, _report, _use

TIER = "unit"

pytestmark = pytest.mark.anyio


@pytest.fixture(autouse=True)
def _fake_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    _use(monkeypatch, FakeBackend(answer=CALL, report=_report()))  # the sessions' backend, asked for its flags


class ScriptedSession(FakeSession):
    """The fake Backend's session, serving a scripted grade endpoint."""

    def __init__(self, plan: Any, run_dir: Path, server: gs.ScriptedServer) -> None:
        super().__init__(plan, run_dir, answer=CALL, report=_report())
        self.server = server

    @contextlib.asynccontextmanager
    async def chat_endpoint(self) -> AsyncIterator[HttpChatEndpoint]:
        async with HttpChatEndpoint("http://fake.invalid", transport=self.server.transport()) as endpoint:
            yield endpoint


async def test_a_session_is_graded_through_its_own_chat_endpoint(tmp_path: Path) -> None:
    server = gs.ScriptedServer(gs.oracle)
    session = ScriptedSession(None, tmp_path, server)
    report = await grade_session(session, label="model fx (fake server)", tier="quick",
                                 known={"model_sha256": "ab" * 32, "chat_template_sha256": None})
    assert report["verdict"]["verdict"] == "pass" and report["score"]["passed"] == report["score"]["total"] == 6
    assert report["endpoint"] == "model fx (fake server)" and len(server.chat_requests) > 0
    fp = report["fingerprint"]
    # the session knows what a running server cannot report: its flags (its backend reads them from
    # its own load record) and backend
    assert fp["flags"] == {"threads": 3} and fp["backend"] == "fake"
    assert fp["model_sha256"] == "ab" * 32
    assert fp["chat_template_sha256"] != "unknown"  # None in `known` leaves the server's reading


async def test_a_never_calling_session_fails_and_the_record_decodes_back(tmp_path: Path) -> None:
    session = ScriptedSession(None, tmp_path, gs.ScriptedServer(gs.never_calls))
    report = await grade_session(session, label="fx", tier="quick")
    result = GradeResult.from_report(report, tmp_path / "g.json")
    assert result.verdict == "fail" and result.passed == 0 and result.stack_problem is None
    assert GradeResult.decode(json.loads(json.dumps(result.to_json()))) == result
    damaged = {**result.to_json(), "passed": "none"}
    with pytest.raises(StageRecordError) as err:
        GradeResult.decode(damaged)
    assert "passed" in err.value.what


async def test_a_stack_failure_through_a_session_is_inconclusive(tmp_path: Path) -> None:
    session = ScriptedSession(None, tmp_path, gs.ScriptedServer(gs.http_500_on_turn_2))
    report = await grade_session(session, label="fx", tier="quick", budget_s=120)
    assert report["verdict"]["verdict"] == "inconclusive" and report["verdict"]["stack_problem"].startswith("http_error")


@pytest.mark.openvino
async def test_an_openvino_session_is_graded_through_the_same_boundary(tmp_path: Path) -> None:
    async with open_ov_fixture(tmp_path) as session:
        report = await grade_session(session, label="ov fixture", tier="quick")
    # the OpenVINO tool-call fixture is no agent either: a model failure, told apart from a stack one
    assert report["verdict"]["verdict"] == "fail" and report["verdict"]["stack_problem"] is None
    assert {s["outcome"] for s in report["scenarios"]} == {"wrong_state"}
    fp = report["fingerprint"]
    assert fp["backend"] == "openvino" and fp["flags"]["max_num_seqs"] == 1 and fp["template_roundtrip"] == "ok"


def cli_json(*argv: str) -> tuple[int, dict[str, Any]]:
    """``hotfit --json ARGV`` in-process: the exit code and the JSON it printed."""
    out = io.StringIO()
    code = main(["--json", *argv], out=out)
    return code, json.loads(out.getvalue())


def cli_error(*argv: str) -> tuple[int, dict[str, Any]]:
    code, data = cli_json(*argv)
    return code, data["error"]


@pytest.mark.integration
def test_cli_grade_model_not_pulled_is_a_usage_error(hotfit_home: Path, plain_world: World, tmp_path: Path) -> None:
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    code, error = cli_error("grade", "--model", SMALL, "--registry", str(plain_world.registry_path),
                            "--probe-file", str(probe))
    assert code == 2 and f"model {SMALL} is not pulled" in error["message"]
    assert f"hotfit pull {SMALL}" in error["hint"] and not (hotfit_home / "grades").exists()


def test_auto_grade_flags_need_grade(hotfit_home: Path) -> None:
    code, error = cli_error("auto", "--grade-tier", "quick")
    assert code == 2 and "need --grade" in error["message"]
    code, error = cli_error("auto", "--grade", "--grade-budget-s", "-1")
    assert code == 2 and "must be a positive number" in error["message"]


# ----------------------------------------------------------------------------- the real llama-server


def grade_cli(hub: LocalHub, home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "grade",
                           "--tier", "quick", *args], cwd=REPO, env=env_for(hub), capture_output=True, text=True,
                          timeout=240, check=False)


@pytest.mark.llama
def test_auto_grade_records_the_verdict_and_hotfit_grade_regrades_the_provisioned_model(
        hub: LocalHub, world: World, tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    done = auto(hub, home, world, probe, "--json", "--grade", "--grade-tier", "quick")
    assert done.returncode == 0, done.stderr[-3000:]  # a failed grade is recorded, auto still provisions
    manifest = json.loads(done.stdout)
    grade = manifest["grade"]
    assert manifest["entry_name"] == LARGE and manifest["probe_verdict"]["passed"] is True
    assert grade["verdict"] == "fail" and grade["stack_problem"] is None and grade["tier"] == "quick"
    assert (grade["passed"], grade["total"]) == (0, 6) and grade["graded_by_run"] == manifest["run_id"]
    assert grade["fingerprint"]["model_sha256"] == manifest["model_sha256"]
    assert "-c" in grade["fingerprint"]["flags"] and "--port" not in grade["fingerprint"]["flags"]
    record = json.loads(Path(grade["path"]).read_text())
    assert record["run_id"] == manifest["run_id"] and record["scenarios"][0]["transcript"]
    assert {s["outcome"] for s in record["scenarios"]} == {"wrong_state"}
    evs = [e for e in events(home) if e.get("run_id") == manifest["run_id"]]
    assert [e["outcome"] for e in evs if e["event"] == "grade.scenario"] == ["wrong_state"] * 6
    done_grade = [e for e in evs if e["event"] == "stage.done" and e.get("stage") == GRADE_STAGE]
    assert len(done_grade) == 1 and done_grade[0]["verdict"] == "fail"

    # the same request again: graded as asked, a no-op
    again = auto(hub, home, world, probe, "--json", "--grade", "--grade-tier", "quick")
    assert again.returncode == 0 and json.loads(again.stdout).get("noop") is True, again.stderr[-2000:]
    # the manifest lost: the rerun reuses every stage, the grade too (its record decodes back), and
    # writes the same verdict again without loading the model
    (home / "manifest.json").unlink()
    rebuilt = auto(hub, home, world, probe, "--json", "--grade", "--grade-tier", "quick")
    assert rebuilt.returncode == 0, rebuilt.stderr[-2000:]
    rebuilt_run = json.loads(rebuilt.stdout)["run_id"]
    skipped = {e["stage"] for e in events(home) if e.get("run_id") == rebuilt_run and e["event"] == "stage.skip"}
    assert {"load", "probe-tool-call", "re-check", GRADE_STAGE} <= skipped
    assert {k: v for k, v in json.loads(rebuilt.stdout)["grade"].items() if k != "graded_at"} \
        == {k: v for k, v in grade.items() if k not in ("graded_at", "graded_by_run")} | {"graded_by_run": rebuilt_run}
    # a full-tier grade asked for: the session runs again, downloads are reused
    full = auto(hub, home, world, probe, "--json", "--grade", "--grade-budget-s", "0.001")
    assert full.returncode == 0, full.stderr[-3000:]
    regraded = json.loads(full.stdout)["grade"]
    assert regraded["tier"] == "full" and regraded["verdict"] == "inconclusive"
    assert regraded["stack_problem"].startswith("budget: --grade-budget-s 0.001 ran out")

    # hotfit grade: the provisioned model, opened through the same Backend, its verdict written back
    graded = grade_cli(hub, home, "--json")
    assert graded.returncode == 8, graded.stderr[-3000:]
    report = json.loads(graded.stdout)
    assert report["model"] == LARGE and report["provisioned"] is True and report["verdict"]["verdict"] == "fail"
    assert report["fingerprint"]["model_sha256"] == manifest["model_sha256"]
    assert report["fingerprint"]["flags"] == grade["fingerprint"]["flags"]  # the flags load and auto used
    assert "transcript" not in report["scenarios"][0] and json.loads(Path(report["output"]).read_text())["scenarios"]
    written = json.loads((home / "manifest.json").read_text())
    assert written["grade"]["tier"] == "quick" and written["grade"]["path"] == report["output"]
    assert written["run_id"] == json.loads(full.stdout)["run_id"]  # the provisioning itself is unchanged
    decoded = read_manifest(home / "manifest.json", strict=True)
    assert decoded is not None and decoded.grade == written["grade"] and decoded.to_json()["grade"] == written["grade"]
    damaged = tmp_path / "damaged.json"
    damaged.write_text(json.dumps({**written, "grade": "pass"}))
    with pytest.raises(UsageError) as err:
        read_manifest(damaged, strict=True)
    assert err.value.details["field"] == "grade"

    # --model: a pulled entry is re-planned and graded; one not pulled is refused
    named = grade_cli(hub, home, "--json", "--model", LARGE, "--registry", str(world.registry_path),
                      "--probe-file", str(probe))
    assert named.returncode == 8 and json.loads(named.stdout)["provisioned"] is False, named.stderr[-3000:]
    missing = grade_cli(hub, home, "--model", SMALL, "--registry", str(world.registry_path), "--probe-file", str(probe))
    assert missing.returncode == 2 and f"model {SMALL} is not pulled" in missing.stderr


@pytest.mark.llama
def test_grade_with_nothing_provisioned_exits_2(hub: LocalHub, world: World, tmp_path: Path) -> None:
    empty = grade_cli(hub, tmp_path / "empty")
    assert empty.returncode == 2 and "nothing is provisioned under" in empty.stderr
