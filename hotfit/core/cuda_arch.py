"""Which GPUs a CUDA build has code for (pure).

A CUDA build carries machine code for the architectures it was compiled for
(``CMAKE_CUDA_ARCHITECTURES``, recorded in build-info.json) and possibly PTX the driver compiles
for later GPUs. A GPU it has neither for fails at the first kernel ("no kernel image is available
for execution on the device"), after the weights are downloaded and loaded; docs/builds.md,
"CUDA architectures". The rules are NVIDIA's CUDA C++ Programming Guide, "Binary Compatibility" and
"PTX Compatibility".
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["arch_numbers", "capability_number", "compiled_archs", "cuda_arch_serves", "unserved_reason"]

# CMAKE_CUDA_ARCHITECTURES entries: "90", "86-real", "75-virtual", "90a", "100f"
_ARCH_RE = re.compile(r"(?P<number>\d+)(?P<specific>[af]?)(?:-(?P<kind>real|virtual))?")
# ggml-cuda's feature line in llama-server's system_info: "CUDA : ARCHS = 750,860 | USE_GRAPHS = 1"
# (nvcc's __CUDA_ARCH_LIST__: each architecture compiled, as major*100 + minor*10)
_ARCHS_LINE_RE = re.compile(r"CUDA : ARCHS = (?P<list>[0-9, ]+)")


def capability_number(text: str) -> int | None:
    """``"8.9"`` (NVML's, nvidia-smi's ``compute_cap``) as 89; None for anything else."""
    match = re.fullmatch(r"\s*(\d+)\.(\d)\s*", text)
    return None if match is None else int(match[1]) * 10 + int(match[2])


def arch_numbers(archs: Iterable[str]) -> set[str]:
    """``"86-real"``, ``"90a"``, ``"75-virtual"`` -> ``"86"``, ``"90"``, ``"75"``: the architectures
    as nvcc's list (and :func:`compiled_archs`) names them; entries that are not one are left out."""
    return {m["number"] for a in archs if (m := _ARCH_RE.fullmatch(a.strip()))}


def cuda_arch_serves(archs: Iterable[str], capability: int) -> bool:
    """Whether code built for ``archs`` runs on a GPU of compute ``capability`` (major*10 + minor:
    89). Machine code (NN, NN-real) runs on the same major version at the same or a later minor;
    PTX (NN, NN-virtual) is compiled by the driver for any later GPU; arch-specific code (NNa) runs
    on its own capability only, family-specific (NNf) on its major version."""
    for arch in archs:
        match = _ARCH_RE.fullmatch(arch.strip())
        if match is None:
            continue
        number, specific, kind = int(match["number"]), match["specific"], match["kind"]
        if specific == "a":
            served = capability == number
        elif specific == "f" or kind == "real":
            served = capability // 10 == number // 10 and capability >= number
        else:  # PTX: "NN-virtual", or "NN" (machine code and PTX)
            served = capability >= number
        if served:
            return True
    return False


def unserved_reason(archs: Iterable[str], capability_text: str | None) -> str | None:
    """Why a build for ``archs`` cannot run on a GPU of ``capability_text`` ("8.9"), or None when it
    can, or when either side is unknown (no archs recorded, NVML did not say): nothing to compare."""
    names = [a.strip() for a in archs if a.strip()]
    capability = capability_number(capability_text) if capability_text else None
    if not names or capability is None or cuda_arch_serves(names, capability):
        return None
    return (f"it has code for CUDA architectures {';'.join(names)} only, and this GPU has compute capability "
            f"{capability_text} (its first kernel would fail: \"no kernel image is available\")")


def compiled_archs(system_info: str) -> tuple[str, ...] | None:
    """The architectures a CUDA build was really compiled for, as llama-server reports them in its
    system_info line (``CUDA : ARCHS = 750,860`` -> ``("75", "86")``); None when the line is absent
    (ggml's CUDA module did not load, or the build is not a CUDA build)."""
    match = _ARCHS_LINE_RE.search(system_info)
    if match is None:
        return None
    values = [int(v) for v in match["list"].replace(" ", "").split(",") if v]
    return tuple(str(v // 10) for v in values)
