"""stages.probe: NVML (through a stand-in pynvml, the one allowed stand-in), AMD sysfs and host
memory from real files in temporary /proc, /sys and cgroup roots; saved probe files."""

from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

import pytest

from hotfit.pipeline.cli import main
from hotfit.core.errors import HardwareProbeError, UsageError
from hotfit.planner.probe import ProbeResult
from hotfit.backends.llama_server.devices import list_ggml_devices, parse_list_devices
from hotfit.stages.probe import load_probe_file, probe_devices, save_probe

TIER = "unit"

GiB = 1 << 30
MiB = 1 << 20


# ----------------------------------------------------------------------------- stand-in pynvml


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


class NVMLError_LibraryNotFound(NVMLError):
    def __init__(self) -> None:
        super().__init__(12)


@dataclass
class FakeGPU:
    name: str
    uuid: str
    total: int
    free: int
    procs: list[int] = field(default_factory=list)


def fake_nvml(gpus: list[FakeGPU], *, init_error: Exception | None = None,
              memory_error: Exception | None = None) -> SimpleNamespace:
    state = {"init": 0, "shutdown": 0}

    def init() -> None:
        if init_error is not None:
            raise init_error
        state["init"] += 1

    def memory(h: FakeGPU) -> SimpleNamespace:
        if memory_error is not None:
            raise memory_error
        return SimpleNamespace(total=h.total, free=h.free, used=h.total - h.free)

    def by_uuid(u: str) -> FakeGPU:
        for g in gpus:
            if g.uuid == u:
                return g
        raise NVMLError(13)

    return SimpleNamespace(
        NVMLError=NVMLError,
        NVMLError_LibraryNotFound=NVMLError_LibraryNotFound,
        NVML_ERROR_LIBRARY_NOT_FOUND=12,
        nvmlInit=init,
        nvmlShutdown=lambda: state.__setitem__("shutdown", state["shutdown"] + 1),
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: gpus[i],
        nvmlDeviceGetHandleByUUID=by_uuid,
        nvmlDeviceGetName=lambda h: h.name.encode(),  # older bindings return bytes
        nvmlDeviceGetUUID=lambda h: h.uuid,
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetComputeRunningProcesses=lambda h: [SimpleNamespace(usedGpuMemory=m) for m in h.procs],
        nvmlDeviceGetGraphicsRunningProcesses=lambda h: [],
        state=state,
    )


# ----------------------------------------------------------------------------- real files


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def roots(tmp_path: Path) -> SimpleNamespace:
    proc, sys_, cg = tmp_path / "proc", tmp_path / "sys", tmp_path / "cgroup"
    write(proc / "meminfo", "MemTotal:       32768000 kB\nMemFree:         1000000 kB\n"
                            "MemAvailable:   16384000 kB\nCached: 12 kB\n")
    write(proc / "self" / "cgroup", "0::/\n")
    cg.mkdir()
    sys_.mkdir()
    return SimpleNamespace(proc=proc, sys=sys_, cg=cg)


def probe(roots: SimpleNamespace, nvml: object = None, env: dict[str, str] | None = None) -> ProbeResult:
    return probe_devices(env=env or {}, nvml=nvml, proc_root=roots.proc, sys_root=roots.sys, cgroup_root=roots.cg)


def amd_card(roots: SimpleNamespace, n: int, total: int, used: int, name: str | None = "Radeon RX 7600") -> None:
    dev = roots.sys / "class" / "drm" / f"card{n}" / "device"
    write(dev / "vendor", "0x1002\n")
    write(dev / "device", "0x7480\n")
    write(dev / "mem_info_vram_total", f"{total}\n")
    write(dev / "mem_info_vram_used", f"{used}\n")
    write(dev / "mem_info_gtt_total", f"{64 * GiB}\n")  # never added
    if name:
        write(dev / "product_name", name + "\n")


# ----------------------------------------------------------------------------- NVIDIA


