"""load: open the planned model in llama-server exactly as planned (issue 5 item 1).

llama.cpp's defaults can silently break a plan (``../shared/reference/anchors.md`` §4, §11):
``--fit`` (on by default) shrinks the context to 4096 or moves layers to the CPU, ``-np`` auto
(4 slots) divides ``-c`` across slots, a quantized V cache needs flash attention. So every
parameter the plan depends on is passed explicitly, and the process is a child we own:

- started in its own session/process group, with ``PR_SET_PDEATHSIG`` so that even a SIGKILL of
  hotfit takes it down;
- always reaped on leaving the context (success, error, cancellation, Ctrl-C): SIGTERM to the
  group, then SIGKILL after a grace period;
- its logs (JSONL with ``--log-jsonl`` when the build has it) go straight to files in the run
  directory, so they survive whatever happens to hotfit and :mod:`stages.recheck` can read the KV
  allocation from them.

The API key is random per start, handed over in the environment (``LLAMA_API_KEY``), never in
argv (world-readable in ``/proc/<pid>/cmdline``), never logged or stored by hotfit.

A server that dies by a signal while loading or warming up (SIGSEGV, SIGILL, SIGBUS, ...) is
diagnosed from what is known about the binary (backend, native/generic build, the ISA features its
``build-info.json`` records) against this CPU's flags, with the causes seen for that signal
(issue 9 item 6; ``../shared/reference/gpu-builds.md`` for ggml's AMX crash). Nothing is deleted
on a failed load: the verified weights stay in place and a rerun resumes at load.

Pure core: :func:`parse_server_features`, :func:`llama_server_argv`, :func:`parse_log_lines`,
:func:`diagnose_load_failure`, :func:`compare_isa`, :func:`diagnose_signal_death`. Effects:
:func:`probe_server_features`, :func:`open_server`.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import re
import secrets
import shlex
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Literal, Mapping, Sequence

import anyio
import httpx

from backends.llama_server import BUILD_INFO_NAME, BuildInfo, build_info_from_json, install_command
from core.errors import BackendError, LoadError
from core.isa import AMX_CPUINFO, MACRO_TO_CPUINFO, cpuinfo_flags, missing_features
from core.log import get_logger
from core.plan import Plan
from registry.kv import LLAMA_UBATCH_TOKENS

__all__ = [
    "API_KEY_ENV",
    "HEALTH_TIMEOUT_S",
    "LLAMA_BATCH_TOKENS",
    "LLAMA_UBATCH_TOKENS",
    "LOG_VERBOSITY",
    "QUANTIZED_KV_TYPES",
    "ServerFeatures",
    "TemplateUsed",
    "LogLine",
    "LoadedServer",
    "parse_server_features",
    "probe_server_features",
    "llama_server_argv",
    "new_api_key",
    "server_env",
    "device_env",
    "child_env",
    "parse_log_lines",
    "read_server_log",
    "relevant_log_lines",
    "diagnose_load_failure",
    "IsaComparison",
    "compare_isa",
    "signal_known_causes",
    "diagnose_signal_death",
    "signal_death_report",
    "template_used",
    "open_server",
]

log = get_logger()

# llama-server reads its API key from this variable (``--help``: "--api-key KEY ... (env:
# LLAMA_API_KEY)"), which keeps the key out of argv.
API_KEY_ENV = "LLAMA_API_KEY"
# Suffix of every generated key. At log verbosity 4 llama-server prints the key's last four
# characters ("api_keys: ****abcd"); a fixed suffix makes those four characters carry no secret.
_API_KEY_SUFFIX = "-hfk"

# Loading a large model from a cold disk takes minutes; a server that is not healthy after this
# long is reported as failed (with its log), never waited on forever.
HEALTH_TIMEOUT_S = 600.0
_HEALTH_POLL_S = 0.1
# After SIGTERM llama-server frees its buffers and exits within a second or two; a process still
# there after this grace period is killed.
TERM_GRACE_S = 10.0

# llama.cpp's own defaults, passed explicitly: the SWA cache holds window + n_ubatch cells
# (llama-kv-cache-iswa.cpp) and the compute buffer scales with n_ubatch, so these are plan facts;
# the micro-batch is registry.kv's, so the estimate and the command line cannot drift apart.
LLAMA_BATCH_TOKENS = 2048
# Verbosity 4 (trace) is the lowest at which libllama's INFO lines reach the log: common/log.cpp
# maps GGML_LOG_LEVEL_INFO to LOG_LEVEL_TRACE (4), and the default threshold is 3. The KV cache
# size records stages.recheck reads are such lines.
LOG_VERBOSITY = 4
# The prompt cache lives in host RAM (default 8192 MiB) outside the plan's budget: disabled, so
# the opened session holds only what was planned (a CPU plan's budget *is* host RAM).
PROMPT_CACHE_RAM_MIB = 0

# ggml cache types whose V cache needs flash attention (llama-context.cpp: "enabling flash_attn
# since it is required for quantized V cache"; anchors.md §4).
QUANTIZED_KV_TYPES = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})

STDOUT_LOG_JSONL = "llama-server.jsonl"
STDOUT_LOG_TEXT = "llama-server.log"
STDERR_LOG = "llama-server.stderr.log"

TemplateKind = Literal["file", "embedded", "fallback", "unknown"]


# ---------------------------------------------------------------- pure core


@dataclass(frozen=True)
class ServerFeatures:
    """What this llama-server build accepts, read from its ``--help`` (flags drift between builds)."""

    log_jsonl: bool  # --log-jsonl
    fit: bool  # --fit [on|off]
    ngl_all: bool  # -ngl accepts 'all'
    api_key_env: bool  # --api-key reads LLAMA_API_KEY
    api_key_file: bool  # --api-key-file
    cache_ram: bool  # -cram / --cache-ram
    offline: bool  # --offline
    verbosity: bool  # -lv / --log-verbosity
    flash_attn_values: bool  # -fa takes on|off|auto (older builds: bare switch)


def parse_server_features(help_text: str) -> ServerFeatures:
    """Pure: which flags ``llama-server --help`` lists."""

    def has(flag: str) -> bool:
        return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", help_text) is not None

    ngl = re.search(r"--n-gpu-layers N\s+(.*?)\(default", help_text, re.S)
    api_key = re.search(r"--api-key KEY.*?\(env: (\w+)\)", help_text, re.S)
    return ServerFeatures(
        log_jsonl=has("--log-jsonl"),
        fit=has("--fit"),
        ngl_all=bool(ngl and "'all'" in ngl.group(1)),
        api_key_env=bool(api_key and api_key.group(1) == API_KEY_ENV),
        api_key_file=has("--api-key-file"),
        cache_ram=has("--cache-ram"),
        offline=has("--offline"),
        verbosity=has("--log-verbosity"),
        flash_attn_values=re.search(r"--flash-attn \[on\|off\|auto\]", help_text) is not None,
    )


def llama_server_argv(
    plan: Plan,
    model_path: Path,
    template_path: Path | None,
    port: int,
    *,
    binary: Path,
    features: ServerFeatures,
    host: str = "127.0.0.1",
    api_key_file: Path | None = None,
    threads: int | None = None,
    warmup: bool = True,
) -> list[str]:
    """The full llama-server command line for ``plan`` (pure; ``hotfit serve`` reuses it).

    The API key is *not* in argv: pass it with :func:`server_env`, or name a key file
    (``api_key_file``, for a long-running ``hotfit serve``)."""
    kv = plan.kv_cache_type
    accelerator = plan.probe.device.kind != "cpu"
    argv = [
        str(binary),
        "-m", str(model_path),
        "--jinja",
        "-c", str(plan.hot_context_tokens),
        "-ctk", kv,
        "-ctv", kv,
        # A quantized V cache needs flash attention; otherwise let llama.cpp choose per device
        # (auto = on where the backend supports it; it does not change the KV size).
        "-fa", "on" if kv in QUANTIZED_KV_TYPES else "auto",
        "-np", "1",  # one slot: -np N divides -c by N (anchors.md §4 "Slots gotcha")
        "-b", str(LLAMA_BATCH_TOKENS),
        "-ub", str(LLAMA_UBATCH_TOKENS),
        "--host", host,
        "--port", str(port),
    ]  # fmt: skip
    if template_path is not None:
        argv += ["--chat-template-file", str(template_path)]
    if accelerator:
        argv += ["-ngl", "all" if features.ngl_all else "999"]
        ggml_device = plan.probe.device.ggml_device
        if ggml_device and plan.probe.device.kind in ("vulkan", "amd"):
            # Only a Vulkan build serves these kinds: pin it to the probed device by ggml's name
            # (NVIDIA is pinned by UUID in the environment, which CUDA and Vulkan builds differ on).
            argv += ["-dev", ggml_device]
    else:
        argv += ["-ngl", "0", "-dev", "none"]  # CPU plan: nothing offloaded, no accelerator touched
    if features.fit:
        argv += ["--fit", "off"]  # the plan decides context and placement, not llama.cpp's fit
    if features.cache_ram:
        argv += ["--cache-ram", str(PROMPT_CACHE_RAM_MIB)]
    if features.offline:
        argv += ["--offline"]  # the model is local; never let the server reach the network
    if features.log_jsonl:
        argv += ["--log-jsonl"]
    if features.verbosity:
        argv += ["-lv", str(LOG_VERBOSITY)]
    if api_key_file is not None:
        argv += ["--api-key-file", str(api_key_file)]
    if threads is not None:
        argv += ["-t", str(threads)]
    if not warmup:
        argv += ["--no-warmup"]
    return argv


def new_api_key() -> str:
    return secrets.token_urlsafe(32) + _API_KEY_SUFFIX


def server_env(api_key: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ours, minus llama.cpp's ``LLAMA_ARG_*`` overrides (they would
    silently change what argv says), plus the API key."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("LLAMA_ARG_")}
    env.pop("LLAMA_API_KEY", None)
    env[API_KEY_ENV] = api_key
    return env


def device_env(plan: Plan) -> dict[str, str]:
    """Pin an NVIDIA plan to the probed card: CUDA numbering need not match NVML's, a UUID does."""
    device = plan.probe.device
    uuid = getattr(device, "uuid", None)
    if device.kind == "nvidia" and uuid:
        return {"CUDA_VISIBLE_DEVICES": str(uuid)}
    return {}


