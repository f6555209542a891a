"""Predicted speed of one model on one device, before a byte is downloaded (pure: no I/O).

An agent's first prompt is large (a tool catalogue and instructions: 16k-26k tokens), so a model
that fits but reads that prompt for ten minutes is no agent (spec, "Selection and hot context": an
estimate that fits "is not a throughput guarantee: prefill and long-context inference still depend
on memory bandwidth and hardware execution support"). Two bounds, docs/benchmarks.md
("Predicted against measured speed") shows how close they come on real GGUFs:

- generation (decode): every generated token streams the active weights once and attends its KV
  cells, so a token takes ``active weight bytes / (bandwidth x efficiency)`` — or, where the CPU's
  threads cannot dequantize and multiply the weights that fast (one core, say),
  ``active weight bytes / (threads x a thread's decode rate)`` — plus the attention at that
  depth (the KV read, or on a CPU its f16 multiply-adds, ``4 x query width x cells`` a layer, whichever
  is slower), plus a fixed cost a layer (the graph's small kernels and thread hand-offs: it matters only
  for tiny models);
- prompt processing (prefill): compute bound, ``2 FLOPs x multiplied parameters`` per prompt token at the
  quantized matmuls' rate, plus attention, ``4 x query width x depth`` per layer (QK and PV; a
  sliding-window layer stops at its window), at the attention kernels' own, slower rate. Time to first
  token = the prompt's matmul time + its attention time.

Every figure carries its ``basis``: which bandwidth (measured, NVML's, or assumed), which efficiency
and which parameter count (MoE: active only) it rests on.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from typing import Any, Protocol

from hotfit.core.entry import Entry
from hotfit.registry.kv import KVCacheType

GB = 1e9

# --------------------------------------------------------------------------- constants
# The CPU constants were fitted on one quiet scripts/bench-speed run of the real test GGUFs (SmolLM2 Q4_1,
# Gemma 3 and Qwen2.5 Q4_K_M at prompt depths 512 to 16k; 2 threads of an AMD EPYC Zen 5 VM, 33.8 GB/s
# measured by the probe's readers) and checked on later runs, at 2 threads and at 1 (docs/benchmarks.md,
# "Predicted against measured speed").
# Decode streams the weights at this fraction of the host's read bandwidth (the probe's memchr readers).
CPU_DECODE_BANDWIDTH_EFFICIENCY = 0.71
# Each generated token also pays this much a layer, whatever the weights' size: a decode graph is
# ~20 small kernels a layer with a thread hand-off each (0.16 ms a layer fitted: 5 ms of SmolLM2's
# 11 ms a token, 3 % of a 7B model's).
CPU_DECODE_OVERHEAD_S_PER_LAYER = 1.6e-4
# Quantized matmul FLOP/s one llama-server thread sustains in a prompt batch (Q4_K: Qwen2.5 94, Gemma 3
# 76 GFLOP/s a thread at 512 tokens). Other quants reach a share of it (QUANT_MATMUL_EFFICIENCY).
CPU_PREFILL_FLOPS_PER_THREAD = 85e9
# Attention runs f16 kernels at its own rate: in a prompt batch (the QK and PV products over the cached
# depth; 62 GFLOP/s for 2 threads on all three models at 8k and 16k) and in decode, where one token's
# query meets every cached cell (14-23 GFLOP/s for 2 threads: compute, not the KV read, limits it).
CPU_ATTENTION_PREFILL_FLOPS_PER_THREAD = 31e9
CPU_ATTENTION_DECODE_FLOPS_PER_THREAD = 8.5e9
# A quant's matmul rate against Q4_K's, where measured: llama.cpp's CPU backend repacks Q4_0, Q4_K and
# IQ4_NL into interleaved kernels for prompt batches; Q4_1 has no such path (SmolLM2 Q4_1: 36 GFLOP/s a
# thread against 85); Qwen2.5 requantized to Q8_0 runs at Q4_K's rate. A quant not listed is taken at
# Q4_K's rate, and the basis says so.
QUANT_MATMUL_EFFICIENCY = {"Q4_K": 1.0, "Q4_1": 0.42, "Q8_0": 1.0}
# A CPU thread dequantizes and multiplies at most this many weight bytes a second in a decode step: with
# few threads that, not the memory bus, bounds generation. One core of the Zen 5 VM, two runs: Qwen2.5
# Q4_K 14 and 11 GB/s, its Q8_0 copy 10 and >= 19 (a shared core moves one run 30 %: the quants are the
# same within that), Gemma 3 14-18; taken at 13 for each of two threads (a lone one runs 1.2x: below).
# Two cores share ~23 GB/s of streamed bandwidth, so the bus binds first there.
CPU_DECODE_WEIGHT_BYTES_PER_S_PER_THREAD = 13e9
# A lone thread runs every compute term (matmuls, attention, the decode rate above) this much faster than
# each of two does: no barrier waits between a graph's ops, the caches to itself. One core's runs against
# two cores' on the same VM (docs/benchmarks.md); more threads are taken at two's rate a thread (not
# measured here: no machine with more cores).
CPU_LONE_THREAD_SPEEDUP = 1.2
# A GPU decode step reaches this fraction of NVML's peak bandwidth (clock x bus width). Not measured
# here (no GPU): llmfit's published factor (0.55) rounded up for llama.cpp's CUDA kernels; an estimate.
GPU_DECODE_BANDWIDTH_EFFICIENCY = 0.6
# A GPU's prefill FLOP/s per byte/s of its bandwidth: recent cards offer 150-300 dense f16 FLOPs per
# byte (H100 295, RTX 4090 165, RTX 3060 142) and llama.cpp's quantized matmuls reach about a third.
# Attention is taken at the same rate, decode attention as bandwidth bound, with no fixed cost a layer
# (the CUDA backend replays a decode graph). Not measured here (no GPU): estimates, and the basis says so.
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
    reads (MoE: the active experts only); ``matmul_params``: parameters multiplied per prompt token;
    ``matmul_efficiency``: its quant's matmul rate against Q4_K's (QUANT_MATMUL_EFFICIENCY);
    ``n_layers``: the blocks a decode step runs (None: the attention layers')."""

    weights_read_per_token_bytes: float
    matmul_params: float
    attention: tuple[AttentionGroup, ...]
    basis: str  # which parameter count and bytes per weight
    matmul_efficiency: float = 1.0
    n_layers: int | None = None

    @property
    def layers(self) -> int:
        return self.n_layers if self.n_layers is not None else sum(g.count for g in self.attention)

    def kv_read_bytes(self, depth_tokens: int) -> float:
        """KV bytes one decode step at ``depth_tokens`` reads (a window layer: its window at most)."""
        return float(sum(g.count * g.kv_bytes_per_token * _attended(depth_tokens, g.window_tokens)
                         for g in self.attention))

    def decode_attention_flops(self, depth_tokens: int) -> float:
        """FLOPs of one generated token's attention at ``depth_tokens``: QK and PV over its cells."""
        return float(sum(g.count * 4 * g.query_width * _attended(depth_tokens, g.window_tokens)
                         for g in self.attention))

    def prompt_matmul_flops(self, prompt_tokens: int) -> float:
        return 2.0 * self.matmul_params * prompt_tokens

    def prompt_attention_flops(self, prompt_tokens: int) -> float:
        """FLOPs of the prompt's attention over the growing depth (token d attends min(d, window) cells)."""
        return float(sum(g.count * 4 * g.query_width * _depth_sum(prompt_tokens, g.window_tokens)
                         for g in self.attention))


