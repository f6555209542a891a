"""The GGUF fixtures are real: gguf reads back what the writers promise, and the pinned
llama-server loads each kind, opens the context asked for, budgets KV per layer type, refuses the
broken ones with a log line that says why, and answers the deterministic model the same way
every time."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from tests import gguf_fixtures as gf

TIER = "unit"

MiB = 1024 * 1024


def _field(reader: gguf.GGUFReader, key: str) -> Any:
    field = reader.get_field(key)
    assert field is not None, f"{key} missing"
    return field.contents()


# ---------------------------------------------------------------- what the files hold (no server)


@pytest.mark.parametrize(
    ("n_layers", "n_heads", "n_kv_heads", "head_dim", "tensor_type"),
    [(2, 4, 2, 64, "f16"), (3, 8, 1, 128, "f32"), (1, 2, 2, 32, "f16")],
)
def test_llama_writer_metadata_reads_back(
    tmp_path: Path, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, tensor_type: str
) -> None:
    info = gf.write_llama_model(
        tmp_path / "m.gguf",
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        n_ctx_train=40960,
        tensor_type=tensor_type,
    )
    reader = gguf.GGUFReader(info.path)
    assert _field(reader, "general.architecture") == "llama"
    assert _field(reader, "llama.block_count") == n_layers
    assert _field(reader, "llama.attention.head_count") == n_heads
    assert _field(reader, "llama.attention.head_count_kv") == n_kv_heads
    assert _field(reader, "llama.attention.key_length") == info.head_dim_k == head_dim
    assert _field(reader, "llama.attention.value_length") == info.head_dim_v == head_dim
    assert _field(reader, "llama.context_length") == info.n_ctx_train == 40960
    assert reader.get_field("tokenizer.chat_template") is None and not info.has_chat_template
    tokens = _field(reader, "tokenizer.ggml.tokens")
    assert len(tokens) == info.n_vocab
    for special in ("<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "</think>"):
        assert special in tokens
    assert tokens[_field(reader, "tokenizer.ggml.eos_token_id")] == "<|im_end|>"
    assert tokens[_field(reader, "tokenizer.ggml.eot_token_id")] == "<|im_end|>"
    q = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    assert q.tensor_type == (gguf.GGMLQuantizationType.F16 if tensor_type == "f16" else gguf.GGMLQuantizationType.F32)
    assert [int(x) for x in q.shape] == [64, n_heads * head_dim]  # ggml order: {n_embd, n_head*head_dim}
    assert info.size_bytes == info.path.stat().st_size < 4 * MiB


def test_embedded_template_reads_back(tmp_path: Path) -> None:
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    info = gf.write_llama_model(tmp_path / "t.gguf", chat_template=template)
    assert info.has_chat_template
    assert _field(gguf.GGUFReader(info.path), "tokenizer.chat_template") == template


def test_byte_vocabulary_covers_every_byte_once() -> None:
    texts = [gf.byte_token_text(b) for b in range(256)]
    assert len(set(texts)) == 256
    assert gf.byte_token_text(ord("{")) == "{" and gf.byte_token_text(ord("\n")) == "Ċ"


@pytest.mark.parametrize(
    ("n_layers", "pattern", "expected"),
    [
        (6, 3, (True, True, False, True, True, False)),
        (7, 6, (True, True, True, True, True, False, True)),
        (3, 0, (True, True, True)),
        (3, [False, True, False], (False, True, False)),
    ],
)
def test_swa_layer_pattern(n_layers: int, pattern: int | list[bool], expected: tuple[bool, ...]) -> None:
    assert gf.swa_layer_pattern(n_layers, pattern) == expected


def test_swa_pattern_length_must_match_layers() -> None:
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        gf.swa_layer_pattern(4, [True, False, True])


@pytest.mark.parametrize("head_dim", [16, 48])
def test_head_dim_must_fit_quantized_kv_blocks(tmp_path: Path, head_dim: int) -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        gf.write_llama_model(tmp_path / "x.gguf", head_dim=head_dim)


def test_gemma3_writer_metadata(tmp_path: Path) -> None:
    info = gf.write_gemma3_swa_model(tmp_path / "g.gguf", n_layers=6, sliding_window_tokens=256, swa_pattern=3)
    reader = gguf.GGUFReader(info.path)
    assert _field(reader, "general.architecture") == "gemma3"
    assert _field(reader, "gemma3.attention.sliding_window") == 256
    assert _field(reader, "gemma3.attention.sliding_window_pattern") == 3
    assert (info.n_swa_layers, info.n_full_layers) == (4, 2)
    per_layer = gf.write_gemma3_swa_model(tmp_path / "g2.gguf", n_layers=3, swa_pattern=[False, True, True])
    flags = _field(gguf.GGUFReader(per_layer.path), "gemma3.attention.sliding_window_pattern")
    assert [bool(x) for x in flags] == [False, True, True] == list(per_layer.swa_layers)


def test_tool_call_model_weights_follow_the_recipe(tmp_path: Path) -> None:
    info = gf.write_tool_call_model(tmp_path / "tc.gguf")
    reader = gguf.GGUFReader(info.path)
    tensors = {t.name: np.asarray(t.data) for t in reader.tensors}
    assert not tensors["blk.0.attn_output.weight"].any()
    assert not tensors["blk.0.ffn_down.weight"].any()
    embd, out = tensors["token_embd.weight"], tensors["output.weight"]
    # next-token preference of a token with only the default direction, best first
    order = np.argsort(-(out @ embd[ord("a")]), kind="stable")[:6]
    names = ["<|im_end|>", "<tool_call>", "</tool_call>", '"', "}", "{"]
    ids = [gf.TOKEN_ID.get(n, ord(n[0]) if len(n) == 1 else -1) for n in names]
    assert list(order) == ids
    assert int(np.argmax(out @ embd[gf.TOKEN_ID["<tool_call>"]])) == ord("\n")
    assert int(np.argmax(out @ embd[ord('"')])) == ord('"')
    assert not info.has_chat_template and reader.get_field("tokenizer.chat_template") is None


def test_truncated_and_garbage_helpers(tmp_path: Path) -> None:
    src = gf.write_llama_model(tmp_path / "m.gguf")
    cut = gf.write_truncated_copy(src.path, tmp_path / "cut.gguf", keep_bytes=1000)
    assert cut.read_bytes() == src.path.read_bytes()[:1000]
    junk = gf.write_garbage_file(tmp_path / "j.gguf", size_bytes=512, gguf_magic=True)
    assert junk.read_bytes()[:4] == b"GGUF" and junk.stat().st_size == 512


def test_command_line_writes_a_fixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "cli.gguf"
    assert gf.main(["gemma3-swa", str(out)]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["path"] == str(out) and record["architecture"] == "gemma3"
    assert _field(gguf.GGUFReader(out), "gemma3.attention.sliding_window") == record["sliding_window_tokens"]


def test_require_llama_server_skips_or_fails_by_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    monkeypatch.delenv("HOTFIT_LLAMA_SERVER", raising=False)
    monkeypatch.setenv("HOTFIT_LLAMA_CACHE", str(empty))
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.delenv(gf.REQUIRE_ENV, raising=False)
    with pytest.raises(pytest.skip.Exception, match="llama-server not available"):
        gf.require_llama_server()
    monkeypatch.setenv(gf.REQUIRE_ENV, "1")
    with pytest.raises(pytest.fail.Exception, match=gf.REQUIRE_ENV):
        gf.require_llama_server()
    monkeypatch.delenv(gf.REQUIRE_ENV)
    monkeypatch.setenv("HOTFIT_LLAMA_SERVER", str(empty / "nope"))
    with pytest.raises(pytest.fail.Exception, match="HOTFIT_LLAMA_SERVER is unusable"):
        gf.require_llama_server()


# ---------------------------------------------------------------- in the real llama-server

_KV_SIZE_RE = re.compile(r"llama_kv_cache: size =\s*([\d.]+) MiB \(\s*(\d+) cells,\s*(\d+) layers")


def _kv_records(log: str) -> list[tuple[float, int, int]]:
    """(MiB, cells, layers) per KV cache llama.cpp created (needs -lv 4 for the info lines).

    The figure is printed with 2 decimals; the tests pick shapes whose sizes are exact there."""
    return [(float(m[1]), int(m[2]), int(m[3])) for m in _KV_SIZE_RE.finditer(log)]


@pytest.mark.llama
@pytest.mark.parametrize(
    ("n_layers", "n_heads", "n_kv_heads", "head_dim", "n_ctx"),
    [(2, 4, 2, 64, 4096), (3, 8, 1, 128, 8192), (1, 2, 2, 32, 2048)],
)
def test_llama_fixture_loads_with_expected_context(
    tmp_path: Path, n_layers: int, n_heads: int, n_kv_heads: int, head_dim: int, n_ctx: int
) -> None:
    info = gf.write_llama_model(
        tmp_path / "m.gguf", n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv_heads, head_dim=head_dim
    )
    with gf.llama_server(info.path, n_ctx=n_ctx, extra_args=["-lv", "4"]) as server:
        props = server.get_json("/props")
        slots = server.get_json("/slots")
        log = server.log_text()
    assert props["default_generation_settings"]["n_ctx"] == n_ctx
    assert props["total_slots"] == 1 and [s["n_ctx"] for s in slots] == [n_ctx]
    # the fixture's shape is what llama.cpp allocated KV for: one cache, every layer, f16
    assert _kv_records(log) == [(n_ctx * info.kv_bytes_per_token_f16() / MiB, n_ctx, n_layers)]


@pytest.mark.llama
def test_q8_0_kv_costs_34_of_64_of_f16(tmp_path: Path) -> None:
    info = gf.write_llama_model(tmp_path / "m.gguf", head_dim=32)
    sizes = {}
    for kv_type in ("f16", "q8_0"):
        args = ["-lv", "4", "-ctk", kv_type, "-ctv", kv_type, "-fa", "on"]
        with gf.llama_server(info.path, n_ctx=16384, extra_args=args) as server:
            assert server.get_json("/slots")[0]["n_ctx"] == 16384
            [(mib, _, _)] = _kv_records(server.log_text())
            sizes[kv_type] = mib
    # q8_0 stores 32 values in 34 bytes (anchors.md §12: not 1 byte per value)
    assert sizes["f16"] == 16384 * info.kv_bytes_per_token_f16() / MiB
    assert sizes["q8_0"] == pytest.approx(sizes["f16"] * 34 / 64, abs=0.005)  # the log prints MiB to 2 decimals


@pytest.mark.llama
def test_embedded_template_reaches_the_server(tmp_path: Path) -> None:
    template = gf.pinned_template().read_text(encoding="utf-8")
    info = gf.write_llama_model(tmp_path / "t.gguf", chat_template=template)
    with gf.llama_server(info.path, n_ctx=2048, extra_args=["--jinja"]) as server:
        props = server.get_json("/props")
    assert props["chat_template"] == template
    assert props["chat_template_caps"]["supports_tool_calls"] is True


@pytest.mark.llama
def test_gemma3_fixture_budgets_kv_per_layer_type(tmp_path: Path) -> None:
    info = gf.write_gemma3_swa_model(tmp_path / "g.gguf", n_layers=6, swa_pattern=3, sliding_window_tokens=300)
    n_ctx = 8192
    with gf.llama_server(info.path, n_ctx=n_ctx, extra_args=["-lv", "4"]) as server:
        assert server.get_json("/slots")[0]["n_ctx"] == n_ctx
        log = server.log_text()
    assert f"n_swa                 = {info.sliding_window_tokens}" in log
    full, swa = _kv_records(log)  # llama_kv_cache_iswa creates the full cache first
    assert full == (n_ctx * info.kv_bytes_per_token_f16("full") / MiB, n_ctx, info.n_full_layers)
    # sliding layers keep the window plus one micro-batch (default 512), padded to 256 cells:
    # pad256(min(n_ctx, n_swa + n_ubatch)) in src/llama-kv-cache-iswa.cpp
    n_ubatch = 512
    expected_cells = -(-min(n_ctx, info.sliding_window_tokens + n_ubatch) // 256) * 256
    assert (swa[1], swa[2]) == (expected_cells, info.n_swa_layers)
    assert swa[0] == swa[1] * info.kv_bytes_per_token_f16("swa") / MiB


@pytest.mark.llama
def test_per_layer_swa_pattern_reaches_the_server(tmp_path: Path) -> None:
    info = gf.write_gemma3_swa_model(tmp_path / "g.gguf", n_layers=5, swa_pattern=[True, False, False, True, False])
    with gf.llama_server(info.path, n_ctx=4096, extra_args=["-lv", "4"]) as server:
        log = server.log_text()
    assert [layers for _, _, layers in _kv_records(log)] == [3, 2]


@pytest.mark.llama
@pytest.mark.parametrize(
    ("make", "log_says"),
    [
        (lambda d: gf.write_unsupported_arch_model(d / "u.gguf").path, f"unknown model architecture: '{gf.UNSUPPORTED_ARCHITECTURE}'"),
        (
            lambda d: gf.write_truncated_copy(gf.write_llama_model(d / "m.gguf").path, d / "cut.gguf"),
            "data is not within the file bounds",
        ),
        (lambda d: gf.write_garbage_file(d / "junk.gguf", gguf_magic=True), "failed to read header"),
        (lambda d: gf.write_garbage_file(d / "junk.gguf"), "failed to load model"),
    ],
    ids=["unsupported-arch", "truncated", "bad-header", "not-gguf"],
)
def test_broken_fixtures_fail_to_load_with_a_reason(tmp_path: Path, make, log_says: str) -> None:
    path = make(tmp_path)
    with pytest.raises(gf.ServerFailedToStart) as failed:
        with gf.llama_server(path, n_ctx=2048):
            pytest.fail("llama-server came up on a broken model")
    assert failed.value.returncode not in (None, 0)
    assert log_says in failed.value.log


@pytest.mark.llama
def test_server_is_reaped_when_the_body_raises(tmp_path: Path) -> None:
    info = gf.write_llama_model(tmp_path / "m.gguf")
    with pytest.raises(RuntimeError, match="boom"):
        with gf.llama_server(info.path, n_ctx=1024) as server:
            proc = server.process
            raise RuntimeError("boom")
    assert proc.poll() is not None  # killed and waited for: no orphan


def _probe_request() -> dict:
    return {
        "messages": [{"role": "user", "content": "Call the probe tool."}],
        "tools": [gf.PROBE_TOOL],
        "tool_choice": "required",
        "temperature": 0,
        "max_tokens": 128,
    }


def _assert_one_probe_call(answer: dict) -> dict:
    choice = answer["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    assert choice["finish_reason"] == "tool_calls", choice
    assert len(calls) == 1, choice
    assert calls[0]["function"]["name"] == gf.PROBE_TOOL["function"]["name"]
    arguments = json.loads(calls[0]["function"]["arguments"])
    assert isinstance(arguments.get("text"), str)
    return {"content": choice["message"].get("content"), "arguments": arguments}


@pytest.mark.llama
@pytest.mark.parametrize("how", ["template-file", "embedded"])
def test_tool_call_model_calls_the_tool_with_qwen3_template(tmp_path: Path, how: str) -> None:
    info = gf.write_tool_call_model(tmp_path / "tc.gguf", embed_template=how == "embedded")
    args = ["--jinja"] + (["--chat-template-file", str(gf.pinned_template())] if how == "template-file" else [])
    with gf.llama_server(info.path, n_ctx=4096, extra_args=args) as server:
        assert server.get_json("/props")["chat_template_caps"]["supports_tools"] is True
        outcomes = [_assert_one_probe_call(server.post_json("/v1/chat/completions", _probe_request())) for _ in range(3)]
    assert outcomes[0]["arguments"] == {"text": ""}
    assert outcomes == [outcomes[0]] * 3  # deterministic: the same answer every time


@pytest.mark.llama
def test_tool_call_model_deterministic_with_q8_0_kv(tmp_path: Path) -> None:
    info = gf.write_tool_call_model(tmp_path / "tc.gguf")
    args = ["--jinja", "--chat-template-file", str(gf.pinned_template()), "-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on"]
    with gf.llama_server(info.path, n_ctx=4096, extra_args=args) as server:
        outcome = _assert_one_probe_call(server.post_json("/v1/chat/completions", _probe_request()))
    assert outcome["arguments"] == {"text": ""}


@pytest.mark.llama
def test_tool_call_model_without_template_answers_without_a_call(tmp_path: Path) -> None:
    info = gf.write_tool_call_model(tmp_path / "tc.gguf")
    with gf.llama_server(info.path, n_ctx=4096, extra_args=["--jinja"]) as server:
        props = server.get_json("/props")
        answers = [server.post_json("/v1/chat/completions", _probe_request()) for _ in range(2)]
    # llama.cpp's ChatML fallback: no tool support, so the server drops `tools` (anchors.md §11.3)
    assert props["chat_template_caps"]["supports_tools"] is False
    for answer in answers:
        choice = answer["choices"][0]
        assert not choice["message"].get("tool_calls"), choice
        assert choice["finish_reason"] == "stop"