def test_nvml_devices_and_the_largest_budget_wins(roots: SimpleNamespace) -> None:
    nvml = fake_nvml([FakeGPU("RTX 3060", "GPU-aaaa-1111", 12 * GiB, 10 * GiB, procs=[300 * MiB, 200 * MiB]),
                      FakeGPU("RTX 4090", "GPU-bbbb-2222", 24 * GiB, 20 * GiB)])
    r = probe(roots, nvml)
    assert [d.kind for d in r.devices] == ["nvidia", "nvidia", "cpu"]
    first = r.devices[0]
    assert (first.name, first.total_bytes, first.free_bytes, first.uuid) == ("RTX 3060", 12 * GiB, 10 * GiB, "GPU-aaaa-1111")
    assert first.processes_used_bytes == 500 * MiB
    assert r.preferred.index == 1 and r.preferred.name == "RTX 4090"
    assert nvml.state == {"init": 1, "shutdown": 1}
    # Host RAM is listed but never chosen over an accelerator, and never added to it.
    assert r.preferred.free_bytes == 20 * GiB


@pytest.mark.parametrize("cvd, names", [
    ("1", ["B"]),
    ("1,0", ["B", "A"]),
    ("GPU-bbbb", ["B"]),           # unique UUID prefix
    ("0,7,1", ["A"]),              # CUDA stops at the first invalid entry
    ("GPU-zzzz,1", []),
    ("MIG-cccc-3333", ["C"]),
])
def test_cuda_visible_devices_is_honoured(roots: SimpleNamespace, cvd: str, names: list[str]) -> None:
    nvml = fake_nvml([FakeGPU("A", "GPU-aaaa", 8 * GiB, 8 * GiB), FakeGPU("B", "GPU-bbbb", 8 * GiB, 8 * GiB)])
    mig = FakeGPU("C", "MIG-cccc-3333", 10 * GiB, 10 * GiB)
    base = nvml.nvmlDeviceGetHandleByUUID
    nvml.nvmlDeviceGetHandleByUUID = lambda u: mig if u == mig.uuid else base(u)
    r = probe(roots, nvml, {"CUDA_VISIBLE_DEVICES": cvd})
    assert [d.name for d in r.devices if d.kind == "nvidia"] == names
    if len(names) < len(cvd.split(",")):
        assert any("CUDA_VISIBLE_DEVICES" in n for n in r.notes)


@pytest.mark.parametrize("cvd", ["", "-1", "NoDevFiles"])
def test_cuda_visible_devices_hiding_everything_skips_nvml(roots: SimpleNamespace, cvd: str) -> None:
    nvml = fake_nvml([], init_error=NVMLError(9))  # would fail if touched
    r = probe(roots, nvml, {"CUDA_VISIBLE_DEVICES": cvd})
    assert r.preferred.kind == "cpu" and any("hides every NVIDIA device" in n for n in r.notes)


def test_nvml_absent_falls_back_to_host_memory_with_a_note(roots: SimpleNamespace) -> None:
    for nvml in (None, fake_nvml([], init_error=NVMLError_LibraryNotFound())):
        r = probe(roots, nvml)
        assert [d.kind for d in r.devices] == ["cpu"]
        assert r.preferred.total_bytes == 32768000 * 1024 and r.preferred.free_bytes == 16384000 * 1024
        assert any("NVML" in n for n in r.notes)


@pytest.mark.parametrize("kwargs", [{"init_error": NVMLError(9)}, {"memory_error": NVMLError(3)}])
def test_nvml_present_but_failing_is_an_error_not_a_fallback(roots: SimpleNamespace, kwargs: dict) -> None:
    nvml = fake_nvml([FakeGPU("A", "GPU-a", 8 * GiB, 8 * GiB)], **kwargs)
    with pytest.raises(HardwareProbeError) as exc:
        probe(roots, nvml)
    assert exc.value.exit_code == 7 and "NVML" in str(exc.value)


def test_the_real_pynvml_without_a_driver_is_reported_as_absent(roots: SimpleNamespace) -> None:
    pynvml = pytest.importorskip("pynvml")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        r = probe(roots, pynvml)
        assert r.preferred.kind == "cpu" and any("NVML library not found" in n for n in r.notes)
    else:  # pragma: no cover - a machine with a driver: the real path must find devices
        pynvml.nvmlShutdown()
        assert probe(roots, pynvml).preferred.kind == "nvidia"


# ----------------------------------------------------------------------------- AMD


