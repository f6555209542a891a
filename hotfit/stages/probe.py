"""Probe stage: what memory this machine offers, device by device (effectful, thin).

Sources, in order (spec "Selection and hot context": the input budget is the hardware probe's
usable memory after device reservations):

1. NVIDIA through NVML (``pynvml`` from nvidia-ml-py): name, UUID, total, free and the memory
   other processes hold, for the devices ``CUDA_VISIBLE_DEVICES`` leaves visible (indices or
   UUID prefixes, parsed like CUDA: the list stops at its first invalid entry). NVML not
   installed (ImportError, or ``NVMLError_LibraryNotFound``) → skipped with a note and a log
   event; NVML present but failing → ``HardwareProbeError``, never a silent fallback.
   Indices are NVML's (PCI bus order), which is CUDA's order under CUDA_DEVICE_ORDER=PCI_BUS_ID;
   the UUID recorded per device is what later stages pin llama-server to. A GPU in MIG mode is
   listed as its MIG devices (name, MIG- UUID, the slice's memory), never as the whole card.
2. AMD through DRM sysfs: ``/sys/class/drm/cardN/device/mem_info_vram_total`` and
   ``mem_info_vram_used`` of vendor 0x1002 cards. GTT (system memory the GPU may map) is never
   added: it is host RAM.
3. GPUs that ggml's Vulkan backend sees, asked of the backends (:meth:`Backend.list_devices`; the
   llama backend asks the Vulkan llama-server hotfit would run, ``--list-devices``: name, total
   and free MiB). A device NVML or sysfs already
   reported is matched by name and keeps those figures (a total that disagrees by more than 5 %
   is noted); any other becomes a ``vulkan`` device (Intel, an AMD card without VRAM counters,
   Mesa's lavapipe). ggml hides CPU-type Vulkan devices such as lavapipe unless the operator sets
   ``GGML_VK_VISIBLE_DEVICES``; the probe passes the environment through and hides nothing itself.
4. Host memory: ``/proc/meminfo`` MemAvailable, bounded by every cgroup v2 (``memory.max`` −
   ``memory.current`` + reclaimable ``inactive_file``) or v1 (``memory.limit_in_bytes`` −
   ``memory.usage_in_bytes`` + ``total_inactive_file``) level above this process. Listed always.

RAM and device memory are never added together. ``preferred`` is the probe's default (the
accelerator with the largest usable budget, else host memory); the planner plans every listed
device and places the model where its plan won (the plan's ``Placement``, planner/plan.py). Roots
(/proc, /sys, the cgroup mount) and the NVML module are parameters so tests feed real files and
a stand-in ``pynvml``.

Over 400 lines: NVML, AMD sysfs, cgroup-limited host RAM, the probe file and ggml's own device list
are the probe stage's sources, kept in the one module per stage the design card asks for.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import anyio

from hotfit.backends.base import DeviceListing, ListedDevice
from hotfit.backends.select import list_devices
from hotfit.core.errors import HardwareProbeError, UsageError
from hotfit.core.log import get_logger
from hotfit.planner.probe import Device, ProbeResult, decode_probe
from hotfit.core.records import Fields, parse_json
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages._host_speed import HostSpeed, host_speed
from hotfit.state.files import read_text_document, write_text_atomic

log = get_logger()

AMD_PCI_VENDOR = "0x1002"
# cgroup v1 reports "no limit" as LONG_MAX rounded down to a page; anything this large is unlimited.
CGROUP_V1_UNLIMITED = 1 << 60
MiB = 1 << 20
# NVML/sysfs and ggml round differently (MiB, reserved regions); beyond this they disagree.
DEVICE_TOTAL_MISMATCH = 0.05


class _ImportPynvml:
    """Default for ``nvml=``: import the real module."""


IMPORT_PYNVML: Any = _ImportPynvml()


# --------------------------------------------------------------------------- NVIDIA (NVML)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _library_missing(nvml: Any, exc: BaseException) -> bool:
    cls = getattr(nvml, "NVMLError_LibraryNotFound", None)
    if cls is not None and isinstance(exc, cls):
        return True
    code = getattr(nvml, "NVML_ERROR_LIBRARY_NOT_FOUND", 12)
    return getattr(exc, "value", None) == code


def _nvml_failure(what: str, exc: BaseException) -> HardwareProbeError:
    return HardwareProbeError(
        f"NVML is installed but failing: {what}: {exc}",
        hint="fix the NVIDIA driver (nvidia-smi must work), or hide NVIDIA devices with CUDA_VISIBLE_DEVICES= "
             "to plan for other memory, or plan from a saved probe with --probe-file",
        nvml_error=str(exc),
    )


def _visible_handles(nvml: Any, raw: str | None, notes: list[str]) -> list[Any]:
    """Handles in CUDA order for CUDA_VISIBLE_DEVICES (None = all, by NVML index)."""
    count = nvml.nvmlDeviceGetCount()
    all_handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
    if raw is None:
        return all_handles
    uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in all_handles]
    chosen: list[Any] = []
    seen: set[str] = set()
    for token in (t.strip() for t in raw.split(",")):
        handle = None
        key = token
        if re.fullmatch(r"\d+", token) and int(token) < count:
            handle, key = all_handles[int(token)], uuids[int(token)]
        elif token.startswith("GPU-"):
            matches = [i for i, u in enumerate(uuids) if u.startswith(token)]
            if len(matches) == 1:
                handle, key = all_handles[matches[0]], uuids[matches[0]]
        elif token.startswith("MIG-"):
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(token)
            except nvml.NVMLError:
                handle = None
        if handle is None:
            # CUDA ignores the rest of the list after the first entry it cannot resolve.
            notes.append(f"CUDA_VISIBLE_DEVICES entry {token!r} matches no NVIDIA device; later entries ignored")
            break
        if key not in seen:
            seen.add(key)
            chosen.append(handle)
    return chosen


def _mig_devices(nvml: Any, handle: Any) -> list[Any] | None:
    """The MIG devices of a GPU in MIG mode (None: MIG off, unsupported, or a MIG device itself).
    CUDA cannot allocate on such a GPU, only on its MIG devices, each pinned by its MIG- UUID."""
    get_mode = getattr(nvml, "nvmlDeviceGetMigMode", None)
    if get_mode is None:
        return None
    try:
        current = get_mode(handle)[0]
    except nvml.NVMLError:
        return None  # not MIG-capable (NVML_ERROR_NOT_SUPPORTED), or a MIG device's own handle
    if current != getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1):
        return None
    found = []
    for i in range(nvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
        try:
            found.append(nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, i))
        except nvml.NVMLError:
            continue  # an empty slot (NVML_ERROR_NOT_FOUND)
    return found


def _mig_expanded(nvml: Any, handles: list[Any], notes: list[str]) -> list[Any]:
    """Each GPU in MIG mode replaced by its MIG devices: the whole card's memory is not one budget."""
    out: list[Any] = []
    for handle in handles:
        migs = _mig_devices(nvml, handle)
        if migs is None:
            out.append(handle)
            continue
        name = _text(nvml.nvmlDeviceGetName(handle))
        notes.append(f"{name} is in MIG mode: its {len(migs)} MIG device(s) are listed instead of the whole GPU"
                     + ("" if migs else "; it has none configured, so nothing on it can be planned"))
        out.extend(migs)
    return out


