"""The OpenVINO backend against real IR models made at test time.

Fixtures: a GGUF written with ``gguf`` and converted to IR by GenAI's own reader
(:mod:`tests.openvino_fixtures`), once per test session. Skipped without openvino-genai unless
``HOTFIT_REQUIRE_OPENVINO=1``, which makes its absence a failure.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hotfit.core.errors import AllocationMismatch, LoadError, ToolCallProbeFailed
from hotfit.backends.openvino.allocation import OpenVinoAllocationReport
from hotfit.stages.probe_tool_call import probe_tool_call
from hotfit.stages.recheck import recheck_allocation
from hotfit.backends.openvino.config import SESSION_FILE
from hotfit.backends.openvino.session import open_openvino_session
from tests.gguf_fixtures import pinned_template
from tests.openvino_fixtures import (
    CHATML_NO_TOOLS_TEMPLATE,
    IR_FILES,
    OvFixture,
    make_ov_fixture,
    ov_plan,
    require_openvino_genai,
)
from tests.polling import wait_until
from tests.test_load import process_gone

TIER = "unit"

pytestmark = [pytest.mark.openvino, pytest.mark.anyio]


@pytest.fixture(autouse=True)
def _needs_openvino() -> None:
    require_openvino_genai()


@pytest.fixture(scope="session")
def tool_ir(tmp_path_factory: pytest.TempPathFactory) -> OvFixture:
    require_openvino_genai()
    return make_ov_fixture(tmp_path_factory.mktemp("ov-tool-call"), "tool-call")


@pytest.fixture(scope="session")
def random_ir(tmp_path_factory: pytest.TempPathFactory) -> OvFixture:
    require_openvino_genai()
    return make_ov_fixture(tmp_path_factory.mktemp("ov-random"), "random")


def _copy(fx: OvFixture, dest: Path) -> OvFixture:
    shutil.copytree(fx.ir_dir, dest)
    return dataclasses.replace(fx, ir_dir=dest)



def test_the_fixture_is_the_hub_file_set(tool_ir: OvFixture) -> None:
    assert sorted(p.name for p in tool_ir.ir_dir.iterdir()) == sorted(IR_FILES)


@pytest.mark.parametrize(("kv", "precision", "bytes_per_token"), [("f16", "f16", 128), ("q8_0", "u8", 80)])
async def test_forced_call_parses_and_the_kv_is_what_was_configured(
    tool_ir: OvFixture, tmp_path: Path, kv: str, precision: str, bytes_per_token: int
) -> None:
    plan = ov_plan(tool_ir, 32768, kv)
    async with open_openvino_session(plan, tool_ir.ir_dir, tmp_path / "run") as session:
        pid = session.pid
        saved = json.loads((tmp_path / "run" / SESSION_FILE).read_text())
        assert saved["num_kv_blocks"] == 1024 and saved["kv_precision"] == precision and saved["max_num_seqs"] == 1
        probe = await probe_tool_call(session)
        assert probe.verdict.passed and probe.family == "hermes"
        assert probe.verdict.tool_name == "hotfit_probe" and probe.verdict.arguments == {"text": ""}
        assert probe.text.startswith("<tool_call>")  # the marker survives decoding
        report = await recheck_allocation(session)
        assert isinstance(report, OpenVinoAllocationReport)  # the backend's own report, with its own fields
    # 1 layer x 1 KV head x head_dim 32: f16 4 x 32 B/token, u8 (32 + 8) + (32 + 8) B/token
    assert report.actual_kv_bytes == 32768 * bytes_per_token
    assert report.opened_context_tokens == 32768 and report.kv_precision == precision
    assert report.ratio == pytest.approx(1.0)
    assert process_gone(pid)  # nothing left running


@pytest.mark.parametrize(("template", "family", "marker"), [
    ("Qwen-Qwen3-0.6B.jinja", "hermes", '<tool_call>\n{"name": "hotfit_probe"'),
    ("Qwen3-Coder.jinja", "qwen3_coder", "<tool_call>\n<function=hotfit_probe>\n<parameter=text>"),
    ("openai-gpt-oss-120b.jinja", "harmony", "<|channel|>commentary to=functions.hotfit_probe"),
])
async def test_real_templates_render_the_tools_and_their_family_parses(
    tmp_path: Path, template: str, family: str, marker: str
) -> None:
    # the publishers' own templates (the pinned llama.cpp tree's copies) through GenAI's minja
    fx = make_ov_fixture(tmp_path / "fx", "tool-call", chat_template=pinned_template(template).read_text())
    async with open_openvino_session(ov_plan(fx, 32768), fx.ir_dir, tmp_path / "run") as session:
        probe = await probe_tool_call(session)
    assert probe.family == family and probe.template_renders_tools
    assert probe.verdict.passed and probe.verdict.tool_name == "hotfit_probe"
    assert probe.text.startswith(marker)


async def test_recheck_before_the_first_step_sees_no_allocation(tool_ir: OvFixture, tmp_path: Path) -> None:
    async with open_openvino_session(ov_plan(tool_ir, 32768), tool_ir.ir_dir, tmp_path) as session:
        with pytest.raises(AllocationMismatch) as err:
            await recheck_allocation(session)
    assert "0 KV bytes" in err.value.what and err.value.details["actual_kv_bytes"] == 0


async def test_an_allocation_above_the_estimate_fails_closed(tool_ir: OvFixture, tmp_path: Path) -> None:
    # the plan budgeted q8_0's llama.cpp figure (34 B per 32 values) but OpenVINO's u8 costs more
    plan = ov_plan(tool_ir, 32768, "q8_0", estimated_kv_bytes=32768 * 68)
    async with open_openvino_session(plan, tool_ir.ir_dir, tmp_path) as session:
        await probe_tool_call(session)
        with pytest.raises(AllocationMismatch) as err:
            await recheck_allocation(session)
    assert "budget would be overrun" in err.value.what
    assert err.value.details["estimated_kv_bytes"] == 32768 * 68 and err.value.details["actual_kv_bytes"] == 32768 * 80


async def test_prose_fails_with_the_cause_named(random_ir: OvFixture, tmp_path: Path) -> None:
    async with open_openvino_session(ov_plan(random_ir, 32768), random_ir.ir_dir, tmp_path) as session:
        with pytest.raises(ToolCallProbeFailed) as err:
            await probe_tool_call(session, force=False, max_tokens=24)
    assert err.value.details["reason"].startswith("answered in prose")
    # the template renders the tools, so prose with no call-shaped JSON is the model ignoring them
    assert err.value.details["cause"] == "ignored_tools"
    assert "tool-call probe failed" in err.value.what


async def test_a_template_without_tools_fails_before_generating(tmp_path: Path) -> None:
    require_openvino_genai()
    fx = make_ov_fixture(tmp_path / "fx", "tool-call", chat_template=CHATML_NO_TOOLS_TEMPLATE)
    async with open_openvino_session(ov_plan(fx, 32768), fx.ir_dir, tmp_path / "run") as session:
        with pytest.raises(ToolCallProbeFailed) as err:
            await probe_tool_call(session)
    assert err.value.details["cause"] == "prose" and "cannot express tools" in err.value.what


async def test_a_prompt_that_does_not_fit_the_cache_is_not_a_pass(tool_ir: OvFixture, tmp_path: Path) -> None:
    # one 32-token block: GenAI ignores the request (no exception); the probe must say so
    async with open_openvino_session(ov_plan(tool_ir, 32), tool_ir.ir_dir, tmp_path) as session:
        with pytest.raises(ToolCallProbeFailed) as err:
            await probe_tool_call(session)
    assert err.value.details["cause"] == "status" and err.value.details["status"] == "IGNORED"


async def test_a_prompt_longer_than_the_tokenizer_passes_is_refused_not_cut(tool_ir: OvFixture, tmp_path: Path) -> None:
    """GenAI's GGUF reader bakes an 8192-token limit into the fixture's tokenizer, which encode's
    truncation=False does not lift: the session finds it on opening, a prompt under it is answered,
    and a longer one fails naming the limit instead of being answered cut (docs/openvino.md)."""
    from hotfit.grading.protocol import ChatFailed
    from hotfit.stages.measure_speed import agent_request

    async with open_openvino_session(ov_plan(tool_ir, 32768), tool_ir.ir_dir, tmp_path / "run") as session:
        assert session.prompt_max_tokens == 8192
        short = await session.call_tools(agent_request(2048, chars_per_token=1.0), timeout_s=120,
                                           purpose="a short prompt")  # this toy vocabulary: about a token a byte
        assert 0 < (short.prompt_tokens or 0) < 8192 and (short.prompt_ms or 0) > 0
        with pytest.raises(ChatFailed) as err:
            await session.call_tools(agent_request(16384, chars_per_token=1.0), timeout_s=120, purpose="a long prompt")
    assert err.value.details == {"status": "TRUNCATED", "prompt_max_tokens": 8192}
    assert "8192" in err.value.what and "openvino_tokenizer.xml" in err.value.what


async def test_a_truncated_weights_file_is_a_damaged_ir(tool_ir: OvFixture, tmp_path: Path) -> None:
    fx = _copy(tool_ir, tmp_path / "ir")
    weights = fx.ir_dir / "openvino_model.bin"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(LoadError) as err:
        async with open_openvino_session(ov_plan(fx, 32768), fx.ir_dir, tmp_path / "run"):
            pytest.fail("a damaged IR opened")
    assert err.value.details["cause"] == "damaged_ir", err.value.to_json()
    assert "re-fetch" in (err.value.hint or "")


async def test_a_garbled_model_xml_is_a_damaged_ir(tool_ir: OvFixture, tmp_path: Path) -> None:
    fx = _copy(tool_ir, tmp_path / "ir")
    xml = fx.ir_dir / "openvino_model.xml"
    xml.write_text(xml.read_text()[:5000])
    with pytest.raises(LoadError) as err:
        async with open_openvino_session(ov_plan(fx, 32768), fx.ir_dir, tmp_path / "run"):
            pytest.fail("a damaged IR opened")
    assert err.value.details["cause"] == "damaged_ir", err.value.to_json()


async def test_a_missing_detokenizer_is_refused_before_starting(tool_ir: OvFixture, tmp_path: Path) -> None:
    fx = _copy(tool_ir, tmp_path / "ir")
    (fx.ir_dir / "openvino_detokenizer.bin").unlink()
    with pytest.raises(LoadError) as err:
        async with open_openvino_session(ov_plan(fx, 32768), fx.ir_dir, tmp_path / "run"):
            pytest.fail("opened without a detokenizer")
    assert err.value.details["cause"] == "missing_files" and err.value.details["missing"] == ["openvino_detokenizer.bin"]
    assert not (tmp_path / "run").exists()  # refused before any process or file


async def test_a_vision_path_export_is_refused(tool_ir: OvFixture, tmp_path: Path) -> None:
    # the layout of optimum-intel's vision-language exports (Gemma 4, Qwen3.5): the language model
    # under its own name, vision embeddings beside it, and a config.json with a vision_config
    fx = _copy(tool_ir, tmp_path / "ir")
    (fx.ir_dir / "openvino_model.xml").rename(fx.ir_dir / "openvino_language_model.xml")
    (fx.ir_dir / "openvino_model.bin").rename(fx.ir_dir / "openvino_language_model.bin")
    shutil.copy(fx.ir_dir / "openvino_language_model.xml", fx.ir_dir / "openvino_vision_embeddings_model.xml")
    (fx.ir_dir / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"],
                                                       "vision_config": {"hidden_size": 64}}))
    with pytest.raises(LoadError) as err:
        async with open_openvino_session(ov_plan(fx, 32768), fx.ir_dir, tmp_path / "run"):
            pytest.fail("a vision-path export opened")
    assert err.value.details["cause"] == "vision_path"
    assert "rejects model-native tool definitions" in err.value.what


async def test_a_start_past_its_deadline_is_killed(tool_ir: OvFixture, tmp_path: Path) -> None:
    with pytest.raises(LoadError) as err:
        async with open_openvino_session(ov_plan(tool_ir, 32768), tool_ir.ir_dir, tmp_path, timeout_s=0.01):
            pytest.fail("opened within 10 ms")
    assert err.value.details["cause"] == "timeout"
    assert process_gone(err.value.details["pid"])  # the worker was killed and reaped
    saved = json.loads((tmp_path / SESSION_FILE).read_text())  # the settings were recorded before starting
    assert saved["num_kv_blocks"] == 1024


async def test_cancellation_leaves_nothing_running(tool_ir: OvFixture, tmp_path: Path) -> None:
    import anyio

    pids: list[int] = []
    with anyio.move_on_after(30):
        async with open_openvino_session(ov_plan(tool_ir, 32768), tool_ir.ir_dir, tmp_path) as session:
            pids.append(session.pid)
            await anyio.sleep(60)  # cancelled by the scope, like a SIGINT in hotfit's runner
    assert pids and process_gone(pids[0])


_HOLDER = """
import sys, anyio
from pathlib import Path
from tests.openvino_fixtures import OvFixture, ov_plan
from hotfit.backends.openvino.session import open_openvino_session

