"""The portable CPU llama-server cross-built for Arm64 (``scripts/install-llama-server --arch aarch64``:
Debian's aarch64 cross toolchain, ggml's Arm CPU variants loaded at run time), run under QEMU's
user-mode emulator as Arm CPUs of different generations, with a real GGUF (docs/builds.md, "Arm64").

Outside CI's required path: the tests skip without the cross build (saying how to make it) and
fail instead when ``HOTFIT_REQUIRE_ARM64`` is set.

What the emulator can show: QEMU's ``-cpu`` model sets the hwcaps the guest reads with getauxval,
which is what ggml's Arm variant scoring reads, so the variant it loads is the one a real CPU of that
model would get; and the cross-built code runs a real model there. What it cannot: speed, SME (its
variants are left out by Debian 12's GCC 12, which lacks ``+sme``), and a kernel's /proc/cpuinfo.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

from hotfit.backends.llama_server.discovery import loaded_cpu_variant
from hotfit.core.isa import cpu_feature_names, ggml_cpu_variant
from tests.real_models import SMOLLM2, realmodels_script, require_model
from hotfit.core.settings import LLAMA_SDIST_VERSION
from tests.test_build_archive import _llama_build, _refused, _script
from tests.test_portable_build import HARDWARE, _bin_dir, _info, _run_here

TIER = "integration"

FLAVOUR = "cpu-aarch64"
REQUIRE_ARM64_ENV = "HOTFIT_REQUIRE_ARM64"
SYSROOT = Path("/usr/aarch64-linux-gnu")  # Debian's libc6-arm64-cross: the loader and libc qemu runs with
ELF_MACHINE_AARCH64 = 183  # e_machine EM_AARCH64
# The built variants: ggml's GGML_CPU_ALL_VARIANTS list for Arm on Linux, less the armv9.2 (SME)
# ones a compiler without +sme leaves out (recorded in build-info.json).
ARM_VARIANTS = {"armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.2_3", "armv8.6_1", "armv8.6_2", "armv9.2_1",
                "armv9.2_2"}
# Linux's AT_HWCAP / AT_HWCAP2 bits in order (arch/arm64/include/uapi/asm/hwcap.h), named as
# /proc/cpuinfo's "Features" line names them.
HWCAP_NAMES = ("fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp", "asimdhp",
               "cpuid", "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "sm3", "sm4", "asimddp", "sha512",
               "sve", "asimdfhm", "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb", "paca", "pacg")
HWCAP2_NAMES = ("dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2", "frint",
                "svei8mm", "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16", "dgh", "rng", "bti", "mte", "ecv",
                "afp", "rpres", "mte3", "sme", "sme_i16i64", "sme_f64f64", "sme_i8i32", "sme_f16f32",
                "sme_b16f32", "sme_f32f32", "sme_fa64", "wfxt")


def _skip_or_fail(why: str) -> None:
    if os.environ.get(REQUIRE_ARM64_ENV):
        pytest.fail(f"{why} ({REQUIRE_ARM64_ENV} is set)")
    pytest.skip(why)


def require_arm64_build() -> Path:
    """The cross-built cpu-aarch64 build's bin folder, or skip (fail with HOTFIT_REQUIRE_ARM64=1)."""
    bin_dir = _bin_dir(FLAVOUR)
    if not (bin_dir / "llama-server").is_file():
        _skip_or_fail(f"no {FLAVOUR} llama-server: scripts/install-llama-server --arch aarch64 "
                      "(needs apt-get install -y g++-aarch64-linux-gnu)")
    return bin_dir


def emulator(cpu_model: str) -> tuple[str, ...]:
    """The command prefix that runs an aarch64 program here as QEMU's ``cpu_model``."""
    qemu = shutil.which("qemu-aarch64")
    if qemu is None or not (SYSROOT / "lib" / "ld-linux-aarch64.so.1").is_file():
        _skip_or_fail("qemu-aarch64 (Debian qemu-user) or the aarch64 sysroot (libc6-arm64-cross) missing")
    return (str(qemu), "-L", str(SYSROOT), "-cpu", cpu_model)


