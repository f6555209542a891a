"""OpenVINO session settings for a plan, and the checks made before anything starts (pure).

:func:`session_config` turns the plan into every pipeline setting; nothing is left to GenAI's
defaults (openvino.genai's ``SchedulerConfig`` and ``ContinuousBatchingPipeline``; docs/benchmarks.md
for the allocation measured here):

- ``ContinuousBatchingPipeline``: the only GenAI pipeline whose metrics report the KV bytes really
  allocated, which the re-check needs;
- ``SchedulerConfig.num_kv_blocks`` = ceil(planned tokens / block) fixes the capacity exactly
  (``cache_size`` in whole GB is too coarse and is set to 0 so it cannot win), ``max_num_seqs=1``
  (one agent session, like llama-server's ``-np 1``), prefix caching and cache eviction off (the
  cache holds what was planned, nothing is silently dropped), ``max_num_batched_tokens`` fixed
  with split-fuse on so a long prompt is processed in bounded chunks;
- ``KV_CACHE_PRECISION`` from the plan's KV type (the CPU default is u8 and an IR's rt_info may
  carry its own default; an explicit property wins, measured).

:func:`check_ir_dir` refuses a vision-path export or missing files; :func:`parse_ir_kv_shape`
and :func:`kv_bytes_per_token` give the IR's KV geometry the re-check sizes the cache with;
:func:`require_openvino` is the one effect (is the extra installed?).
"""

from __future__ import annotations

import importlib.util
import json
import re
import signal
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hotfit.core.errors import BackendNotFound, LoadError
from hotfit.planner.plan import Plan
from hotfit.registry.kv import (
    OPENVINO_KV_BLOCK_TOKENS,
    OPENVINO_KV_PRECISIONS,
    openvino_state_bytes_per_token,
)

__all__ = [
    "IR_REQUIRED_FILES",
    "KV_BLOCK_TOKENS",
    "KV_PRECISIONS",
    "MAX_NUM_BATCHED_TOKENS",
    "OPENVINO_DEVICES",
    "OPENVINO_GENAI_VERSION",
    "OPENVINO_INSTALL_HINT",
    "OPEN_TIMEOUT_S",
    "VISION_PATH_FILES",
    "KvShape",
    "SessionConfig",
    "check_ir_dir",
    "diagnose_openvino_failure",
    "kv_blocks_for",
    "kv_bytes_per_token",
    "kv_bytes_per_token_for_entry",
    "openvino_device",
    "openvino_kv_precision",
    "parse_ir_kv_shape",
    "require_openvino",
    "session_config",
]

OPENVINO_GENAI_VERSION = "2026.4.1.0"  # the pin in pyproject.toml's `openvino` extra
OPENVINO_INSTALL_HINT = (
    'install the OpenVINO backend: `.venv/bin/pip install -e ".[openvino]"` from the hotfit checkout '
    "(or `scripts/bootstrap --openvino`)"
)
# The runtime files of an exported LLM (the `OpenVINO/*-ov` Hub repositories). A missing
# tokenizer or detokenizer does not fail at load, only at the first generate (measured), so all
# six are checked before anything starts.
IR_REQUIRED_FILES: tuple[str, ...] = (
    "openvino_model.xml", "openvino_model.bin",
    "openvino_tokenizer.xml", "openvino_tokenizer.bin",
    "openvino_detokenizer.xml", "openvino_detokenizer.bin",
)  # fmt: skip
# Files only a vision-language export has (optimum-intel's VLM layout): such a session rejects
# model-native tool definitions (spec, "Exclusions and backend differences").
VISION_PATH_FILES: tuple[str, ...] = (
    "openvino_vision_embeddings_model.xml",
    "openvino_language_model.xml",
    "openvino_text_embeddings_model.xml",
)
# Tokens per KV block of GenAI's paged cache (continuous_batching/cache/kv_cache_manager.hpp).
KV_BLOCK_TOKENS: dict[str, int] = {"CPU": OPENVINO_KV_BLOCK_TOKENS, "GPU": 16}
# The plan's KV type (ggml names, CONTENOX_LLAMA_KV_CACHE_TYPE) -> OpenVINO's KV_CACHE_PRECISION.
# u8 is the analogue of q8_0. f32 is refused by the CPU plugin on BF16-capable
# CPUs and u4 costs more than u8 there (measured), so neither is offered.
KV_PRECISIONS: dict[str, str] = dict(OPENVINO_KV_PRECISIONS)
# Compiling an 8B int4 IR on a cold disk takes a minute or two; beyond this it is reported hung.
OPEN_TIMEOUT_S = 600.0
# Prompt chunk per scheduler step (GenAI's default is 256); llama-server's -ub is 512.
MAX_NUM_BATCHED_TOKENS = 512
CLOSE_GRACE_S = 5.0
WORKER_LOG = "openvino-worker.log"
SESSION_FILE = "openvino-session.json"