def child_env(plan: Plan, api_key: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The one environment every llama-server hotfit starts gets (the load stage and ``hotfit
    serve`` both build it here, so a served model runs on the card it was verified on): ``base``
    (default ours) without ``LLAMA_ARG_*`` overrides or a stale key, the API key when given
    (None: the caller names a key file in argv, or runs without one), and the plan's device pin."""
    env = server_env(api_key or "", dict(os.environ if base is None else base))
    if api_key is None:
        env.pop(API_KEY_ENV, None)
    return env | device_env(plan)


@dataclass(frozen=True)
class LogLine:
    level: str  # "info" | "warn" | "error" | "debug" | "output" | "" (plain text: unknown)
    msg: str  # one line, no trailing newline


def parse_log_lines(text: str) -> list[LogLine]:
    """Pure: llama-server log text → lines. JSONL records (``{"type":"log","level",...,"msg"}``)
    and plain text (stderr, builds without ``--log-jsonl``) are both accepted."""
    out: list[LogLine] = []
    for raw in text.splitlines():
        raw = raw.rstrip()
        if not raw:
            continue
        if raw.startswith("{"):
            try:
                rec = json.loads(raw)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                if rec.get("type") == "log":
                    for part in str(rec.get("msg", "")).splitlines():
                        if part.strip():
                            out.append(LogLine(str(rec.get("level", "")), part.rstrip()))
                else:  # typed records (e.g. fit_memory_breakdown): keep them, as JSON text
                    out.append(LogLine(str(rec.get("type", "")), raw))
                continue
        out.append(LogLine("", raw))
    return out


_FAILURE_RE = re.compile(
    r"error|failed|failure|unknown model architecture|out of memory|cannot|unable|abort|invalid|"
    r"terminate|exception|not supported|unsupported",
    re.I,
)


def relevant_log_lines(lines: Sequence[LogLine], limit: int = 12) -> list[str]:
    """The lines that say why a load failed: errors and warnings first; else the log's tail."""
    picked = [
        ln.msg for ln in lines if ln.level in ("error", "warn") or (ln.level == "" and _FAILURE_RE.search(ln.msg))
    ]
    picked = [m for m in picked if "no API key is set" not in m]  # our key is set; noise otherwise
    if not picked:
        picked = [ln.msg for ln in lines]
    return picked[-limit:]


_CAUSES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    (
        "unsupported_architecture",
        re.compile(r"unknown model architecture", re.I),
        "this llama-server build does not support the model's architecture: the registry entry "
        "must not be auto-eligible for this backend, or build a llama.cpp that supports it",
    ),
    (
        "out_of_memory",
        re.compile(r"out of memory|insufficient memory|failed to allocate|cudaMalloc|unable to allocate|alloc.*failed|OOM", re.I),
        "the device did not have the memory the plan counted on (another process may hold it): "
        "free memory, or re-plan (`hotfit plan`) against the memory free now",
    ),
    (
        "bad_model_file",
        re.compile(r"gguf_init|invalid magic|failed to read|tensor .* data is not within|corrupt|"
                   r"error loading model|failed to load model", re.I),
        "the model file is not a valid GGUF for this build: re-run verify (`hotfit pull NAME`), "
        "which re-downloads a file whose hash does not match",
    ),
    (
        "bad_chat_template",
        re.compile(r"chat template|jinja", re.I),
        "the chat template did not parse in llama-server: re-fetch it (`hotfit pull NAME`)",
    ),
    (
        "port_in_use",
        re.compile(r"couldn't bind|address already in use", re.I),
        "another process took the port; retry",
    ),
)


