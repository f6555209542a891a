"""verify: integrity, the bounded GGUF header reader, registry cross-checks, and the verify stage."""

from __future__ import annotations

import io
import os
import struct
from dataclasses import replace
from pathlib import Path
from typing import Any

import json

import gguf
import numpy as np
import pytest
import structlog

from hotfit.core.entry import LayerGroup, TemplateSource
from hotfit.core.errors import IntegrityError, TemplateError
from hotfit.core.model_files import FetchResult
from hotfit.stages.fetch_template import fetch_template
from hotfit.stages.fetch_weights import fetch_weights, fetched_still_on_disk
from hotfit.stages.verify import (
    GGUFHeader,
    check_header_against_entry,
    check_integrity,
    ensure_header_matches,
    read_gguf_header,
    verify,
)
from hotfit.state.receipts import decode_receipt, read_receipt, receipt_matches, receipt_path
from tests.hubserver import LocalHub
from tests.test_fetch_weights import FAST, make_entry, make_gguf, settings_for, sha256_of

TIER = "unit"

SHA_A, SHA_B = "a" * 64, "b" * 64


# --------------------------------------------------------------------------- integrity (pure)


def test_integrity_accepts_matching_references() -> None:
    assert check_integrity(file="f", size_bytes=10, sha256=SHA_A, expected_size=10, registry_sha256=SHA_A,
                           hub_sha256=SHA_A) == ("registry", "hub_lfs")


