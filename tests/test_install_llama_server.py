"""scripts/install-llama-server: built once per backend from the pinned sdist, a second run is a
no-op, the CPU build never takes ggml's AMX path and records the ISA features it uses, and the
backend is picked from the hardware."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from hotfit.core.isa import AMX_CPUINFO, cpuinfo_flags
from hotfit.core.settings import LLAMA_SDIST_VERSION, default_llama_cache
from tests.conftest import REPO_ROOT

TIER = "integration"

SCRIPT = REPO_ROOT / "scripts" / "install-llama-server"


def _bin_dir(backend: str = "cpu") -> Path:
    return default_llama_cache(os.environ) / LLAMA_SDIST_VERSION / backend / "bin"


@pytest.fixture
def built() -> None:
    if not (_bin_dir() / "llama-server").exists():
        if os.environ.get("HOTFIT_REQUIRE_LLAMA"):
            pytest.fail("llama-server is not built; run scripts/install-llama-server --backend cpu")
        pytest.skip("llama-server not built (set HOTFIT_REQUIRE_LLAMA=1 to make this a failure)")


@pytest.fixture
def built_native() -> None:
    if not (_bin_dir("cpu-native") / "llama-server").exists():
        if os.environ.get("HOTFIT_REQUIRE_LLAMA"):
            pytest.fail("the native CPU build is missing; run scripts/install-llama-server --backend cpu --variant native")
        pytest.skip("native llama-server not built (set HOTFIT_REQUIRE_LLAMA=1 to make this a failure)")


def test_script_pins_the_same_version_as_settings() -> None:
    text = SCRIPT.read_text()
    assert f'SDIST_VERSION="{LLAMA_SDIST_VERSION}"' in text
    assert re.search(r'SDIST_SHA256="[0-9a-f]{64}"', text)
    assert re.search(r'VK_HEADERS_SHA256="[0-9a-f]{64}"', text)
    for flag in ("-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                 "--target llama-server llama-fit-params", "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"):
        assert flag in text


def test_second_run_is_a_noop_and_build_info_is_recorded(built: None) -> None:
    server = _bin_dir() / "llama-server"
    mtime = server.stat().st_mtime_ns
    proc = subprocess.run([str(SCRIPT), "--backend", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "no-op" in proc.stderr
    assert proc.stdout.strip() == str(server)
    assert server.stat().st_mtime_ns == mtime
    info = json.loads((_bin_dir() / "build-info.json").read_text())
    sha = re.search(r'SDIST_SHA256="([0-9a-f]{64})"', SCRIPT.read_text()).group(1)
    assert info["sdist_sha256"] == sha and info["sdist_version"] == LLAMA_SDIST_VERSION
    assert info["backend"] == "cpu" and info["variant"] == "portable"  # the default build
    assert "llama-server" in info["targets"] and "llama-fit-params" in info["targets"]
    assert (_bin_dir() / "llama-fit-params").exists()
    version = subprocess.run([str(server), "--version"], capture_output=True, text=True, timeout=30)
    assert "version" in (version.stdout + version.stderr)


def test_native_cpu_build_uses_this_cpus_isa_but_never_amx(built_native: None) -> None:
    """The recorded features are what the compiler may emit for ggml-cpu: all present on this CPU
    (it was built here), AVX2 at least on x86-64, and no AMX whatever the CPU reports."""
    info = json.loads((_bin_dir("cpu-native") / "build-info.json").read_text())
    assert info["variant"] == "native"
    features = set(info["cpu_features"])
    assert not features & AMX_CPUINFO
    assert set(info["cpu_features_excluded"]) == {"amx_tile", "amx_int8", "amx_bf16"}
    have = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    assert features <= have, f"recorded features this CPU lacks: {sorted(features - have)}"
    if "avx2" in have:
        assert "avx2" in features  # native: the host's ISA is kept, not a baseline
    if "avx512f" in have:
        assert {"avx512f", "avx512bw"} <= features
    if "avx512_vnni" in have:
        assert "avx512_vnni" in features


def _detect(tmp_path: Path, *, driver: str | None = None, vendors: tuple[str, ...] = ()) -> tuple[str, str]:
    root = tmp_path / "root"
    if driver is not None:
        version = root / "proc" / "driver" / "nvidia" / "version"
        version.parent.mkdir(parents=True)
        version.write_text(f"NVRM version: NVIDIA UNIX x86_64 Kernel Module  {driver}  Release Build\n")
    for i, vendor in enumerate(vendors):
        dev = root / "sys" / "class" / "drm" / f"card{i}" / "device"
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(vendor + "\n")
        (dev / "class").write_text("0x030000\n")
    env = {**os.environ, "HOTFIT_DETECT_ROOT": str(root), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([str(SCRIPT), "--detect"], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr
    backend, why = proc.stdout.rstrip("\n").split("\t")
    return backend, why


@pytest.mark.parametrize(
    ("driver", "vendors", "expected", "why_part"),
    [
        (None, (), "cpu", "no GPU"),
        ("580.65.06", ("0x10de",), "cuda", "580.65.06"),
        ("575.57.08", ("0x10de",), "vulkan", "older than 580"),
        (None, ("0x1002",), "vulkan", "AMD/Intel"),
        (None, ("0x8086",), "vulkan", "AMD/Intel"),
        (None, ("0x10de",), "vulkan", "without a loaded NVIDIA driver"),
        (None, ("0x1a03",), "cpu", "no GPU"),  # a BMC's display controller is no accelerator
    ],
)
def test_backend_is_picked_from_the_hardware(tmp_path: Path, driver, vendors, expected, why_part) -> None:
    backend, why = _detect(tmp_path, driver=driver, vendors=vendors)
    assert backend == expected
    assert why_part in why


@pytest.mark.parametrize("args", [["--backend", "rocm"], ["--variant", "fast"], ["--frobnicate"],
                                  ["--backend", "vulkan", "--variant", "generic"],
                                  ["--backend", "vulkan", "--variant", "native"],
                                  ["--export", "a.tgz", "--from", "b.tgz"], ["--arch", "riscv64"],
                                  ["--arch", "aarch64", "--backend", "vulkan"],
                                  ["--arch", "aarch64", "--backend", "cpu", "--variant", "native"]])
def test_bad_arguments_are_refused_with_a_message(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "HOTFIT_LLAMA_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode != 0
    assert "install-llama-server:" in proc.stderr
    assert not (tmp_path / "cache" / LLAMA_SDIST_VERSION / "vulkan").exists()


def test_the_amx_exclusion_holds_on_a_cpu_that_has_amx() -> None:
    """This machine may lack AMX, so ask the compiler as if for an AMX CPU (Sapphire Rapids):
    the script's flags leave no AMX macro (ggml compiles its AMX kernels under __AMX_INT8__)
    while AVX-512 and VNNI stay."""
    flags = re.search(r'cpu_flags="(-mno-amx[^"]*)"', SCRIPT.read_text()).group(1).split()
    from hotfit.core.isa import features_from_macros

    def features(*extra: str) -> set[str]:
        proc = subprocess.run(["c++", "-march=sapphirerapids", *extra, "-dM", "-E", "-x", "c++", "/dev/null"],
                              capture_output=True, text=True, timeout=60, check=True)
        return set(features_from_macros(proc.stdout))

    assert {"amx_tile", "amx_int8", "amx_bf16"} <= features()
    kept = features(*flags)
    assert not kept & AMX_CPUINFO
    assert {"avx512f", "avx512_vnni", "avx512_bf16", "avx512bw"} <= kept