def test_amd_vram_from_sysfs_without_gtt(roots: SimpleNamespace) -> None:
    amd_card(roots, 0, 8 * GiB, 1 * GiB)
    amd_card(roots, 1, 16 * GiB, 2 * GiB, name=None)
    # A connector entry and a non-AMD card are ignored.
    write(roots.sys / "class" / "drm" / "card0-DP-1" / "status", "connected\n")
    other = roots.sys / "class" / "drm" / "card2" / "device"
    write(other / "vendor", "0x8086\n")
    write(other / "mem_info_vram_total", f"{4 * GiB}\n")
    write(other / "mem_info_vram_used", "0\n")
    r = probe(roots, None)
    amd = [d for d in r.devices if d.kind == "amd"]
    assert [(d.total_bytes, d.free_bytes) for d in amd] == [(8 * GiB, 7 * GiB), (16 * GiB, 14 * GiB)]
    assert amd[0].name == "Radeon RX 7600" and "card1" in amd[1].name
    assert r.preferred is amd[1]


# ----------------------------------------------------------------------------- host memory, cgroups


def test_cgroup_v2_limit_bounds_host_memory(roots: SimpleNamespace) -> None:
    write(roots.proc / "self" / "cgroup", "0::/user.slice/job\n")
    write(roots.cg / "cgroup.controllers", "memory cpu\n")
    job = roots.cg / "user.slice" / "job"
    write(job / "memory.max", f"{8 * GiB}\n")
    write(job / "memory.current", f"{3 * GiB}\n")
    write(job / "memory.stat", f"anon 1\ninactive_file {1 * GiB}\n")
    write(roots.cg / "user.slice" / "memory.max", "max\n")
    r = probe(roots, None)
    host = r.preferred
    assert host.kind == "cpu" and host.total_bytes == 8 * GiB
    assert host.free_bytes == 8 * GiB - 3 * GiB + 1 * GiB
    assert "cgroup" in host.name


def test_a_tighter_parent_cgroup_wins(roots: SimpleNamespace) -> None:
    write(roots.proc / "self" / "cgroup", "0::/a/b\n")
    write(roots.cg / "cgroup.controllers", "memory\n")
    write(roots.cg / "a" / "memory.max", f"{4 * GiB}\n")
    write(roots.cg / "a" / "memory.current", f"{3 * GiB}\n")
    write(roots.cg / "a" / "b" / "memory.max", f"{16 * GiB}\n")
    write(roots.cg / "a" / "b" / "memory.current", f"{1 * GiB}\n")
    r = probe(roots, None)
    assert r.preferred.total_bytes == 4 * GiB and r.preferred.free_bytes == 1 * GiB