def require_openvino() -> None:
    """Raise :class:`BackendNotFound` naming the install command when openvino-genai is absent."""
    if importlib.util.find_spec("openvino_genai") is None:
        raise BackendNotFound(
            "the OpenVINO backend is not installed: the Python package openvino-genai is missing",
            hint=OPENVINO_INSTALL_HINT,
            package="openvino-genai",
            version=OPENVINO_GENAI_VERSION,
        )


# ---------------------------------------------------------------- pure core


def openvino_kv_precision(kv_cache_type: str) -> str:
    try:
        return KV_PRECISIONS[kv_cache_type]
    except KeyError:
        raise LoadError(
            f"KV cache type {kv_cache_type!r} has no OpenVINO equivalent",
            hint=f"set CONTENOX_LLAMA_KV_CACHE_TYPE to one of {', '.join(KV_PRECISIONS)} for an OpenVINO plan "
                 "(q8_0 runs as OpenVINO's u8)",
            cause="kv_precision_unsupported",
            kv_cache_type=kv_cache_type,
        ) from None


# The probe's device kind -> OpenVINO's device name. hotfit's probe sees OpenVINO's GPU plugin's
# devices (Intel GPUs) only as generic Vulkan devices, so only host-memory plans run on OpenVINO
# today; the planner plans OpenVINO models on these kinds only (OpenVinoBackend.device_kinds).
OPENVINO_DEVICES: dict[str, str] = {"cpu": "CPU"}


def openvino_device(plan: Plan) -> str:
    """The OpenVINO device for the planned one (:data:`OPENVINO_DEVICES`)."""
    device = plan.placement.device
    if device.kind in OPENVINO_DEVICES:
        return OPENVINO_DEVICES[device.kind]
    raise LoadError(
        f"the plan is for {device.kind} device {device.name!r}, which hotfit cannot map to an OpenVINO device",
        hint="plan the OpenVINO model for host memory (`--device cpu`), or use the llama backend on this device",
        cause="device_unsupported",
        device_kind=device.kind,
    )


def kv_blocks_for(tokens: int, block_tokens: int) -> int:
    return -(-tokens // block_tokens)


@dataclass(frozen=True)
class SessionConfig:
    """Every setting the pipeline is opened with (written to ``openvino-session.json``)."""

    ir_dir: str
    device: str
    kv_precision: str  # OpenVINO's name (u8, f16, bf16)
    kv_cache_type: str  # the plan's name
    planned_tokens: int
    block_tokens: int
    num_kv_blocks: int
    cache_size: int  # GB; 0 so num_kv_blocks alone decides
    max_num_batched_tokens: int
    max_num_seqs: int
    enable_prefix_caching: bool
    dynamic_split_fuse: bool
    use_cache_eviction: bool
    properties: tuple[tuple[str, str], ...]

    @property
    def capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_tokens

    def scheduler_json(self) -> dict[str, Any]:
        keys = ("num_kv_blocks", "cache_size", "max_num_batched_tokens", "max_num_seqs",
                "enable_prefix_caching", "dynamic_split_fuse", "use_cache_eviction")
        return {k: getattr(self, k) for k in keys}

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"capacity_tokens": self.capacity_tokens}


