"""core/cuda_arch.py: which GPUs a CUDA build has code for (NVIDIA's binary and PTX compatibility
rules), and the architectures llama-server reports it was compiled for."""

from __future__ import annotations

import pytest

from hotfit.core.cuda_arch import capability_number, compiled_archs, cuda_arch_serves, unserved_reason

TIER = "unit"


@pytest.mark.parametrize(("archs", "capability", "runs"), [
    (["90"], 90, True), (["90"], 100, True), (["90"], 89, False),  # machine code + PTX
    (["80-real"], 86, True), (["86-real"], 90, False),             # machine code: same major, not older
    (["86-real"], 89, True), (["75-real", "86-real"], 90, False),  # an L4/4090 runs sm_86; a Hopper does not
    (["75-virtual"], 120, True), (["90a"], 90, True), (["90a"], 100, False), (["100f"], 103, True),
    (["75", "86"], 90, True),                                      # the fleet build: H100 by 86's PTX
    (["garbage"], 90, False), ([], 90, False),
])
def test_which_cuda_architectures_run_on_which_gpu(archs: list[str], capability: int, runs: bool) -> None:
    assert cuda_arch_serves(archs, capability) is runs


@pytest.mark.parametrize(("text", "number"), [("8.9", 89), ("9.0", 90), ("12.0", 120), (" 7.5\n", 75),
                                              ("8", None), ("8.9.1", None), ("", None), ("N/A", None)])
def test_a_compute_capability_as_nvml_writes_it(text: str, number: int | None) -> None:
    assert capability_number(text) == number


def test_the_reason_names_the_archs_and_the_gpu_or_is_none_when_nothing_can_be_compared() -> None:
    reason = unserved_reason(["90"], "7.5")
    assert reason is not None and "90 only" in reason and "compute capability 7.5" in reason
    assert unserved_reason(["75", "90"], "7.5") is None
    assert unserved_reason([], "7.5") is None        # a build that recorded no archs: not compared
    assert unserved_reason(["90"], None) is None     # NVML did not say
    assert unserved_reason(["90"], "N/A") is None


def test_the_archs_llama_server_reports_in_its_system_info() -> None:
    # the line as the real CUDA build prints it (tests/test_cuda_build.py asks the build itself)
    line = ("system_info: n_threads = 2 (n_threads_batch = 2) / 2 | CUDA : ARCHS = 750,860 | USE_GRAPHS = 1 | "
            "FA_QUANTS = q4_0-q4_0 | CPU : SSE3 = 1 | AVX = 1 |")
    assert compiled_archs(line) == ("75", "86")
    assert compiled_archs("system_info: ... | CUDA : ARCHS = 900 | USE_GRAPHS = 1") == ("90",)
    assert compiled_archs("system_info: n_threads = 2 | CPU : SSE3 = 1 |") is None  # no CUDA module loaded