def test_cgroup_v1_limit_and_unlimited(roots: SimpleNamespace) -> None:
    write(roots.proc / "self" / "cgroup", "4:memory:/docker/abc\n0::/\n")
    mem = roots.cg / "memory" / "docker" / "abc"
    write(mem / "memory.limit_in_bytes", f"{6 * GiB}\n")
    write(mem / "memory.usage_in_bytes", f"{2 * GiB}\n")
    write(mem / "memory.stat", f"cache 5\ntotal_inactive_file {512 * MiB}\n")
    write(roots.cg / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")
    r = probe(roots, None)
    assert r.preferred.total_bytes == 6 * GiB and r.preferred.free_bytes == 4 * GiB + 512 * MiB
    write(mem / "memory.limit_in_bytes", "9223372036854771712\n")
    r = probe(roots, None)
    assert r.preferred.total_bytes == 32768000 * 1024 and r.preferred.name == "host memory"


def test_this_machine_probes_without_error() -> None:
    r = probe_devices(nvml=None)
    assert r.preferred.total_bytes > 0 and 0 <= r.preferred.free_bytes <= r.preferred.total_bytes


# ----------------------------------------------------------------------------- saved probes + CLI


def test_save_and_load_round_trip(tmp_path: Path, roots: SimpleNamespace) -> None:
    nvml = fake_nvml([FakeGPU("RTX 3060", "GPU-a", 12 * GiB, 10 * GiB)])
    r = probe(roots, nvml)
    path = tmp_path / "probe.json"
    save_probe(r, path)
    data = json.loads(path.read_text())
    assert data["schema"] == 1 and data["selected"] == 0
    assert {"index", "kind", "name", "total_bytes", "free_bytes"} <= set(data["devices"][0])
    loaded = load_probe_file(path)
    assert loaded.devices == r.devices and loaded.preferred == r.preferred


def test_save_to_an_unwritable_path_is_a_usage_error(tmp_path: Path, roots: SimpleNamespace) -> None:
    r = probe(roots, fake_nvml([FakeGPU("RTX 3060", "GPU-a", 12 * GiB, 10 * GiB)]))
    target = tmp_path / "a-directory.json"
    target.mkdir()
    with pytest.raises(UsageError) as exc:
        save_probe(r, target)
    assert str(target) in str(exc.value) and exc.value.hint


GOOD = {"schema": 1, "devices": [{"index": 0, "kind": "nvidia", "name": "X", "total_bytes": 100, "free_bytes": 50}],
        "selected": 0}


@pytest.mark.parametrize("mutate, field", [
    (lambda d: d.update(schema=2), "schema"),
    (lambda d: d.update(devices=[]), "devices"),
    (lambda d: d["devices"][0].update(kind="tpu"), "devices[0].kind"),
    (lambda d: d["devices"][0].update(total_bytes="8GiB"), "devices[0].total_bytes"),
    (lambda d: d["devices"][0].update(free_bytes=-1), "devices[0].free_bytes"),
    (lambda d: d["devices"][0].update(free_bytes=101), "devices[0].free_bytes"),
    (lambda d: d["devices"][0].update(index=True), "devices[0].index"),
    (lambda d: d.update(selected=3), "selected"),
])
def test_bad_probe_file_names_the_file_and_field(tmp_path: Path, mutate, field: str) -> None:
    data = json.loads(json.dumps(GOOD))
    mutate(data)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as exc:
        load_probe_file(path)
    assert str(path) in str(exc.value) and field in str(exc.value)
    assert exc.value.details["field"] == field


def test_unreadable_or_non_json_probe_file(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot be read") as missing:
        load_probe_file(tmp_path / "missing.json")
    assert missing.value.hint  # what to do: save one with hotfit probe --save
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(UsageError, match="not JSON"):
        load_probe_file(tmp_path / "x.json")


def test_a_deeply_nested_probe_file_is_a_usage_error_not_a_traceback(tmp_path: Path) -> None:
    path = tmp_path / "probe.json"
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(UsageError) as exc:
        load_probe_file(path)
    assert str(path) in str(exc.value)


@pytest.mark.integration
def test_probe_cli_json_and_save(tmp_path: Path, hotfit_home: Path) -> None:
    out = io.StringIO()
    save = tmp_path / "saved.json"
    assert main(["probe", "--json", "--save", str(save)], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["schema"] == 1 and isinstance(data["selected"], int)
    assert all({"index", "kind", "name", "total_bytes", "free_bytes"} <= set(d) for d in data["devices"])
    assert load_probe_file(save).preferred.index == data["selected"]


# ----------------------------------------------------------------------------- ggml's device list

LAVAPIPE_LISTING = (
    "ggml_vulkan: Found 1 Vulkan devices:\n"
    "Available devices:\n"
    "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)\n"
)


def _lister(tmp_path: Path, text: str, code: int = 0) -> Path:
    """A stand-in binary printing a `--list-devices` answer (the real Vulkan build is tested in
    tests/test_vulkan.py); the text is llama.cpp's format, copied from a real lavapipe run."""
    path = tmp_path / "lister" / "llama-server"
    path.parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "listing.txt").write_text(text)
    path.write_text(f"#!/bin/sh\ncat {tmp_path / 'listing.txt'}\nexit {code}\n")
    path.chmod(0o755)
    return path


def test_list_devices_lines_are_parsed_in_bytes() -> None:
    devices = parse_list_devices(LAVAPIPE_LISTING + "  CUDA0: NVIDIA H200 (143167 MiB, 142000 MiB free)\nnoise\n")
    assert [(d.name, d.api, d.total_bytes, d.free_bytes) for d in devices] == [
        ("Vulkan0", "vulkan", 2048 * MiB, 2048 * MiB), ("CUDA0", "cuda", 143167 * MiB, 142000 * MiB)]
    assert devices[0].description == "llvmpipe (LLVM 15.0.6, 256 bits)"
    assert parse_list_devices("Available devices:\n") == []  # a CPU build lists none


@pytest.mark.integration
def test_a_vulkan_only_device_is_probed_through_the_binary(roots: SimpleNamespace, tmp_path: Path) -> None:
    binary = _lister(tmp_path, LAVAPIPE_LISTING)
    r = probe_devices(env={}, nvml=None, proc_root=roots.proc, sys_root=roots.sys, cgroup_root=roots.cg,
                      listing=list_ggml_devices(binary, {}))
    assert [d.kind for d in r.devices] == ["vulkan", "cpu"]
    vk = r.devices[0]
    assert (vk.name, vk.total_bytes, vk.free_bytes, vk.ggml_device) == (
        "llvmpipe (LLVM 15.0.6, 256 bits)", 2 * GiB, 2 * GiB, "Vulkan0")


@pytest.mark.integration
def test_a_card_nvml_or_sysfs_reported_keeps_their_figures_and_gets_its_vulkan_name(
        roots: SimpleNamespace, tmp_path: Path) -> None:
    amd_card(roots, 0, 8 * GiB, 1 * GiB, name="Radeon RX 7600")
    binary = _lister(tmp_path, "  Vulkan0: AMD Radeon RX 7600 (RADV NAVI33) (7000 MiB, 6000 MiB free)\n")
    r = probe_devices(env={}, nvml=None, proc_root=roots.proc, sys_root=roots.sys, cgroup_root=roots.cg,
                      listing=list_ggml_devices(binary, {}))
    assert [d.kind for d in r.devices] == ["amd", "cpu"]
    amd = r.devices[0]
    assert (amd.total_bytes, amd.free_bytes, amd.ggml_device) == (8 * GiB, 7 * GiB, "Vulkan0")
    assert any("planning with the amd figure" in n for n in r.notes)  # 7000 MiB vs 8 GiB: > 5 % apart


@pytest.mark.integration
def test_a_binary_that_cannot_list_devices_is_noted_not_fatal(roots: SimpleNamespace, tmp_path: Path) -> None:
    binary = _lister(tmp_path, "ggml_vulkan: no devices\n", code=1)
    r = probe_devices(env={}, nvml=None, proc_root=roots.proc, sys_root=roots.sys, cgroup_root=roots.cg,
                      listing=list_ggml_devices(binary, {}))
    assert [d.kind for d in r.devices] == ["cpu"]
    assert any("--list-devices exited with 1" in n for n in r.notes)


@pytest.mark.integration
def test_a_probe_file_keeps_the_vulkan_device_name(tmp_path: Path, roots: SimpleNamespace) -> None:
    binary = _lister(tmp_path, LAVAPIPE_LISTING)
    r = probe_devices(env={}, nvml=None, proc_root=roots.proc, sys_root=roots.sys, cgroup_root=roots.cg,
                      listing=list_ggml_devices(binary, {}))
    path = tmp_path / "probe.json"
    save_probe(r, path)
    again = load_probe_file(path)
    assert again.devices[0].ggml_device == "Vulkan0" and again.devices[0].kind == "vulkan"
    data = json.loads(path.read_text())
    data["devices"][0]["ggml_device"] = "Vulkan0; rm -rf /"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="ggml_device"):
        load_probe_file(path)


def test_the_gpus_compute_capability_comes_from_nvml_and_is_none_when_nvml_does_not_say(
        tmp_path: Path, roots: SimpleNamespace) -> None:
    """The load stage's preflight checks a CUDA build has code for it (core/cuda_arch.py); an NVML
    that cannot say leaves it unknown, never a probe error."""
    nvml = fake_nvml([FakeGPU("NVIDIA L4", "GPU-aaaa", 24 * GiB, 23 * GiB)])
    assert probe(roots, nvml).devices[0].compute_capability is None  # bindings without the call
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: (8, 9)
    found = probe(roots, nvml)
    assert found.devices[0].compute_capability == "8.9"
    path = tmp_path / "probe.json"
    save_probe(found, path)
    assert load_probe_file(path).devices[0].compute_capability == "8.9"

    def unsupported(h: object) -> object:
        raise NVMLError(3)

    nvml.nvmlDeviceGetCudaComputeCapability = unsupported
    nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle = unsupported
    gpu = probe(roots, nvml).devices[0]
    assert (gpu.kind, gpu.compute_capability) == ("nvidia", None)
    nvml.nvmlDeviceGetCudaComputeCapability = lambda h: "garbage"
    assert probe(roots, nvml).devices[0].compute_capability is None

    data = json.loads(path.read_text())
    data["devices"][0]["compute_capability"] = "8,9"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="compute_capability"):
        load_probe_file(path)