def session_config(plan: Plan, ir_dir: Path, *, cache_dir: Path | None = None) -> SessionConfig:
    """Pure: the plan -> the pipeline's settings, nothing left to a default that matters."""
    device = openvino_device(plan)
    precision = openvino_kv_precision(plan.kv_cache_type)
    block = KV_BLOCK_TOKENS[device.split(".")[0]]
    props: dict[str, str] = {
        "KV_CACHE_PRECISION": precision,
        # K and V separately too: a per-tensor property would otherwise override the joint one.
        "KEY_CACHE_PRECISION": precision,
        "VALUE_CACHE_PRECISION": precision,
    }
    if cache_dir is not None:
        props["CACHE_DIR"] = str(cache_dir)  # compiled blobs: a re-open skips recompilation
    return SessionConfig(
        ir_dir=str(ir_dir),
        device=device,
        kv_precision=precision,
        kv_cache_type=plan.kv_cache_type,
        planned_tokens=plan.hot_context_tokens,
        block_tokens=block,
        num_kv_blocks=kv_blocks_for(plan.hot_context_tokens, block),
        cache_size=0,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        max_num_seqs=1,
        enable_prefix_caching=False,
        dynamic_split_fuse=True,
        use_cache_eviction=False,
        properties=tuple(sorted(props.items())),
    )


PROMPT_CAP_LEAD = "the export's tokenizer passes at most"


def prompt_cap_problem(cap: int, planned_tokens: int) -> str:
    """What a tokenizer that cuts prompts at ``cap`` means for a session planned for ``planned_tokens``."""
    return (f"{PROMPT_CAP_LEAD} {cap} prompt tokens (a limit in openvino_tokenizer.xml that "
            f"GenAI's truncation=False does not lift; GenAI's GGUF reader writes one), fewer than the {planned_tokens} "
            "planned: hotfit refuses a longer prompt rather than let it be cut, and measures speed within the limit")


def check_ir_dir(ir_dir: Path, names: Iterable[str] | None = None) -> None:
    """Refuse a directory that cannot serve the tool loop, before any process starts: a
    vision-language export (first: it has no ``openvino_model.xml`` either) or missing files."""
    present = set(names) if names is not None else ({p.name for p in ir_dir.iterdir()} if ir_dir.is_dir() else set())
    if not present and names is None and not ir_dir.is_dir():
        raise LoadError(
            f"the OpenVINO snapshot directory {ir_dir} does not exist",
            hint="fetch and verify it first (`hotfit pull NAME`)",
            cause="missing_files",
            ir_dir=str(ir_dir),
        )
    vision = sorted(present & set(VISION_PATH_FILES))
    config = _vision_config_marker(ir_dir) if "config.json" in present and names is None else None
    if vision or config:
        marker = ", ".join(vision) if vision else f"config.json {config}"
        raise LoadError(
            f"{ir_dir} is a vision-language export ({marker}): its session rejects model-native tool "
            "definitions, so it cannot serve the tool loop",
            hint="pick a text-only OpenVINO export (the registry marks vision-path exports not auto-eligible)",
            cause="vision_path",
            ir_dir=str(ir_dir),
            markers=vision or [config],
        )
    missing = [f for f in IR_REQUIRED_FILES if f not in present]
    if missing:
        raise LoadError(
            f"the OpenVINO snapshot {ir_dir} lacks {', '.join(missing)}",
            hint="re-fetch it (`hotfit pull NAME`); a snapshot without its tokenizer or detokenizer IR "
                 "loads but fails at the first generation",
            cause="missing_files",
            ir_dir=str(ir_dir),
            missing=missing,
        )


