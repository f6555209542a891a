"""llama-server's hot allocation: what the opened session really holds, judged against the plan.

Read from the running server (the re-check stage, :mod:`stages.recheck`, decides what a failed
verdict means):

- ``/props`` and ``/slots``: the window each slot opened (``n_ctx``), the slot count, the chat
  template's capabilities and the build;
- its log: the KV cache records libllama prints while creating the context
  (``src/llama-kv-cache.cpp``)::

      llama_kv_cache:        CPU KV buffer size =    17.00 MiB
      llama_kv_cache: size =   17.00 MiB ( 32768 cells,   2 layers,  1/1 seqs), K (q8_0):    8.50 MiB, V (q8_0):    8.50 MiB

  and, for sliding-window models, one such record per cache, each announced by
  ``llama_kv_cache_iswa: creating non-SWA KV cache, size = N cells`` / ``creating     SWA KV
  cache, ...`` (``src/llama-kv-cache-iswa.cpp``).

:func:`judge_allocation` (pure) finds a problem when the opened window is below the plan or below
the agentic floor, when the KV bytes exceed the estimate by more than the tolerance, when the cache
type differs from the plan, when an accelerator plan finds KV buffers or layers on the host, or
when the allocation cannot be read at all. A session holding less than half the estimate is a
warning.

Precision: llama.cpp prints these sizes as ``%.2f`` MiB of a 32-bit float, so each figure is
exact to ±(0.005 MiB + half a float32 step); :func:`mib_half_step_bytes` computes that bound
and the report carries it (``actual_kv_bytes_uncertainty``). The exit-time
``fit_memory_breakdown`` record is whole MiB and only written when the server stops, so it is
not used here.
"""

from __future__ import annotations

import math
import re
import struct
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import anyio

from hotfit.backends.base import KV_EXCESS_TOLERANCE, KV_SHORTFALL_WARN_RATIO, AllocationVerdict
from hotfit.backends.llama_server.logs import LogLine, read_server_log
from hotfit.core.errors import AllocationMismatch
from hotfit.core.lazy_import import lazy_module
from hotfit.planner.plan import Plan
from hotfit.registry.kv import allocation_kv_bytes

if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import httpx
else:
    httpx = lazy_module("httpx")  # third-party, imported on first use (core.lazy_import says why)

if TYPE_CHECKING:  # annotations only: process.py imports this module
    from hotfit.backends.llama_server.process import LoadedServer

__all__ = [
    "AllocationReport",
    "KvBufferRecord",
    "KvCacheRecord",
    "LogAllocation",
    "judge_allocation",
    "mib_half_step_bytes",
    "parse_log_allocation",
    "read_allocation",
]

MiB = 1 << 20
# registry.kv mirrors llama.cpp's allocation byte for byte, so the real KV should equal the

# llama_kv_cache: size =   17.00 MiB ( 32768 cells,   2 layers,  1/1 seqs), K (q8_0):    8.50 MiB, V (q8_0):    8.50 MiB
_KV_SIZE_RE = re.compile(
    r"llama_kv_cache: size =\s*(?P<total>[\d.]+) MiB \(\s*(?P<cells>\d+) cells,\s*(?P<layers>\d+) layers,"
    r"\s*(?P<seqs>\d+)/(?P<streams>\d+) seqs\), K \((?P<k_type>\w+)\):\s*(?P<k>[\d.]+) MiB,"
    r" V \((?P<v_type>\w+)\):\s*(?P<v>[\d.]+) MiB"
)
# llama_kv_cache:        CPU KV buffer size =    17.00 MiB
_KV_BUFFER_RE = re.compile(r"llama_kv_cache:\s*(?P<buffer>\S+) KV buffer size =\s*(?P<mib>[\d.]+) MiB")
# llama_kv_cache_iswa: creating     SWA KV cache, size = 1024 cells
_ISWA_RE = re.compile(r"llama_kv_cache_iswa: creating\s+(?P<kind>non-SWA|SWA) KV cache, size = (?P<cells>\d+) cells")
# load_tensors: offloaded 29/29 layers to GPU
_OFFLOAD_RE = re.compile(r"offloaded (?P<done>\d+)/(?P<total>\d+) layers to GPU")
_N_CTX_RE = re.compile(r"llama_context: n_ctx\s+=\s+(?P<n>\d+)")
_N_CTX_SEQ_RE = re.compile(r"llama_context: n_ctx_seq\s+=\s+(?P<n>\d+)")
_FLASH_RE = re.compile(r"llama_context: flash_attn\s+=\s+(?P<v>\S+)")


