"""The CUDA llama-server built on a build server without a GPU (``HOTFIT_CUDA_ARCHS=90
scripts/install-llama-server --backend cuda``: the portable layout, ``libggml-cuda.so`` linked against
a stub libcuda, the CUDA runtime beside it), exported, and refused by ``--from`` on a machine
without an NVIDIA driver (docs/builds.md, "CUDA on a build server without a GPU").

The build takes about an hour on 2 cores, so CI does not make it: the tests that need it skip,
saying how to build it, and fail instead when ``HOTFIT_REQUIRE_CUDA_BUILD`` is set. On a machine with
an NVIDIA driver the same tests expect the opposite answers (a CUDA device listed, the import
accepted) — the part only a GPU machine can show.
"""

from __future__ import annotations

import json
import os
import re
import struct
import subprocess
import tarfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from hotfit.backends.llama_server.discovery import find_llama_server
from hotfit.core.cuda_arch import arch_numbers
from hotfit.core.isa import AMX_CPUINFO
from hotfit.core.settings import load_settings
from tests.hardware_matrix import nvidia_smi_standin
from tests.test_build_archive import _llama_build, _refused, _script
from tests.test_portable_build import HARDWARE, _bin_dir, _info, _require_build

TIER = "integration"

REQUIRE_CUDA_ENV = "HOTFIT_REQUIRE_CUDA_BUILD"
HAS_DRIVER = Path("/proc/driver/nvidia/version").is_file()
# What libggml-cuda.so loads from its own folder ($ORIGIN): NVIDIA's runtime and cuBLAS; the
# driver's libcuda.so.1 comes from the machine.
CUDA_RUNTIME = {"libcudart.so.13", "libcublas.so.13", "libcublasLt.so.13"}


def require_cuda_build() -> Path:
    bin_dir = _bin_dir("cuda")
    if not (bin_dir / "llama-server").is_file():
        why = ("no cuda llama-server: HOTFIT_CUDA_ARCHS=90 scripts/install-llama-server --backend cuda "
               "(about an hour on 2 cores; no GPU or driver needed with HOTFIT_CUDA_ARCHS set)")
        if os.environ.get(REQUIRE_CUDA_ENV):
            pytest.fail(f"{why} ({REQUIRE_CUDA_ENV} is set)")
        pytest.skip(why)
    return bin_dir


def _needed(library: Path) -> list[str]:
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dynamic)


# ------------------------------------------------------------------------------ without a build
def test_without_a_driver_the_cuda_build_needs_named_architectures(tmp_path: Path) -> None:
    """No driver and no HOTFIT_CUDA_ARCHS: refused before anything is downloaded, with the way to
    build for export; an old driver stays refused whatever the archs."""
    env = {"PATH": "/usr/bin:/bin", "HOTFIT_CUDA_ARCHS": ""}
    proc = _script("--backend", "cuda", cache=tmp_path / "cache", root=tmp_path / "no-gpu", extra_env=env)
    assert proc.returncode == 1
    assert "no NVIDIA driver found" in proc.stderr and 'HOTFIT_CUDA_ARCHS="75;86;89;90"' in proc.stderr
    old = tmp_path / "old" / "proc" / "driver" / "nvidia" / "version"
    old.parent.mkdir(parents=True)
    old.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  575.57.08  Release Build\n")
    proc = _script("--backend", "cuda", cache=tmp_path / "cache", root=tmp_path / "old",
                   extra_env={**env, "HOTFIT_CUDA_ARCHS": "90"})
    assert proc.returncode == 1 and "older than 580" in proc.stderr
    assert not (tmp_path / "cache").exists()