def diagnose_load_failure(lines: Sequence[LogLine]) -> tuple[str, str]:
    """Pure: (cause, hint) for a failed start, from the first matching error/warning line."""
    candidates = [ln.msg for ln in lines if ln.level in ("error", "warn", "")]
    for cause, pattern, hint in _CAUSES:
        if any(pattern.search(m) for m in candidates):
            return cause, hint
    return "unknown", "read the quoted llama-server log lines; the full log is in the run directory"


# The ISA names a compiler can target (core.isa): the part of /proc/cpuinfo's flags that says
# which binaries this CPU can run. The rest (vmx, hypervisor, ...) says nothing about a crash.
_ISA_NAMES = frozenset(MACRO_TO_CPUINFO.values())
_SIGNAL_WORDS = {
    "SIGSEGV": "segmentation fault",
    "SIGILL": "illegal instruction",
    "SIGBUS": "bus error",
    "SIGFPE": "arithmetic exception",
    "SIGABRT": "abort",
    "SIGKILL": "killed",
}
# How many of the server's last log lines a signal diagnosis quotes: the crash is at the end.
SIGNAL_LOG_TAIL_LINES = 12


@dataclass(frozen=True)
class IsaComparison:
    """The binary's recorded ISA build against this CPU (cpuinfo names, sorted)."""

    recorded: tuple[str, ...] | None  # what the CPU code was compiled for; None: no record
    cpu_isa: tuple[str, ...]  # this CPU's ISA features; () when /proc/cpuinfo lists no flags
    missing: tuple[str, ...]  # recorded, not on this CPU (SIGILL material)
    amx_on_cpu: tuple[str, ...]  # AMX features this CPU has
    amx_in_build: tuple[str, ...] | None  # AMX features the build uses; None: unknown

    @property
    def amx_compiled_out(self) -> bool:
        return bool(self.amx_on_cpu) and self.amx_in_build == ()


