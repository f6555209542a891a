"""Hostile input: the GGUF header check and template / tokenizer_config parsing give their
typed error — never another exception, a hang, or an allocation out of proportion to the input.

Allocation is measured with tracemalloc (deterministic), not with a clock.
"""

from __future__ import annotations

import io
import json
import struct
import tracemalloc
from typing import Any, Callable

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hotfit.core.errors import IntegrityError, TemplateError
from hotfit.stages.fetch_template import check_tool_capable, extract_template
from hotfit.stages.verify import read_gguf_header
from tests.test_fetch_weights import make_gguf

TIER = "unit"

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PEAK_LIMIT_BYTES = 32 << 20  # far below what a multi-GB declared length would cost if honoured

u32 = st.integers(0, 2**32 - 1)
u64 = st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1), st.sampled_from([2**31, 2**32, 2**62, 2**64 - 1]))
vtype = st.one_of(st.sampled_from([int(t) for t in gguf.GGUFValueType]), u32)


def _peak(fn: Callable[[], Any]) -> int:
    tracemalloc.start()
    try:
        fn()
    except (IntegrityError, TemplateError):
        pass
    finally:
        _cur, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def _gguf(data: bytes) -> None:
    read_gguf_header(io.BytesIO(data), name="fuzz.gguf")


@st.composite
def hostile_headers(draw: st.DrawFn) -> bytes:
    """A plausible GGUF prefix, then key/value records with attacker-chosen types, counts and lengths."""
    out = [b"GGUF", struct.pack("<I", draw(st.sampled_from([2, 3, draw(u32)])))]
    out.append(struct.pack("<QQ", draw(st.integers(0, 8)), draw(st.one_of(st.integers(0, 6), u64))))
    for _ in range(draw(st.integers(0, 6))):
        key = draw(st.binary(max_size=24))
        out.append(struct.pack("<Q", draw(st.sampled_from([len(key), draw(u64)]))) + key)
        t = draw(vtype)
        out.append(struct.pack("<I", t))
        if t == gguf.GGUFValueType.ARRAY:
            out.append(struct.pack("<IQ", draw(vtype), draw(u64)))
        elif t == gguf.GGUFValueType.STRING:
            out.append(struct.pack("<Q", draw(u64)))
        out.append(draw(st.binary(max_size=32)))
    return b"".join(out)


@FUZZ
@given(st.binary(max_size=4096))
def test_gguf_garbage(data: bytes) -> None:
    try:
        _gguf(data)  # almost always IntegrityError; anything but a typed error fails the test
    except IntegrityError:
        pass


@FUZZ
@given(hostile_headers())
def test_gguf_hostile_counts_and_lengths(data: bytes) -> None:
    try:
        _gguf(data)
    except IntegrityError:
        pass
    assert _peak(lambda: _gguf(data)) < PEAK_LIMIT_BYTES


@pytest.fixture(scope="module")
def real_header(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = make_gguf(tmp_path_factory.mktemp("g") / "m.gguf", kv_heads=[2, 2, 0, 2], template="{{ tools }}",
                     sliding_window=256, pad_bytes=64)
    return path.read_bytes()


@FUZZ
@given(data=st.data())
def test_gguf_mutated_real_header(real_header: bytes, data: st.DataObject) -> None:
    blob = bytearray(real_header)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(blob) - 8))
        blob[at:at + 8] = data.draw(st.one_of(st.binary(min_size=8, max_size=8),
                                              st.sampled_from([b"\xff" * 8, struct.pack("<Q", 2**62)])))
    cut = data.draw(st.integers(0, len(blob)))
    try:
        _gguf(bytes(blob[:cut]))
    except IntegrityError:
        pass
    assert _peak(lambda: _gguf(bytes(blob[:cut]))) < PEAK_LIMIT_BYTES


def test_gguf_multi_gb_string_and_array_declarations_fail_fast() -> None:
    key = b"tokenizer.ggml.tokens"
    head = b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    for body in (struct.pack("<IQ", gguf.GGUFValueType.STRING, 8 << 30),
                 struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, 2**40),
                 struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.UINT64, 2**61),
                 struct.pack("<IIQ", gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.ARRAY, 2**40)):
        blob = head + body + b"\0" * 64
        with pytest.raises(IntegrityError):
            _gguf(blob)
        assert _peak(lambda: _gguf(blob)) < 1 << 20
    too_many = b"GGUF" + struct.pack("<IQQ", 3, 2**63, 2**63)
    with pytest.raises(IntegrityError, match="exceeds"):
        _gguf(too_many)


# --------------------------------------------------------------------------- templates


def _template(filename: str, data: bytes) -> None:
    text, _variant = extract_template(filename, data)
    check_tool_capable(text, source=filename)


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False), st.text(max_size=40)),
    lambda children: st.one_of(st.lists(children, max_size=4),
                               st.dictionaries(st.sampled_from(["name", "template", "chat_template", "x"]),
                                               children, max_size=4)),
    max_leaves=20,
)


@FUZZ
@given(st.binary(max_size=2048), st.sampled_from(["tokenizer_config.json", "chat_template.jinja"]))
def test_template_sources_from_garbage(data: bytes, filename: str) -> None:
    try:
        _template(filename, data)
    except TemplateError:
        pass


@FUZZ
@given(json_values)
def test_tokenizer_config_shapes(value: Any) -> None:
    try:
        _template("tokenizer_config.json", json.dumps({"chat_template": value}).encode())
    except TemplateError:
        pass


@FUZZ
@given(st.text(alphabet="{}%tols #[]<>_", max_size=3000))
def test_tool_check_on_tag_soup(text: str) -> None:
    try:
        check_tool_capable(text, source="fuzz")
    except TemplateError:
        pass


def test_oversized_and_pathological_template_inputs() -> None:
    with pytest.raises(TemplateError, match="too large"):
        _template("tokenizer_config.json", b" " * (9 << 20))
    with pytest.raises(TemplateError, match="exceeds"):
        _template("chat_template.jinja", b"{{ tools }}" + b"x" * (2 << 20))
    with pytest.raises(TemplateError, match="not valid JSON"):
        _template("tokenizer_config.json", b"[" * 200_000 + b"]" * 200_000)  # nesting beyond the recursion limit
    # quadratic-regex bait: many unclosed tags, near the size cap; the scan is linear
    with pytest.raises(TemplateError):
        check_tool_capable("{%" * 400_000, source="bait")
    assert check_tool_capable("{%" * 400_000 + "%}{% if tools %}", source="bait") == ("tools",)
