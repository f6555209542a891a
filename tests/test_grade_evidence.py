"""Earning a place by grade, opt-in: the evidence file, ``--admit-graded`` on
``plan``/``auto``, invalidation by fingerprint, and ``hotfit status``.

What is real and what is a stand-in:

- the model files are real: the fixture GGUFs pulled from the local Hub by ``hotfit pull`` (receipts,
  template and all); the fingerprint's model and template sha256 are read from them;
- the grade job is the real one (:func:`pipeline.grade.grade_model`: plan, receipts, session, report,
  evidence), but the model's *answers* come from a scripted server (tests/grade_scripts.py) served by a
  stand-in llama Backend — the deterministic fixture fails the real packs, so a PASS needs a script;
- the backend build is a stand-in ``llama-server`` (a shell script answering ``--version``, with a
  ``build-info.json`` beside it) in the non-llama tests; the ``llama`` test uses the real binary, a
  real ``hotfit auto --admit-graded`` and a real full-tier grade of the fixture (which fails, and so
  withdraws the evidence).

Just over 400 lines: one world (pulled files, stand-in build, scripted grade job) serves every test
here, and splitting it would put that set-up in a third module for no reader's gain.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

import hotfit.backends.select
from hotfit.backends.llama_server.backend import LlamaServerBackend
from hotfit.backends.llama_server.discovery import find_llama_server
from hotfit.core.errors import UsageError
from hotfit.planner.probe import Device, ProbeResult
from hotfit.core.settings import Settings, load_settings
from hotfit.pipeline.cli import main
from hotfit.pipeline.grade import grade_model
from hotfit.registry.kv import parse_kv_cache_type
from hotfit.planner.select import select_auto
from hotfit.registry.select import device_budget
from hotfit.planner.devices import Admission
from hotfit.stages.plan import build_plan
from hotfit.state.evidence import (
    AgenticEvidence,
    EvidenceFile,
    GradeFingerprint,
    decode_evidence_file,
    evidence_path,
    stale_reason,
    write_evidence_file,
)
from hotfit.state.receipts import read_receipt
from tests import grade_scripts as gs
from tests.e2e_support import (
    LARGE,
    SMALL,
    TEMPLATE_REPO,
    World,
    fixture_entry,
    sha256_of,
    write_probe,
    write_registry,
)
from tests.entries import GiB, entry
from tests.test_backend_boundary import CALL, FakeBackend, _report
from tests.gguf_fixtures import write_standin_llama_server, write_tool_call_model
from tests.hubserver import LocalHub
from tests.test_auto_e2e import REPO, ROOMY_FREE_BYTES, auto, env_for
from tests.test_grade_model import ScriptedSession, cli_json

TIER = "integration"

FP = GradeFingerprint(model_sha256="a" * 64, template_sha256="b" * 64, backend_build="c" * 64,
                      backend_build_described="llama.cpp 0.5.0-dev, commit 0c1e570, cpu backend, native build",
                      grade_version="grade-0.1", scenario_pack_sha256="d" * 64)


def _evidence(model: str = "m", kind: str = "cpu", fp: GradeFingerprint = FP) -> AgenticEvidence:
    return AgenticEvidence(model=model, device_kind=kind, verdict="pass", tier="full", passed=15, total=16,
                           fraction=0.9375, graded_at="2026-12-01T14:00:00Z", grade_record="/h/grades/g.json",
                           fingerprint=fp)


# ----------------------------------------------------------------------------- pure: file and rules


def test_the_evidence_file_round_trips_and_a_damaged_one_names_the_file_and_field(tmp_path: Path) -> None:
    path = tmp_path / "evidence.json"
    doc = EvidenceFile()
    for item in (_evidence("b"), _evidence("a"), _evidence("a", "nvidia")):
        doc = doc.with_evidence(item)
    write_evidence_file(path, doc)
    back = decode_evidence_file(path.read_text(), path=path)
    assert back == doc and [e.model for e in back.evidence] == ["a", "a", "b"]
    assert back.without("a", "cpu").find("a", "cpu") is None and back.without("a", "cpu").find("a", "nvidia")

    good = json.loads(path.read_text())
    cases = [
        ({**good, "schema": 2}, "schema"),
        ({**good, "evidence": [{**good["evidence"][0], "tier": "quick"}]}, "evidence[0].tier"),
        ({**good, "evidence": [{**good["evidence"][0], "verdict": "fail"}]}, "evidence[0].verdict"),
        ({**good, "evidence": [{**good["evidence"][0], "passed": 17}]}, "evidence[0].passed"),
        ({**good, "evidence": [{k: v for k, v in good["evidence"][0].items() if k != "graded_at"}]},
         "evidence[0].graded_at"),
        ({**good, "evidence": [{**good["evidence"][0], "fingerprint": {
            **good["evidence"][0]["fingerprint"], "backend_build": 7}}]}, "evidence[0].fingerprint.backend_build"),
        ({**good, "evidence": [good["evidence"][0], good["evidence"][0]]}, "evidence"),
    ]
    for bad, field in cases:
        with pytest.raises(UsageError) as err:
            decode_evidence_file(json.dumps(bad), path=path)
        assert err.value.details["field"] == field and str(path) in err.value.what, (field, err.value.what)
        assert "hotfit grade" in (err.value.hint or "")
    with pytest.raises(UsageError) as err:
        decode_evidence_file("{not json", path=path)
    assert str(path) in err.value.what and "not JSON" in err.value.what


def test_stale_reason_names_the_part_that_changed() -> None:
    assert stale_reason(FP, FP) is None
    changes = {
        "model_sha256": "evidence stale: model file changed",
        "template_sha256": "evidence stale: chat template changed",
        "backend_build": "evidence stale: backend build changed",
        "grade_version": "evidence stale: grade version changed",
        "scenario_pack_sha256": "evidence stale: scenario pack changed",
    }
    for key, words in changes.items():
        reason = stale_reason(FP, dataclasses.replace(FP, **{key: "e" * 64}))
        assert reason is not None and reason.startswith(words), reason
    same_version = stale_reason(FP, dataclasses.replace(FP, backend_build="f" * 64))
    assert same_version is not None and "same version, different binary" in same_version
    assert "none (the GGUF's own template)" in str(stale_reason(FP, dataclasses.replace(FP, template_sha256=None)))


def test_the_pure_selector_admits_only_the_named_tool_chat_entries() -> None:
    big_tool_chat = entry("tc-big", params_b=8.0, weights=1 * GiB, tier="tool-chat")
    small_agentic = entry("ag-small", params_b=2.0, weights=1 * GiB)
    none_tier = entry("no-tools", params_b=9.0, weights=1 * GiB, tier="none")
    budget = device_budget("cpu", 64 * GiB, 48 * GiB)
    f16 = parse_kv_cache_type("f16")
    entries = (big_tool_chat, small_agentic, none_tier)

    curated = select_auto(entries, budget, f16)
    assert curated.chosen is not None and curated.chosen.entry.name == "ag-small" and not curated.admitted_by_grade
    assert {v.entry.name: v.reason_code for v in curated.verdicts}["tc-big"] == "tier"

    admitted = select_auto(entries, budget, f16, admitted={"tc-big", "no-tools", "ag-small"})
    assert admitted.chosen is not None and admitted.chosen.entry.name == "tc-big" and admitted.admitted_by_grade
    verdicts = {v.entry.name: v for v in admitted.verdicts}
    assert verdicts["tc-big"].reason.startswith("admitted by grade evidence (tool-chat); holds ")
    assert verdicts["tc-big"].entry.agentic_tier == "tool-chat"  # reported as what it is
    assert verdicts["no-tools"].reason_code == "tier"  # tier none: the runtime cannot read its calls
    # admitted, but every other rule still holds: a budget it does not fit excludes it
    tight = select_auto(entries, device_budget("cpu", 64 * GiB, 3 * GiB), f16, admitted={"tc-big"})
    assert {v.entry.name: v.verdict for v in tight.verdicts}["tc-big"] == "excluded"


def test_build_plan_admits_per_device() -> None:
    tc = entry("tc", params_b=8.0, weights=1 * GiB, tier="tool-chat")
    ag = entry("ag", params_b=2.0, weights=1 * GiB)
    probe = ProbeResult(devices=(Device(0, "nvidia", "gpu", 24 * GiB, 20 * GiB),
                                 Device(1, "cpu", "host", 64 * GiB, 48 * GiB)))
    f16 = parse_kv_cache_type("f16")
    report = ({"model": "tc", "device_index": 1, "device_kind": "cpu", "status": "valid", "reason": None,
               "evidence": _evidence("tc").to_json()},)
    outcome = build_plan(probe, (tc, ag), f16, admission=Admission({1: frozenset({"tc"})}, report, "/h/e.json"))
    assert outcome.plan is not None and outcome.plan.entry.name == "tc" and outcome.placement.device.index == 1
    assert [dp.chosen_name for dp in outcome.devices] == ["ag", "tc"]  # the GPU's plan holds no admitted name
    assert outcome.admitted_evidence is not None and outcome.admitted_evidence["device_index"] == 1
    plain = build_plan(probe, (tc, ag), f16)
    assert plain.plan is not None and plain.plan.entry.name == "ag" and plain.admitted_evidence is None


# ----------------------------------------------------------------------------- the world


class ScriptedLlama:
    """Stand-in for the llama Backend: its sessions answer from a scripted agent (no model runs);
    the preflight is the real binary search, so the grade's flags and build are what load would use."""

    name = "llama"
    device_kinds = hotfit.backends.select.backend_for("llama").device_kinds  # the planner asks it (stages/plan.py)

    def __init__(self, agent: gs.Agent) -> None:
        self.agent = agent

    def preflight(self, plan: Any, settings: Settings) -> Any:
        return find_llama_server(settings, device_kind=plan.placement.device.kind)

    def device_env(self, plan: Any) -> dict[str, str]:
        return {}

    def grade_build(self, entry: Any, device_kind: str, settings: Settings) -> tuple[str, str]:
        return LlamaServerBackend().grade_build(entry, device_kind, settings)  # the real build's identity

    def build_identity(self, device_kind: str, settings: Settings) -> tuple[str, str]:
        return LlamaServerBackend().build_identity(device_kind, settings)

    @contextlib.asynccontextmanager
    async def open(self, plan: Any, files: Any, *, run_dir: Path, binary: Any,
                   settings: Any) -> AsyncIterator[ScriptedSession]:
        run_dir.mkdir(parents=True, exist_ok=True)
        yield ScriptedSession(plan, run_dir, gs.ScriptedServer(self.agent))


