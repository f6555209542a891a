"""Predicted speed of one model on one device, before a byte is downloaded (pure: no I/O).

An agent's first prompt is large (a tool catalogue and instructions: 16k-26k tokens), so a model
that fits but reads that prompt for ten minutes is no agent (spec, "Selection and hot context": an
estimate that fits "is not a throughput guarantee: prefill and long-context inference still depend
on memory bandwidth and hardware execution support"). Two bounds, docs/benchmarks.md
("Predicted against measured speed") shows how close they come on real GGUFs:

- generation (decode): every generated token reads the active weights once and the KV cells it
  attends, so ``tokens/s = bandwidth x efficiency / (active weight bytes + KV bytes at that depth)``;
- prompt processing (prefill): compute bound, ``2 FLOPs x multiplied parameters`` per prompt token
  plus attention, ``4 x query width x depth`` per layer (QK and PV; a sliding-window layer stops at
  its window), at the device's compute rate. Time to first token = the prompt's FLOPs / that rate.

Every figure carries its ``basis``: which bandwidth (measured, NVML's, or assumed), which efficiency
and which parameter count (MoE: active only) it rests on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Protocol

from hotfit.core.entry import Entry
from hotfit.registry.kv import KVCacheType

GB = 1e9

# --------------------------------------------------------------------------- constants
# Decode on a CPU reaches this fraction of the host's streaming-read bandwidth (probe: one pass of
# memchr per thread). Fitted on the quiet bench-backend run of the real Q4_K_M test GGUFs (Gemma 3 0.57,
# Qwen2.5 0.55 at 32.8 GB/s, 2 cores of an AMD EPYC Zen 5 VM; docs/benchmarks.md, "Predicted against
# measured speed"); SmolLM2 Q4_1 reaches 0.33.
CPU_DECODE_BANDWIDTH_EFFICIENCY = 0.55
# A GPU decode step reaches this fraction of NVML's peak bandwidth (clock x bus width). Not measured
# here (no GPU): llmfit's published factor (0.55) rounded up for llama.cpp's CUDA kernels; an estimate.
GPU_DECODE_BANDWIDTH_EFFICIENCY = 0.6
# Prefill FLOP/s one llama-server thread sustains on the quantized matmuls (AVX-512 VNNI, Q4_K), fitted
# on the same quiet runs (Qwen2.5 87, Gemma 3 73 GFLOP/s a thread at 256 tokens; SmolLM2's Q4_1 kernel
# 32: over-predicted 2.7x; docs/benchmarks.md).
CPU_PREFILL_FLOPS_PER_THREAD = 90e9
# Attention at depth runs f16 kernels, maybe slower per FLOP than the quantized matmuls: this many matmul
# FLOPs' time per attention FLOP. Not yet fitted (no quiet deep run here; scripts/bench-speed --fit
# fits it from its 8k/16k runs): 1 = the same rate.
ATTENTION_FLOP_COST = 1.0
# A GPU's prefill FLOP/s per byte/s of its bandwidth: recent cards offer 150-300 dense f16 FLOPs per
# byte (H100 295, RTX 4090 165, RTX 3060 142) and llama.cpp's quantized matmuls reach about a third.
# Not measured here (no GPU): an estimate, and the basis says so.
GPU_PREFILL_FLOPS_PER_BYTE = 50.0
# Used when the probe did not measure the device (an old probe file): a dual-channel DDR4 desktop,
# 4 threads; a mid-range GPU. The basis then says "assumed".
ASSUMED_HOST_BANDWIDTH_BYTES_PER_S = 20e9
ASSUMED_HOST_THREADS = 4
ASSUMED_GPU_BANDWIDTH_BYTES_PER_S = 300e9
# The agent prompt a prediction is made for: Claude Code sends 16-26k tokens for "hello", OpenCode
# with MCP tools 20-25k (docs/benchmarks.md, "Predicted against measured speed").
DEFAULT_AGENT_PROMPT_TOKENS = 16384
# Without floors, plan and auto warn past this first-token time: harnesses give up after 30 s to
# 10 minutes, and 300 s idle is a common default; 120 s is well inside most.
SLOW_FIRST_TOKEN_S = 120.0


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class AttentionGroup:
    """``count`` attention layers of one shape. ``query_width`` = query heads x head dim (the
    multiply-adds per cached token in QK and again in PV); ``kv_bytes_per_token`` = K + V bytes one
    cached token costs in one layer at the KV type; ``window_tokens`` set = sliding window."""

    count: int
    query_width: int
    kv_bytes_per_token: int
    window_tokens: int | None = None


@dataclass(frozen=True)
class ModelSpeedFacts:
    """What speed depends on in the model. ``weights_read_per_token_bytes``: weights one decode step
    reads (MoE: the active experts only); ``matmul_params``: parameters multiplied per prompt token."""

    weights_read_per_token_bytes: float
    matmul_params: float
    attention: tuple[AttentionGroup, ...]
    basis: str  # which parameter count and bytes per weight

    def kv_read_bytes(self, depth_tokens: int) -> float:
        """KV bytes one decode step at ``depth_tokens`` reads (a window layer: its window at most)."""
        return float(sum(g.count * g.kv_bytes_per_token * _attended(depth_tokens, g.window_tokens)
                         for g in self.attention))

    def prompt_flops(self, prompt_tokens: int) -> float:
        """FLOPs of prefilling ``prompt_tokens``: the matmuls, and attention over the growing depth
        (token d attends min(d, window) cells), weighted by ATTENTION_FLOP_COST."""
        attention = sum(g.count * 4 * g.query_width * _depth_sum(prompt_tokens, g.window_tokens)
                        for g in self.attention)
        return 2.0 * self.matmul_params * prompt_tokens + ATTENTION_FLOP_COST * attention


@dataclass(frozen=True)
class DeviceSpeedFacts:
    """What speed depends on in the device: its read bandwidth and compute rate, and their basis."""

    kind: str
    read_bandwidth_bytes_per_s: float
    decode_efficiency: float
    prefill_flops_per_s: float
    bandwidth_basis: str  # "measured ...", "NVML ...", "assumed ..."
    compute_basis: str


def _attended(depth: int, window: int | None) -> int:
    return depth if window is None else min(depth, window)


def _depth_sum(n: int, window: int | None) -> int:
    """sum over d in [0, n) of min(d, window): the cells each prompt token attends, in total."""
    if window is None or n <= window:
        return n * (n - 1) // 2
    return window * (window - 1) // 2 + (n - window) * window


# --------------------------------------------------------------------------- prediction


@dataclass(frozen=True)
class SpeedPrediction:
    prompt_tokens: int
    prefill_tokens_per_s: float  # the whole prompt's mean rate
    decode_tokens_per_s: float  # generating after the prompt (depth = prompt_tokens): the agent's answer
    decode_start_tokens_per_s: float  # generating at depth 0
    first_token_s: float
    basis: dict[str, str]

    def to_json(self) -> dict[str, Any]:
        return {"prompt_tokens": self.prompt_tokens,
                "prefill_tokens_per_s": round(self.prefill_tokens_per_s, 2),
                "decode_tokens_per_s": round(self.decode_tokens_per_s, 2),
                "decode_start_tokens_per_s": round(self.decode_start_tokens_per_s, 2),
                "first_token_s": round(self.first_token_s, 2),
                "basis": dict(self.basis)}

    def text(self) -> str:
        return (f"prefill {self.prefill_tokens_per_s:.0f} tok/s, first token {fmt_seconds(self.first_token_s)} "
                f"for {self.prompt_tokens} tokens, generation {self.decode_tokens_per_s:.1f} tok/s")


def fmt_seconds(s: float) -> str:
    if s < 90:
        return f"{s:.1f} s"
    return f"{s / 60:.1f} min"


def decode_tokens_per_s(model: ModelSpeedFacts, device: DeviceSpeedFacts, depth_tokens: int) -> float:
    read = model.weights_read_per_token_bytes + model.kv_read_bytes(depth_tokens)
    return device.read_bandwidth_bytes_per_s * device.decode_efficiency / read


def predict(model: ModelSpeedFacts, device: DeviceSpeedFacts, prompt_tokens: int) -> SpeedPrediction:
    """Prefill, time to first token and generation (at depth 0 and after the prompt) for an agent
    prompt of ``prompt_tokens`` tokens."""
    n = max(1, prompt_tokens)
    first_token_s = model.prompt_flops(n) / device.prefill_flops_per_s
    return SpeedPrediction(
        prompt_tokens=n, prefill_tokens_per_s=n / first_token_s,
        decode_tokens_per_s=decode_tokens_per_s(model, device, n),
        decode_start_tokens_per_s=decode_tokens_per_s(model, device, 0), first_token_s=first_token_s,
        basis={"bandwidth": device.bandwidth_basis,
               "efficiency": f"decode {device.decode_efficiency:g} of that bandwidth",
               "compute": device.compute_basis, "parameters": model.basis})


# --------------------------------------------------------------------------- the adapters


class Device(Protocol):
    """What speed reads of a probed device (planner/probe.py's Device has these fields; the registry
    sits below the planner, so it names the shape, not the class)."""

    @property
    def kind(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def read_bandwidth_bytes_per_s(self) -> int | None: ...
    @property
    def bandwidth_basis(self) -> str | None: ...
    @property
    def compute_threads(self) -> int | None: ...


def device_speed_facts(device: Device) -> DeviceSpeedFacts:
    """The probe's figures for ``device`` (bandwidth, threads), or the assumed ones an old probe
    file without them gets — the basis names which."""
    bw = device.read_bandwidth_bytes_per_s
    if device.kind == "cpu":
        threads = device.compute_threads or ASSUMED_HOST_THREADS
        bandwidth = float(bw) if bw else ASSUMED_HOST_BANDWIDTH_BYTES_PER_S
        bw_basis = (device.bandwidth_basis or "measured") if bw else (
            f"assumed {ASSUMED_HOST_BANDWIDTH_BYTES_PER_S / GB:.0f} GB/s: the probe did not measure this host "
            "(an old probe file); run 'hotfit probe' on it")
        compute_basis = (f"{threads} threads x {CPU_PREFILL_FLOPS_PER_THREAD / GB:.0f} GFLOP/s per thread "
                         f"(fitted on an AVX-512 Zen 5 with Q4_K: docs/benchmarks.md)"
                         + ("" if device.compute_threads else "; threads assumed: not probed"))
        return DeviceSpeedFacts("cpu", bandwidth, CPU_DECODE_BANDWIDTH_EFFICIENCY,
                                threads * CPU_PREFILL_FLOPS_PER_THREAD, f"{bandwidth / GB:.1f} GB/s, {bw_basis}",
                                compute_basis)
    bandwidth = float(bw) if bw else ASSUMED_GPU_BANDWIDTH_BYTES_PER_S
    bw_basis = (device.bandwidth_basis or "probed") if bw else (
        f"assumed {ASSUMED_GPU_BANDWIDTH_BYTES_PER_S / GB:.0f} GB/s: the probe could not read this GPU's "
        "memory clock and bus width")
    return DeviceSpeedFacts(device.kind, bandwidth, GPU_DECODE_BANDWIDTH_EFFICIENCY,
                            bandwidth * GPU_PREFILL_FLOPS_PER_BYTE, f"{bandwidth / GB:.0f} GB/s, {bw_basis}",
                            f"{GPU_PREFILL_FLOPS_PER_BYTE:g} FLOP per byte of bandwidth (estimated, not measured "
                            "on a GPU)")


def estimated_query_width(active_params: float, n_layers: int) -> int:
    """The registry records KV heads, not query heads: a transformer layer holds about 12 d^2
    parameters (attention 4 d^2, FFN 8 d^2), and query heads x head dim is about d."""
    return max(1, int(round(math.sqrt(active_params / (12 * max(1, n_layers))))))


def model_speed_facts(entry: Entry, cache_type: KVCacheType) -> ModelSpeedFacts | None:
    """The registry's figures for ``entry``: active parameters (MoE) x the quant's bytes per weight
    (artifact bytes / total parameters), the KV geometry at ``cache_type``. None when a figure is
    not recorded (the prediction is then absent, never invented)."""
    total_b, weights = entry.params_total_b, entry.weights_bytes
    groups = entry.config.layer_groups
    if not total_b or not weights or not groups:
        return None
    active_b = entry.params_active_b or total_b
    bytes_per_weight = weights / (total_b * GB)
    n_layers = entry.config.n_layers or sum(g.count for g in groups)
    width = estimated_query_width(active_b * GB, n_layers)
    attention = tuple(AttentionGroup(g.count, width, cache_type.row_bytes(g.n_kv_heads * g.head_dim_k)
                                     + cache_type.row_bytes(g.n_kv_heads * g.head_dim_v), g.window_tokens)
                      for g in groups)
    moe = f"{active_b:g}B active of {total_b:g}B (MoE)" if active_b != total_b else f"{total_b:g}B (dense)"
    basis = (f"{moe} parameters x {bytes_per_weight:.3f} bytes/weight (artifact bytes / parameters); "
             f"query width ~{width} estimated from parameters per layer; KV at {cache_type.name}")
    return ModelSpeedFacts(active_b * GB * bytes_per_weight, active_b * GB, attention, basis)


# --------------------------------------------------------------------------- floors


@dataclass(frozen=True)
class SpeedFloors:
    """Opt-in requirements (``--min-decode-tokens-per-s``, ``--max-first-token-s``, ``--min-context``)."""

    min_decode_tokens_per_s: float | None = None
    max_first_token_s: float | None = None
    min_context_tokens: int | None = None  # at least the spec's 32768

    @property
    def any_speed(self) -> bool:
        return self.min_decode_tokens_per_s is not None or self.max_first_token_s is not None

    def to_json(self) -> dict[str, Any]:
        return {"min_decode_tokens_per_s": self.min_decode_tokens_per_s, "max_first_token_s": self.max_first_token_s,
                "min_context_tokens": self.min_context_tokens}

    def flags(self) -> str:
        """The floors set, as the flags that set them: '--min-decode-tokens-per-s 10; --min-context 65536'."""
        return "; ".join(f"{flag} {x:g}" for flag, x in (("--min-decode-tokens-per-s", self.min_decode_tokens_per_s),
                                                         ("--max-first-token-s", self.max_first_token_s),
                                                         ("--min-context", self.min_context_tokens)) if x is not None)

    def over(self, min_decode_tokens_per_s: float | None, max_first_token_s: float | None) -> SpeedFloors:
        """These floors (the flags) over the environment's: a flag wins over its variable."""
        return SpeedFloors(self.min_decode_tokens_per_s if self.min_decode_tokens_per_s is not None
                           else min_decode_tokens_per_s,
                           self.max_first_token_s if self.max_first_token_s is not None else max_first_token_s,
                           self.min_context_tokens)


