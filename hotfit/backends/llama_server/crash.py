"""Why llama-server died by a signal, from what is known about the binary.

A server that dies by a signal while loading, warming up or answering (SIGSEGV, SIGILL, SIGBUS,
...) is diagnosed from its build (backend, native/generic, the ISA features its
``build-info.json`` records) against this CPU's flags, with the causes seen for that signal
(docs/builds.md, "Why no AMX anywhere", for ggml's AMX crash). Pure core: :func:`compare_isa`,
:func:`signal_known_causes`, :func:`diagnose_signal_death`; :func:`signal_death_report` reads the
CPU flags, the build record and the log of a running server.
"""

from __future__ import annotations

import json
import shlex
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from hotfit.backends.llama_server.discovery import BUILD_INFO_NAME, BuildInfo, build_info_from_json, install_command
from hotfit.core.isa import AMX_CPUINFO, MACRO_TO_CPUINFO, cpuinfo_flags, executable_features, missing_features

if TYPE_CHECKING:  # annotations only: process.py imports this module
    from hotfit.backends.llama_server.process import LoadedServer

__all__ = [
    "SIGNAL_LOG_TAIL_LINES",
    "IsaComparison",
    "compare_isa",
    "diagnose_signal_death",
    "signal_death_report",
    "signal_known_causes",
]

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
    missing = (tuple(missing_features(executable_features(recorded), cpu_flags))
               if recorded is not None and cpu_flags else ())
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
            # shader for head_dim 256 (Gemma 3); the same model runs with -fa off. And at random in
            # prompt processing with more than one of its threads, flash attention on or off (gdb:
            # libvulkan_lvp.so; every try with 8, never in 20 with LP_NUM_THREADS=1: docs/hardware.md)
            causes.append("a Vulkan driver bug in one of ggml's shaders (seen: Mesa's lavapipe 22.3.6 crashes in "
                          "flash attention for Gemma 3's head_dim 256, and at random in prompt processing with "
                          "more than one of its threads, which LP_NUM_THREADS=1 avoids; the backtrace ends in "
                          "the driver's library)")
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