def _cached_cuda_build(cache: Path, archs: list[str]) -> None:
    """A cache holding a finished cuda build for ``archs`` (stand-in binaries: only its record is read)."""
    bin_dir = cache / "0.3.36" / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-server", "llama-fit-params"):
        (bin_dir / name).write_text("#!/bin/sh\n")
        (bin_dir / name).chmod(0o755)
    (bin_dir / "build-info.json").write_text(json.dumps(
        {"sdist_sha256": "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e", "backend": "cuda",
         "variant": "portable", "cuda_architectures": archs}, indent=2))


@pytest.mark.parametrize(("asked", "gpu_row", "rebuild"), [
    ("90", None, None),                      # what the cache holds: a no-op
    ("75;86", None, "it was built for CUDA architectures 90, HOTFIT_CUDA_ARCHS asks for 75;86"),
    ("", "nvidia-h100-80gb", None),          # this machine's GPU has code in it
    ("", "nvidia-tesla-t4",
     "it has code for CUDA architectures 90, not for this machine's GPUs of compute capability 7.5"),
])
def test_a_cached_cuda_build_is_reused_only_for_the_architectures_asked_now(
        tmp_path: Path, asked: str, gpu_row: str | None, rebuild: str | None) -> None:
    """A changed HOTFIT_CUDA_ARCHS, or a GPU here the cached build has no code for, rebuilds it
    (said on stderr) instead of a silent no-op. The rebuild then stops at this test's old driver."""
    cache = tmp_path / "cache"
    _cached_cuda_build(cache, ["90"])
    root = tmp_path / "root"
    version = root / "proc" / "driver" / "nvidia" / "version"
    version.parent.mkdir(parents=True)
    version.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  575.57.08  Release Build\n")
    path = "/usr/bin:/bin"
    if gpu_row is not None:
        nvidia_smi_standin(tmp_path / "bin", HARDWARE / gpu_row / "nvml.json")
        path = f"{tmp_path / 'bin'}:{path}"
    proc = _script("--backend", "cuda", cache=cache, root=root,
                   extra_env={"HOTFIT_CUDA_ARCHS": asked, "PATH": path})
    if rebuild is None:
        assert proc.returncode == 0 and "already built" in proc.stderr, proc.stderr
        assert "rebuilding" not in proc.stderr
    else:
        assert f"rebuilding the cached cuda build: {rebuild}" in proc.stderr, proc.stderr
        assert proc.returncode == 1 and "older than 580" in proc.stderr


# ------------------------------------------------------------------------------ a mixed GPU fleet
NVIDIA_ROWS = sorted(p.parent.name for p in HARDWARE.glob("nvidia-*/nvml.json"))


def _fake_cuda_build(tmp_path: Path, gpus: list[dict]) -> Path:
    """A bin folder whose llama-server answers as the real one does on a machine with ``gpus``
    (ggml-cuda's start-up device lines, then the device list)."""
    bin_dir = tmp_path / "cuda" / "bin"
    bin_dir.mkdir(parents=True)
    lines = [f"  Device {i}: {g['name']}, compute capability {g['compute_cap']}, VMM: yes, VRAM: "
             f"{g['memory_total_mib']} MiB" for i, g in enumerate(gpus)]
    listed = [f"  CUDA{i}: {g['name']} ({g['memory_total_mib']} MiB, {g['memory_free_mib']} MiB free)"
              for i, g in enumerate(gpus)]
    script = bin_dir / "llama-server"
    script.write_text("#!/bin/sh\ncase \"$*\" in *--version*) echo 'version: 1 (abcdef0)'; exit 0 ;; esac\n"
                      + "".join(f"echo '{line}' >&2\n" for line in lines)

                      + "echo 'Available devices:'\n" + "".join(f"echo '{line}'\n" for line in listed))
    script.chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("row", NVIDIA_ROWS)