def speed_shortfalls(p: SpeedPrediction, floors: SpeedFloors, *, word: str = "predicted") -> tuple[str, ...]:
    """Each floor ``p`` misses, naming the figures: 'predicted 4.1 generated tokens/s < 10'."""
    out = []
    if floors.min_decode_tokens_per_s is not None and p.decode_tokens_per_s < floors.min_decode_tokens_per_s:
        out.append(f"{word} {p.decode_tokens_per_s:.1f} generated tokens/s < {floors.min_decode_tokens_per_s:g}")
    if floors.max_first_token_s is not None and p.first_token_s > floors.max_first_token_s:
        out.append(f"{word} first token after {p.first_token_s:.0f} s > {floors.max_first_token_s:g} s "
                   f"for a {p.prompt_tokens}-token prompt")
    return tuple(out)


@dataclass(frozen=True)
class SpeedRequest:
    """What the planner predicts for and holds candidates to, on one device."""

    device: DeviceSpeedFacts
    prompt_tokens: int = DEFAULT_AGENT_PROMPT_TOKENS
    floors: SpeedFloors = SpeedFloors()

    def predict(self, entry: Entry, cache_type: KVCacheType) -> SpeedPrediction | None:
        facts = model_speed_facts(entry, cache_type)
        if facts is None:
            return None
        p = predict(facts, self.device, self.prompt_tokens)
        if entry.layout.file_format != "GGUF":  # the constants were fitted on GGUF weights in llama.cpp's kernels
            p = replace(p, basis={**p.basis, "efficiency": f"{p.basis['efficiency']} (llama.cpp's, not measured "
                                                          f"for the {entry.backend} backend)"})
        return p


