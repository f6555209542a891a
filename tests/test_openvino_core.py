"""The OpenVINO backend's pure core: parsers, settings, IR checks, KV arithmetic and the
re-check's judgement. No openvino-genai needed: these run everywhere."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.errors import BackendNotFound, LoadError
from hotfit.planner.plan import Placement
from hotfit.planner.probe import Device, ProbeResult
from hotfit.backends.openvino import config as openvino_config
from hotfit.backends.openvino.toolcall import (
    PARSERS,
    answer_from_text,
    structural_tag,
    tool_call_family,
)
from hotfit.backends.openvino.allocation import OpenVinoAllocationReport, judge_openvino_allocation
from hotfit.backends.openvino.config import (
    IR_REQUIRED_FILES,
    KvShape,
    SessionConfig,
    check_ir_dir,
    diagnose_openvino_failure,
    kv_bytes_per_token,
    kv_bytes_per_token_for_entry,
    openvino_device,
    openvino_kv_precision,
    parse_ir_kv_shape,
    require_openvino,
    session_config,
)
from hotfit.stages.probe_tool_call import PROBE_TOOL, PROBE_TOOL_NAME, judge_answer
from tests.openvino_fixtures import OvFixture, ov_plan

TIER = "unit"

ARGS = {"text": "ping"}


# ---------------------------------------------------------------- parsers

_HERMES_CASES: list[tuple[str, Any]] = [
    ('<tool_call>\n{"name": "hotfit_probe", "arguments": {"text": "ping"}}\n</tool_call>', [("hotfit_probe", ARGS)]),
    ('<think>\nok\n</think>\n\n<tool_call>\n{"name":"hotfit_probe","arguments":{"text":"ping"}}\n</tool_call><|im_end|>',
     [("hotfit_probe", ARGS)]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>',
     [("a", {}), ("b", {"x": 1})]),
    ('<tool_call>\n{"name": "hotfit_probe", "arguments": {"text": "ping"}}', [("hotfit_probe", ARGS)]),  # unclosed
    ('<tool_call>\n{"name": "hotfit_probe", "arguments": "{\\"text\\": \\"ping\\"}"}\n</tool_call>',
     [("hotfit_probe", ARGS)]),  # arguments as a JSON string
    ("Sure! I would call hotfit_probe with ping.", []),
    ('{"name": "hotfit_probe", "arguments": {"text": "ping"}}', []),  # no markers: not a hermes call
    ("<tool_call>not json</tool_call>", []),
]

_HARMONY_CASES: list[tuple[str, Any]] = [
    ('<|channel|>commentary to=functions.hotfit_probe <|constrain|>json<|message|>{"text": "ping"}<|call|>',
     [("hotfit_probe", ARGS)]),
    (('<|channel|>analysis<|message|>Need to call.<|end|><|start|>assistant<|channel|>commentary '
      'to=functions.hotfit_probe <|constrain|>json<|message|>{"text":"ping"}<|call|>'), [("hotfit_probe", ARGS)]),
    ('<|start|>assistant to=functions.hotfit_probe<|channel|>commentary json<|message|>{"text": "ping"}<|call|>',
     [("hotfit_probe", ARGS)]),  # recipient in the role header
    ('<|channel|>commentary to=functions.hotfit_probe<|message|>{"text": "ping"}', [("hotfit_probe", ARGS)]),
    ("<|channel|>final<|message|>Hello there.<|return|>", []),
]

_PHI4_CASES: list[tuple[str, Any]] = [
    ('functools[{"name": "hotfit_probe", "arguments": {"text": "ping"}}]', [("hotfit_probe", ARGS)]),
    ('functools[{"name": "a", "arguments": {}}, {"name": "b", "parameters": {"y": true}}]',
     [("a", {}), ("b", {"y": True})]),
    ('<|tool_call|>[{"name": "hotfit_probe", "arguments": {"text": "ping"}}]<|/tool_call|><|end|>',
     [("hotfit_probe", ARGS)]),
    ("I cannot call tools.", []),
    ("functools[oops", []),
]

_QWEN3_CODER_CASES: list[tuple[str, Any]] = [
    ("<tool_call>\n<function=hotfit_probe>\n<parameter=text>\nping\n</parameter>\n</function>\n</tool_call>",
     [("hotfit_probe", ARGS)]),
    (("Let me call it.\n<tool_call>\n<function=hotfit_probe>\n<parameter=text>\nping\n</parameter>\n"
     "<parameter=loud>\ntrue\n</parameter>\n</function>\n</tool_call>"), [("hotfit_probe", {"text": "ping", "loud": True})]),
    ("<tool_call>\n<function=hotfit_probe>\n<parameter=text>\ntwo\nlines\n</parameter>\n</function>",
     [("hotfit_probe", {"text": "two\nlines"})]),  # unclosed call, multi-line value
    ("<tool_call>\n<function=hotfit_probe>\n<parameter=text>\n123\n</parameter>\n</function>\n</tool_call>",
     [("hotfit_probe", {"text": "123"})]),  # a string parameter stays text
    ('<tool_call>\n{"name": "hotfit_probe", "arguments": {"text": "ping"}}\n</tool_call>', []),  # JSON: not this syntax
    ("No tools needed.", []),
]


@pytest.mark.parametrize(
    ("family", "text", "expected"),
    [pytest.param(family, text, expected, id=f"{family}-{i}")
     for family, cases in [("hermes", _HERMES_CASES), ("harmony", _HARMONY_CASES), ("phi4", _PHI4_CASES),
                           ("qwen3_coder", _QWEN3_CODER_CASES)]
     for i, (text, expected) in enumerate(cases)],
)
def test_parse(family: str, text: str, expected: list[tuple[str, object]]) -> None:
    # through PARSERS, with the request's tools, as answer_from_text calls them
    assert [(c.name, c.arguments) for c in PARSERS[family](text, [PROBE_TOOL])] == expected


@pytest.mark.parametrize(
    ("template", "name", "family"),
    [
        ("...<tool_call>\\n{...}</tool_call>...", "qwen3-8b-ov", "hermes"),
        ("<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>", "x", "qwen3_coder"),
        ("", "qwen3-coder-30b-a3b-ov", "qwen3_coder"),
        ("{{- '<|start|>assistant<|channel|>' }} to=functions.", "anything", "harmony"),
        ("<|tool|>{{ tools }}<|/tool|> functools[", "x", "phi4"),
        ("", "gpt-oss-20b-ov", "harmony"),
        ("", "phi-4-mini-ov", "phi4"),
        (None, "qwen3-8b-ov", "hermes"),
    ],
)
def test_tool_call_family(template: str | None, name: str, family: str) -> None:
    assert tool_call_family(template, name) == family


@pytest.mark.parametrize(("family", "arguments"), [
    ("hermes", '{"text": "ping"}'), ("harmony", '{"text": "ping"}'), ("phi4", '{"text": "ping"}'),
    ("qwen3_coder", "<parameter=text>\nping\n</parameter>\n"),
])
def test_structural_tag_forces_one_probe_call(family: str, arguments: str) -> None:
    import re

    from hotfit.backends.openvino.toolcall import PARSERS

    tag = json.loads(structural_tag(family, PROBE_TOOL))
    fmt = tag["format"]
    assert fmt["type"] == "triggered_tags" and fmt["at_least_one"] is True and fmt["stop_after_first"] is True
    (only,) = fmt["tags"]
    assert only["begin"].startswith(fmt["triggers"][0])
    if family == "qwen3_coder":  # XML parameters: a bounded regex admits these arguments
        assert re.fullmatch(only["content"]["pattern"], arguments)
    else:
        assert only["content"]["json_schema"] == PROBE_TOOL["function"]["parameters"]
    # what the tag forces, with valid arguments, parses with the family's own parser
    forced = only["begin"] + arguments + only["end"]
    assert [(c.name, c.arguments) for c in PARSERS[family](forced, [PROBE_TOOL])] == [(PROBE_TOOL_NAME, ARGS)]


def test_prose_fails_the_shared_verdict_and_a_call_passes() -> None:
    prose = judge_answer(answer_from_text("I would rather chat.", "hermes", "stop"))
    assert not prose.passed and prose.reason.startswith("answered in prose")
    call = judge_answer(answer_from_text('<tool_call>{"name": "hotfit_probe", "arguments": {"text": ""}}</tool_call>',
                                         "hermes", "tool_calls"))
    assert call.passed and call.arguments == {"text": ""}
    missing = judge_answer(answer_from_text('<tool_call>{"name": "hotfit_probe", "arguments": {"loud": true}}</tool_call>',
                                            "hermes", "tool_calls"))
    assert not missing.passed and "required string" in missing.reason


# ---------------------------------------------------------------- settings

def _fixture(tmp_path: Path) -> OvFixture:
    ir = tmp_path / "ir"
    ir.mkdir()
    for name in IR_REQUIRED_FILES:
        (ir / name).write_bytes(b"x")
    return OvFixture(ir, "tool-call", 2, 2, 64, 0.0)


@pytest.mark.parametrize(("kv", "precision"), [("f16", "f16"), ("bf16", "bf16"), ("q8_0", "u8")])
def test_session_config_sets_everything_explicitly(tmp_path: Path, kv: str, precision: str) -> None:
    fx = _fixture(tmp_path)
    plan = ov_plan(fx, 40960, kv)
    config = session_config(plan, fx.ir_dir)
    assert config.device == "CPU" and config.kv_precision == precision
    assert config.num_kv_blocks == 1280 and config.capacity_tokens == 40960  # 40960 / 32
    assert config.cache_size == 0  # so num_kv_blocks alone decides
    assert config.max_num_seqs == 1 and not config.enable_prefix_caching and not config.use_cache_eviction
    assert dict(config.properties) == {"KV_CACHE_PRECISION": precision, "KEY_CACHE_PRECISION": precision,
                                       "VALUE_CACHE_PRECISION": precision}
    odd = session_config(ov_plan(fx, 32769, kv), fx.ir_dir)
    assert odd.num_kv_blocks == 1025 and odd.capacity_tokens >= 32769  # rounded up, never down


def test_kv_types_without_an_openvino_equivalent_are_refused() -> None:
    with pytest.raises(LoadError) as err:
        openvino_kv_precision("q4_0")
    assert err.value.details["cause"] == "kv_precision_unsupported" and "q8_0" in (err.value.hint or "")


def test_a_gpu_plan_is_refused_naming_the_device(tmp_path: Path) -> None:
    import dataclasses

    plan = ov_plan(_fixture(tmp_path), 32768)
    gpu = Device(index=1, kind="nvidia", name="RTX", total_bytes=1 << 34, free_bytes=1 << 34)
    plan = dataclasses.replace(plan, probe=ProbeResult(devices=(gpu,)), placement=Placement.single(gpu))
    with pytest.raises(LoadError) as err:
        openvino_device(plan)
    assert err.value.details["cause"] == "device_unsupported" and "RTX" in err.value.what


def test_missing_extra_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(openvino_config.importlib.util, "find_spec",
                        lambda name, *a: None if name == "openvino_genai" else real(name, *a))
    with pytest.raises(BackendNotFound) as err:
        require_openvino()
    assert 'pip install -e ".[openvino]"' in (err.value.hint or "")
    assert "scripts/bootstrap --openvino" in (err.value.hint or "")


# ---------------------------------------------------------------- IR directory checks

def test_missing_ir_files_are_named(tmp_path: Path) -> None:
    fx = _fixture(tmp_path)
    (fx.ir_dir / "openvino_detokenizer.xml").unlink()
    with pytest.raises(LoadError) as err:
        check_ir_dir(fx.ir_dir)
    assert err.value.details["cause"] == "missing_files"
    assert err.value.details["missing"] == ["openvino_detokenizer.xml"]


def test_absent_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(LoadError) as err:
        check_ir_dir(tmp_path / "nope")
    assert err.value.details["cause"] == "missing_files" and "does not exist" in err.value.what


def test_vision_language_layout_is_refused_before_missing_files(tmp_path: Path) -> None:
    # optimum-intel's VLM export: no openvino_model.xml, a language model and vision embeddings instead
    names = ["openvino_language_model.xml", "openvino_vision_embeddings_model.xml", "openvino_tokenizer.xml"]
    with pytest.raises(LoadError) as err:
        check_ir_dir(tmp_path, names)
    assert err.value.details["cause"] == "vision_path" and "vision-language" in err.value.what


@pytest.mark.parametrize("config", [{"vision_config": {"hidden_size": 8}, "architectures": ["X"]},
                                    {"architectures": ["Gemma3ForConditionalGeneration"]}])
def test_vision_config_marker_is_refused(tmp_path: Path, config: dict[str, object]) -> None:
    fx = _fixture(tmp_path)
    (fx.ir_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoadError) as err:
        check_ir_dir(fx.ir_dir)
    assert err.value.details["cause"] == "vision_path"


def test_text_only_config_passes(tmp_path: Path) -> None:
    fx = _fixture(tmp_path)
    (fx.ir_dir / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"]}))
    check_ir_dir(fx.ir_dir)


@pytest.mark.parametrize(
    ("message", "code", "cause"),
    [
        ("Exception from src/core/src/runtime/... Incorrect weights in bin file!", None, "damaged_ir"),
        ("std::bad_alloc", None, "out_of_memory"),
        ("", -9, "out_of_memory"),
        ("expect kvcache type bf16", None, "kv_precision_unsupported"),
        ("something else", -11, "worker_crashed"),
        ("something else", None, "unknown"),
    ],
)
def test_diagnose_openvino_failure(message: str, code: int | None, cause: str) -> None:
    assert diagnose_openvino_failure(message, code)[0] == cause


# ---------------------------------------------------------------- KV arithmetic and the re-check

_XML = """<layers>
<data variable_id="past_key_values.0.keypresent.0.key" variable_type="f32" variable_shape="?,8,?,128" />
<data variable_id="past_key_values.0.valuepresent.0.key" variable_type="f32" variable_shape="?,8,?,128" />
<data variable_id="beam_idx_state" variable_type="i32" variable_shape="?" />
</layers>"""


def test_kv_geometry_from_the_ir_and_bytes_per_token() -> None:
    shape = parse_ir_kv_shape(_XML)
    assert shape.n_layers == 1 and [(h, d) for _, h, d in shape.states] == [(8, 128), (8, 128)]
    # f16: K+V 2 x 8 heads x 128 x 2 B; u8 (the CPU plugin's scales): K 128+32, V 128+8 per head
    assert kv_bytes_per_token(shape, "f16") == 4096
    assert kv_bytes_per_token(shape, "u8") == 8 * (160 + 136)
    # Qwen3-8B (36 layers, 8 KV heads, 128): 147456 B/token f16, 85248 B/token u8
    assert kv_bytes_per_token_for_entry([(36, 8, 128, 128)], "f16") == 147456
    assert kv_bytes_per_token_for_entry([(36, 8, 128, 128)], "u8") == 85248


def _config(tokens: int = 32768, precision: str = "f16") -> SessionConfig:
    return SessionConfig(ir_dir="/x", device="CPU", kv_precision=precision, kv_cache_type="f16", planned_tokens=tokens,
                         block_tokens=32, num_kv_blocks=-(-tokens // 32), cache_size=0, max_num_batched_tokens=512,
                         max_num_seqs=1, enable_prefix_caching=False, dynamic_split_fuse=True,
                         use_cache_eviction=False, properties=())


SHAPE = KvShape((("past_key_values.0.key", 2, 64), ("past_key_values.0.value", 2, 64)))  # 512 B/token f16


def test_recheck_passes_when_the_allocation_is_the_plan() -> None:
    r = judge_openvino_allocation(config=_config(), shape=SHAPE, estimated_kv_bytes=512 * 32768,
                                  actual_kv_bytes=512 * 32768)
    assert r.verdict == "pass" and r.opened_context_tokens == 32768 and r.ratio == 1.0



def test_a_tokenizer_prompt_limit_below_the_window_is_a_recheck_warning_with_its_own_event() -> None:
    def judged(prompt_max_tokens: int | None) -> OpenVinoAllocationReport:
        return judge_openvino_allocation(config=_config(), shape=SHAPE, estimated_kv_bytes=512 * 32768,
                                         actual_kv_bytes=512 * 32768, prompt_max_tokens=prompt_max_tokens)

    r = judged(8192)
    assert r.verdict == "pass" and len(r.warnings) == 1 and "at most 8192 prompt tokens" in r.warnings[0]
    assert r.warning_event(r.warnings[0]) == "recheck.prompt_cap"
    assert judged(32768).warnings == () and judged(None).warnings == ()


@pytest.mark.parametrize(
    ("tokens", "actual", "estimate", "needle"),
    [
        (32768, 0, 512 * 32768, "0 KV bytes"),
        (40960, 512 * 32768, 512 * 40960, "below the planned 40960"),
        (16384, 512 * 16384, 512 * 16384, "below the agentic floor of 32768"),
        (32768, 512 * 32768 * 2, 512 * 32768, "budget would be overrun"),
        (32768, 512 * 32768, 0, "no KV estimate"),
        # u8 bytes where f16 was planned: 296 B/token x 32768 is not whole f16 blocks
        (32768, 2 * (80 + 72) * 32768, 512 * 32768, "the precision fell back"),
    ],
)
def test_recheck_fails_closed(tokens: int, actual: int, estimate: int, needle: str) -> None:
    r = judge_openvino_allocation(config=_config(tokens), shape=SHAPE, estimated_kv_bytes=estimate,
                                  actual_kv_bytes=actual)
    assert r.verdict == "fail"
    assert any(needle in p for p in r.problems), r.problems
    assert r.actual_kv_bytes == actual and r.estimated_kv_bytes == estimate  # never merged


def test_recheck_without_kv_states_cannot_verify() -> None:
    r = judge_openvino_allocation(config=_config(), shape=KvShape(()), estimated_kv_bytes=1, actual_kv_bytes=1)
    assert r.verdict == "fail" and r.opened_context_tokens is None


@pytest.mark.parametrize(
    ("template", "prompt", "ok", "needle"),
    [
        ("{%- if tools %}{{ tools | tojson }}{% endif %}", f"... {PROBE_TOOL['function']['description']} ...", True, ""),
        ("{%- for m in messages %}{{ m.content }}{% endfor %}", "anything", False, "never reads the `tools`"),
        (None, "", False, "no chat template"),
        ("{% if tools %}{% endif %}",
         "You can call any of the following tools to satisfy the user's requests: [...]", False, "generic tool prompt"),
        ("{% if tools %}{% endif %}", "<|im_start|>user\nCall the hotfit_probe tool", False, "does not hold"),
    ],
)
def test_template_expresses_tools(template: str | None, prompt: str, ok: bool, needle: str) -> None:
    from hotfit.backends.openvino.toolcall import template_expresses_tools

    got, why = template_expresses_tools(template, prompt, [PROBE_TOOL])
    assert got is ok and needle in why


@pytest.mark.parametrize(("files", "rendered", "expected"), [
    ({}, "{{ x }}", None),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{% if tools %}{{ tools }}{% endif %}"})}, "plain", "tokenizer_config.json"),
    ({"tokenizer_config.json": json.dumps({"chat_template": "{% if tools %}{{ tools }}{% endif %}"})},
     "{% if tools %}{{ tools }}{% endif %}", None),  # the same template: it was rendered
    ({"tokenizer_config.json": json.dumps({"chat_template": "{{ messages }}"})}, "plain", None),  # no tools either
    ({"tokenizer_config.json": json.dumps({"chat_template": [{"name": "default", "template": "x"},
                                                             {"name": "tool_use", "template": "{{ tools }}"}]})},
     "plain", "tokenizer_config.json"),
    ({"tokenizer_config.json": "not json", "chat_template.jinja": "{%- for t in tools %}{% endfor %}"}, "plain",
     "chat_template.jinja"),
    ({"tokenizer_config.json": "[1, 2]"}, "plain", None),
])
def test_a_tool_template_genai_did_not_render_is_named(files: dict[str, str], rendered: str,
                                                      expected: str | None) -> None:
    from hotfit.backends.openvino.toolcall import unrendered_tool_template

    assert unrendered_tool_template(files, rendered) == expected