def test_an_import_checks_the_build_has_code_for_each_gpu_here(tmp_path: Path, row: str) -> None:
    """Each captured NVIDIA machine (T4 7.5, A10G 8.6, RTX 4090 8.9, H100 9.0, an H100 MIG slice):
    a fleet build for "75;86;89;90" runs on every one; the one-architecture build made here ("90")
    only on the H100s, and elsewhere the import says which GPU lacks code and how to build for it."""
    gpus = json.loads((HARDWARE / row / "nvml.json").read_text())["gpus"]
    bin_dir = _fake_cuda_build(tmp_path, gpus)
    build = _llama_build()
    check = build.check_runs_here
    assert check(bin_dir, {"backend": "cuda", "cuda_architectures": ["75", "86", "89", "90"]}, "") \
        == "cuda build runs here"
    single = {"backend": "cuda", "cuda_architectures": ["90"]}
    if all(g["compute_cap"] == "9.0" for g in gpus):
        assert check(bin_dir, single, "") == "cuda build runs here"
    else:
        with pytest.raises(build.BuildArchiveError) as refused:
            check(bin_dir, single, "")
        assert f"not for {gpus[0]['name']} (compute capability {gpus[0]['compute_cap']})" in str(refused.value)
        assert "HOTFIT_CUDA_ARCHS" in str(refused.value)


def test_an_import_whose_module_holds_other_archs_than_its_record_says_is_refused(tmp_path: Path) -> None:
    """build-info.json is the exporter's word; the module is asked (its "ARCHS" feature, through
    ggml_ask.py, answered here as the real one answers: test_the_cuda_build_says_which_...) and an
    archive whose record claims architectures its module lacks is refused."""
    gpus = json.loads((HARDWARE / "nvidia-tesla-t4" / "nvml.json").read_text())["gpus"]
    build = _llama_build()
    check = build.check_runs_here

    def ggml_says(archs: str) -> Callable[..., str]:
        return lambda bin_dir, stub_libcuda=None: f"CUDA : ARCHS = {archs} | USE_GRAPHS = 1\nCPU : SSE3 = 1\n"

    setattr(build, "ask_ggml", ggml_says("750,860"))  # noqa: B010 (a module loaded from a file)
    honest = _fake_cuda_build(tmp_path / "honest", gpus)
    assert check(honest, {"backend": "cuda", "cuda_architectures": ["75", "86-real"]}, "") == "cuda build runs here"
    setattr(build, "ask_ggml", ggml_says("900"))  # noqa: B010
    mislabeled = _fake_cuda_build(tmp_path / "mislabeled", gpus)
    with pytest.raises(build.BuildArchiveError) as refused:
        check(mislabeled, {"backend": "cuda", "cuda_architectures": ["75", "90"]}, "")
    assert "says CUDA architectures 75;90, but libggml-cuda.so holds code for 90" in str(refused.value)


# ------------------------------------------------------------------------------ the real build
def test_the_cuda_build_says_which_architectures_it_holds_and_its_record_agrees() -> None:
    """Asked, not inferred: llama-server's system_info names the architectures nvcc compiled
    (__CUDA_ARCH_LIST__). Without a driver the module loads against the stub libcuda the build
    linked with (no device; nothing runs on it), and not at all without it."""
    bin_dir = require_cuda_build()
    info = _info(bin_dir)
    build = _llama_build()
    stub = info["libcuda"] if info["driver"] is None else None
    reported = build.reported_cuda_archs(bin_dir, stub)
    assert reported is not None
    assert set(reported) == arch_numbers(info["cuda_architectures"])
    if "cuda_architectures_compiled" in info:  # recorded by builds since the check (docs/builds.md)
        assert info["cuda_architectures_compiled"] == list(reported)
    if not HAS_DRIVER:
        assert build.reported_cuda_archs(bin_dir) is None  # the module does not load without libcuda
    # The build step refuses a build whose module lacks an architecture that was asked for.
    with pytest.raises(build.BuildArchiveError) as refused:
        build._checked_cuda_archs(bin_dir, {**info, "cuda_architectures": [*info["cuda_architectures"], "61"]})
    assert "were asked for: refusing the build" in str(refused.value)