@dataclass(frozen=True)
class Calibration:
    """What a measurement on this machine taught the model: measured / predicted for prefill and
    decode, on one device with the bandwidth figure the probe had then, by one backend build (another
    device, a new probe figure, another backend or build resets it: kernels differ between builds
    and flavours), and where it came from (run, model, build)."""

    device_kind: str
    device_name: str
    read_bandwidth_bytes_per_s: int | None
    backend: str
    backend_build: str  # the backend's build identity (Backend.build_identity): facts and bytes
    backend_build_described: str
    prefill_factor: float
    decode_factor: float
    provenance: str

    def applies_to(self, device: Device) -> bool:
        return (device.kind, device.name, device.read_bandwidth_bytes_per_s) == (
            self.device_kind, self.device_name, self.read_bandwidth_bytes_per_s)

    def build_change(self, backend: str | None, build_now: tuple[str, str] | None) -> str | None:
        """Why this calibration does not hold for a plan on ``backend`` whose build is ``build_now``
        ((identity, description); None: no build found), or None when it was measured by that build."""
        if backend is not None and backend != self.backend:
            return f"measured with the {self.backend} backend, this plan runs {backend}"
        if build_now is None:
            return f"measured with {self.backend_build_described}; no {self.backend} build is found now"
        if build_now[0] != self.backend_build:
            same = " (the same version, other bytes: a rebuild)" if build_now[1] == self.backend_build_described else ""
            return f"measured with {self.backend_build_described}, the build now is {build_now[1]}{same}"
        return None

    def apply(self, facts: DeviceSpeedFacts) -> DeviceSpeedFacts:
        note = f"; calibrated x{{:.2f}} by {self.provenance}"
        return replace(facts, decode_efficiency=facts.decode_efficiency * self.decode_factor,
                       prefill_flops_per_s=facts.prefill_flops_per_s * self.prefill_factor,
                       bandwidth_basis=facts.bandwidth_basis + note.format(self.decode_factor),
                       compute_basis=facts.compute_basis + note.format(self.prefill_factor))

    def ignored(self, facts: DeviceSpeedFacts, why: str) -> DeviceSpeedFacts:
        """``facts`` uncalibrated, the basis saying which calibration was set aside and why."""
        note = f"; not calibrated: this machine's calibration ({self.provenance}) was {why}"
        return replace(facts, bandwidth_basis=facts.bandwidth_basis + note, compute_basis=facts.compute_basis + note)