def _vision_config_marker(ir_dir: Path) -> str | None:
    """``vision_config`` / ``*ForConditionalGeneration`` in config.json: a VLM even where files are renamed."""
    try:
        config = json.loads((ir_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if "vision_config" in config:
        return "has vision_config"
    archs = [a for a in config.get("architectures") or [] if isinstance(a, str)]
    vlm = [a for a in archs if a.endswith("ForConditionalGeneration")]
    return f"architectures {vlm}" if vlm else None


@dataclass(frozen=True)
class KvShape:
    """The KV states of a stateful IR: one (kv_heads, head_dim) per state, K and V per layer."""

    states: tuple[tuple[str, int, int], ...]  # (variable_id, kv_heads, head_dim)

    @property
    def n_layers(self) -> int:
        return len(self.states) // 2


_READ_VALUE_RE = re.compile(r'<data\s+variable_id="(?P<id>[^"]+)"\s+variable_type="[^"]*"\s+variable_shape="(?P<shape>[^"]+)"')


def parse_ir_kv_shape(model_xml: str) -> KvShape:
    """Pure: the KV geometry from the IR's ``ReadValue`` states (``[batch, kv_heads, seq, head_dim]``),
    so the check needs no config.json."""
    states = []
    for m in _READ_VALUE_RE.finditer(model_xml):
        dims = m["shape"].split(",")
        if len(dims) == 4 and dims[1].isdigit() and dims[3].isdigit():
            states.append((m["id"], int(dims[1]), int(dims[3])))
    return KvShape(tuple(states))


_STATE_ROLE_RE = re.compile(r"past_key_values\.\d+\.(key|value)")


def _is_key_state(variable_id: str) -> bool:
    """``past_key_values.N.key...`` / ``.value...`` (optimum and the GGUF reader both name them so)."""
    m = _STATE_ROLE_RE.match(variable_id)
    return m[1] == "key" if m else "value" not in variable_id


def _state_bytes_per_token(variable_id: str, kv_heads: int, head_dim: int, precision: str) -> int:
    # the planner prices OpenVINO entries with the same function (registry.kv), so estimate and check agree
    return openvino_state_bytes_per_token(kv_heads, head_dim, precision, is_key=_is_key_state(variable_id))


def kv_bytes_per_token(shape: KvShape, precision: str) -> int:
    """Pure: KV bytes one cached token costs at ``precision`` over every state of ``shape``."""
    return sum(_state_bytes_per_token(vid, h, d, precision) for vid, h, d in shape.states)


def kv_bytes_per_token_for_entry(layer_groups: Iterable[tuple[int, int, int, int]], precision: str) -> int:
    """Pure, for the planner: (count, kv_heads, head_dim_k, head_dim_v) groups -> bytes per token."""
    total = 0
    for count, heads, dk, dv in layer_groups:
        k = _state_bytes_per_token("key", heads, dk, precision)
        v = _state_bytes_per_token("value", heads, dv, precision)
        total += count * (k + v)
    return total


_FAILURE_CAUSES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    ("out_of_memory", re.compile(r"bad_alloc|out of memory|cannot allocate|failed to allocate|oom", re.IGNORECASE),
     "the host did not have the memory the plan counted on: free memory, or re-plan (`hotfit plan`)"),
    ("damaged_ir", re.compile(r"Incorrect weights in bin file|Unable to read the model|Error parsing|"
                              r"xml|\.bin|Cannot create .* layer|unexpected end", re.IGNORECASE),
     "the IR files are damaged: re-fetch and verify the snapshot (`hotfit pull NAME`)"),
    ("kv_precision_unsupported", re.compile(r"kvcache type|cache precision|KV_CACHE_PRECISION", re.IGNORECASE),
     "this CPU does not take the planned KV precision: plan another KV type (CONTENOX_LLAMA_KV_CACHE_TYPE)"),
    ("unsupported_model", re.compile(r"not supported|unsupported|Model references undeclared", re.IGNORECASE),
     "this OpenVINO GenAI release cannot run the export: the registry entry must not be auto-eligible"),
)


def diagnose_openvino_failure(message: str, returncode: int | None) -> tuple[str, str]:
    """Pure: (cause, hint) for a failed open from GenAI's exception text and the worker's exit."""
    if returncode is not None and returncode < 0 and -returncode == signal.SIGKILL:
        return "out_of_memory", ("the OpenVINO worker was killed (SIGKILL), most likely by the kernel's OOM killer: "
                                 "free memory, or re-plan (`hotfit plan`) against the memory free now")
    for cause, pattern, hint in _FAILURE_CAUSES:
        if pattern.search(message):
            return cause, hint
    if returncode is not None and returncode < 0:
        return "worker_crashed", f"the OpenVINO worker died by signal {-returncode}: see the worker log"
    return "unknown", "read the quoted error and the worker log in the run directory"