FATBIN_MAGIC = 0xBA55ED50
FATBIN_KINDS = {1: "ptx", 2: "sass"}


def _fatbin_entries(library: Path) -> Counter[tuple[str, int]]:
    """(kind, architecture) of each code object in a CUDA module's ``.nv_fatbin`` section: "ptx"
    (the driver compiles it for that and any later GPU) or "sass" (machine code). Read from the
    entry headers, the fields cuobjdump lists (no toolkit wheel the install script uses ships it):
    a container is (u32 magic, u16 version, u16 header size, u64 size); an entry (u16 kind, u16,
    u32 header size, u64 payload size, ..., u32 architecture at byte 28)."""
    sections = subprocess.run(["readelf", "-S", "-W", str(library)], capture_output=True, text=True,
                              check=True).stdout
    fields = next(line.split() for line in sections.splitlines() if " .nv_fatbin " in line)
    at = fields.index(".nv_fatbin")
    offset, size = int(fields[at + 3], 16), int(fields[at + 4], 16)
    with open(library, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    found: Counter[tuple[str, int]] = Counter()
    pos = 0
    while pos + 16 <= len(data):
        magic, _version, header_size, fat_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:  # containers are 8-byte aligned
            pos += 8
            continue
        entry, end = pos + header_size, pos + header_size + fat_size
        while entry < end:
            kind, _, entry_header, payload = struct.unpack_from("<HHIQ", data, entry)
            found[(FATBIN_KINDS.get(kind, str(kind)), struct.unpack_from("<I", data, entry + 28)[0])] += 1
            entry += entry_header + payload
        pos = end
    return found


def test_each_cuda_architecture_holds_the_code_its_name_promises() -> None:
    """What the architectures check (core/cuda_arch.py) assumes, read from the module: a plain
    ``NN`` holds machine code and PTX (so a later GPU runs it after the driver compiles the PTX,
    as an H100 runs the fleet build's 86), ``NN-real`` machine code only, ``NN-virtual`` PTX
    only; for every CUDA object of the module, and nothing for an architecture not asked for."""
    bin_dir = require_cuda_build()
    info = _info(bin_dir)
    entries = _fatbin_entries(bin_dir / "libggml-cuda.so")
    assert entries, "no code objects read from .nv_fatbin"
    objects = max(entries.values())
    assert objects >= 100, entries  # ggml-cuda's sources: 144 in the pinned tree
    for arch in info["cuda_architectures"]:
        (number_text,) = arch_numbers([arch])
        number = int(number_text)
        assert entries[("sass", number)] == (0 if arch.endswith("-virtual") else objects), (arch, entries)
        assert entries[("ptx", number)] == (0 if arch.endswith("-real") else objects), (arch, entries)
    assert {str(a) for _, a in entries} == arch_numbers(info["cuda_architectures"]), entries


def test_the_cuda_build_holds_its_module_the_cpu_variants_and_the_cuda_runtime() -> None:
    bin_dir = require_cuda_build()
    info = _info(bin_dir)
    assert info["backend"] == "cuda" and info["variant"] == "portable" and info["ggml_backend_dl"] is True
    assert info["cuda_architectures"] and info["cuda_toolkit"].endswith("==13.0.2")
    if info["driver"] is None:  # built without a driver: linked against the stub
        assert info["libcuda"].endswith("/stubs/libcuda.so")
    names = {p.name for p in bin_dir.iterdir()}
    assert {"llama-server", "llama-fit-params", "build-info.json", "libggml-cuda.so", "libggml-base.so.0",
            "libggml.so.0", "libllama.so.0"} | CUDA_RUNTIME <= names
    assert "libcuda.so.1" not in names and "libcuda.so" not in names  # the driver's, never shipped
    # The CPU code is the portable build's modules, one per variant, none with AMX.
    variants = info["cpu_variants"]
    assert "x64" in variants and "haswell" in variants and "sapphirerapids" not in variants
    assert {f"libggml-cpu-{tag}.so" for tag in variants} <= names
    assert not {f for fs in variants.values() for f in fs} & AMX_CPUINFO
    cpu_build = _bin_dir("cpu") / "build-info.json"
    if cpu_build.is_file():
        assert variants == _info(cpu_build.parent)["cpu_variants"]
    # The module needs the driver's libcuda.so.1 (as linked against a real driver) and finds the
    # rest beside it; nothing else it needs is missing here.
    module = bin_dir / "libggml-cuda.so"
    assert {"libcuda.so.1", "libcudart.so.13", "libcublas.so.13"} <= set(_needed(module))
    assert "$ORIGIN" in subprocess.run(["readelf", "-d", str(module)], capture_output=True, text=True).stdout
    ldd = subprocess.run(["ldd", str(module)], capture_output=True, text=True).stdout
    missing = set(re.findall(r"^\s*(\S+) => not found", ldd, re.M))
    assert missing == (set() if HAS_DRIVER else {"libcuda.so.1"}), ldd
    for lib in CUDA_RUNTIME:
        assert f"{lib} => {bin_dir}/{lib}" in ldd, ldd


def test_the_cuda_build_runs_here_and_lists_a_cuda_device_only_with_a_driver() -> None:
    bin_dir = require_cuda_build()
    version = subprocess.run(["./llama-server", "--version"], cwd=bin_dir, capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and "version" in version.stdout + version.stderr
    devices = subprocess.run(["./llama-server", "--list-devices"], cwd=bin_dir, capture_output=True, text=True,
                             timeout=60)
    assert devices.returncode == 0, devices.stderr
    assert bool(re.search(r"^\s*CUDA\d+:", devices.stdout + devices.stderr, re.M)) == HAS_DRIVER


def test_the_cuda_build_exports_and_from_without_a_driver_is_refused_leaving_the_cache(tmp_path: Path) -> None:
    bin_dir = require_cuda_build()
    before = {p.name: p.stat().st_mtime_ns for p in bin_dir.iterdir()}
    archive = tmp_path / "llama-server-cuda.tar.gz"
    proc = _script("--backend", "cuda", "--export", str(archive))
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
        manifest = tar.extractfile("SHA256SUMS").read().decode()
    assert {f"cuda/bin/{n}" for n in ("llama-server", "libggml-cuda.so", "libggml-cpu-x64.so", "build-info.json",
                                      *CUDA_RUNTIME)} <= names
    assert len(manifest.splitlines()) == len(names) - 1
    if HAS_DRIVER:  # a GPU machine: the same archive installs (into a fresh cache) and sees its GPU
        ok = _script("--from", str(archive), cache=tmp_path / "fresh")
        assert ok.returncode == 0 and "cuda build runs here" in ok.stderr, ok.stderr
    else:
        proc = _refused(archive, tmp_path, "sees no CUDA device here")
        assert "libggml-cuda.so does not load here: libcuda.so.1" in proc.stderr, proc.stderr
    assert {p.name: p.stat().st_mtime_ns for p in bin_dir.iterdir()} == before  # the build cache as it was


def test_discovery_on_a_machine_without_a_gpu_never_picks_the_cuda_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """A plan here is for the host (no GPU): discovery looks for the CPU build only, and without a
    plan (status, serve) the CPU build comes first."""
    require_cuda_build()
    _require_build("cpu")
    if HAS_DRIVER:
        pytest.skip("this machine has an NVIDIA driver: the cuda build may rightly be picked")
    monkeypatch.delenv("HOTFIT_LLAMA_SERVER", raising=False)
    for device_kind in ("cpu", None):
        found = find_llama_server(load_settings(), path_env="", device_kind=device_kind)
        assert found.build.backend == "cpu" and found.server_path.parent == _bin_dir("cpu"), device_kind