def mib_half_step_bytes(mib: float) -> int:
    """Half the resolution of a ``%.2f`` MiB figure printed from a float32, in bytes (rounded
    up): the printed value is within this many bytes of the true size."""
    f32 = struct.unpack("f", struct.pack("f", mib))[0]
    ulp = math.ulp(f32) * (1 << 29) if f32 else 0.0  # float32 step = float64 step × 2^29
    return math.ceil((0.005 + ulp / 2) * MiB)


@dataclass(frozen=True)
class KvCacheRecord:
    """One ``llama_kv_cache: size = ...`` record (one cache; SWA models have two)."""

    role: str  # "kv" (plain cache), "non-swa" or "swa" (ISWA caches)
    cells: int
    layers: int
    seqs: int
    k_type: str
    v_type: str
    size_mib: float
    k_mib: float
    v_mib: float

    @property
    def size_bytes(self) -> int:
        return round(self.size_mib * MiB)


@dataclass(frozen=True)
class KvBufferRecord:
    buffer: str  # backend buffer name: "CPU", "CUDA0", ...
    mib: float

    @property
    def on_host(self) -> bool:
        return self.buffer.upper().startswith("CPU")


@dataclass(frozen=True)
class LogAllocation:
    """What the log says the context allocated (pure parse result)."""

    caches: tuple[KvCacheRecord, ...]
    buffers: tuple[KvBufferRecord, ...]
    n_ctx: int | None
    n_ctx_seq: int | None
    flash_attn: str | None
    offloaded_layers: tuple[int, int] | None  # (on GPU, total); None when not printed (CPU)

    @property
    def kv_bytes(self) -> int:
        return sum(c.size_bytes for c in self.caches)

    @property
    def kv_bytes_uncertainty(self) -> int:
        return sum(mib_half_step_bytes(c.size_mib) for c in self.caches)


def parse_log_allocation(lines: Sequence[LogLine]) -> LogAllocation:
    """Pure: the KV records of the *last* context created in the log (a restart appends)."""
    caches: list[KvCacheRecord] = []
    buffers: list[KvBufferRecord] = []
    n_ctx = n_ctx_seq = None
    flash = None
    offload = None
    pending_role = "kv"
    for ln in lines:
        msg = ln.msg
        if m := _N_CTX_RE.search(msg):
            # A new context: forget records of an earlier one in the same log.
            n_ctx, caches, buffers, pending_role = int(m["n"]), [], [], "kv"
        elif m := _N_CTX_SEQ_RE.search(msg):
            n_ctx_seq = int(m["n"])
        elif m := _FLASH_RE.search(msg):
            flash = m["v"]
        elif m := _OFFLOAD_RE.search(msg):
            offload = (int(m["done"]), int(m["total"]))
        elif m := _ISWA_RE.search(msg):
            pending_role = "swa" if m["kind"] == "SWA" else "non-swa"
        elif m := _KV_BUFFER_RE.search(msg):
            buffers.append(KvBufferRecord(m["buffer"], float(m["mib"])))
        elif m := _KV_SIZE_RE.search(msg):
            caches.append(
                KvCacheRecord(
                    role=pending_role,
                    cells=int(m["cells"]),
                    layers=int(m["layers"]),
                    seqs=int(m["seqs"]),
                    k_type=m["k_type"],
                    v_type=m["v_type"],
                    size_mib=float(m["total"]),
                    k_mib=float(m["k"]),
                    v_mib=float(m["v"]),
                )
            )
            pending_role = "kv"
    return LogAllocation(tuple(caches), tuple(buffers), n_ctx, n_ctx_seq, flash, offload)


