"""Tiny OpenVINO IR models for tests, made offline at test time.

OpenVINO GenAI's GGUF reader converts a GGUF to the IR file set of the ``OpenVINO/*-ov`` Hub
repositories (``openvino_model``, ``openvino_tokenizer``, ``openvino_detokenizer`` ``.xml``/``.bin``)
when it loads one with ``enable_save_ov_model=True`` (openvino.genai's GGUF reader). The
GGUFs are written by the writers of :mod:`tests.gguf_fixtures`, with two arguments the reader needs:

- ``tensor_type="f16"`` (the reader refuses F32 matrices: "Unsupported quantization type");
- ``vocab=OV_VOCAB``: the BPE merge list holds a merge whose result is in the vocabulary: the
  llama.cpp fixtures' placeholder merge of two special tokens makes the OpenVINO BPE tokenizer fail
  at the first encode (``BPETokenizer ... unordered_map::at``, measured). One merged token (``ab``)
  is appended after the chat special tokens, so every token id of :mod:`tests.gguf_fixtures` stays
  the same.

Writers: :func:`write_ov_tool_call_gguf` (:func:`tests.gguf_fixtures.write_tool_call_model`'s
deterministic recipe, template embedded) and :func:`write_ov_random_gguf`
(:func:`tests.gguf_fixtures.write_llama_model`: random weights, greedy output is prose-like noise).
:func:`convert_gguf_to_ir` runs the conversion in a child process (the reader is C++ and cannot be
interrupted from Python) and returns the IR directory.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from hotfit.backends.base import ModelFiles, Session
from hotfit.backends.openvino.backend import OpenVinoBackend
from hotfit.backends.openvino.config import KV_BLOCK_TOKENS, KV_PRECISIONS, kv_blocks_for, kv_bytes_per_token_for_entry
from hotfit.core.entry import Artifact, Entry, Evidence, LayerGroup, SourceConfig
from hotfit.planner.plan import BudgetBreakdown, Placement, Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.core.settings import load_settings
from tests.gguf_fixtures import FixtureInfo, FixtureVocab, write_llama_model, write_tool_call_model

__all__ = [
    "CHATML_NO_TOOLS_TEMPLATE",
    "IR_FILES",
    "OV_N_VOCAB",
    "OV_VOCAB",
    "QWEN3_TOOLS_TEMPLATE",
    "REQUIRE_OPENVINO_ENV",
    "OvFixture",
    "convert_gguf_to_ir",
    "make_ov_fixture",
    "open_ov_fixture",
    "ov_entry",
    "ov_plan",
    "require_openvino_genai",
    "write_ov_random_gguf",
    "write_ov_tool_call_gguf",
]

# One real merge ("a" + "b" -> "ab") after the specials: the OpenVINO BPE needs its result in the vocabulary.
OV_VOCAB = FixtureVocab(extra_tokens=("ab",), merges=("a b",))
OV_N_VOCAB = OV_VOCAB.n_vocab
IR_FILES = (
    "openvino_model.xml", "openvino_model.bin",
    "openvino_tokenizer.xml", "openvino_tokenizer.bin",
    "openvino_detokenizer.xml", "openvino_detokenizer.bin",
)  # fmt: skip
CONVERT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class OvFixture:
    """An IR directory made from a fixture GGUF, with the shape figures the KV check needs."""

    ir_dir: Path
    kind: str  # "tool-call" | "random"
    n_layers: int
    n_kv_heads: int
    head_dim: int
    convert_seconds: float


def write_ov_tool_call_gguf(path: Path, chat_template: str, *, n_ctx_train: int = 65536) -> FixtureInfo:
    """The deterministic tool-call model (:func:`tests.gguf_fixtures.write_tool_call_model`) with
    F16 matrices and the OpenVINO-safe vocabulary. Unconstrained, its first token is end of turn
    (an empty answer); constrained to a call, it fills the arguments as ``{"text":""}``."""
    return write_tool_call_model(path, chat_template=chat_template, n_ctx_train=n_ctx_train, tensor_type="f16",
                                 name="hotfit-ov-tool-call", vocab=OV_VOCAB)


def write_ov_random_gguf(path: Path, chat_template: str, *, seed: int = 0) -> FixtureInfo:
    """2 layers, 2 KV heads, head_dim 32, seeded random F16 weights: unconstrained output is noise."""
    return write_llama_model(path, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, n_embd=64, n_ff=128,
                             n_ctx_train=65536, chat_template=chat_template, tensor_type="f16", seed=seed,
                             name="hotfit-ov-random", vocab=OV_VOCAB)


_CONVERT = (
    "import sys, openvino_genai as og\n"
    "og.LLMPipeline(sys.argv[1], 'CPU', enable_save_ov_model=True)\n"
)


def convert_gguf_to_ir(gguf_path: Path, ir_dir: Path) -> float:
    """GGUF -> IR directory (the six IR files only); returns the conversion's wall seconds."""
    work = gguf_path.parent
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(gguf_path)],
        check=False, capture_output=True, text=True, timeout=CONVERT_TIMEOUT_S, env=os.environ | {"CI": "true"},
    )  # fmt: skip
    seconds = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"GGUF -> IR conversion of {gguf_path} failed: {proc.stderr[-2000:]}")
    ir_dir.mkdir(parents=True, exist_ok=True)
    for name in IR_FILES:
        shutil.move(str(work / name), ir_dir / name)
    return seconds


