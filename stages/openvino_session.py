"""OpenVINO load: open a verified IR snapshot exactly as planned (issue 13 item 1).

The OpenVINO counterpart of :mod:`stages.load`, with a small surface a later Backend
implementation wraps: :func:`session_config` (pure: the plan -> every pipeline setting),
:func:`check_ir_dir` (pure on the file listing: refuses a vision-path export or missing files
before anything starts) and :func:`open_openvino_session` (an async context manager yielding an
:class:`OpenVinoSession`).

Nothing is left to GenAI's defaults (``../shared/design/openvino.md`` §2, §4):

- ``ContinuousBatchingPipeline``: the only GenAI pipeline whose metrics report the KV bytes really
  allocated, which the re-check needs;
- ``SchedulerConfig.num_kv_blocks`` = ceil(planned tokens / block) fixes the capacity exactly
  (``cache_size`` in whole GB is too coarse and is set to 0 so it cannot win), ``max_num_seqs=1``
  (one agent session, like llama-server's ``-np 1``), prefix caching and cache eviction off (the
  cache holds what was planned, nothing is silently dropped), ``max_num_batched_tokens`` fixed
  with split-fuse on so a long prompt is processed in bounded chunks;
- ``KV_CACHE_PRECISION`` from the plan's KV type (the CPU default is u8 and an IR's rt_info may
  carry its own default; an explicit property wins, measured).

The pipeline lives in a child process (:mod:`stages.openvino_worker`, which says why) started in
its own session, killed at a deadline, and always reaped on leaving the context: success, error,
cancellation or signal. Its log (GenAI's and OpenVINO's own output) is a file in the run directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from core.errors import BackendNotFound, LoadError
from core.log import get_logger
from core.plan import Plan
from registry.kv import (
    OPENVINO_KV_BLOCK_TOKENS,
    OPENVINO_KV_PRECISIONS,
    openvino_state_bytes_per_token,
)

__all__ = [
    "IR_REQUIRED_FILES",
    "KV_BLOCK_TOKENS",
    "KV_PRECISIONS",
    "MAX_NUM_BATCHED_TOKENS",
    "OPENVINO_GENAI_VERSION",
    "OPENVINO_INSTALL_HINT",
    "OPEN_TIMEOUT_S",
    "VISION_PATH_FILES",
    "KvShape",
    "OpenVinoSession",
    "SessionConfig",
    "check_ir_dir",
    "diagnose_openvino_failure",
    "kv_blocks_for",
    "kv_bytes_per_token",
    "open_openvino_session",
    "openvino_device",
    "openvino_kv_precision",
    "parse_ir_kv_shape",
    "require_openvino",
    "session_config",
]

log = get_logger()

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
# u8 is the analogue of q8_0 (design note §4). f32 is refused by the CPU plugin on BF16-capable
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


def openvino_device(plan: Plan) -> str:
    """The OpenVINO device for the planned one. hotfit's probe sees OpenVINO's GPU plugin's devices
    (Intel GPUs) only as generic Vulkan devices, so only host-memory plans run on OpenVINO today."""
    device = plan.probe.device
    if device.kind == "cpu":
        return "CPU"
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
    """Pure: the KV geometry from the IR's ``ReadValue`` states (``[batch, kv_heads, seq, head_dim]``;
    design note §4), so the check needs no config.json."""
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


# ---------------------------------------------------------------- effects


class OpenVinoSession:
    """An opened pipeline in its worker process (valid inside :func:`open_openvino_session`)."""

    def __init__(self, *, process: subprocess.Popen[bytes], config: SessionConfig, plan: Plan,
                 run_dir: Path, log_path: Path, opened: Mapping[str, Any]) -> None:
        self.process = process
        self.config = config
        self.plan = plan
        self.run_dir = run_dir
        self.log_path = log_path
        self.opened = dict(opened)
        self.load_seconds = float(opened.get("load_seconds", 0.0))
        self.ir_dir = Path(config.ir_dir)

    @property
    def pid(self) -> int:
        return self.process.pid

    def returncode(self) -> int | None:
        return self.process.poll()

    def describe_exit(self) -> str:
        code = self.returncode()
        if code is None:
            return "still running"
        return f"killed by signal {-code}" if code < 0 else f"exited with status {code}"

    def log_tail(self, limit: int = 12) -> list[str]:
        try:
            lines = self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return []
        return [ln for ln in lines if ln.strip()][-limit:]

    async def request(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """One request to the worker; a reply that does not come within ``timeout_s`` kills it."""
        return await _request(self.process, {"op": op, **fields}, timeout_s)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "config": self.config.to_json(), "load_seconds": self.load_seconds,
                "log_path": str(self.log_path), **{k: v for k, v in self.opened.items() if k != "ok"}}


class _WorkerGone(Exception):
    """The worker closed its stdout (it died) or sent something that is not a reply."""


async def _request(process: subprocess.Popen[bytes], payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    assert process.stdin is not None and process.stdout is not None

    def exchange() -> bytes:
        if payload:
            process.stdin.write((json.dumps(payload) + "\n").encode())  # type: ignore[union-attr]
            process.stdin.flush()  # type: ignore[union-attr]
        return process.stdout.readline()  # type: ignore[union-attr]

    with anyio.fail_after(timeout_s):
        try:
            raw = await anyio.to_thread.run_sync(exchange, abandon_on_cancel=True)
        except (BrokenPipeError, OSError) as exc:
            raise _WorkerGone(str(exc)) from None
    if not raw:
        raise _WorkerGone("the worker closed its output")
    try:
        reply = json.loads(raw)
    except ValueError:
        raise _WorkerGone(f"not a reply: {raw[:200]!r}") from None
    if not isinstance(reply, dict):
        raise _WorkerGone(f"not a reply: {raw[:200]!r}")
    return reply


def _kill_group(process: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


async def _reap(process: subprocess.Popen[bytes]) -> None:
    """Close the worker: ask, then SIGTERM the group, then SIGKILL; always waited for."""
    if process.poll() is None:
        with contextlib.suppress(Exception):
            with anyio.move_on_after(CLOSE_GRACE_S):
                await _request(process, {"op": "close"}, CLOSE_GRACE_S)
                while process.poll() is None:
                    await anyio.sleep(0.05)
    if process.poll() is None:
        _kill_group(process, signal.SIGTERM)
        with anyio.move_on_after(CLOSE_GRACE_S):
            while process.poll() is None:
                await anyio.sleep(0.05)
    if process.poll() is None:
        _kill_group(process, signal.SIGKILL)
    await anyio.to_thread.run_sync(process.wait)
    for stream in (process.stdin, process.stdout):
        with contextlib.suppress(OSError):
            if stream is not None:
                stream.close()


def worker_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The worker's environment: ours, with OpenVINO's property dump on (level 3 prints the compiled
    model's KV_CACHE_PRECISION and the SchedulerConfig to the log: evidence of the effective
    settings) and telemetry off."""
    env = dict(os.environ if base is None else base)
    env["OPENVINO_LOG_LEVEL"] = "3"
    env["CI"] = "true"  # opt-in telemetry of OpenVINO tooling stays off
    env["PYTHONUNBUFFERED"] = "1"
    return env