@dataclass(frozen=True)
class DeviceSpeedFacts:
    """What speed depends on in the device: its read bandwidth and compute rates, and their basis.
    ``attention_prefill_flops_per_s`` None: attention at the matmuls' rate; ``attention_decode_flops_per_s``
    None: decode attention is bound by the KV read alone; ``decode_weight_bytes_per_s``: weight bytes a
    second its threads dequantize and multiply in a decode step (None: the bandwidth alone bounds it)."""

    kind: str
    read_bandwidth_bytes_per_s: float
    decode_efficiency: float
    prefill_flops_per_s: float
    bandwidth_basis: str  # "measured ...", "NVML ...", "assumed ..."
    compute_basis: str
    attention_prefill_flops_per_s: float | None = None
    attention_decode_flops_per_s: float | None = None
    decode_overhead_s_per_layer: float = 0.0
    decode_weight_bytes_per_s: float | None = None

    def scaled(self, *, decode: float = 1.0, prefill: float = 1.0) -> DeviceSpeedFacts:
        """These facts with every decode term ``decode`` times as fast and every prefill term ``prefill``
        times (a calibration: measured / predicted rates on this device)."""
        def times(x: float | None, k: float) -> float | None:
            return None if x is None else x * k
        return replace(self, decode_efficiency=self.decode_efficiency * decode,
                       attention_decode_flops_per_s=times(self.attention_decode_flops_per_s, decode),
                       decode_overhead_s_per_layer=self.decode_overhead_s_per_layer / decode,
                       decode_weight_bytes_per_s=times(self.decode_weight_bytes_per_s, decode),
                       prefill_flops_per_s=self.prefill_flops_per_s * prefill,
                       attention_prefill_flops_per_s=times(self.attention_prefill_flops_per_s, prefill))


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
    streamed_bytes_per_s = device.read_bandwidth_bytes_per_s * device.decode_efficiency
    attention_s = model.kv_read_bytes(depth_tokens) / streamed_bytes_per_s
    if device.attention_decode_flops_per_s is not None:
        attention_s = max(attention_s, model.decode_attention_flops(depth_tokens) / device.attention_decode_flops_per_s)
    weights_bytes_per_s = streamed_bytes_per_s  # the bus, or the threads' dequantize-and-multiply rate
    if device.decode_weight_bytes_per_s is not None:
        weights_bytes_per_s = min(weights_bytes_per_s, device.decode_weight_bytes_per_s)
    token_s = (model.weights_read_per_token_bytes / weights_bytes_per_s + attention_s
               + model.layers * device.decode_overhead_s_per_layer)
    return 1.0 / token_s