# Qwen3's tool branch (the system block listing the tools, then ChatML turns), compact: the
# fixtures must not depend on the llama.cpp tree; what GenAI renders from it is checked by the tests.
QWEN3_TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{%- if messages[0].role == 'system' %}{{ messages[0].content + '\\n\\n' }}{%- endif %}"
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' %}"
    "<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
# ChatML without a tools branch: a template that cannot express tools.
CHATML_NO_TOOLS_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
REQUIRE_OPENVINO_ENV = "HOTFIT_REQUIRE_OPENVINO"


def require_openvino_genai() -> None:
    """Skip the calling test without openvino-genai, unless HOTFIT_REQUIRE_OPENVINO=1 (then fail)."""
    import importlib.util

    import pytest

    if importlib.util.find_spec("openvino_genai") is not None:
        return
    why = "openvino-genai is not installed (pip install -e '.[openvino]')"
    if os.environ.get(REQUIRE_OPENVINO_ENV) == "1":
        pytest.fail(f"{why}; {REQUIRE_OPENVINO_ENV}=1 is set, so this is a failure, not a skip")
    pytest.skip(why)


def make_ov_fixture(root: Path, kind: str, chat_template: str = QWEN3_TOOLS_TEMPLATE) -> OvFixture:
    """Write the GGUF of ``kind`` ("tool-call" | "random") under ``root`` and convert it to ``root/ir``."""
    root.mkdir(parents=True, exist_ok=True)
    gguf_path = root / "model.gguf"
    writer = write_ov_tool_call_gguf if kind == "tool-call" else write_ov_random_gguf
    info = writer(gguf_path, chat_template)
    seconds = convert_gguf_to_ir(gguf_path, root / "ir")
    gguf_path.unlink()
    return OvFixture(root / "ir", kind, info.n_layers, info.n_kv_heads, info.head_dim_k, seconds)


@asynccontextmanager
async def open_ov_fixture(tmp_path: Path, kind: str = "tool-call", tokens: int = 32768) -> AsyncIterator[Session]:
    """An OpenVINO session on a fresh ``kind`` fixture (made under ``tmp_path/ov``), planned for ``tokens``
    (skips, or fails under REQUIRE_OPENVINO_ENV, without openvino-genai)."""
    require_openvino_genai()
    fx = make_ov_fixture(tmp_path / "ov", kind)
    async with OpenVinoBackend().open(ov_plan(fx, tokens), ModelFiles(fx.ir_dir), run_dir=tmp_path / "run",
                                      binary=None, settings=load_settings()) as session:
        yield session


def ov_entry(fx: OvFixture, name: str | None = None) -> Entry:
    size = sum(p.stat().st_size for p in fx.ir_dir.iterdir() if p.is_file())
    return Entry(
        name=name or f"fixture-ov-{fx.kind}", display_name=f"OpenVINO fixture {fx.kind}", backend="openvino",
        origin="us", license="Apache-2.0", params_total_b=0.001, params_active_b=None, release_date=None,
        architecture=None, agentic_tier="agentic",
        evidence=(Evidence("measured", "fixture", "tests/openvino_fixtures.py"),),
        auto_eligible=True, ineligible_reason=None,
        artifact=Artifact(repo="hotfit-test/ov-fixture", revision=None, file=None, size_bytes=size, sha256=None),
        projector=None, chat_template=None,
        config=SourceConfig(n_layers=fx.n_layers,
                            layer_groups=(LayerGroup(fx.n_layers, fx.n_kv_heads, fx.head_dim, fx.head_dim),),
                            source="tests/openvino_fixtures.py"),
        context_limit=65536, tool_parser="openvino: hermes (Qwen3 <tool_call>)", notes="test fixture",
    )  # fmt: skip


def ov_plan(fx: OvFixture, tokens: int, kv_type: str = "f16", *, estimated_kv_bytes: int | None = None,
            entry_name: str | None = None) -> Plan:
    """A host-memory plan for ``fx`` whose estimate is OpenVINO's own KV arithmetic (what the planner
    must use for OpenVINO entries: backends.openvino.config.kv_bytes_per_token_for_entry)."""
    entry = ov_entry(fx, entry_name)
    per_token = kv_bytes_per_token_for_entry(
        [(fx.n_layers, fx.n_kv_heads, fx.head_dim, fx.head_dim)], KV_PRECISIONS.get(kv_type, "f16"))
    block = KV_BLOCK_TOKENS["CPU"]
    estimate = per_token * kv_blocks_for(tokens, block) * block if estimated_kv_bytes is None else estimated_kv_bytes
    device = Device(index=0, kind="cpu", name="test host", total_bytes=16 << 30, free_bytes=12 << 30)
    budget = BudgetBreakdown(
        free_bytes=12 << 30, reserve_bytes=0, headroom_bytes=0, usable_bytes=12 << 30,
        weights_bytes=entry.artifact.size_bytes or 0, allowance_bytes=256 << 20, kv_budget_bytes=estimate,
        hot_context_tokens=tokens,
    )  # fmt: skip
    return Plan(entry=entry, probe=ProbeResult(devices=(device,)),
                placement=Placement.single(device), kv_cache_type=kv_type,
                kv_cache_type_source="flag", hot_context_tokens=tokens, estimated_kv_bytes=estimate,
                budget=budget, origin=None)