def _hides_all(raw: str | None) -> bool:
    """CUDA_VISIBLE_DEVICES set so that no device can be visible ('', '-1', 'NoDevFiles', ...)."""
    if raw is None:
        return False
    first = raw.split(",")[0].strip()
    return not (re.fullmatch(r"\d+", first) or first.startswith(("GPU-", "MIG-")))


def probe_nvidia(nvml: Any, env: Mapping[str, str], notes: list[str]) -> list[Device]:
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if _hides_all(raw):
        notes.append(f"CUDA_VISIBLE_DEVICES={raw!r} hides every NVIDIA device; NVML not queried")
        log.info("probe.nvml_skipped", reason="CUDA_VISIBLE_DEVICES hides all devices", value=raw)
        return []
    if nvml is IMPORT_PYNVML:
        try:
            import pynvml  # nvidia-ml-py
        except ImportError as exc:
            notes.append(f"NVML not available (pynvml not importable: {exc}); NVIDIA devices not probed")
            log.info("probe.nvml_absent", reason="pynvml not importable", error=str(exc))
            return []
        nvml = pynvml
    elif nvml is None:
        notes.append("NVML not available (pynvml not installed); NVIDIA devices not probed")
        log.info("probe.nvml_absent", reason="pynvml not installed")
        return []
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as exc:
        if _library_missing(nvml, exc):
            notes.append(f"NVML library not found ({exc}); NVIDIA devices not probed")
            log.info("probe.nvml_absent", reason="NVML shared library not found", error=str(exc))
            return []
        raise _nvml_failure("nvmlInit", exc) from exc
    devices: list[Device] = []
    try:
        handles = _mig_expanded(nvml, _visible_handles(nvml, raw, notes), notes)
        if raw is not None and env.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and len(handles) > 1:
            notes.append("CUDA_VISIBLE_DEVICES indices were read in NVML (PCI bus) order; set "
                         "CUDA_DEVICE_ORDER=PCI_BUS_ID so CUDA numbers devices the same way")
        for handle in handles:
            name = _text(nvml.nvmlDeviceGetName(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            devices.append(Device(index=-1, kind="nvidia", name=name, total_bytes=int(mem.total),
                                  free_bytes=int(mem.free), uuid=uuid,
                                  processes_used_bytes=_processes_used(nvml, handle),
                                  compute_capability=_compute_capability(nvml, handle),
                                  **_memory_bandwidth(nvml, handle)))
    except nvml.NVMLError as exc:
        raise _nvml_failure("reading device memory", exc) from exc
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass
    if not devices and raw is None:
        notes.append("NVML found no NVIDIA device")
    return devices


def _compute_capability(nvml: Any, handle: Any) -> str | None:
    """The device's CUDA compute capability ("8.9"): the load stage's preflight refuses a CUDA build
    without code for it before any download (core/cuda_arch.py). A MIG device answers through its
    GPU. None when NVML does not say: informational, nothing is refused on it."""
    def own() -> Any:
        return nvml.nvmlDeviceGetCudaComputeCapability(handle)

    def through_its_gpu() -> Any:
        return nvml.nvmlDeviceGetCudaComputeCapability(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle))

    for ask in (own, through_its_gpu):
        try:
            major, minor = ask()
            return f"{int(major)}.{int(minor)}"
        except nvml.NVMLError:
            continue  # a MIG device may answer only through its GPU
        except (AttributeError, TypeError, ValueError):
            return None  # bindings without the call, or not a (major, minor) pair
    return None


def _memory_bandwidth(nvml: Any, handle: Any) -> dict[str, Any]:
    """The card's peak memory read bandwidth from NVML: max memory clock (MHz) x 2 (double data rate)
    x bus width (bits) / 8 — H100 SXM 2619 MHz x 5120 bits = 3.35 TB/s, RTX 4090 10501 MHz x 384
    bits = 1.01 TB/s, the vendors' figures. A MIG device answers through its GPU (the whole card's
    figure: an upper bound for its slice). Empty when NVML does not say: the speed model then
    assumes a figure and its basis says so (registry/speed.py)."""
    def ask(h: Any) -> tuple[int, int]:
        return int(nvml.nvmlDeviceGetMaxClockInfo(h, getattr(nvml, "NVML_CLOCK_MEM", 2))), \
            int(nvml.nvmlDeviceGetMemoryBusWidth(h))

    for get in (lambda: ask(handle), lambda: ask(nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(handle))):
        try:
            clock_mhz, bus_bits = get()
        except nvml.NVMLError:
            continue
        except (AttributeError, TypeError, ValueError):
            return {}
        if clock_mhz > 0 and bus_bits > 0:
            return {"read_bandwidth_bytes_per_s": clock_mhz * 1_000_000 * 2 * bus_bits // 8,
                    "bandwidth_basis": f"NVML: memory clock {clock_mhz} MHz x 2 x {bus_bits}-bit bus"}
    return {}


def _processes_used(nvml: Any, handle: Any) -> int | None:
    """Memory other processes hold on the device (None when the driver does not say)."""
    total = 0
    known = False
    for getter in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses"):
        fn = getattr(nvml, getter, None)
        if fn is None:
            continue
        try:
            procs = fn(handle)
        except nvml.NVMLError:
            continue  # informational only: free memory already excludes what they hold
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            if used is not None:
                total += int(used)
                known = True
    return total if known else None


# --------------------------------------------------------------------------- AMD (DRM sysfs)


def _read_int(path: Path) -> int:
    return int(path.read_text().strip())


def _pci_device(dev: Path) -> str:
    """The PCI device id, from ``device`` or else ``uevent``'s PCI_ID (vendor:device), or '?'."""
    try:
        if (dev / "device").exists():
            return (dev / "device").read_text().strip()
        for line in (dev / "uevent").read_text().splitlines():
            if line.startswith("PCI_ID=") and ":" in line:
                return "0x" + line.split(":", 1)[1].strip().lower()
    except OSError:
        pass
    return "?"


def probe_amd(sys_root: Path, notes: list[str]) -> list[Device]:
    drm = sys_root / "class" / "drm"
    if not drm.is_dir():
        return []
    devices: list[Device] = []
    seen: set[Path] = set()
    cards = sorted((p for p in drm.iterdir() if re.fullmatch(r"card\d+", p.name)), key=lambda p: int(p.name[4:]))
    for card in cards:
        dev = card / "device"
        total_file, used_file = dev / "mem_info_vram_total", dev / "mem_info_vram_used"
        if not total_file.exists():
            continue
        real = dev.resolve()
        if real in seen:
            continue
        seen.add(real)
        try:
            vendor = (dev / "vendor").read_text().strip().lower() if (dev / "vendor").exists() else AMD_PCI_VENDOR
            if vendor != AMD_PCI_VENDOR:
                continue
            total = _read_int(total_file)
            used = _read_int(used_file)
        except (OSError, ValueError) as exc:
            notes.append(f"{card.name}: VRAM counters unreadable ({exc}); skipped")
            log.warning("probe.amd_unreadable", card=card.name, error=str(exc))
            continue
        name_file = dev / "product_name"
        name = ""
        if name_file.exists():
            try:
                name = name_file.read_text().strip()
            except OSError:
                name = ""
        if not name:
            name = f"AMD GPU {card.name} (PCI device {_pci_device(dev)})"
        devices.append(Device(index=-1, kind="amd", name=name, total_bytes=total,
                              free_bytes=max(total - used, 0)))
    return devices


# --------------------------------------------------------------------------- the backends' device lists


def _same_card(device: Device, ggml: ListedDevice) -> bool:
    a, b = device.name.lower(), ggml.description.lower()
    return bool(a) and (a in b or b.split(" (")[0] in a)


def merge_ggml_devices(found: list[Device], ggml: tuple[ListedDevice, ...], notes: list[str]) -> list[Device]:
    """Pure: NVML/sysfs devices with the Vulkan name of the same card attached, plus the Vulkan
    devices nothing else reported. CUDA entries only cross-check NVML (CUDA is pinned by UUID).
    ``ggml``: what the backends listed (:func:`backends.select.list_devices`)."""
    out = list(found)
    for g in ggml:
        if g.api != "vulkan":
            if g.api == "cuda" and not any(d.kind == "nvidia" for d in found):
                notes.append(f"llama-server sees {g.name} ({g.description}) but NVML reported no NVIDIA device")
            continue
        match = next((i for i, d in enumerate(out) if d.kind in ("nvidia", "amd") and d.ggml_device is None
                      and _same_card(d, g)), None)
        if match is None:
            out.append(Device(index=-1, kind="vulkan", name=g.description, total_bytes=g.total_bytes,
                              free_bytes=min(g.free_bytes, g.total_bytes), ggml_device=g.name))
            continue
        d = out[match]
        if abs(g.total_bytes - d.total_bytes) > DEVICE_TOTAL_MISMATCH * d.total_bytes:
            notes.append(f"{d.name}: {d.kind} reports {d.total_bytes // MiB} MiB, Vulkan ({g.name}) "
                         f"{g.total_bytes // MiB} MiB; planning with the {d.kind} figure")
        out[match] = replace(d, ggml_device=g.name)
    return out


# --------------------------------------------------------------------------- host memory


def _meminfo(proc_root: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (proc_root / "meminfo").read_text().splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out


def _stat_value(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v.strip())
    except (OSError, ValueError):
        pass
    return 0


def _levels(base: Path, rel: str) -> list[Path]:
    """The cgroup directory of this process and every ancestor up to the mount (existing ones)."""
    parts = [p for p in rel.strip("/").split("/") if p]
    out = []
    for i in range(len(parts), -1, -1):
        d = base.joinpath(*parts[:i])
        if d.is_dir():
            out.append(d)
    return out


def cgroup_limits(proc_root: Path, cgroup_root: Path) -> tuple[int | None, int | None]:
    """(tightest limit, least room left under any limit) over the cgroup levels; None = unlimited."""
    try:
        lines = (proc_root / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None, None
    limit: int | None = None
    room: int | None = None

    def take(lim: int, usage: int, inactive: int) -> None:
        nonlocal limit, room
        left = max(lim - usage + inactive, 0)
        limit = lim if limit is None else min(limit, lim)
        room = left if room is None else min(room, left)

    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hier == "0" and controllers == "":
            base = cgroup_root if (cgroup_root / "cgroup.controllers").exists() else cgroup_root / "unified"
            for d in _levels(base, path):
                max_file = d / "memory.max"
                if not max_file.exists():
                    continue
                raw = max_file.read_text().strip()
                if raw == "max":
                    continue
                take(int(raw), _read_int(d / "memory.current"), _stat_value(d / "memory.stat", "inactive_file"))
        elif "memory" in controllers.split(","):
            for d in _levels(cgroup_root / "memory", path):
                lim_file = d / "memory.limit_in_bytes"
                if not lim_file.exists():
                    continue
                lim = _read_int(lim_file)
                if lim >= CGROUP_V1_UNLIMITED:
                    continue
                take(lim, _read_int(d / "memory.usage_in_bytes"),
                     _stat_value(d / "memory.stat", "total_inactive_file"))
    return limit, room


def probe_host(proc_root: Path, cgroup_root: Path, notes: list[str], speed: HostSpeed | None = None) -> Device:
    info = _meminfo(proc_root)
    if "MemTotal" not in info or "MemAvailable" not in info:
        raise HardwareProbeError(f"{proc_root / 'meminfo'} has no MemTotal/MemAvailable",
                                 hint="plan from a saved probe with --probe-file")
    total, free = info["MemTotal"], info["MemAvailable"]
    limit, room = cgroup_limits(proc_root, cgroup_root)
    name = "host memory"
    if limit is not None and room is not None and (limit < total or room < free):
        total, free = min(total, limit), min(free, room)
        name = "host memory (cgroup limit)"
        notes.append(f"host memory bounded by a cgroup limit of {limit} bytes")
    return Device(index=-1, kind="cpu", name=name, total_bytes=total, free_bytes=min(free, total),
                  read_bandwidth_bytes_per_s=None if speed is None else speed.read_bandwidth_bytes_per_s,
                  bandwidth_basis=None if speed is None else speed.basis,
                  compute_threads=None if speed is None else speed.threads)


# --------------------------------------------------------------------------- the probe


def probe_devices(
    *,
    env: Mapping[str, str] | None = None,
    nvml: ModuleType | Any = IMPORT_PYNVML,
    proc_root: Path = Path("/proc"),
    sys_root: Path = Path("/sys"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    listing: DeviceListing = DeviceListing(),
    host_speed: HostSpeed | None = None,
) -> ProbeResult:
    """Every device with its memory, and the one the probe alone prefers (largest usable budget).

    ``listing``: the GPUs the backends' runtimes see (source 3; :func:`backends.select.list_devices`).
    ``host_speed``: the host's measured bandwidth and threads (stages/_host_speed.py), recorded on
    the host device (None: not measured, e.g. in tests of the memory sources)."""
    env = os.environ if env is None else env
    notes: list[str] = []
    found = probe_nvidia(nvml, env, notes) + probe_amd(sys_root, notes)
    notes += listing.notes
    found = merge_ggml_devices(found, listing.devices, notes)
    host = probe_host(proc_root, cgroup_root, notes, host_speed)
    devices = tuple(replace(d, index=i) for i, d in enumerate([*found, host]))
    result = ProbeResult(devices=devices, notes=tuple(notes))
    best = result.preferred
    if all(d.kind == "cpu" for d in devices):
        notes.append("no accelerator found: planning for host memory")
    for d in devices:
        log.info("probe.device", index=d.index, kind=d.kind, name=d.name, total_bytes=d.total_bytes,
                 free_bytes=d.free_bytes, processes_used_bytes=d.processes_used_bytes,
                 compute_capability=d.compute_capability, read_bandwidth_bytes_per_s=d.read_bandwidth_bytes_per_s,
                 bandwidth_basis=d.bandwidth_basis, compute_threads=d.compute_threads)
    log.info("probe.selected", index=best.index, kind=best.kind, name=best.name)
    return replace(result, notes=tuple(notes))


# --------------------------------------------------------------------------- saved probes


@dataclass(frozen=True)
class MachineFacts:
    """Who wrote a saved probe: the host name and CPU architecture (``platform.machine()``), so a
    fleet's planner names each machine and knows which llama-server build it needs
    (``hotfit fleet plan``, docs/fleet.md). Kept beside the probe, never in it: the plan's id hashes
    the probe, and a host name must not change it."""

    name: str | None = None
    arch: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "arch": self.arch}


def this_machine() -> MachineFacts:
    return MachineFacts(name=socket.gethostname() or None, arch=platform.machine() or None)


@dataclass(frozen=True)
class SavedProbe:
    result: ProbeResult
    machine: MachineFacts


def probe_document(result: ProbeResult, machine: MachineFacts | None = None) -> dict[str, Any]:
    """What ``hotfit probe --json`` prints and ``--save`` writes: the probe, and who it is of."""
    return result.to_json() | ({} if machine is None else {"machine": machine.to_json()})


def save_probe(result: ProbeResult, path: Path, machine: MachineFacts | None = None) -> None:
    try:
        write_text_atomic(path, json.dumps(probe_document(result, machine), indent=2) + "\n")
    except OSError as exc:
        raise UsageError(f"probe --save {path}: cannot be written ({exc.strerror or exc})",
                         hint="pass a writable file path to --save", file=str(path)) from None


PROBE_FILE_HINT = "or write it anew with 'hotfit probe --save FILE' (schema 1)"


def load_probe_file(path: str | os.PathLike[str]) -> ProbeResult:
    """A saved probe (``hotfit probe --save``), checked field by field (planner.probe.decode_probe)."""
    return load_saved_probe(path).result


def load_saved_probe(path: str | os.PathLike[str]) -> SavedProbe:
    """A saved probe and the machine it names (both optional facts may be absent: an older file)."""
    p = Path(path)

    def fail_document(problem: str, hint: str, **details: Any) -> UsageError:
        return UsageError(f"probe file {p}: {problem}", hint="pass a probe saved with 'hotfit probe --save FILE'",
                          file=str(p), field=None, **details)

    def fail(field: str, problem: str, hint: str) -> UsageError:
        return UsageError(f"probe file {p}: {field} {problem}", hint=f"{hint}; {PROBE_FILE_HINT}",
                          file=str(p), field=field)

    text = read_text_document(p, fail_document)
    data = parse_json(text, fail_document, kind="a probe", shape="a probe is what 'hotfit probe --save FILE' writes")
    f = Fields(fail, noun="probe")
    result = decode_probe(data, f)
    machine = MachineFacts()
    if data.get("machine") is not None:
        m = f.at("machine")
        raw = m.object(data["machine"], "", (), optional=("name", "arch"), extra=True)
        machine = MachineFacts(name=m.string(raw.get("name"), "name", nullable=True) or None,
                               arch=m.string(raw.get("arch"), "arch", nullable=True) or None)
    return SavedProbe(replace(result, notes=(*result.notes, f"probe read from {p}")), machine)


# --------------------------------------------------------------------------- the stage



@dataclass(frozen=True)
class ProbeJob:
    """What the run asks of the probe: the machine, or a saved probe (``auto --probe-file``)."""

    probe_file: Path | None = None


async def probe_work(ctx: StageContext) -> ProbeResult:
    job = ctx.job(ProbeJob)
    if job.probe_file is not None:
        return await anyio.to_thread.run_sync(load_probe_file, job.probe_file)
    listing = await anyio.to_thread.run_sync(functools.partial(list_devices, ctx.settings))
    speed = await anyio.to_thread.run_sync(host_speed, ctx.settings.host_speed_file)
    return await anyio.to_thread.run_sync(functools.partial(probe_devices, listing=listing, host_speed=speed))


def probe_figures(probe: ProbeResult) -> dict[str, Any]:
    d = probe.preferred
    return {"device_kind": d.kind, "device_name": d.name, "total_bytes": d.total_bytes, "free_bytes": d.free_bytes}


# Always run (the world may have changed), so no reuse check and no fingerprint beyond its record.
DECLARATION = StageDeclaration(
    "probe", probe_work, always_run=True, decode=ProbeResult.decode, figures=probe_figures, version=1,
    result_type=ProbeResult, job=ProbeJob())