def first_token_s(model: ModelSpeedFacts, device: DeviceSpeedFacts, prompt_tokens: int) -> float:
    """The prompt's matmuls at the quant's rate, plus its attention at the attention kernels' rate."""
    attention_rate = device.attention_prefill_flops_per_s or device.prefill_flops_per_s
    return (model.prompt_matmul_flops(prompt_tokens) / (device.prefill_flops_per_s * model.matmul_efficiency)
            + model.prompt_attention_flops(prompt_tokens) / attention_rate)


def predict(model: ModelSpeedFacts, device: DeviceSpeedFacts, prompt_tokens: int) -> SpeedPrediction:
    """Prefill, time to first token and generation (at depth 0 and after the prompt) for an agent
    prompt of ``prompt_tokens`` tokens."""
    n = max(1, prompt_tokens)
    first_s = first_token_s(model, device, n)
    return SpeedPrediction(
        prompt_tokens=n, prefill_tokens_per_s=n / first_s,
        decode_tokens_per_s=decode_tokens_per_s(model, device, n),
        decode_start_tokens_per_s=decode_tokens_per_s(model, device, 0), first_token_s=first_s,
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


def cpu_thread_units(threads: int) -> float:
    """What ``threads`` llama-server threads compute, in units of one of two threads' rates (the
    per-thread constants' unit): a lone thread runs CPU_LONE_THREAD_SPEEDUP of one."""
    return CPU_LONE_THREAD_SPEEDUP if threads == 1 else float(threads)


def device_speed_facts(device: Device) -> DeviceSpeedFacts:
    """The probe's figures for ``device`` (bandwidth, threads), or the assumed ones an old probe
    file without them gets — the basis names which."""
    bw = device.read_bandwidth_bytes_per_s
    if device.kind == "cpu":
        threads = device.compute_threads or ASSUMED_HOST_THREADS
        units = cpu_thread_units(threads)
        bandwidth = float(bw) if bw else ASSUMED_HOST_BANDWIDTH_BYTES_PER_S
        bw_basis = (device.bandwidth_basis or "measured") if bw else (
            f"assumed {ASSUMED_HOST_BANDWIDTH_BYTES_PER_S / GB:.0f} GB/s: the probe did not measure this host "
            "(an old probe file); run 'hotfit probe' on it")
        compute_basis = (f"{threads} threads x {CPU_PREFILL_FLOPS_PER_THREAD / GB:.0f} GFLOP/s per thread in "
                         f"matmuls, {CPU_ATTENTION_PREFILL_FLOPS_PER_THREAD / GB:.0f} in prompt attention, "
                         f"{CPU_ATTENTION_DECODE_FLOPS_PER_THREAD / GB:.1f} in decode attention, "
                         f"{CPU_DECODE_WEIGHT_BYTES_PER_S_PER_THREAD / GB:.0f} GB/s of weights in decode, "
                         f"{CPU_DECODE_OVERHEAD_S_PER_LAYER * 1e3:g} ms a layer a token (fitted on an AVX-512 Zen 5 "
                         "with Q4_K: docs/benchmarks.md)"
                         + (f"; x{CPU_LONE_THREAD_SPEEDUP:g}: a lone thread" if threads == 1 else "")
                         + ("" if device.compute_threads else "; threads assumed: not probed"))
        return DeviceSpeedFacts("cpu", bandwidth, CPU_DECODE_BANDWIDTH_EFFICIENCY,
                                units * CPU_PREFILL_FLOPS_PER_THREAD, f"{bandwidth / GB:.1f} GB/s, {bw_basis}",
                                compute_basis,
                                attention_prefill_flops_per_s=units * CPU_ATTENTION_PREFILL_FLOPS_PER_THREAD,
                                attention_decode_flops_per_s=units * CPU_ATTENTION_DECODE_FLOPS_PER_THREAD,
                                decode_overhead_s_per_layer=CPU_DECODE_OVERHEAD_S_PER_LAYER,
                                decode_weight_bytes_per_s=units * CPU_DECODE_WEIGHT_BYTES_PER_S_PER_THREAD)
    bandwidth = float(bw) if bw else ASSUMED_GPU_BANDWIDTH_BYTES_PER_S
    bw_basis = (device.bandwidth_basis or "probed") if bw else (
        f"assumed {ASSUMED_GPU_BANDWIDTH_BYTES_PER_S / GB:.0f} GB/s: the probe could not read this GPU's "
        "memory clock and bus width")
    return DeviceSpeedFacts(device.kind, bandwidth, GPU_DECODE_BANDWIDTH_EFFICIENCY,
                            bandwidth * GPU_PREFILL_FLOPS_PER_BYTE, f"{bandwidth / GB:.0f} GB/s, {bw_basis}",
                            f"{GPU_PREFILL_FLOPS_PER_BYTE:g} FLOP per byte of bandwidth (estimated, not measured "
                            "on a GPU)")


def quant_matmul_efficiency(quant_label: str | None) -> tuple[float, str]:
    """The matmul rate of the quant named in ``quant_label`` (a GGUF file type, or an artifact's file
    name: 'Q4_K_M', 'model-Q4_1.gguf') against Q4_K's, and what the basis says of it."""
    label = (quant_label or "").upper()
    for quant in sorted(QUANT_MATMUL_EFFICIENCY, key=len, reverse=True):
        if re.search(rf"(?<![A-Z0-9]){quant}(?![0-9])", label):
            factor = QUANT_MATMUL_EFFICIENCY[quant]
            return factor, ("" if factor == 1.0 else f"{quant} matmuls at {factor:g} of Q4_K's rate (measured)")
    return 1.0, "matmuls and a thread's decode rate taken at Q4_K's (this quant's not measured)"


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
    efficiency, quant_note = quant_matmul_efficiency(entry.artifact.file if entry.artifact else None)
    basis = (f"{moe} parameters x {bytes_per_weight:.3f} bytes/weight (artifact bytes / parameters); "
             f"query width ~{width} estimated from parameters per layer; KV at {cache_type.name}"
             + (f"; {quant_note}" if quant_note else ""))
    return ModelSpeedFacts(active_b * GB * bytes_per_weight, active_b * GB, attention, basis,
                           matmul_efficiency=efficiency, n_layers=n_layers)


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
        return replace(facts.scaled(decode=self.decode_factor, prefill=self.prefill_factor),
                       bandwidth_basis=facts.bandwidth_basis + note.format(self.decode_factor),
                       compute_basis=facts.compute_basis + note.format(self.prefill_factor))

    def ignored(self, facts: DeviceSpeedFacts, why: str) -> DeviceSpeedFacts:
        """``facts`` uncalibrated, the basis saying which calibration was set aside and why."""
        note = f"; not calibrated: this machine's calibration ({self.provenance}) was {why}"
        return replace(facts, bandwidth_basis=facts.bandwidth_basis + note, compute_basis=facts.compute_basis + note)


def calibration_from(device: Device, backend: str, build: tuple[str, str], predicted: dict[str, Any],
                     measured: dict[str, Any], provenance: str) -> Calibration | None:
    """measured / predicted rates as a calibration of ``device`` by ``backend``'s ``build``
    ((identity, description)); the prompt lengths may differ: rates are compared, not times. A rate
    the session did not measure (an answer that ended at its first token has no generation rate)
    keeps factor 1, said in the provenance; None when neither was."""
    factors = {key: _rate_factor(predicted, measured, key) for key in ("prefill_tokens_per_s", "decode_tokens_per_s")}
    if all(f is None for f in factors.values()):
        return None
    unmeasured = [key.removesuffix("_tokens_per_s") for key, f in factors.items() if f is None]
    note = f"; {' and '.join(unmeasured)} not measured (factor 1)" if unmeasured else ""
    return Calibration(device.kind, device.name, device.read_bandwidth_bytes_per_s, backend, build[0], build[1],
                       round(factors["prefill_tokens_per_s"] or 1.0, 4), round(factors["decode_tokens_per_s"] or 1.0, 4),
                       provenance + note)


def _rate_factor(predicted: dict[str, Any], measured: dict[str, Any], key: str) -> float | None:
    try:
        factor = float(measured[key]) / float(predicted[key])
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return factor if factor > 0 else None


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
