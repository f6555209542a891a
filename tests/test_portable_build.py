"""The portable CPU llama-server (scripts/install-llama-server --variant portable, the default):
ggml's CPU variants loaded at run time, no AMX variant, the variant ggml loads asked of the binary
and checked against hotfit's prediction — here, and by execution under QEMU's user-mode emulator
as older CPUs (docs/builds.md, docs/hardware.md).

What the emulator can show: QEMU 7.2's TCG runs x86-64 code up to AVX2 (no AVX-512 at all, whatever
``-cpu`` says) and answers CPUID as the named CPU model, which is what ggml's variant scoring and
GCC's ``-march=native`` read. What it cannot: AVX-512 variants (zen4, icelake, ...), speed, and a
kernel's /proc/cpuinfo (inside the emulator it is the host's).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from hotfit.backends.llama_server.discovery import (GGML_ASK, BackendError, ask_ggml, check_cpu_features,
                                             find_llama_server, loaded_cpu_variant, with_loaded_variant)
from hotfit.core.isa import AMX_CPUINFO, cpuinfo_flags, features_from_macros, ggml_cpu_variant
from hotfit.core.settings import LLAMA_SDIST_VERSION, default_llama_cache, load_settings
from tests.gguf_fixtures import REQUIRE_ENV
from tests.real_models import realmodels_script, require_model

TIER = "integration"



HARDWARE = Path(__file__).parent / "data" / "hardware"
# Instructions a compiler only emits for an intrinsic or inline asm (core.isa.INTRINSIC_ONLY_CPUINFO).
INTRINSIC_ONLY_MNEMONIC = re.compile(
    r"\t(rdseed|rdrand|v?aes(enc|enclast|dec|declast|imc|keygenassist)|sha1\w+|sha256\w+|v?pclmul\w*"
    r"|xsave\w*|xrstor\w*|clwb|clflushopt|adcx|adox|extrq|insertq|movntss|movntsd)\b")


def _bin_dir(flavour: str) -> Path:
    return default_llama_cache(os.environ) / LLAMA_SDIST_VERSION / flavour / "bin"


def _require_build(flavour: str) -> Path:
    bin_dir = _bin_dir(flavour)
    if not (bin_dir / "llama-server").is_file():
        variant = "" if flavour == "cpu" else f" --variant {flavour.removeprefix('cpu-')}"
        why = f"no {flavour} llama-server: scripts/install-llama-server --backend cpu{variant}"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(f"{why} ({REQUIRE_ENV} is set)")
        pytest.skip(why)
    return bin_dir


def _info(bin_dir: Path) -> dict:
    return json.loads((bin_dir / "build-info.json").read_text())


def _run_here(bin_dir: Path, *args: str, wrapper: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*wrapper, str(bin_dir / "llama-server"), *args], capture_output=True, text=True,
                          timeout=600, cwd=bin_dir, stdin=subprocess.DEVNULL)


def _ask_ggml_under(bin_dir: Path, wrapper: tuple[str, ...]) -> str:
    """The build's ggml asked which CPU variant it loads (backends/llama_server/ggml_ask.py, what
    discovery runs), under an emulated CPU: Debian's python3 (x86-64 baseline) runs there too."""
    proc = subprocess.run([*wrapper, "/usr/bin/python3", str(GGML_ASK), str(bin_dir)], capture_output=True,
                          text=True, timeout=600, cwd=bin_dir, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout + proc.stderr


def _need_qemu() -> str:
    qemu = shutil.which("qemu-x86_64")
    if qemu is None:
        if os.environ.get(REQUIRE_ENV):
            pytest.fail("qemu-x86_64 missing (Debian qemu-user; scripts/bootstrap --test installs it)")
        pytest.skip("qemu-x86_64 missing (Debian qemu-user)")
    return qemu


def emulated_cpu_flags(cpu_model: str) -> frozenset[str]:
    """The ISA of QEMU's ``-cpu MODEL`` in cpuinfo names, read the way GCC reads a real CPU: its
    driver expands ``-march=native`` from CPUID (here the emulated CPU's) into ``-march``/``-m``
    options; the host compiler then says which feature macros those options define."""
    qemu = _need_qemu()
    gcc = shutil.which("gcc")
    assert gcc is not None
    proc = subprocess.run([qemu, "-cpu", cpu_model, gcc, "-march=native", "-###", "-E", "-x", "c", "/dev/null"],
                          capture_output=True, text=True, timeout=120)
    cc1 = next(line for line in proc.stderr.splitlines() if "cc1" in line and "-march=" in line)
    options = [a for a in shlex.split(cc1) if a.startswith("-m") and not a.startswith(("-mtune", "-mabi"))]
    macros = subprocess.run([gcc, *options, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True, text=True,
                            timeout=60, check=True).stdout
    return frozenset(features_from_macros(macros)) | {"sse", "sse2"}


# ------------------------------------------------------------------------------ the build itself
def test_portable_build_records_every_variant_but_amx_and_needs_only_x86_64() -> None:
    bin_dir = _require_build("cpu")
    info = _info(bin_dir)
    assert info["variant"] == "portable" and info["ggml_backend_dl"] is True
    variants = info["cpu_variants"]
    assert {"x64", "sse42", "sandybridge", "haswell", "skylakex", "icelake", "zen4", "alderlake"} <= set(variants)
    assert "sapphirerapids" not in variants  # the AMX variant is left out
    assert all(not set(features) & AMX_CPUINFO for features in variants.values())
    assert {"avx512f", "avx512_vnni", "avx512_bf16"} <= set(variants["zen4"])
    assert "avx2" in variants["haswell"] and "avx" not in variants["sse42"]
    # The binary's own code is the x86-64 baseline: every 64-bit x86 CPU starts it.
    assert set(info["cpu_features"]) <= {"sse", "sse2"}
    for name in variants:
        assert (bin_dir / f"libggml-cpu-{name}.so").is_file()
    assert not (bin_dir / "libggml-cpu-sapphirerapids.so").exists()
    assert not [p.name for p in bin_dir.iterdir() if p.is_symlink()]  # plain files: any copy keeps it whole


def test_the_binary_names_the_variant_ggml_loads_and_hotfit_predicts_the_same() -> None:
    bin_dir = _require_build("cpu")
    flags = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    proc = _run_here(bin_dir, "-v", "--list-devices")
    assert proc.returncode == 0, proc.stderr[-2000:]
    # ggml's line, asked of the build's ggml: llama-server logs it from a logger thread that the
    # listing's exit() may beat (seen under load: the line missing), so discovery asks this way.
    loaded = loaded_cpu_variant(ask_ggml(bin_dir))
    assert loaded is not None and loaded == ggml_cpu_variant(_info(bin_dir)["cpu_variants"], flags)


def test_ggml_ask_says_nothing_for_a_folder_without_the_portable_layout(tmp_path: Path) -> None:
    """A static build (cpu-native, cpu-generic) has no libggml.so.0 to ask: exit 3 with the reason,
    and discovery then takes ggml's scoring on /proc/cpuinfo (core.isa) for the variant."""
    proc = subprocess.run([sys.executable, str(GGML_ASK), str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 3 and "not a portable build" in proc.stderr and "Traceback" not in proc.stderr
    assert ask_ggml(tmp_path).strip().startswith("ggml_ask: no ")


def test_discovery_reports_the_loaded_variant_and_judges_its_isa(monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = _require_build("cpu")
    monkeypatch.setenv("HOTFIT_LLAMA_SERVER", str(bin_dir / "llama-server"))
    found = find_llama_server(load_settings())
    info = _info(bin_dir)
    assert found.build.variant == "portable"
    assert found.build.cpu_variant in info["cpu_variants"]
    assert set(info["cpu_variants"][found.build.cpu_variant]) <= set(found.build.cpu_features or ())
    # A CPU whose kernel hides a feature the loaded variant uses (CPUID says yes, cpuinfo no):
    # refused, naming the variant and the feature.
    needs = info["cpu_variants"][found.build.cpu_variant]
    if needs:
        hidden = sorted(needs)[-1]
        flags = " ".join(sorted(cpuinfo_flags(Path("/proc/cpuinfo").read_text()) - {hidden}))
        with pytest.raises(BackendError, match=rf"{found.build.cpu_variant} CPU variant.*{hidden}"):
            check_cpu_features(found, f"flags\t: {flags}\n")


def test_zen5_with_rdseed_masked_loads_the_zen4_variant_and_is_not_refused() -> None:
    bin_dir = _require_build("cpu")
    info = _info(bin_dir)
    zen5 = cpuinfo_flags((HARDWARE / "amd-zen5-epyc-rdseed-masked" / "proc-cpuinfo.txt").read_text())
    assert ggml_cpu_variant(info["cpu_variants"], zen5) == "zen4"
    from hotfit.backends.llama_server.discovery import build_info_from_json
    build = with_loaded_variant(build_info_from_json(info), info, None, zen5)
    assert build.cpu_variant == "zen4" and "rdseed" not in (build.cpu_features or ())


@pytest.mark.parametrize("flavour", ["cpu", "cpu-native"])
def test_no_intrinsic_only_instruction_in_the_built_code(flavour: str) -> None:
    """What core.isa assumes, checked on the machine code: neither the compiler nor ggml put
    rdseed, rdrand, AES, SHA, PCLMUL, XSAVE, CLWB, CLFLUSHOPT, ADX or SSE4A instructions in any
    binary or library of the build, so a CPU lacking them (Zen 5's masked rdseed) runs it."""
    bin_dir = _require_build(flavour)
    objdump = shutil.which("objdump")
    assert objdump is not None, "objdump (binutils) is part of the C++ toolchain the build needs"
    files = [bin_dir / "llama-server", *sorted(bin_dir.glob("lib*.so*"))]
    for path in files:
        text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True,
                              timeout=600, check=True).stdout
        found = sorted({m.group(1) for m in INTRINSIC_ONLY_MNEMONIC.finditer(text)})
        assert not found, f"{path.name} contains {found}"


# ------------------------------------------------------------------------------ by execution under QEMU
@pytest.mark.parametrize(("cpu_model", "expected"), [("Haswell", "haswell"), ("Nehalem", "sse42"),
                                                     ("qemu64", "x64")])
def test_under_qemu_ggml_loads_the_variant_hotfit_predicts(cpu_model: str, expected: str) -> None:
    bin_dir = _require_build("cpu")
    flags = emulated_cpu_flags(cpu_model)
    predicted = ggml_cpu_variant(_info(bin_dir)["cpu_variants"], flags)
    proc = _run_here(bin_dir, "-v", "--list-devices", wrapper=(_need_qemu(), "-cpu", cpu_model))
    assert proc.returncode == 0, proc.stderr[-2000:]  # llama-server itself starts on the emulated CPU
    assert loaded_cpu_variant(_ask_ggml_under(bin_dir, (_need_qemu(), "-cpu", cpu_model))) == predicted == expected


def test_under_qemu_haswell_the_portable_build_generates_from_a_real_gguf(tmp_path: Path) -> None:
    bin_dir = _require_build("cpu")
    model = require_model("smollm2-135m")
    realmodels = realmodels_script()
    with realmodels.Server(bin_dir / "llama-server", model.path, tmp_path / "run", threads=2, ctx_tokens=512,
                           wrapper=(_need_qemu(), "-cpu", "Haswell")) as server:
        server.wait_healthy(600)
        timing = realmodels.complete(server.base_url, realmodels.prompt_tokens(server.base_url, 16), 8,
                                     timeout_s=600)
    assert timing.prompt_tokens == 16 and timing.generated_tokens == 8
    # The server's own log does not repeat ggml's module loading; the same build's ggml on the same
    # emulated CPU says which variant it loads.
    assert loaded_cpu_variant(_ask_ggml_under(bin_dir, (_need_qemu(), "-cpu", "Haswell"))) == "haswell"


def test_under_qemu_haswell_an_avx512_build_dies_by_sigill_and_hotfit_refuses_it(tmp_path: Path) -> None:
    bin_dir = _require_build("cpu-native")
    info = _info(bin_dir)
    if "avx512f" not in info["cpu_features"]:
        pytest.skip("the native build of this machine uses no AVX-512 (the CPU has none)")
    flags = emulated_cpu_flags("Haswell")
    assert "avx2" in flags and "avx512f" not in flags
    # hotfit's check, for the emulated CPU's feature set: refused before anything runs.
    from hotfit.backends.llama_server.discovery import ServerBinary, build_info_from_json
    native = ServerBinary(bin_dir / "llama-server", "cache", build_info_from_json(info), None)
    with pytest.raises(BackendError, match="avx512"):
        check_cpu_features(native, f"flags\t: {' '.join(sorted(flags))}\n")
    # And by execution: the same binary, a real GGUF, the emulated Haswell: SIGILL.
    model = require_model("smollm2-135m")
    realmodels = realmodels_script()
    server = realmodels.Server(bin_dir / "llama-server", model.path, tmp_path / "run", threads=2, ctx_tokens=512,
                               wrapper=(_need_qemu(), "-cpu", "Haswell"))
    try:
        try:
            server.wait_healthy(600)
            realmodels.complete(server.base_url, realmodels.prompt_tokens(server.base_url, 16), 4, timeout_s=600)
        except Exception:  # noqa: BLE001 - the server dies; what it died of is asserted below
            pass
        server.proc.wait(120)
    finally:
        server.close()
    # qemu-user re-raises the guest's signal: the process ends by SIGILL.
    assert server.proc.returncode == -signal.SIGILL, server.proc.returncode