def compare_isa(build: BuildInfo | None, cpu_flags: frozenset[str]) -> IsaComparison:
    """Pure: which recorded features this CPU lacks, and where AMX stands on each side."""
    recorded = tuple(sorted(build.cpu_features)) if build is not None and build.cpu_features is not None else None
    cpu_isa = tuple(sorted(cpu_flags & _ISA_NAMES))
    missing = tuple(missing_features(recorded, cpu_flags)) if recorded is not None and cpu_flags else ()
    amx_in_build = tuple(f for f in recorded if f in AMX_CPUINFO) if recorded is not None else None
    return IsaComparison(recorded, cpu_isa, missing, tuple(sorted(cpu_flags & AMX_CPUINFO)), amx_in_build)


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def signal_known_causes(sig: int, build: BuildInfo | None, isa: IsaComparison) -> list[str]:
    """Pure: the causes seen for a load that died by ``sig``, most likely first for this binary
    and CPU. Causes the facts rule out are left out (AMX on a build that compiled it out)."""
    name = _signal_name(sig)
    backend = build.backend if build is not None else None
    gpu = backend in ("cuda", "vulkan") or backend is None
    causes: list[str] = []
    if name == "SIGSEGV":
        if isa.amx_on_cpu and isa.amx_in_build != ():
            uses = ("the build uses them" if isa.amx_in_build
                    else "the build records no ISA features, so it may use them")
            causes.append("ggml's AMX kernels segfault at warm-up on quantized GGUFs on CPUs with AMX "
                          f"(llama.cpp#20824); this CPU has {', '.join(isa.amx_on_cpu)} and {uses}")
        if gpu:
            causes.append("a GPU driver that does not match the runtime the binary was built against "
                          "(CUDA: a driver older than the toolkit; Vulkan: another loader or ICD)")
        if backend in ("vulkan", None):
            # seen here: Mesa lavapipe 22.3.6 dies in its own thread running ggml's flash-attention
            # shader for head_dim 256 (Gemma 3); the same model runs with -fa off
            causes.append("a Vulkan driver bug in one of ggml's shaders (seen: Mesa's lavapipe 22.3.6 crashes in "
                          "flash attention for Gemma 3's head_dim 256; the backtrace ends in the driver's library)")
        causes.append("a llama.cpp bug with this model's architecture or tensor types: the backtrace says where")
    elif name == "SIGILL":
        if isa.missing:
            causes.append(f"the binary executes instructions this CPU lacks: {', '.join(isa.missing)} "
                          "(built on or for another CPU)")
        elif isa.recorded is None:
            causes.append("the binary was built for another CPU; it records no ISA features to compare "
                          "(not built by scripts/install-llama-server here)")
        elif not isa.cpu_isa:
            causes.append(f"the binary was built for {', '.join(isa.recorded)}, which this CPU may lack "
                          "(its flags are unknown)")
        else:
            causes.append("an instruction outside the recorded ISA build (the binary was replaced after its "
                          "build-info.json was written, or built with flags beyond it)")
        causes.append("a trap in the code (an unreachable branch reached): the backtrace says where")
    elif name == "SIGBUS":
        causes += [
            ("the model file shrank or changed while llama-server had it memory-mapped "
             "(another process writing or copying over it)"),
            "an I/O error reading the mapped file (a failing disk, a network filesystem that dropped)",
            "a full tmpfs or hugetlbfs backing the mapping",
        ]
    elif name == "SIGABRT":
        causes.append("llama.cpp stopped on a failed check (GGML_ASSERT, GGML_ABORT) or an uncaught "
                      "C++ exception: the log lines name it")
        if gpu:
            causes.append("a GPU runtime error (CUDA error, Vulkan device lost) reported as an abort")
    elif name == "SIGFPE":
        causes.append("an integer division by zero in llama.cpp, usually from a model header value of 0")
    elif name == "SIGKILL":
        causes += [("the kernel's OOM killer: memory the plan counted on was taken "
                    "(`journalctl -k | grep -i 'killed process'` says)"),
                   "another process or the operator killed it"]
    else:
        causes.append(f"{name} came from outside (another process, the operator, a supervisor)")
    return causes