# ---------------------------------------------------------------- a real export, converted once


@dataclass(frozen=True)
class CachedExport:
    """An IR directory GenAI's GGUF reader made from a real, pinned GGUF, kept outside the repository."""

    ir_dir: Path
    gguf_sha256: str
    genai_version: str
    convert_seconds: float  # of the run that made it (recorded in the receipt)
    converted_now: bool  # False: taken from the cache


EXPORT_RECEIPT = "export.json"


def _export_receipt(ir_dir: Path, gguf_sha256: str, genai_version: str) -> dict[str, object] | None:
    import json

    try:
        receipt = json.loads((ir_dir.parent / EXPORT_RECEIPT).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    sizes = {n: (ir_dir / n).stat().st_size for n in IR_FILES if (ir_dir / n).is_file()}
    same = (isinstance(receipt, dict) and receipt.get("gguf_sha256") == gguf_sha256
            and receipt.get("genai_version") == genai_version and receipt.get("sizes") == sizes
            and len(sizes) == len(IR_FILES))
    return receipt if same else None


def cached_export(gguf_path: Path, gguf_sha256: str, cache_root: Path) -> CachedExport:
    """The IR of ``gguf_path`` under ``cache_root/<sha256[:16]>-genai<version>/ir``, converted once (the
    conversion is GenAI's own, in a child process) and then reused while its receipt matches: the GGUF's
    sha256, the openvino-genai release that converted it, and each IR file's size. Concurrent callers
    queue on a lock; a failed conversion leaves nothing behind."""
    import importlib.metadata
    import json
    import tempfile

    from hotfit.state.locks import FileLock

    version = importlib.metadata.version("openvino-genai")
    root = cache_root / f"{gguf_sha256[:16]}-genai{version}"
    ir_dir = root / "ir"
    with FileLock(cache_root / f"{gguf_sha256[:16]}.lock", wait=True, what=f"OpenVINO export of {gguf_path.name}"):
        receipt = _export_receipt(ir_dir, gguf_sha256, version)
        if receipt is not None:
            return CachedExport(ir_dir, gguf_sha256, version, float(receipt["convert_seconds"]),  # type: ignore[arg-type]
                                converted_now=False)
        shutil.rmtree(root, ignore_errors=True)
        cache_root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache_root, prefix=".converting-") as tmp:
            work = Path(tmp) / "work"
            work.mkdir()
            (work / gguf_path.name).symlink_to(gguf_path)  # the reader writes the IR beside the path it is given
            seconds = convert_gguf_to_ir(work / gguf_path.name, Path(tmp) / "ir")
            (work / gguf_path.name).unlink()
            sizes = {n: (Path(tmp) / "ir" / n).stat().st_size for n in IR_FILES}
            (Path(tmp) / EXPORT_RECEIPT).write_text(json.dumps(
                {"gguf": gguf_path.name, "gguf_sha256": gguf_sha256, "genai_version": version,
                 "convert_seconds": round(seconds, 3), "sizes": sizes}, indent=1), encoding="utf-8")
            shutil.rmtree(work)
            os.rename(tmp, root)  # whole, or not at all
            Path(tmp).mkdir()  # TemporaryDirectory removes its (now empty) name on exit
    return CachedExport(ir_dir, gguf_sha256, version, seconds, converted_now=True)


def with_ir_chat_template(ir_dir: Path, out_dir: Path, chat_template: str) -> Path:
    """A copy of ``ir_dir`` in ``out_dir`` whose tokenizer and detokenizer IRs carry ``chat_template``
    in their rt_info, as an optimum-intel export carries the repository's template (the model files
    are linked, not copied). GenAI renders this one in preference to a ``tokenizer_config.json``."""
    import openvino as ov
    import openvino_tokenizers  # noqa: F401 - registers the tokenizer ops read_model needs

    out_dir.mkdir(parents=True, exist_ok=True)
    core = ov.Core()
    for stem in ("openvino_tokenizer", "openvino_detokenizer"):
        model = core.read_model(ir_dir / f"{stem}.xml")
        model.set_rt_info(chat_template, "chat_template")
        ov.save_model(model, out_dir / f"{stem}.xml", compress_to_fp16=False)
    for name in ("openvino_model.xml", "openvino_model.bin"):
        (out_dir / name).symlink_to(ir_dir / name)
    return out_dir
