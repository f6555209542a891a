"""Each stage is declared with its work in its own module, and the engine's reuse key carries the
stage's version (CONTRIBUTING.md, "Adding a stage")."""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.records import canonical_json
from hotfit.pipeline.engine import RunContext, Runner, Stage, StageContext, inputs_hash
from hotfit.pipeline.provision import STAGE_NAMES, AutoOptions, provisioning_stages
from hotfit.pipeline.session_stages import GradeOptions, grade_stage
from hotfit.stages.declaration import StageDeclaration
from hotfit.state.store import StateStore
from tests.test_runner import fake_settings

TIER = "unit"

# every stages/<name>.py (the private helpers, _gguf_header and _snapshot_verify, are no stages)
STAGE_MODULES = ("probe", "plan", "fetch_weights", "fetch_template", "verify", "load", "probe_tool_call",
                 "recheck", "measure_speed", "grade")


def test_the_stage_modules_are_every_public_module_of_stages() -> None:
    here = Path(__file__).resolve().parent.parent / "stages"
    public = {p.stem for p in here.glob("*.py") if not p.stem.startswith("_")} - {"declaration"}
    assert public == set(STAGE_MODULES)


@pytest.mark.parametrize("module", STAGE_MODULES)
def test_every_stage_module_exports_its_declaration(module: str) -> None:
    declared = importlib.import_module(f"hotfit.stages.{module}").DECLARATION
    assert isinstance(declared, StageDeclaration)
    assert inspect.iscoroutinefunction(declared.fn), "the work is an async function of the stage context"
    assert isinstance(declared.version, int) and not isinstance(declared.version, bool) and declared.version >= 1
    assert declared.result_type is not None
    assert declared.decode is not None, "a reused stage hands on the type a fresh one returns"
    assert declared.figures is not None or declared.name in ("fetch-template", "verify")
    # a stage the engine may reuse says when its record is no longer good, or is reused with its session
    assert declared.always_run or declared.still_valid is not None or declared.session is not None


def test_the_order_is_the_declarations() -> None:
    """pipeline/ keeps only the order: the stages of `hotfit auto` are the declared ones, each
    bound to its job and otherwise as its module declares it."""
    stages = provisioning_stages(AutoOptions())
    assert tuple(s.name for s in stages) == STAGE_NAMES
    for stage in [*stages, grade_stage(GradeOptions("quick"))]:
        module = importlib.import_module(f"hotfit.stages.{stage.name.replace('-', '_').replace('re_check', 'recheck')}")
        declared = module.DECLARATION
        assert (stage.name, stage.fn, stage.decode, stage.fingerprint, stage.figures, stage.version) == (
            declared.name, declared.fn, declared.decode, declared.fingerprint, declared.figures, declared.version)


# --------------------------------------------------------------------------- the version in the reuse key


def _context() -> RunContext:
    async def enter(cm: Any) -> Any:
        raise AssertionError("not entered")

    return RunContext(run_id="r", run_dir=Path("/nowhere"), settings=fake_settings(Path("/nowhere")),
                      plan=None, results={}, enter_context=enter)


def test_a_version_1_key_is_the_key_records_were_written_under_before_versions() -> None:
    stage: Stage[Any] = Stage("s", _work, deps=("up",))
    before = hashlib.sha256(canonical_json(
        {"stage": "s", "inputs": {"plan_id": None}, "upstream": {"up": {"x": 1}}}).encode()).hexdigest()
    assert inputs_hash(stage, _context(), {"up": {"x": 1}}) == before
    assert inputs_hash(dataclasses.replace(stage, version=2), _context(), {"up": {"x": 1}}) != before


calls: list[str] = []


async def _work(ctx: StageContext) -> dict[str, Any]:
    calls.append("work")
    return {"made": True}


@pytest.mark.anyio
async def test_a_record_of_another_version_is_not_reused(tmp_path: Path) -> None:
    settings = fake_settings(tmp_path)
    stage: Stage[Any] = Stage("made", _work)

    async def run(declared: Stage[Any]) -> tuple[str, ...]:
        store = await StateStore.open(tmp_path / "state.db")
        try:
            return (await Runner([declared], store, settings, handle_signals=False).run()).skipped
        finally:
            await store.aclose()

    calls.clear()
    assert await run(stage) == ()
    assert await run(stage) == ("made",)  # same version: reused
    assert calls == ["work"]
    bumped = dataclasses.replace(stage, version=2)
    assert await run(bumped) == ()  # the result changed shape: the old record is not trusted
    assert calls == ["work", "work"]
    assert await run(bumped) == ("made",)  # and the new record is reused in its turn
    assert calls == ["work", "work"]