def _isa_lines(build: BuildInfo | None, isa: IsaComparison) -> list[str]:
    if isa.recorded is None:
        built = "the binary records no ISA features (no build-info.json with cpu_features)"
    else:
        built = f"built for {len(isa.recorded)} ISA features: {', '.join(isa.recorded) or 'none'}"
    if not isa.cpu_isa:
        cpu = "this CPU's flags are unknown (no flags line in /proc/cpuinfo)"
    elif isa.missing:
        cpu = f"this CPU lacks {', '.join(isa.missing)}"
    elif isa.recorded is not None:
        cpu = "this CPU has all of them"
    else:
        cpu = "nothing to compare this CPU against"
    lines = [f"ISA: {built}; {cpu}"]
    if isa.recorded is None or not isa.cpu_isa:
        lines.append(f"this CPU's ISA features: {', '.join(isa.cpu_isa) or 'unknown'}")
    else:  # the rest is the list above: name only what the CPU has and the build leaves unused
        extra = sorted(set(isa.cpu_isa) - set(isa.recorded))
        lines.append(f"this CPU's ISA features the build does not use: {', '.join(extra) or 'none'}")
    if isa.amx_on_cpu:
        if isa.amx_compiled_out:
            amx = "the build compiled ggml's AMX kernels out, so they are not the cause"
        elif isa.amx_in_build:
            amx = f"the build uses {', '.join(isa.amx_in_build)}"
        else:
            amx = "whether the build uses it is unknown"
        lines.append(f"AMX: this CPU has {', '.join(isa.amx_on_cpu)}; {amx}")
    return lines


def diagnose_signal_death(
    sig: int,
    build: BuildInfo | None,
    cpu_flags: frozenset[str],
    log_lines: Sequence[str],
    *,
    binary: Path,
    argv: Sequence[str] = (),
    model_name: str | None = None,
    during: str = "while loading or warming up the model",
) -> tuple[str, str]:
    """Pure: (message, hint) for a llama-server that died by signal ``sig`` ``during`` a stage
    (by default: before it was healthy).

    The message names the signal, the binary (path, backend, variant), its recorded ISA build
    against this CPU's flags, the known causes for that signal and the log tail; the hint names
    the fix and how to get a backtrace."""
    name = _signal_name(sig)
    isa = compare_isa(build, cpu_flags)
    backend = build.backend if build is not None else None
    described = build.describe() if build is not None else "no build record"
    words = _SIGNAL_WORDS.get(name)
    out = [f"llama-server killed by {name}{f' ({words})' if words else ''} {during}",
           f"binary: {binary} ({described})", *_isa_lines(build, isa), f"known causes of {name}:"]
    out += [f"  - {c}" for c in signal_known_causes(sig, build, isa)]
    tail = list(log_lines)[-SIGNAL_LOG_TAIL_LINES:]
    out.append("llama-server's last log lines:" if tail else "llama-server wrote no log lines")
    out += [f"    {m}" for m in tail]

    rebuild = f"`{install_command(backend or 'cpu')} --force`"
    if name == "SIGILL":
        fix = f"rebuild llama-server on this machine: {rebuild}"
    elif name == "SIGSEGV" and isa.amx_on_cpu and isa.amx_in_build != ():
        fix = f"rebuild with AMX compiled out (the current script does): {rebuild}"
    elif name == "SIGBUS":
        fix = ("make sure nothing else writes the model file and the disk is healthy (`dmesg`), then "
               f"re-verify it (`hotfit pull {model_name or 'NAME'}`)")
    elif name == "SIGKILL":
        fix = "free memory, or re-plan against what is free now (`hotfit plan`), then rerun"
    else:
        fix = f"rebuild llama-server: {rebuild}"
    if backend in ("cuda", "vulkan"):
        fix += ("; check the GPU driver (`nvidia-smi`, `vulkaninfo --summary`) or use the CPU build "
                f"(`{install_command('cpu')}`)")
    gdb = shlex.join(["gdb", "-batch", "-ex", "run", "-ex", "bt", "--args", *(argv or [str(binary)])])
    hint = (f"{fix}. If it still dies, get the backtrace with `{gdb}` and report it to llama.cpp with the log. "
            "The downloaded, verified files are kept: a rerun resumes at load without downloading again")
    return "\n    ".join(out), hint