def emulated_hwcaps(cpu_model: str) -> frozenset[str]:
    """The hwcaps the emulated CPU gives a guest (what ggml's getauxval reads), from glibc's own
    report of them: the aarch64 loader's ``--list-diagnostics`` under the same emulator."""
    proc = subprocess.run([*emulator(cpu_model), str(SYSROOT / "lib" / "ld-linux-aarch64.so.1"), "--list-diagnostics"],
                          capture_output=True, text=True, timeout=120)
    values = dict(line.split("=", 1) for line in proc.stdout.splitlines() if line.startswith("dl_hwcap"))
    hwcap, hwcap2 = int(values["dl_hwcap"], 16), int(values["dl_hwcap2"], 16)
    return frozenset([n for i, n in enumerate(HWCAP_NAMES) if hwcap >> i & 1]
                     + [n for i, n in enumerate(HWCAP2_NAMES) if hwcap2 >> i & 1])


# ------------------------------------------------------------------------------ the build itself
def test_the_cross_build_is_aarch64_code_with_the_arm_variants() -> None:
    bin_dir = require_arm64_build()
    info = _info(bin_dir)
    assert info["arch"] == "aarch64" and info["backend"] == "cpu" and info["variant"] == "portable"
    assert info["ggml_backend_dl"] is True and "aarch64-linux-gnu" in info["cross_compiler"]
    variants = info["cpu_variants"]
    assert set(variants) | set(info["cpu_variants_left_out"]) == ARM_VARIANTS
    assert not set(variants) & set(info["cpu_variants_left_out"])
    assert {"armv8.0_1", "armv8.2_2", "armv8.6_2"} <= set(variants)
    assert variants["armv8.0_1"] == ["asimd"]  # the baseline: every aarch64 CPU
    assert {"asimddp", "asimdhp", "fphp"} <= set(variants["armv8.2_2"]) and "sve" not in variants["armv8.2_2"]
    assert {"sve", "sve2", "i8mm"} <= set(variants["armv8.6_2"])
    assert set(info["cpu_features"]) <= {"asimd"}  # the binary's own code: the armv8-a baseline
    for name in variants:
        assert (bin_dir / f"libggml-cpu-{name}.so").is_file()
    for path in [bin_dir / "llama-server", *bin_dir.glob("lib*.so*")]:
        header = path.read_bytes()[:20]
        assert header[:4] == b"\x7fELF" and int.from_bytes(header[18:20], "little") == ELF_MACHINE_AARCH64, path
    assert "version" in info["llama_cpp_version"]  # asked of the binary, under the emulator


# ------------------------------------------------------------------------------ by execution under QEMU
def _variant_loaded_under(bin_dir: Path, cpu_model: str, attempts: int = 5) -> str | None:
    """The CPU variant llama-server's ggml says it loads under the emulated CPU. llama.cpp writes
    that line from a logger thread the listing's exit() may beat (its logger is leaked on purpose),
    so a loaded machine can lose it; on x86 discovery asks ggml directly (ggml_ask.py), which needs
    a python of the target's architecture, absent here: the listing is asked again instead."""
    for _ in range(attempts):
        proc = _run_here(bin_dir, "-v", "--list-devices", wrapper=emulator(cpu_model))
        assert proc.returncode == 0, proc.stderr[-2000:]
        variant = loaded_cpu_variant(proc.stdout + proc.stderr)
        if variant is not None:
            return variant
    return None


@pytest.mark.parametrize(("cpu_model", "expected"), [
    ("cortex-a57", "armv8.0_1"),   # armv8.0: no dotprod
    ("neoverse-n1", "armv8.2_2"),  # Graviton2: dotprod + fp16, no SVE
    ("max", "armv8.6_2"),          # QEMU's every feature: SVE2 + i8mm (its SME has no variant here)
])
def test_under_qemu_ggml_loads_the_arm_variant_hotfit_predicts(cpu_model: str, expected: str) -> None:
    bin_dir = require_arm64_build()
    predicted = ggml_cpu_variant(_info(bin_dir)["cpu_variants"], emulated_hwcaps(cpu_model))
    assert _variant_loaded_under(bin_dir, cpu_model) == predicted == expected