def write_build(server: Path, commit: str = "0c1e570") -> None:
    (server.parent / "build-info.json").write_text(json.dumps({
        "sdist": "llama-cpp-python", "sdist_version": "0.3.36", "sdist_sha256": "0" * 64,
        "llama_cpp_version": f"version: 0.5.0-dev (build 1, commit {commit})", "backend": "cpu",
        "variant": "native", "cpu_features": [], "cuda_architectures": []}))


@dataclasses.dataclass
class Earned:
    hub: LocalHub
    world: World
    home: Path
    probe: Path
    server: Path | None  # the stand-in llama-server (None: the real one)


def tool_chat_world(world: World, root: Path) -> World:
    """``world`` with LARGE (the larger fixture, the automatic pick) curated tool-chat, not agentic."""
    entries = {**world.entries, LARGE: dataclasses.replace(world.entry(LARGE), agentic_tier="tool-chat")}
    path = root / "registry-tool-chat.json"
    write_registry(path, entries.values())
    return World(world.root, path, entries, world.repos)


def pull(e: Earned, name: str = LARGE) -> None:
    done = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(e.home), "--log-format", "json", "pull",
                           name, "--registry", str(e.world.registry_path)], cwd=REPO,
                          env=env_for(e.hub, e.server), capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-3000:]