@dataclass(frozen=True)
class TemplateUsed:
    """Which chat template the server formats with (named in a failed tool-call probe)."""

    kind: TemplateKind
    path: Path | None = None

    def describe(self) -> str:
        if self.kind == "file":
            return str(self.path)
        if self.kind == "embedded":
            return "embedded (the GGUF's tokenizer.chat_template)"
        if self.kind == "unknown":
            return "the GGUF's embedded template, or llama.cpp's ChatML fallback if it has none (header unreadable)"
        return "llama.cpp ChatML fallback (no template file, none embedded in the GGUF)"


def template_used(template_path: Path | None, gguf_has_template: bool | None) -> TemplateUsed:
    if template_path is not None:
        return TemplateUsed("file", template_path)
    if gguf_has_template is None:
        return TemplateUsed("unknown")
    return TemplateUsed("embedded" if gguf_has_template else "fallback")


# ---------------------------------------------------------------- effects


_features_cache: dict[tuple[str, int, int], ServerFeatures] = {}


async def probe_server_features(binary: Path) -> ServerFeatures:
    """Run ``llama-server --help`` once per binary (cached by path, size and mtime)."""
    st = binary.stat()
    key = (str(binary), st.st_size, st.st_mtime_ns)
    if key not in _features_cache:
        try:
            with anyio.fail_after(30):
                proc = await anyio.run_process([str(binary), "--help"], check=False)
        except TimeoutError:
            raise BackendError(f"`{binary} --help` did not answer within 30 s", binary=str(binary)) from None
        text = (proc.stdout or b"").decode(errors="replace") + (proc.stderr or b"").decode(errors="replace")
        _features_cache[key] = parse_server_features(text)
    return _features_cache[key]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_PR_SET_PDEATHSIG = 1
