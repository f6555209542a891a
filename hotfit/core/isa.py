"""Which x86 (and Arm64) ISA features a binary was compiled for, and whether this CPU has them.

scripts/install-llama-server asks the compiler, with the exact flags ggml-cpu was compiled with,
which feature macros it defines (``c++ <flags> -dM -E``); this module maps those macros to the
names ``/proc/cpuinfo`` uses and records them in ``build-info.json``. Before a binary is started
hotfit compares the recorded names with this CPU's flags, so a binary copied to a machine that
lacks one fails with a message naming it instead of dying by SIGILL in the middle of a run.

Pure, standard library only: the install script runs it with the system ``python3`` before the
virtualenv exists (``python3 core/isa.py < macros``).
"""

from __future__ import annotations

import re
import sys
from typing import Iterable, Mapping

__all__ = [
    "MACRO_TO_CPUINFO",
    "ARM_MACRO_TO_HWCAP",
    "AMX_CPUINFO",
    "INTRINSIC_ONLY_CPUINFO",
    "executable_features",
    "GGML_VARIANT_SCORE_BITS",
    "ggml_cpu_variant",
    "features_from_macros",
    "cpuinfo_flags",
    "cpu_feature_names",
    "missing_features",
    "loaded_cpu_variant",
]

# GCC/Clang predefined macro -> /proc/cpuinfo flag. Only features a compiler can emit code for
# from -march/-m flags; where the kernel spells it differently the kernel's name is used.
MACRO_TO_CPUINFO: dict[str, str] = {
    "__SSE__": "sse",
    "__SSE2__": "sse2",
    "__SSE3__": "pni",
    "__SSSE3__": "ssse3",
    "__SSE4_1__": "sse4_1",
    "__SSE4_2__": "sse4_2",
    "__SSE4A__": "sse4a",
    "__POPCNT__": "popcnt",
    "__AES__": "aes",
    "__PCLMUL__": "pclmulqdq",
    "__AVX__": "avx",
    "__AVX2__": "avx2",
    "__FMA__": "fma",
    "__FMA4__": "fma4",
    "__F16C__": "f16c",
    "__BMI__": "bmi1",
    "__BMI2__": "bmi2",
    "__LZCNT__": "abm",
    "__MOVBE__": "movbe",
    "__ADX__": "adx",
    "__RDRND__": "rdrand",
    "__RDSEED__": "rdseed",
    "__SHA__": "sha_ni",
    "__VAES__": "vaes",
    "__VPCLMULQDQ__": "vpclmulqdq",
    "__GFNI__": "gfni",
    "__XSAVE__": "xsave",
    "__XSAVEOPT__": "xsaveopt",
    "__XSAVEC__": "xsavec",
    "__XSAVES__": "xsaves",
    "__CLFLUSHOPT__": "clflushopt",
    "__CLWB__": "clwb",
    "__AVX512F__": "avx512f",
    "__AVX512CD__": "avx512cd",
    "__AVX512BW__": "avx512bw",
    "__AVX512DQ__": "avx512dq",
    "__AVX512VL__": "avx512vl",
    "__AVX512IFMA__": "avx512ifma",
    "__AVX512VBMI__": "avx512vbmi",
    "__AVX512VBMI2__": "avx512_vbmi2",
    "__AVX512VNNI__": "avx512_vnni",
    "__AVX512BITALG__": "avx512_bitalg",
    "__AVX512VPOPCNTDQ__": "avx512_vpopcntdq",
    "__AVX512BF16__": "avx512_bf16",
    "__AVX512FP16__": "avx512_fp16",
    "__AVX512VP2INTERSECT__": "avx512_vp2intersect",
    "__AVXVNNI__": "avx_vnni",
    "__AVXIFMA__": "avx_ifma",
    "__AVXVNNIINT8__": "avx_vnni_int8",
    "__AVXNECONVERT__": "avx_ne_convert",
    "__AMX_TILE__": "amx_tile",
    "__AMX_INT8__": "amx_int8",
    "__AMX_BF16__": "amx_bf16",
    "__AMX_FP16__": "amx_fp16",
}

# ggml's AMX kernels crash on real quantized models (llama.cpp#20824): the build never uses them.
AMX_CPUINFO = frozenset({"amx_tile", "amx_int8", "amx_bf16", "amx_fp16"})

# Features a compiler enables with -march but never emits on its own: only a call of their
# intrinsics (or inline asm) puts these instructions in a binary, and ggml calls none of them
# (tests/test_portable_build.py disassembles the built binaries; GFNI is not here: GCC vectorises
# byte shifts with vgf2p8affineqb on its own, which that scan found in a native build). A CPU
# whose kernel hides one of them (Zen 5's rdseed, masked for AMD's RDSEED erratum) still runs a
# binary "built for" it: docs/hardware.md.
INTRINSIC_ONLY_CPUINFO = frozenset({
    "aes", "pclmulqdq", "vaes", "vpclmulqdq", "sha_ni",
    "rdrand", "rdseed", "adx",
    "xsave", "xsaveopt", "xsavec", "xsaves",
    "clflushopt", "clwb",
    "sse4a",  # EXTRQ/INSERTQ/MOVNTSS/MOVNTSD: builtins only
})