def calibration_from(device: Device, backend: str, build: tuple[str, str], predicted: dict[str, Any],
                     measured: dict[str, Any], provenance: str) -> Calibration | None:
    """measured / predicted rates as a calibration of ``device`` by ``backend``'s ``build``
    ((identity, description)); the prompt lengths may differ: rates are compared, not times. None
    when a figure is missing."""
    try:
        prefill = float(measured["prefill_tokens_per_s"]) / float(predicted["prefill_tokens_per_s"])
        decode = float(measured["decode_tokens_per_s"]) / float(predicted["decode_tokens_per_s"])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    if not (prefill > 0 and decode > 0):
        return None
    return Calibration(device.kind, device.name, device.read_bandwidth_bytes_per_s, backend, build[0], build[1],
                       round(prefill, 4), round(decode, 4), provenance)


@dataclass(frozen=True)
class SpeedPlanning:
    """The run's speed inputs (``--agent-prompt-tokens`` and the floors), made a
    :class:`SpeedRequest` per device from the probe's figures and this machine's calibration.
    ``calibration_build_now``: (identity, description) of the build the calibration's backend would
    run on its device now (None: none found); the calibration holds only for that same build."""

    prompt_tokens: int = DEFAULT_AGENT_PROMPT_TOKENS
    floors: SpeedFloors = SpeedFloors()
    calibration: Calibration | None = None
    calibration_build_now: tuple[str, str] | None = None

    def calibration_set_aside(self, backend: str | None = None) -> str | None:
        """Why this machine's calibration holds for no plan on ``backend`` (None: any), or None."""
        if self.calibration is None:
            return None
        return self.calibration.build_change(backend, self.calibration_build_now)

    def on(self, device: Device, backend: str | None = None) -> SpeedRequest:
        """The request for candidates served by ``backend`` (None: the calibration's own) on ``device``."""
        facts = device_speed_facts(device)
        if self.calibration is not None and self.calibration.applies_to(device):
            why = self.calibration_set_aside(backend)
            facts = self.calibration.apply(facts) if why is None else self.calibration.ignored(facts, why)
        return SpeedRequest(facts, self.prompt_tokens, self.floors)