try:  # resolved here, in the parent: the forked child must not dlopen or import anything
    _prctl = ctypes.CDLL(None, use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the context manager's reaping still applies
    _prctl = None


def _child_setup(parent_pid: int) -> None:
    """Runs in the child between fork and exec: die with hotfit, even on SIGKILL (Linux)."""
    if _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    if os.getppid() != parent_pid:  # hotfit died before prctl took effect
        os._exit(1)


def read_server_log(run_dir: Path) -> list[LogLine]:
    """Every log line llama-server wrote into ``run_dir`` (stdout log, then stderr)."""
    lines: list[LogLine] = []
    for name in (STDOUT_LOG_JSONL, STDOUT_LOG_TEXT, STDERR_LOG):
        path = run_dir / name
        if path.is_file():
            lines += parse_log_lines(path.read_text(encoding="utf-8", errors="replace"))
    return lines


class LoadedServer:
    """A running llama-server opened by :func:`open_server` (valid inside the ``async with``)."""

    def __init__(
        self,
        *,
        process: subprocess.Popen[bytes],
        argv: list[str],
        host: str,
        port: int,
        api_key: str,
        run_dir: Path,
        log_path: Path,
        stderr_path: Path,
        template: TemplateUsed,
        features: ServerFeatures,
        plan: Plan,
        model_path: Path,
        load_seconds: float = 0.0,
        build: BuildInfo | None = None,
    ) -> None:
        self.process = process
        self.argv = tuple(argv)
        self.host = host
        self.port = port
        self._api_key = api_key
        self.run_dir = run_dir
        self.log_path = log_path
        self.stderr_path = stderr_path
        self.template = template
        self.features = features
        self.plan = plan
        self.model_path = model_path
        self.load_seconds = load_seconds
        self.build = build  # what the binary is (backend, ISA build); None: not known to the caller

    def __repr__(self) -> str:  # never show the key
        return f"LoadedServer(pid={self.pid}, base_url={self.base_url!r}, log={str(self.log_path)!r})"

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def auth_headers(self) -> dict[str, str]:
        # A build without LLAMA_API_KEY support runs keyless: an empty "Bearer " is an illegal header
        return {"Authorization": f"Bearer {self._api_key}"} if self._api_key else {}

    def client(self, timeout_s: float) -> httpx.AsyncClient:
        """An HTTP client for this server (authorised; proxies from the environment ignored)."""
        return httpx.AsyncClient(
            base_url=self.base_url, headers=self.auth_headers, timeout=timeout_s, trust_env=False
        )

    def returncode(self) -> int | None:
        return self.process.poll()

    def log_lines(self) -> list[LogLine]:
        return read_server_log(self.run_dir)

    def describe_exit(self) -> str:
        return _describe_returncode(self.process.poll())

    def to_json(self) -> dict[str, Any]:
        """What a stage record keeps (no key; argv holds none)."""
        return {
            "pid": self.pid,
            "base_url": self.base_url,
            "argv": list(self.argv),
            "log_path": str(self.log_path),
            "stderr_path": str(self.stderr_path),
            "template": {"kind": self.template.kind, "path": str(self.template.path) if self.template.path else None},
            "load_seconds": round(self.load_seconds, 3),
        }


def _describe_returncode(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


async def _reap(process: subprocess.Popen[bytes], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM the child's process group, SIGKILL it after ``grace_s``, wait until it is gone.
    Runs shielded: a cancelled caller still waits for the child to be reaped."""
    with anyio.CancelScope(shield=True):
        if process.poll() is None:
            _signal_group(process, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while process.poll() is None and time.monotonic() < deadline:
                await anyio.sleep(0.05)
            if process.poll() is None:
                _signal_group(process, signal.SIGKILL)
                log.warning("load.server_killed", pid=process.pid, grace_s=grace_s)
        while process.poll() is None:
            await anyio.sleep(0.02)
        # The group may still hold children of the server (none today); make sure of it.
        _signal_group(process, signal.SIGKILL)


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    try:
        os.killpg(process.pid, sig)  # start_new_session: the group id is the child's pid
    except (ProcessLookupError, PermissionError):
        pass


@contextlib.asynccontextmanager
async def open_server(
    plan: Plan,
    model_path: Path,
    *,
    binary: Path,
    run_dir: Path,
    template_path: Path | None = None,
    health_timeout_s: float = HEALTH_TIMEOUT_S,
    host: str = "127.0.0.1",
    threads: int | None = None,
    warmup: bool = True,
    build: BuildInfo | None = None,
    gguf_has_chat_template: bool | None = None,
) -> AsyncIterator[LoadedServer]:
    """Start llama-server for ``plan``, wait until ``/health`` answers 200, yield it, and always
    stop and reap it on leaving (normally, on error, on cancellation).

    Raises :class:`LoadError` quoting the relevant log lines when the server exits early or is
    not healthy within ``health_timeout_s``. ``build`` (``Backend.build`` from
    :func:`backends.llama_server.find_llama_server`) is what a death by signal is diagnosed against;
    without it the ``build-info.json`` beside ``binary`` is read, if there is one.
    ``gguf_has_chat_template`` is verify's reading of the GGUF header (``VerifyResult``): load never
    opens the weights itself; None (not known) describes the template as "embedded or ChatML"."""
    model_path = Path(model_path)
    if not model_path.is_file():
        raise LoadError(
            f"model file {model_path} does not exist",
            hint="run the fetch and verify stages first (`hotfit pull NAME`)",
            model_path=str(model_path),
        )
    if template_path is not None and not Path(template_path).is_file():
        raise LoadError(
            f"chat template {template_path} does not exist",
            hint="re-run fetch-template (`hotfit pull NAME`)",
            template_path=str(template_path),
        )
    features = await probe_server_features(binary)
    run_dir.mkdir(parents=True, exist_ok=True)
    template = template_used(template_path, gguf_has_chat_template)
    if not features.log_jsonl:
        log.warning("load.no_log_jsonl", binary=str(binary), note="capturing plain-text logs")
    if not features.api_key_env:
        log.warning("load.api_key_env_unsupported", binary=str(binary), note="server runs without an API key")

    api_key = new_api_key()
    env = child_env(plan, api_key)
    if not features.api_key_env:  # older build: no key at all rather than one in argv
        env.pop(API_KEY_ENV, None)
        api_key = ""

    attempts = 3  # a free port can be taken between our probe and the server's bind
    for attempt in range(1, attempts + 1):
        port = free_port(host)
        argv = llama_server_argv(
            plan, model_path, template_path, port, binary=binary, features=features, host=host,
            threads=threads, warmup=warmup,
        )  # fmt: skip
        log_path = run_dir / (STDOUT_LOG_JSONL if features.log_jsonl else STDOUT_LOG_TEXT)
        stderr_path = run_dir / STDERR_LOG
        log.info(
            "load.start",
            argv=argv,
            log_path=str(log_path),
            template=template.describe(),
            hot_context_tokens=plan.hot_context_tokens,
            kv_cache_type=plan.kv_cache_type,
            attempt=attempt,
        )
        started = time.monotonic()
        with open(log_path, "wb") as out, open(stderr_path, "wb") as err:
            parent = os.getpid()
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                start_new_session=True,
                preexec_fn=lambda: _child_setup(parent),
            )
        server = LoadedServer(
            process=process, argv=argv, host=host, port=port, api_key=api_key, run_dir=run_dir,
            log_path=log_path, stderr_path=stderr_path, template=template, features=features,
            plan=plan, model_path=model_path, build=build,
        )  # fmt: skip
        try:
            try:
                await _wait_healthy(server, health_timeout_s)
            except LoadError as exc:
                if exc.details.get("cause") == "port_in_use" and attempt < attempts:
                    log.warning("load.port_taken", port=port, attempt=attempt)
                    continue
                raise
            server.load_seconds = time.monotonic() - started
            log.info("load.healthy", pid=server.pid, port=port, load_seconds=round(server.load_seconds, 3))
            yield server
            return
        finally:
            await _reap(process)
            log.info("load.stopped", pid=process.pid, how=_describe_returncode(process.poll()))


async def _wait_healthy(server: LoadedServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(base_url=server.base_url, timeout=5.0, trust_env=False) as client:
        while True:
            code = server.returncode()
            if code is not None:
                await anyio.sleep(0.05)  # let the last log lines reach the file
                raise _load_error(server, f"llama-server {_describe_returncode(code)} before it was healthy")
            # The deadline is checked before each poll, so an answer that arrives after it (a
            # fast load on a slow machine included) never counts as healthy in time.
            if time.monotonic() >= deadline:
                raise _load_error(server, f"llama-server not healthy after {timeout_s:.0f} s")
            try:
                resp = await client.get("/health")
                if resp.status_code == 200 and server.returncode() is None:
                    return  # (a 200 while our child is dead would come from someone else's server)
            except httpx.TransportError:
                pass  # not listening yet
            await anyio.sleep(_HEALTH_POLL_S)


def _recorded_build(binary: Path) -> BuildInfo | None:
    """The ``build-info.json`` beside ``binary``, when the caller passed no build (None if absent)."""
    try:
        data = json.loads((binary.parent / BUILD_INFO_NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return build_info_from_json(data) if isinstance(data, dict) else None


def _cpu_flags(cpuinfo_path: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    try:
        return cpuinfo_flags(cpuinfo_path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return frozenset()


def signal_death_report(server: LoadedServer, sig: int, during: str) -> tuple[str, str, dict[str, Any]]:
    """(message, hint, details) for ``server`` dead by signal ``sig`` ``during`` a stage: the
    build it was started with (or the ``build-info.json`` beside it) against this CPU's flags."""
    binary = Path(server.argv[0])
    build = server.build if server.build is not None else _recorded_build(binary)
    flags = _cpu_flags()
    isa = compare_isa(build, flags)
    tail = [ln.msg for ln in server.log_lines() if "no API key is set" not in ln.msg][-SIGNAL_LOG_TAIL_LINES:]
    message, hint = diagnose_signal_death(sig, build, flags, tail, binary=binary, argv=server.argv,
                                          model_name=server.plan.entry.name, during=during)
    details: dict[str, Any] = {
        "signal": _signal_name(sig),
        "binary": str(binary),
        "backend": build.backend if build else None,
        "variant": build.variant if build else None,
        "build_cpu_features": list(isa.recorded) if isa.recorded is not None else None,
        "cpu_isa_features": list(isa.cpu_isa),
        "missing_cpu_features": list(isa.missing),
        "amx_on_cpu": list(isa.amx_on_cpu),
        "amx_compiled_out": isa.amx_compiled_out,
        "known_causes": signal_known_causes(sig, build, isa),
        "log_lines": tail,
        "returncode": server.returncode(),
    }
    return message, f"{hint}; full log: {server.log_path}", details


def _signal_error(server: LoadedServer, sig: int) -> LoadError:
    message, hint, details = signal_death_report(server, sig, "while loading or warming up the model")
    log.error("load.killed_by_signal", signal=details["signal"], binary=details["binary"],
              backend=details["backend"], variant=details["variant"],
              missing_cpu_features=details["missing_cpu_features"], log_path=str(server.log_path),
              lines=details["log_lines"])
    return LoadError(message, hint=hint, cause="killed_by_signal", log_path=str(server.log_path),
                     model_path=str(server.model_path), **details)


def _load_error(server: LoadedServer, what: str) -> LoadError:
    code = server.returncode()
    if code is not None and code < 0:  # died by a signal: the binary and the CPU are the suspects
        return _signal_error(server, -code)
    lines = server.log_lines()
    cause, hint = diagnose_load_failure(lines)
    quoted = relevant_log_lines(lines)
    log.error("load.failed", cause=cause, log_path=str(server.log_path), lines=quoted)
    body = "\n".join(f"    {m}" for m in quoted)
    return LoadError(
        f"{what} ({cause.replace('_', ' ')}); llama-server said:\n{body}",
        hint=f"{hint}; full log: {server.log_path}",
        cause=cause,
        log_lines=quoted,
        log_path=str(server.log_path),
        returncode=server.returncode(),
        model_path=str(server.model_path),
    )