def test_the_graviton2_row_of_the_hardware_matrix_is_what_its_emulated_cpu_loads() -> None:
    """The matrix's Arm64 rows predict the variant from the captured Features line; QEMU's
    neoverse-n1 (Graviton2's core) offers the same variant-deciding features and loads that variant."""
    bin_dir = require_arm64_build()
    row = HARDWARE / "arm64-graviton2-neoverse-n1"
    expected = json.loads((row / "expected.json").read_text())["ggml_cpu_variant"]
    captured = cpu_feature_names((row / "proc-cpuinfo.txt").read_text())
    emulated = emulated_hwcaps("neoverse-n1")
    deciding = {f for features in _info(bin_dir)["cpu_variants"].values() for f in features}
    assert captured & deciding == emulated & deciding
    assert _variant_loaded_under(bin_dir, "neoverse-n1") == expected == "armv8.2_2"


@pytest.mark.parametrize("cpu_model", ["cortex-a57", "neoverse-n1", "max"])  # NEON; dotprod+fp16; SVE2+i8mm
def test_under_qemu_the_arm64_build_generates_from_a_real_gguf(cpu_model: str, tmp_path: Path) -> None:
    bin_dir = require_arm64_build()
    model = require_model(SMOLLM2)
    realmodels = realmodels_script()
    # Tiny on purpose: every instruction is translated (a few seconds each on 2 busy cores).
    with realmodels.Server(bin_dir / "llama-server", model.path, tmp_path / "run", threads=2, ctx_tokens=256,
                           wrapper=emulator(cpu_model)) as server:
        server.wait_healthy(600)
        timing = realmodels.complete(server.base_url, realmodels.prompt_tokens(server.base_url, 8), 4,
                                     timeout_s=600)
    assert timing.prompt_tokens == 8 and timing.generated_tokens == 4


# ------------------------------------------------------------------------------ built here, run there
@pytest.fixture(scope="module")
def exported_arm64(tmp_path_factory: pytest.TempPathFactory) -> Path:
    require_arm64_build()
    archive = tmp_path_factory.mktemp("export") / "llama-server-cpu-aarch64.tar.gz"
    proc = _script("--arch", "aarch64", "--export", str(archive))
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(archive) as tar:
        assert {Path(m.name).parts[0] for m in tar.getmembers() if m.name != "SHA256SUMS"} == {FLAVOUR}
    return archive


def test_this_x86_64_machine_refuses_the_arm64_archive_naming_the_arch(exported_arm64: Path, tmp_path: Path) -> None:
    if os.uname().machine != "x86_64":
        pytest.skip("the refusal is of a foreign architecture: run on an x86-64 build machine")
    _refused(exported_arm64, tmp_path, "the build is for aarch64, this machine is x86_64")


def test_an_arm64_machine_installs_the_archive_as_its_cpu_build(exported_arm64: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """llama_build's import as it runs on a Graviton2: the machine's arch and /proc/cpuinfo are the
    row's, the binary's checks run under the emulated neoverse-n1."""
    llama_build = _llama_build()
    arm = os.uname_result((*os.uname()[:4], "aarch64"))
    monkeypatch.setattr(os, "uname", lambda: arm)
    wrapper = emulator("neoverse-n1")
    monkeypatch.setattr(llama_build, "_run", lambda binary, *args: _run_here(binary.parent, *args, wrapper=wrapper))
    info = _info(require_arm64_build())
    pin = {"sdist_version": info["sdist_version"], "sdist_sha256": info["sdist_sha256"]}
    version_dir = tmp_path / "cache" / LLAMA_SDIST_VERSION
    installed = llama_build.import_archive(exported_arm64, version_dir, pin,
                                           HARDWARE / "arm64-graviton2-neoverse-n1" / "proc-cpuinfo.txt")
    assert installed == version_dir / "cpu" / "bin" / "llama-server"
    assert sorted(p.name for p in version_dir.iterdir()) == ["cpu"]