@pytest.mark.parametrize("kw, field", [
    (dict(size_bytes=9), "size_bytes"),
    (dict(registry_sha256=SHA_B), "sha256"),
    (dict(hub_sha256=SHA_B), "sha256"),
    (dict(registry_sha256=None, hub_sha256=None), "sha256"),  # nothing to check against: fail closed
    (dict(registry_sha256=None, hub_sha256=None, git_sha1="1" * 40, hub_git_sha1="2" * 40), "git_blob_sha1"),
])
def test_integrity_failures_name_the_field(kw: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = dict(file="f", size_bytes=10, sha256=SHA_A, expected_size=10, registry_sha256=SHA_A,
                                hub_sha256=SHA_A)
    args.update(kw)
    with pytest.raises(IntegrityError) as exc:
        check_integrity(**args)
    assert exc.value.details["field"] == field


# --------------------------------------------------------------------------- GGUF header


def test_header_reads_real_gguf(tmp_path: Path) -> None:
    path = make_gguf(tmp_path / "m.gguf", n_layers=6, kv_heads=[0, 2, 2, 0, 2, 2], head_dim=32, ctx=4096,
                     sliding_window=512, template="{{ tools }}", pad_bytes=1000)
    h = read_gguf_header(path)
    assert h.architecture == "llama" and h.version == 3 and h.tensor_count == 1
    assert h.arch_key(gguf.Keys.LLM.BLOCK_COUNT) == 6
    assert h.arch_key(gguf.Keys.Attention.HEAD_COUNT_KV) == (0, 2, 2, 0, 2, 2)
    assert h.arch_key(gguf.Keys.Attention.SLIDING_WINDOW) == 512
    assert h.has_chat_template and h.chat_template == "{{ tools }}"
    assert not read_gguf_header(make_gguf(tmp_path / "n.gguf", pad_bytes=10)).has_chat_template


def test_truncated_and_garbage_headers_are_integrity_errors(tmp_path: Path) -> None:
    data = make_gguf(tmp_path / "m.gguf", pad_bytes=10).read_bytes()
    for cut in (0, 3, 8, 20, 40, len(data) // 2):
        with pytest.raises(IntegrityError):
            read_gguf_header(io.BytesIO(data[:cut]) if cut < 100 else _header_only(data, cut))
    with pytest.raises(IntegrityError, match="magic"):
        read_gguf_header(io.BytesIO(b"GGML" + data[4:]))
    with pytest.raises(IntegrityError, match="version"):
        read_gguf_header(io.BytesIO(data[:4] + struct.pack("<I", 7) + data[8:]))


def _header_only(data: bytes, cut: int) -> io.BytesIO:
    # cut inside the key/value section: find where it ends by parsing the whole file first
    end = read_gguf_header(io.BytesIO(data)).header_bytes
    return io.BytesIO(data[: min(cut, end - 1)])


def test_huge_declared_string_is_refused_without_allocating() -> None:
    # header: magic, v3, 0 tensors, 1 kv; key "general.architecture"; type STRING; length 2**62
    key = b"general.architecture"
    blob = (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IQ", gguf.GGUFValueType.STRING, 1 << 62))
    with pytest.raises(IntegrityError, match="needs"):
        read_gguf_header(io.BytesIO(blob))


# --------------------------------------------------------------------------- registry cross-checks


def _entry(**kw: Any) -> Any:
    return make_entry("m", "o/r", "0" * 40, "m.gguf", 1, SHA_A, **kw)


@pytest.mark.parametrize("change, field", [
    (dict(architecture="qwen3"), "architecture"),
    (dict(n_layers=5), "block_count"),
    (dict(kv_heads=4), "head_count_kv"),
    (dict(head_dim=128), "key_length"),
    (dict(ctx=16384), "context_length"),  # the registry promises more than the model declares
    (dict(window=1024), "sliding_window"),
])
def test_each_fact_mismatch_fails_closed_naming_the_field(tmp_path: Path, change: dict[str, Any], field: str) -> None:
    header = read_gguf_header(make_gguf(tmp_path / "m.gguf", pad_bytes=10))  # llama, 4 layers, 2 kv, 64, 8192
    ensure_header_matches(check_header_against_entry(header, _entry()), file="m.gguf", entry_name="m")
    checks = check_header_against_entry(header, _entry(**change))
    with pytest.raises(IntegrityError) as exc:
        ensure_header_matches(checks, file="m.gguf", entry_name="m")
    assert exc.value.details["field"] == field and field in str(exc.value)


def test_lower_registry_ceiling_and_conservative_full_attention_pass(tmp_path: Path) -> None:
    header = read_gguf_header(make_gguf(tmp_path / "m.gguf", sliding_window=512, pad_bytes=10))
    checks = check_header_against_entry(header, _entry(ctx=4096))  # a cap below the GGUF's ceiling is fine
    ensure_header_matches(checks, file="m.gguf", entry_name="m")
    assert any(c.field == "sliding_window" and c.ok is None for c in checks)


def test_per_layer_kv_heads_with_recurrent_layers(tmp_path: Path) -> None:
    header = read_gguf_header(make_gguf(tmp_path / "m.gguf", n_layers=4, kv_heads=[0, 0, 0, 4], pad_bytes=10))
    entry = _entry(kv_heads=4)
    entry = replace(entry, config=replace(entry.config, layer_groups=(LayerGroup(4, 4, 64, 64),), recurrent=True))
    ensure_header_matches(check_header_against_entry(header, entry), file="m.gguf", entry_name="m")


# --------------------------------------------------------------------------- the stage


@pytest.mark.integration
@pytest.mark.anyio
async def test_verify_stage_after_pull_and_after_tampering(local_hub: LocalHub, tmp_path: Path) -> None:
    weights = make_gguf(tmp_path / "model.gguf", pad_bytes=300_000)
    commit = local_hub.create_repo("org/m", {"model.gguf": weights, "chat_template.jinja": "{% if tools %}x{% endif %}"},
                                   lfs=["model.gguf"])
    entry = make_entry("m", "org/m", commit, "model.gguf", weights.stat().st_size, sha256_of(weights),
                       template=TemplateSource("org/m", commit, "chat_template.jinja"))
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("m")
    fetched = await fetch_weights(entry, dest, settings=settings, options=FAST, progress=False)
    with pytest.raises(TemplateError, match="missing"):
        await verify(entry, dest, fetched=fetched)  # the entry names a template and it is not there yet
    template = await fetch_template(entry, dest, settings=settings)
    result = await verify(entry, dest, fetched=fetched, template=template)
    assert result.sha256 == sha256_of(weights) and result.sha256_source == "streamed"
    assert result.chat_template_path and result.gguf_embeds_chat_template is False
    assert result.gguf is not None and result.gguf.architecture == "llama" and result.gguf.block_count == 4
    assert result.gguf.head_count_kv == 2 and result.gguf.context_length == 8192
    assert (await verify(entry, dest, rehash=True)).sha256_source == "rehashed"
    # the template fetch-template checked, and no other text
    Path(template.path).write_text("{% if tools %}other{% endif %}")  # type: ignore[arg-type]
    with pytest.raises(TemplateError, match="not the template fetch-template checked"):
        await verify(entry, dest)
    Path(template.path).write_text("{% if tools %}x{% endif %}")  # type: ignore[arg-type]

    final = dest / "model.gguf"
    data = bytearray(final.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit of rot
    final.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as exc:
        await verify(entry, dest, rehash=True)
    assert exc.value.details["field"] == "sha256"
    final.write_bytes(bytes(data[:-1]))
    with pytest.raises(IntegrityError, match="receipt"):
        await verify(entry, dest)


# --------------------------------------------------------------------------- hostile header values


_VALID_META: dict[str, Any] = {
    "general.architecture": "llama", "llama.block_count": 4, "llama.context_length": 8192,
    "llama.embedding_length": 256, "llama.attention.head_count": 4, "llama.attention.head_count_kv": 2,
    "llama.attention.key_length": 64, "llama.attention.value_length": 64,
}


@pytest.mark.parametrize("key, value", [
    ("llama.nextn_predict_layers", "two"),  # a string where a count belongs
    ("llama.nextn_predict_layers", (1, 2)),
    ("llama.block_count", "4"),
    ("llama.attention.head_count_kv", float("nan")),
    ("llama.attention.head_count_kv", (float("inf"), 2.0)),
    ("llama.attention.head_count_kv", "2"),
    ("llama.attention.key_length", "sixty-four"),
    ("llama.attention.key_length", (64, 64)),
    ("llama.attention.key_length", float("nan")),
    ("llama.attention.sliding_window", "512"),
    ("llama.attention.sliding_window", float("inf")),
    ("llama.context_length", float("nan")),
])
def test_hostile_header_values_fail_closed_naming_the_field_never_crash(key: str, value: Any) -> None:
    meta = dict(_VALID_META)
    meta[key] = value
    header = GGUFHeader(version=3, tensor_count=1, kv_count=len(meta), metadata=meta, chat_template=None,
                        has_chat_template=False, header_bytes=0)
    entry = _entry(window=512) if "sliding_window" in key else _entry()
    with pytest.raises(IntegrityError) as exc:
        ensure_header_matches(check_header_against_entry(header, entry), file="m.gguf", entry_name="m")
    assert exc.value.details["field"]


def test_zero_head_count_without_key_length_is_an_integrity_error() -> None:
    meta = {k: v for k, v in _VALID_META.items() if "length" not in k or "context" in k or "embedding" in k}
    meta["llama.attention.head_count"] = 0
    header = GGUFHeader(version=3, tensor_count=1, kv_count=len(meta), metadata=meta, chat_template=None,
                        has_chat_template=False, header_bytes=0)
    with pytest.raises(IntegrityError) as exc:
        ensure_header_matches(check_header_against_entry(header, _entry()), file="m.gguf", entry_name="m")
    assert exc.value.details["field"] == "key_length"


def test_a_real_gguf_with_a_string_key_length_is_an_integrity_error(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(4)
    w.add_context_length(8192)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_string("llama.attention.key_length", "64")
    w.add_string("llama.nextn_predict_layers", "x")
    w.add_tensor("pad", np.zeros(32, dtype=np.int8), raw_dtype=gguf.GGMLQuantizationType.I8)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(IntegrityError):
        ensure_header_matches(check_header_against_entry(read_gguf_header(path), _entry()), file="m.gguf",
                              entry_name="m")


@pytest.mark.parametrize("manifest", [
    {"files": [{"path": "../outside.bin", "size_bytes": 1}]},
    {"files": [{"path": "/etc/passwd", "size_bytes": 1}]},
    {"files": [{"size_bytes": 1}]},
    {"files": ["model.xml"]},
    {"files": {"model.xml": 1}},
    {"files": [{"path": "model.xml", "size_bytes": "1"}]},
])
def test_a_tampered_snapshot_manifest_is_an_integrity_error(tmp_path: Path, manifest: dict[str, Any]) -> None:
    import json

    from hotfit.stages.verify import verify_snapshot_dir

    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "model.xml").write_bytes(b"x")
    (tmp_path / "snapshot.json").write_text(json.dumps({"schema": 1, **manifest}))
    with pytest.raises(IntegrityError) as exc:
        verify_snapshot_dir(tmp_path)
    assert "snapshot.json" in str(exc.value) or "snapshot" in str(exc.value)


def test_a_receipt_without_its_sha256_is_not_a_match(tmp_path: Path) -> None:
    from hotfit.core.entry import Artifact

    final = tmp_path / "m.gguf"
    final.write_bytes(b"x" * 10)
    art = Artifact("o/r", "0" * 40, "m.gguf", 10, None)
    base = {"schema": 1, "repo": "o/r", "file": "m.gguf", "revision": "0" * 40, "size_bytes": 10}
    assert receipt_matches(decode_receipt(json.dumps({**base, "sha256": "a" * 64}), path="r"), art, final)
    assert not receipt_matches(decode_receipt(json.dumps(base), path="r"), art, final)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, "[1]", "not json",
                                  '{"schema": 1, "repo": "o/r", "file": "m.gguf", "size_bytes": "10"}',
                                  '{"schema": 1, "repo": "o/r", "file": "m.gguf", "sha256": 7}',
                                  '{"schema": 2, "repo": "o/r", "file": "m.gguf"}'])
def test_a_damaged_receipt_is_no_receipt(tmp_path: Path, text: str) -> None:
    path = receipt_path(tmp_path, "m.gguf")
    path.parent.mkdir(parents=True)
    path.write_text(text)
    with structlog.testing.capture_logs() as logs:
        assert read_receipt(tmp_path, "m.gguf") is None  # today's behaviour: verified again, never trusted
    # the one decoder says which file is damaged and why
    with pytest.raises(IntegrityError, match=f"receipt {path} is damaged") as exc:
        decode_receipt(text, path=path)
    assert exc.value.details["file"] == str(path) and exc.value.details["field"] == "receipt"
    damaged = [e for e in logs if e["event"] == "receipt.damaged"]
    assert damaged and damaged[0]["file"] == str(path)


def test_receipts_written_today_read_back_unchanged(tmp_path: Path) -> None:
    """The receipt files on disk keep their keys (a home written by an earlier hotfit stays valid)."""
    weights = {"schema": 1, "repo": "o/r", "revision": "0" * 40, "file": "m.gguf", "size_bytes": 10,
               "sha256": "a" * 64, "hub_lfs_sha256": "a" * 64, "verified_against": ["registry", "hub_lfs"]}
    template = {"schema": 1, "repo": "o/t", "revision": "1" * 40, "file": "tokenizer_config.json",
                "sha256": "b" * 64, "variant": "tokenizer_config:tool_use", "tool_markers": ["tools"]}
    for data in (weights, template):
        r = decode_receipt(json.dumps(data), path="r")
        assert r.to_json() == data


# --------------------------------------------------------------------------- the hashed partial, reused or not


async def _fetched_partial(local_hub: LocalHub, tmp_path: Path, repo: str = "org/m") -> tuple[Any, Any, Path, Path]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    weights = make_gguf(tmp_path / "model.gguf", pad_bytes=300_000)
    commit = local_hub.create_repo(repo, {"model.gguf": weights}, lfs=["model.gguf"])
    entry = make_entry("m", repo, commit, "model.gguf", weights.stat().st_size, sha256_of(weights))
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("m")
    fetched = await fetch_weights(entry, dest, settings=settings, options=FAST, progress=False)
    return entry, fetched, dest, weights


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_recorded_partial_is_verified_from_its_streamed_hash_after_a_restart(local_hub: LocalHub,
                                                                                      tmp_path: Path) -> None:
    # A run killed between fetch-weights and verify: the next run decodes the recorded result
    # (state.db) and verify reuses its sha256 — the partial is the same file, unchanged since hashing.
    entry, fetched, dest, weights = await _fetched_partial(local_hub, tmp_path)
    record = json.loads(json.dumps(fetched.to_json()))
    assert FetchResult.decode(record) == fetched
    assert fetched_still_on_disk(FetchResult.decode(record))
    with structlog.testing.capture_logs() as logs:
        result = await verify(entry, dest, fetched=FetchResult.decode(record))
    assert result.sha256_source == "streamed" and not [e for e in logs if e["event"] == "verify.rehash"]
    assert (dest / "model.gguf").read_bytes() == weights.read_bytes()
    # the partial is gone, but in place with a receipt for that sha256
    assert fetched_still_on_disk(FetchResult.decode(record))
    receipt_path(dest, "model.gguf").unlink()
    assert not fetched_still_on_disk(FetchResult.decode(record))


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_partial_touched_since_hashing_is_rehashed_and_a_damaged_one_discarded(local_hub: LocalHub,
                                                                                       tmp_path: Path) -> None:
    entry, fetched, dest, weights = await _fetched_partial(local_hub, tmp_path)
    partial = Path(fetched.weights.partial_path)
    st = partial.stat()
    os.utime(partial, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # same bytes, another mtime
    assert not fetched_still_on_disk(fetched)  # a rerun would fetch (and hash) it again
    result = await verify(entry, dest, fetched=fetched)
    assert result.sha256_source == "rehashed" and result.sha256 == sha256_of(weights)

    entry, fetched, dest, weights = await _fetched_partial(local_hub, tmp_path / "second", "org/m2")
    partial = Path(fetched.weights.partial_path)
    data = bytearray(partial.read_bytes())
    data[-1] ^= 0xFF  # one bit of rot, same size
    partial.write_bytes(bytes(data))
    with pytest.raises(IntegrityError) as exc:
        await verify(entry, dest, fetched=fetched)
    assert exc.value.details["field"] == "sha256"
    assert not partial.exists() and not (dest / "model.gguf").exists()  # never resumed from, never in place
    assert not fetched_still_on_disk(fetched)  # so the next run fetches it again
    again = await fetch_weights(entry, dest, settings=settings_for(local_hub, tmp_path / "second" / "home"),
                                options=FAST, progress=False)
    assert again.weights is not None and again.weights.resumed_from_bytes == 0
    assert (await verify(entry, dest, fetched=again)).sha256 == sha256_of(weights)


@pytest.mark.integration
@pytest.mark.anyio
async def test_a_partial_of_another_pin_is_refused(local_hub: LocalHub, tmp_path: Path) -> None:
    entry, fetched, dest, _weights = await _fetched_partial(local_hub, tmp_path)
    other = replace(fetched, weights=replace(fetched.weights, revision="f" * 40))
    with pytest.raises(IntegrityError, match="pins") as exc:
        await verify(entry, dest, fetched=other)
    assert exc.value.details["field"] == "revision" and not (dest / "model.gguf").exists()