async def main() -> None:
    fx = OvFixture(Path(sys.argv[1]), "tool-call", 1, 1, 32, 0.0)
    async with open_openvino_session(ov_plan(fx, 32768), fx.ir_dir, Path(sys.argv[2])) as session:
        print("WORKER", session.pid, flush=True)
        await anyio.sleep(120)

anyio.run(main)
"""


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_worker_dies_with_hotfit(tool_ir: OvFixture, tmp_path: Path, sig: int) -> None:
    # The holder has no signal handlers, so both signals end it with no cleanup at all (hotfit's runner
    # turns SIGTERM into cancellation, which reaps like test_cancellation_leaves_nothing_running):
    # what is left is PR_SET_PDEATHSIG and the worker seeing its stdin close.
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(tool_ir.ir_dir), str(tmp_path)],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).resolve().parent.parent)
    try:
        assert holder.stdout is not None
        line = ""
        while not line.startswith("WORKER "):  # hotfit's own log lines come first
            line = holder.stdout.readline()
            assert line, "the holder exited before opening the session"
        worker_pid = int(line.split()[1])
        assert not process_gone(worker_pid)
        holder.send_signal(sig)
        holder.wait(timeout=30)
        wait_until(lambda: process_gone(worker_pid), f"the worker {worker_pid} to end with its holder", timeout_s=10)
    finally:
        holder.kill()
        holder.wait()