def run_text(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--log-format", "json", *argv], out=out)
    return code, out.getvalue()


def plan_json(e: Earned, *extra: str) -> tuple[int, dict[str, Any]]:
    return cli_json("plan", "--registry", str(e.world.registry_path), "--probe-file", str(e.probe), *extra)


def grade(e: Earned, agent: gs.Agent, tier: str) -> dict[str, Any]:
    """The real ``hotfit grade --model LARGE`` job, the model's answers scripted."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(hotfit.backends.select.BACKENDS, "llama", ScriptedLlama(agent))
        mp.setitem(hotfit.backends.select.BACKENDS, "fake", FakeBackend(answer=CALL, report=_report()))  # the sessions'
        return anyio.run(lambda: grade_model(load_settings(), model=LARGE, registry_file=e.world.registry_path,
                                             tier=tier, budget_s=None, output=None, probe_file=e.probe))


@pytest.fixture
def earned(hub: LocalHub, plain_world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Earned]:
    home = tmp_path / "home"
    (tmp_path / "bin").mkdir()
    server = write_standin_llama_server(tmp_path / "bin" / "llama-server")
    write_build(server)
    monkeypatch.setenv("HOTFIT_HOME", str(home))
    monkeypatch.setenv("HOTFIT_LLAMA_SERVER", str(server))
    monkeypatch.delenv("CONTENOX_LLAMA_KV_CACHE_TYPE", raising=False)
    e = Earned(hub, tool_chat_world(plain_world, tmp_path), home, write_probe(tmp_path / "probe.json",
                                                                                 ROOMY_FREE_BYTES), server)
    pull(e)
    yield e


# ----------------------------------------------------------------------------- record and admit


def test_a_full_pass_admits_the_tool_chat_model_only_with_the_flag(
        earned: Earned, monkeypatch: pytest.MonkeyPatch) -> None:
    e = earned
    # before any grade: the flag changes nothing, and says there is no evidence
    code, before = plan_json(e, "--admit-graded")
    assert code == 0 and before["selected"]["name"] == SMALL and before["admission"]["models"] == []

    report = grade(e, gs.oracle, "full")
    assert report["verdict"]["verdict"] == "pass" and report["score"] == {"passed": 16, "total": 16, "fraction": 1.0}
    ev = report["evidence"]
    assert ev["recorded"] is True and ev["path"] == str(evidence_path(e.home)), ev
    artifact = e.world.entry(LARGE).artifact
    assert artifact is not None and artifact.file is not None
    receipt = read_receipt(load_settings().model_dir(LARGE), artifact.file)
    assert receipt is not None
    fp = ev["evidence"]["fingerprint"]
    template = load_settings().model_dir(LARGE) / "chat_template.jinja"
    assert fp["model_sha256"] == receipt.sha256 == report["fingerprint"]["model_sha256"]
    assert fp["template_sha256"] == sha256_of(template)
    assert fp["backend_build_described"] == ("llama.cpp 0.5.0-dev, commit 0c1e570, sdist 0.3.36, cpu backend, "
                                             "native build")
    assert fp["grade_version"] == report["grade_version"]
    assert fp["scenario_pack_sha256"] == report["fingerprint"]["scenario_pack_sha256"]
    assert ev["evidence"]["graded_at"].endswith("Z") and ev["evidence"]["grade_record"] == report["output"]

    # default: curation only — the same evidence does nothing without the flag
    code, plain = plan_json(e)
    assert code == 0 and plain["selected"]["name"] == SMALL and "admission" not in plain
    assert "admitted_by_grade" not in plain["selected"]
    assert {c["name"]: c["reason_code"] for c in plain["candidates"]}[LARGE] == "tier"

    code, admitted = plan_json(e, "--admit-graded")
    assert code == 0 and admitted["selected"]["name"] == LARGE and admitted["selected"]["admitted_by_grade"] is True
    assert admitted["selected"]["agentic_tier"] == "tool-chat"
    assert admitted["selected"]["evidence"]["status"] == "valid"
    assert admitted["selected"]["evidence"]["evidence"]["fingerprint"] == fp
    assert {c["name"]: c["reason"] for c in admitted["candidates"]}[LARGE].startswith("admitted by grade evidence")

    # auto --dry-run says the same (the full auto is the llama test below)
    code, dry = cli_json("auto", "--dry-run", "--admit-graded", "--registry", str(e.world.registry_path),
                        "--probe-file", str(e.probe))
    assert code == 0 and dry["model"] == LARGE and dry["selection"]["selected"]["admitted_by_grade"] is True

    code, text = run_text("plan", "--admit-graded", "--registry", str(e.world.registry_path),
                          "--probe-file", str(e.probe))
    assert code == 0 and f"admitted by grade: {LARGE} — full tier 16/16 on this machine's cpu device" in text

    code, status = cli_json("status", "--registry", str(e.world.registry_path))
    assert code == 0
    rows = {(m["model"], m["device_kind"]): m for m in status["grade_evidence"]["models"]}
    assert rows[(LARGE, "cpu")]["status"] == "valid" and rows[(LARGE, "cpu")]["evidence"]["passed"] == 16
    code, text = run_text("status", "--registry", str(e.world.registry_path))
    assert code == 0 and "valid: full tier 16/16" in text and LARGE in text


def test_each_fingerprint_change_withdraws_the_admission_naming_the_part(
        earned: Earned, monkeypatch: pytest.MonkeyPatch) -> None:
    e = earned
    assert (grade(e, gs.oracle, "full"))["evidence"]["recorded"] is True
    assert e.server is not None

    def refused(words: str) -> dict[str, Any]:
        code, doc = plan_json(e, "--admit-graded")
        assert code == 0 and doc["selected"]["name"] == SMALL and doc["selected"]["admitted_by_grade"] is False
        [row] = doc["admission"]["models"]
        assert row["model"] == LARGE and row["status"] == "stale" and row["reason"].startswith(words), row
        code, text = run_text("plan", "--admit-graded", "--registry", str(e.world.registry_path),
                              "--probe-file", str(e.probe))
        assert code == 0 and f"not admitted: {LARGE} on [0] cpu — {words}" in text
        return row

    def admitted() -> None:
        code, doc = plan_json(e, "--admit-graded")
        assert code == 0 and doc["selected"]["name"] == LARGE, doc["admission"]

    # a new build: another llama.cpp commit in build-info.json
    write_build(e.server, commit="1234567")
    row = refused("evidence stale: backend build changed")
    assert "commit 0c1e570" in row["reason"] and "commit 1234567" in row["reason"]
    write_build(e.server)
    admitted()
    # a rebuilt binary of the same version: other bytes
    original = e.server.read_bytes()
    e.server.write_bytes(original + b"# rebuilt\n")
    assert "same version, different binary" in refused("evidence stale: backend build changed")["reason"]
    e.server.write_bytes(original)
    admitted()

    # the grade itself changed (another grade version recorded than this hotfit's)
    path = evidence_path(e.home)
    recorded = path.read_text()
    doc = json.loads(recorded)
    doc["evidence"][0]["fingerprint"]["grade_version"] = "grade-0.0"
    path.write_text(json.dumps(doc))
    assert "graded grade-0.0, now grade-0.1" in refused("evidence stale: grade version changed")["reason"]
    path.write_text(recorded)
    admitted()

    # a new template: the registry pins a new revision of the template repository, pulled again
    large = e.world.entry(LARGE)
    assert large.chat_template is not None
    commit = e.hub.commit(TEMPLATE_REPO, {"chat_template.jinja": (
        load_settings().model_dir(LARGE) / "chat_template.jinja").read_text() + "\n{# revised #}\n"})
    new_template = dataclasses.replace(large, chat_template=dataclasses.replace(large.chat_template, revision=commit))
    write_registry(e.world.registry_path, {**e.world.entries, LARGE: new_template}.values())
    pull(e)
    refused("evidence stale: chat template changed")

    # a new model file: the registry pins another GGUF (same name, other bytes), pulled again
    (e.world.registry_path.parent / "v2").mkdir()
    info = write_tool_call_model(e.world.registry_path.parent / "v2" / f"{LARGE}.gguf", tensor_type="f16")
    repo = e.world.repos[LARGE]
    commit = e.hub.commit(repo, {info.path.name: info.path}, lfs=True)
    new_model = fixture_entry(LARGE, info, repo=repo, revision=commit, sha256=sha256_of(info.path), params_b=0.02,
                              template=new_template.chat_template, tier="tool-chat")
    write_registry(e.world.registry_path, {**e.world.entries, LARGE: new_model}.values())
    # the new pin, not pulled yet: the file in place is not the registry's, so nothing vouches for it
    code, doc = plan_json(e, "--admit-graded")
    [row] = doc["admission"]["models"]
    assert code == 0 and doc["selected"]["name"] == SMALL and row["status"] == "unusable"
    assert row["reason"].startswith(f"evidence unusable: no verified {LARGE}.gguf for the registry's pin"), row
    pull(e)
    refused("evidence stale: model file changed")  # the first part that differs is named (the template did too)
    code, status = cli_json("status", "--registry", str(e.world.registry_path))
    assert [m["status"] for m in status["grade_evidence"]["models"] if m["model"] == LARGE] == ["stale"]


def test_quick_passes_never_count_a_fail_removes_and_inconclusive_keeps(
        earned: Earned, monkeypatch: pytest.MonkeyPatch) -> None:
    e = earned
    quick = grade(e, gs.oracle, "quick")
    assert quick["verdict"]["verdict"] == "pass" and quick["verdict"]["provisional"] is True
    assert quick["evidence"]["recorded"] is False and "quick-tier pass is provisional" in quick["evidence"]["why"]
    assert not evidence_path(e.home).exists()
    with pytest.MonkeyPatch.context() as mp:  # the CLI says so too
        mp.setitem(hotfit.backends.select.BACKENDS, "llama", ScriptedLlama(gs.oracle))
        mp.setitem(hotfit.backends.select.BACKENDS, "fake", FakeBackend(answer=CALL, report=_report()))  # the sessions'
        code, text = run_text("grade", "--model", LARGE, "--registry", str(e.world.registry_path),
                              "--probe-file", str(e.probe), "--tier", "quick")
    assert code == 0 and "evidence: not recorded — a quick-tier pass is provisional" in text, text

    assert (grade(e, gs.oracle, "full"))["evidence"]["recorded"] is True
    broken = grade(e, gs.http_500_on_turn_2, "full")
    assert broken["verdict"]["verdict"] == "inconclusive"
    assert broken["evidence"]["recorded"] is False and broken["evidence"]["removed"] is False
    assert len(json.loads(evidence_path(e.home).read_text())["evidence"]) == 1  # a stack problem is not the model's

    failed = grade(e, gs.never_calls, "full")
    assert failed["verdict"]["verdict"] == "fail" and failed["evidence"]["removed"] is True
    assert json.loads(evidence_path(e.home).read_text())["evidence"] == []
    code, doc = plan_json(e, "--admit-graded")
    assert code == 0 and doc["selected"]["name"] == SMALL and doc["admission"]["models"] == []


def test_a_damaged_evidence_file_is_an_error_naming_it(earned: Earned) -> None:
    e = earned
    path = evidence_path(e.home)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"schema": 1, "evidence": [{"model": "x"}]}')
    code, doc = plan_json(e, "--admit-graded")
    assert code == 2 and str(path) in doc["error"]["message"] and "device_kind" in doc["error"]["message"]
    code, plain = plan_json(e)  # without the flag the file is not read at all
    assert code == 0 and plain["selected"]["name"] == SMALL
    code, status = cli_json("status", "--registry", str(e.world.registry_path))
    assert code == 0 and str(path) in status["grade_evidence"]["problem"]


# ----------------------------------------------------------------------------- the real llama-server


@pytest.mark.llama
def test_auto_admit_graded_provisions_the_earned_model_and_a_real_failed_grade_withdraws_it(
        hub: LocalHub, world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("HOTFIT_HOME", str(home))
    monkeypatch.delenv("HOTFIT_LLAMA_SERVER", raising=False)
    monkeypatch.delenv("CONTENOX_LLAMA_KV_CACHE_TYPE", raising=False)
    e = Earned(hub, tool_chat_world(world, tmp_path), home, write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES),
               None)
    pull(e)
    # the evidence: a scripted full-tier pass, fingerprinted with the real files and the real binary
    recorded = (grade(e, gs.oracle, "full"))["evidence"]
    assert recorded["recorded"] is True  # the real llama Backend from here on

    human = auto(hub, home, e.world, e.probe, "--admit-graded")
    assert human.returncode == 0 and "admitted by grade  tool-chat, selected on its full-tier pass 16/16" \
        in human.stdout, human.stdout + human.stderr[-3000:]
    done = auto(hub, home, e.world, e.probe, "--json", "--admit-graded")
    assert done.returncode == 0 and json.loads(done.stdout)["noop"] is True, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["entry_name"] == LARGE and out["probe_verdict"]["passed"] is True
    assert out["admitted_by_grade"]["evidence"]["fingerprint"] == recorded["evidence"]["fingerprint"]
    assert out["extra"]["admitted_by_grade"] == out["admitted_by_grade"]  # kept in the manifest
    # without the flag the provisioning does not stand: curation picks the agentic model
    dry = auto(hub, home, e.world, e.probe, "--json", "--dry-run")
    assert dry.returncode == 0 and json.loads(dry.stdout)["model"] == SMALL

    # auto --grade: a real full-tier grade of the provisioned fixture in the session; it fails (the
    # fixture never calls under "auto"), which withdraws the evidence
    regraded = auto(hub, home, e.world, e.probe, "--json", "--admit-graded", "--grade", "--recheck")
    assert regraded.returncode == 0, regraded.stderr[-3000:]
    out = json.loads(regraded.stdout)
    assert out["entry_name"] == LARGE and out["grade"]["verdict"] == "fail" and out["grade"]["tier"] == "full"
    assert out["grade_evidence"]["removed"] is True and json.loads(evidence_path(home).read_text())["evidence"] == []
    text = auto(hub, home, e.world, e.probe, "--admit-graded", "--dry-run")
    assert text.returncode == 0 and json.loads(text.stdout)["model"] == SMALL  # no longer admitted

    # earned again (scripted), then withdrawn by a real `hotfit grade --tier full` of the provisioned model;
    # the next --admit-graded plan no longer admits it
    assert grade(e, gs.oracle, "full")["evidence"]["recorded"] is True
    graded = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "grade",
                             "--tier", "full", "--json"], cwd=REPO, env=env_for(hub), capture_output=True, text=True,
                            timeout=300, check=False)
    assert graded.returncode == 8, graded.stderr[-3000:]
    report = json.loads(graded.stdout)
    assert report["tier"] == "full" and report["evidence"]["removed"] is True
    code, doc = plan_json(e, "--admit-graded")
    assert code == 0 and doc["selected"]["name"] == SMALL and doc["admission"]["models"] == []
    code, status = cli_json("status", "--registry", str(e.world.registry_path))
    assert status["last_grade"]["verdict"] == "fail" and status["last_grade"]["tier"] == "full"
    assert status["last_grade"]["total"] == 16 and status["last_grade"]["graded_at"]