@contextlib.asynccontextmanager
async def open_openvino_session(
    plan: Plan,
    ir_dir: Path,
    run_dir: Path,
    *,
    timeout_s: float = OPEN_TIMEOUT_S,
    cache_dir: Path | None = None,
    python: str | None = None,
) -> AsyncIterator[OpenVinoSession]:
    """Open ``ir_dir`` as ``plan`` says in a worker process; reap it on leaving, whatever happens.

    Raises :class:`BackendNotFound` without openvino-genai, :class:`LoadError` (``details.cause``:
    ``missing_files``, ``vision_path``, ``damaged_ir``, ``out_of_memory``, ``timeout``, ...)."""
    require_openvino()
    config = session_config(plan, ir_dir, cache_dir=cache_dir)
    check_ir_dir(ir_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    log_path = run_dir / WORKER_LOG
    (run_dir / SESSION_FILE).write_text(json.dumps(config.to_json(), indent=2) + "\n", encoding="utf-8")
    started = time.monotonic()

    def spawn() -> subprocess.Popen[bytes]:
        with open(log_path, "ab") as log_file:
            return subprocess.Popen(
                [python or sys.executable, "-m", "stages.openvino_worker", str(os.getpid())],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log_file,
                cwd=str(Path(__file__).resolve().parent.parent), env=worker_env(), start_new_session=True,
            )  # fmt: skip

    process = await anyio.to_thread.run_sync(spawn)
    log.info("openvino.start", pid=process.pid, ir_dir=str(ir_dir), **config.scheduler_json(),
             kv_precision=config.kv_precision, device=config.device)

    def failed(what: str, cause: str, hint: str, **details: Any) -> LoadError:
        tail = _tail(log_path)
        log.error("openvino.load_failed", cause=cause, what=what, pid=process.pid)
        return LoadError(what, hint=hint, cause=cause, ir_dir=str(ir_dir), log_path=str(log_path),
                         log_lines=tail, returncode=process.poll(), pid=process.pid, **details)

    try:
        try:
            reply = await _request(process, {}, timeout_s)  # the worker's "ready" line
            if reply.get("ok"):
                reply = await _request(process, {"op": "open", "ir_dir": str(ir_dir), "device": config.device,
                                                 "scheduler": config.scheduler_json(),
                                                 "properties": dict(config.properties)},
                                       max(1.0, timeout_s - (time.monotonic() - started)))
        except TimeoutError:
            raise failed(f"the OpenVINO pipeline did not open within {timeout_s:.0f} s", "timeout",
                         "the worker was killed; a cold compile of a large IR can take minutes on a slow "
                         "disk, otherwise the runtime hangs: see the worker log") from None
        except _WorkerGone as exc:
            await anyio.to_thread.run_sync(process.wait)
            cause, hint = diagnose_openvino_failure(" ".join(_tail(log_path)), process.returncode)
            raise failed(f"the OpenVINO worker {_describe(process)} while opening {ir_dir} ({exc})", cause,
                         hint) from None
        if not reply.get("ok"):
            error = str(reply.get("error", ""))
            cause, hint = diagnose_openvino_failure(error, None)
            first = error.strip().splitlines()[-1] if error.strip() else reply.get("exception", "error")
            raise failed(f"OpenVINO could not open {ir_dir}: {first}", cause, hint, error=error[-2000:])
        session = OpenVinoSession(process=process, config=config, plan=plan, run_dir=run_dir,
                                  log_path=log_path, opened=reply)
        log.info("openvino.loaded", pid=process.pid, load_seconds=round(session.load_seconds, 3),
                 capacity_tokens=config.capacity_tokens)
        yield session
    finally:
        with anyio.CancelScope(shield=True):
            await _reap(process)


def _describe(process: subprocess.Popen[bytes]) -> str:
    code = process.poll()
    if code is None:
        return "stopped answering"
    return f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"


def _tail(path: Path, limit: int = 12) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    picked = [ln for ln in lines if re.search(r"error|exception|fail|incorrect|unable|cannot", ln, re.IGNORECASE)]
    return (picked or [ln for ln in lines if ln.strip()])[-limit:]