@dataclass(frozen=True)
class AllocationReport(AllocationVerdict):
    """The verified hot allocation (``actual_*``) beside the plan's estimate — never merged."""

    opened_n_ctx_per_slot: tuple[int, ...]  # from /slots
    props_n_ctx: int | None  # /props default_generation_settings.n_ctx
    total_slots: int | None
    kv_cache_type: str
    estimated_kv_bytes: int  # what the plan budgeted (may be conservative: Gemma, MLA, hybrid)
    predicted_kv_bytes: int | None  # registry.kv's exact model of llama.cpp's allocation, if any
    actual_kv_bytes: int | None  # from the log; None = could not be read
    actual_kv_bytes_uncertainty: int | None  # ± bytes from the log's %.2f MiB rounding
    ratio: float | None  # actual / estimate
    predicted_ratio: float | None  # actual / predicted: how well registry.kv models llama.cpp
    tolerance: float
    caches: tuple[dict[str, Any], ...]
    kv_buffers: tuple[dict[str, Any], ...]
    offloaded_layers: tuple[int, int] | None
    flash_attn: str | None
    chat_template_caps: dict[str, Any] = field(default_factory=dict)
    build_info: str | None = None
    model_path: str | None = None

    @property
    def opened_context_tokens(self) -> int | None:
        """The smallest window a slot opened (None: /slots reported none)."""
        return min(self.opened_n_ctx_per_slot) if self.opened_n_ctx_per_slot else None

    def opened_figure(self) -> list[int]:
        return list(self.opened_n_ctx_per_slot)  # the window per slot

    def event_facts(self) -> dict[str, Any]:
        return dict(
            verdict=self.verdict,
            planned_hot_context_tokens=self.planned_hot_context_tokens,
            opened_n_ctx_per_slot=list(self.opened_n_ctx_per_slot),
            estimated_kv_bytes=self.estimated_kv_bytes,
            predicted_kv_bytes=self.predicted_kv_bytes,
            actual_kv_bytes=self.actual_kv_bytes,
            actual_kv_bytes_uncertainty=self.actual_kv_bytes_uncertainty,
            ratio=round(self.ratio, 6) if self.ratio is not None else None,
            kv_cache_type=self.kv_cache_type,
        )

    def warning_event(self, warning: str) -> str:
        return "recheck.kv_prediction_off" if "prediction" in warning else "recheck.kv_below_estimate"


def judge_allocation(
    *,
    planned_tokens: int,
    floor_tokens: int,
    kv_cache_type: str,
    estimated_kv_bytes: int,
    accelerator: bool,
    slot_n_ctx: Sequence[int],
    observed: LogAllocation,
    tolerance: float = KV_EXCESS_TOLERANCE,
) -> tuple[list[str], list[str]]:
    """Pure: (problems, warnings). Any problem fails the stage."""
    problems: list[str] = []
    warnings: list[str] = []
    if not slot_n_ctx:
        problems.append("/slots reported no slot: the opened window cannot be verified")
    for i, n in enumerate(slot_n_ctx):
        if n < planned_tokens:
            problems.append(f"slot {i} opened {n} tokens, below the planned {planned_tokens}")
        if n < floor_tokens:
            problems.append(f"slot {i} opened {n} tokens, below the agentic floor of {floor_tokens}")
    if not observed.caches:
        problems.append(
            "no KV cache record in the llama-server log: the real allocation cannot be verified "
            "(is the log verbosity below 4?)"
        )
    else:
        for c in observed.caches:
            if c.k_type != kv_cache_type or c.v_type != kv_cache_type:
                problems.append(
                    f"{c.role} cache holds K {c.k_type} / V {c.v_type}, the plan said {kv_cache_type}"
                )
        actual = observed.kv_bytes
        if estimated_kv_bytes <= 0:
            problems.append(f"the plan carries no KV estimate ({estimated_kv_bytes} bytes) to check against")
        else:
            ratio = actual / estimated_kv_bytes
            if ratio > 1 + tolerance:
                problems.append(
                    f"llama-server allocated {actual} KV bytes, {ratio:.4f}× the estimate of "
                    f"{estimated_kv_bytes} (tolerance {tolerance:.0%})"
                )
            elif ratio < KV_SHORTFALL_WARN_RATIO:
                warnings.append(
                    f"llama-server allocated {actual} KV bytes, only {ratio:.3f}× the estimate of "
                    f"{estimated_kv_bytes}"
                )
    if accelerator:
        host = [b.buffer for b in observed.buffers if b.on_host]
        if host:
            problems.append(f"KV buffers on the host ({', '.join(host)}) although the plan is for an accelerator")
        if observed.offloaded_layers is not None:
            done, total = observed.offloaded_layers
            if done < total:
                problems.append(f"only {done}/{total} layers were offloaded to the accelerator")
        else:
            problems.append("the log does not say how many layers were offloaded to the accelerator")
    return problems, warnings


