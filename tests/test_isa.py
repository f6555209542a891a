"""core.isa on real captures: a binary's requirements are what its code can execute, so a feature
the kernel masks on purpose (rdseed on Zen 5) never refuses a build, while a vector extension the
CPU lacks still does (docs/hardware.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from hotfit.core.isa import (INTRINSIC_ONLY_CPUINFO, MACRO_TO_CPUINFO, cpuinfo_flags, executable_features,
                      features_from_macros, loaded_cpu_variant, missing_features)

TIER = "unit"

HARDWARE = Path(__file__).parent / "data" / "hardware"
ZEN5 = HARDWARE / "amd-zen5-epyc-rdseed-masked"


def test_zen5_native_build_is_not_refused_for_the_masked_rdseed() -> None:
    macros = (ZEN5 / "gcc-march-native-macros.txt").read_text()
    flags = cpuinfo_flags((ZEN5 / "proc-cpuinfo.txt").read_text())
    assert "#define __RDSEED__ 1" in macros and "rdseed" not in flags  # the capture shows the trap
    required = features_from_macros(macros)
    assert "rdseed" not in required
    assert {"avx2", "avx512f", "avx512_vnni", "avx512_bf16"} <= set(required)  # the vector ISA stays
    assert missing_features(required, flags) == []


def test_a_vector_extension_the_cpu_lacks_still_refuses() -> None:
    macros = (ZEN5 / "gcc-march-native-macros.txt").read_text()
    flags = cpuinfo_flags((ZEN5 / "proc-cpuinfo.txt").read_text())
    without_avx512 = frozenset(f for f in flags if not f.startswith("avx512"))
    missing = missing_features(features_from_macros(macros), without_avx512)
    assert "avx512f" in missing and "avx512_vnni" in missing and "rdseed" not in missing


def test_records_that_still_list_intrinsic_only_features_are_filtered_and_unknown_names_kept() -> None:
    assert executable_features(["avx2", "rdseed", "sha_ni", "aes", "hotfit_no_such_feature"]) == [
        "avx2", "hotfit_no_such_feature"]


@pytest.mark.parametrize("name", sorted(INTRINSIC_ONLY_CPUINFO))
def test_every_intrinsic_only_feature_is_a_known_cpuinfo_name(name: str) -> None:
    assert name in MACRO_TO_CPUINFO.values()


@pytest.mark.parametrize("folder", ["/home/op/.cache/hotfit/llama.cpp/0.3.36/cpu/bin",
                                    "/srv/build cache/hotfit llama/0.3.36/cpu/bin", "./"])
def test_the_loaded_variant_is_read_from_a_path_with_spaces(folder: str) -> None:
    """Seen: --from refused a good build when the cache path held a space (the pattern stopped at it)."""
    text = (f"load_backend: loaded CPU backend from {folder}/libggml-cpu-zen4.so\n"
            "load_backend: loaded RPC backend from elsewhere.so\n")
    assert loaded_cpu_variant(text) == "zen4"
    assert loaded_cpu_variant(f"loaded CPU backend from {folder}/libggml-cpu-haswell.so") == "haswell"
    assert loaded_cpu_variant("no backend here") is None