# Arm64: the compiler's ACLE macro -> the Linux hwcap name /proc/cpuinfo lists under "Features".
# Only what ggml's Arm variants are built for (and its scoring checks: ggml-cpu/arch/arm/cpu-feats.cpp)
# plus what GCC emits on its own at those -march levels (LSE atomics, scalar FP16); the rest an
# -march enables (crc32, rdm, bf16, jscvt, ...) is intrinsics only, as on x86. docs/builds.md.
ARM_MACRO_TO_HWCAP: dict[str, str] = {
    "__ARM_NEON": "asimd",
    "__ARM_FEATURE_ATOMICS": "atomics",
    "__ARM_FEATURE_DOTPROD": "asimddp",
    "__ARM_FEATURE_FP16_SCALAR_ARITHMETIC": "fphp",
    "__ARM_FEATURE_FP16_VECTOR_ARITHMETIC": "asimdhp",
    "__ARM_FEATURE_SVE": "sve",
    "__ARM_FEATURE_SVE2": "sve2",
    "__ARM_FEATURE_MATMUL_INT8": "i8mm",
    "__ARM_FEATURE_SME": "sme",
}

_MACRO_RE = re.compile(r"#define\s+(__[A-Z0-9_]+__)\s")
_ARM_MACRO_RE = re.compile(r"#define\s+(__ARM_[A-Z0-9_]+)\s")


def features_from_macros(text: str) -> list[str]:
    """The cpuinfo names of the ISA macros in ``c++ -dM -E`` output that the compiled code can
    execute (:func:`executable_features`), sorted."""
    found = {MACRO_TO_CPUINFO[m] for m in _MACRO_RE.findall(text) if m in MACRO_TO_CPUINFO}
    found |= {ARM_MACRO_TO_HWCAP[m] for m in _ARM_MACRO_RE.findall(text) if m in ARM_MACRO_TO_HWCAP}
    return executable_features(found)


def executable_features(recorded: Iterable[str]) -> list[str]:
    """The features a binary can really execute, of those its compiler enabled: everything but
    :data:`INTRINSIC_ONLY_CPUINFO`. An unknown name stays (fail closed), sorted."""
    return sorted(set(recorded) - INTRINSIC_ONLY_CPUINFO)


# What ggml's x86 variant scoring adds for each feature a variant was compiled for
# (ggml-cpu/arch/x86/cpu-feats.cpp, ggml_backend_cpu_x86_score); a variant that needs a feature the
# CPU lacks scores 0 and is never loaded. avx512f stands for ggml's AVX512 group (F, CD, VL, DQ, BW).
GGML_VARIANT_SCORE_BITS: dict[str, int] = {
    "fma": 1, "f16c": 1 << 1, "sse4_2": 1 << 2, "bmi2": 1 << 3, "avx": 1 << 4, "avx2": 1 << 5,
    "avx_vnni": 1 << 6, "avx512f": 1 << 7, "avx512vbmi": 1 << 8, "avx512_bf16": 1 << 9,
    "avx512_vnni": 1 << 10, "amx_int8": 1 << 11,
    # Arm64 (ggml-cpu/arch/arm/cpu-feats.cpp): its fp16 bit needs fphp and asimdhp, both recorded.
    "asimddp": 1 << 1, "asimdhp": 1 << 2, "sve": 1 << 3, "i8mm": 1 << 4, "sve2": 1 << 5, "sme": 1 << 6,
}


def ggml_cpu_variant(variants: Mapping[str, Iterable[str]], cpu_flags: frozenset[str]) -> str | None:
    """The CPU variant a portable build's ggml loads on a CPU with these flags: the highest-scoring
    variant whose executable features the CPU all has (ties: the first name), None if none runs.

    ggml scores CPUID, not /proc/cpuinfo; where the two differ (a feature the kernel or hypervisor
    hides) the binary's own answer is what counts: discovery compares both."""
    best: tuple[int, str] | None = None
    for name in sorted(variants):
        needs = executable_features(variants[name])
        if missing_features(needs, cpu_flags):
            continue
        score = 1 + sum(GGML_VARIANT_SCORE_BITS.get(f, 0) for f in needs)
        if best is None or score > best[0]:
            best = (score, name)
    return best[1] if best else None


def cpuinfo_flags(text: str) -> frozenset[str]:
    """The flags of the first processor in ``/proc/cpuinfo`` text (empty if none listed)."""
    return _first_line_words(text, "flags")


def cpu_feature_names(text: str) -> frozenset[str]:
    """The ISA names of the first processor in ``/proc/cpuinfo`` text: x86's ``flags`` line, or
    Arm64's ``Features`` line (hwcap names) where there is none; empty if neither is listed."""
    return cpuinfo_flags(text) or _first_line_words(text, "Features")


def _first_line_words(text: str, key: str) -> frozenset[str]:
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == key:
            return frozenset(value.split())
    return frozenset()


def missing_features(required: Iterable[str], available: frozenset[str]) -> list[str]:
    """Features the binary was built for that this CPU lacks, sorted."""
    return sorted(set(required) - available)


# The path runs to the first ".so" that ends a word: a cache path may hold spaces (docs/builds.md).
_LOADED_CPU_RE = re.compile(r"loaded CPU backend from (?P<path>[^\r\n]*?\.so)(?=\s|$)", re.MULTILINE)


def loaded_cpu_variant(text: str) -> str | None:
    """The CPU variant ggml reports loading (``load_backend: loaded CPU backend from
    .../libggml-cpu-zen4.so``), None when the text names none."""
    match = _LOADED_CPU_RE.search(text)
    if match is None:
        return None
    tag = re.fullmatch(r"libggml-cpu-(.+)\.so", match.group("path").rsplit("/", 1)[-1])
    return tag.group(1) if tag else None


if __name__ == "__main__":  # the install script: macros on stdin -> one cpuinfo name a line
    for name in features_from_macros(sys.stdin.read()):
        print(name)