def _predicted_kv_bytes(plan: Plan, observed: LogAllocation) -> int | None:
    """registry.kv's exact prediction for the window llama.cpp opened (None where it has none)."""
    tokens = observed.n_ctx or plan.hot_context_tokens
    try:
        return allocation_kv_bytes(plan.entry, tokens, plan.kv_cache_type)
    except (KeyError, ValueError):
        return None




async def read_allocation(
    server: LoadedServer,
    plan: Plan,
    *,
    floor_tokens: int,
    tolerance: float = KV_EXCESS_TOLERANCE,
    timeout_s: float = 30.0,
) -> AllocationReport:
    """Read ``/props``, ``/slots`` and the log of ``server`` and judge them against ``plan``.

    Raises :class:`AllocationMismatch` only when ``/props`` or ``/slots`` cannot be read."""
    async with server.client(timeout_s) as client:
        try:
            props = (await client.get("/props")).raise_for_status().json()
            slots = (await client.get("/slots")).raise_for_status().json()
        except (httpx.HTTPError, ValueError) as exc:
            raise AllocationMismatch(
                f"could not read /props and /slots from llama-server ({server.describe_exit()}): {exc}",
                hint=f"the session cannot be verified; see the server log {server.log_path}",
                log_path=str(server.log_path),
            ) from None
    lines = await anyio.to_thread.run_sync(read_server_log, server.run_dir)
    observed = parse_log_allocation(lines)
    slot_n_ctx = tuple(int(s.get("n_ctx", 0)) for s in slots) if isinstance(slots, list) else ()
    accelerator = plan.placement.device.kind != "cpu"
    problems, warnings = judge_allocation(
        planned_tokens=plan.hot_context_tokens,
        floor_tokens=floor_tokens,
        kv_cache_type=plan.kv_cache_type,
        estimated_kv_bytes=plan.estimated_kv_bytes,
        accelerator=accelerator,
        slot_n_ctx=slot_n_ctx,
        observed=observed,
        tolerance=tolerance,
    )
    actual = observed.kv_bytes if observed.caches else None
    predicted = _predicted_kv_bytes(plan, observed)
    predicted_ratio = actual / predicted if actual is not None and predicted else None
    if predicted_ratio is not None and abs(predicted_ratio - 1) > tolerance:
        # not unsafe while the estimate holds, but registry.kv no longer models this build
        warnings.append(
            f"llama-server allocated {actual} KV bytes, {predicted_ratio:.4f}× registry.kv's exact "
            f"prediction of {predicted}"
        )
    return AllocationReport.judged(
        problems,
        warnings,
        planned_hot_context_tokens=plan.hot_context_tokens,
        floor_tokens=floor_tokens,
        opened_n_ctx_per_slot=slot_n_ctx,
        props_n_ctx=(props.get("default_generation_settings") or {}).get("n_ctx"),
        total_slots=props.get("total_slots"),
        kv_cache_type=plan.kv_cache_type,
        estimated_kv_bytes=plan.estimated_kv_bytes,
        predicted_kv_bytes=predicted,
        actual_kv_bytes=actual,
        actual_kv_bytes_uncertainty=observed.kv_bytes_uncertainty if observed.caches else None,
        ratio=(actual / plan.estimated_kv_bytes) if actual is not None and plan.estimated_kv_bytes > 0 else None,
        predicted_ratio=predicted_ratio,
        tolerance=tolerance,
        caches=tuple(asdict(c) | {"size_bytes": c.size_bytes} for c in observed.caches),
        kv_buffers=tuple(asdict(b) for b in observed.buffers),
        offloaded_layers=observed.offloaded_layers,
        flash_attn=observed.flash_attn,
        chat_template_caps=dict(props.get("chat_template_caps") or {}),
        build_info=props.get("build_info"),
        model_path=props.get("model_path"),
    )
