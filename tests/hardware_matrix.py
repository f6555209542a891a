"""The hardware matrix's machinery: one folder per real machine under tests/data/hardware (captured
files, their public source in SOURCE.md, expected.json), turned into what hotfit reads on that
machine — a /proc and /sys root, a stand-in ``nvidia-smi`` on PATH and a stand-in ``pynvml``, both
answering from the folder's ``nvml.json`` (transcribed from the capture; checked against it here).

docs/hardware-matrix.md lists the machines and what each row drives.
"""

from __future__ import annotations

import csv
import io
import json
import re
import shutil
import stat
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

MATRIX = Path(__file__).parent / "data" / "hardware"
MiB = 1 << 20
GiB = 1 << 30

# No capture includes /proc/meminfo: every row gets this one host (16 GiB, 14 GiB available: a
# g4dn.xlarge's or g5.xlarge's RAM), so a row's plan differs from another's only by what was
# captured (docs/hardware-matrix.md).
HOST_MEMINFO = "MemTotal:       16777216 kB\nMemFree:         2097152 kB\nMemAvailable:   14680064 kB\n"

# The native build recorded on this project's build machine (Zen 5): the ISA verdict of each row is
# whether that binary may run there.
BUILD_MACHINE = "amd-zen5-epyc-rdseed-masked"


@dataclass(frozen=True)
class Row:
    machine: str
    folder: Path

    @property
    def expected(self) -> dict[str, Any]:
        return json.loads((self.folder / "expected.json").read_text())

    def file(self, name: str) -> Path | None:
        path = self.folder / name
        return path if path.exists() else None

    @property
    def nvml(self) -> dict[str, Any] | None:
        path = self.file("nvml.json")
        return None if path is None else json.loads(path.read_text())


def rows() -> list[Row]:
    return [Row(p.name, p) for p in sorted(MATRIX.iterdir()) if (p / "expected.json").exists()]


# ----------------------------------------------------------------------------- the machine's roots


def machine_root(row: Row | None, tmp: Path, *, cpuinfo: str | None = None) -> Path:
    """A root with the row's /proc/cpuinfo, a fixed /proc/meminfo, a cgroup file and its /sys."""
    root = tmp / "root"
    proc = root / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(HOST_MEMINFO)
    (proc / "self" / "cgroup").write_text("0::/\n")
    (root / "cgroup").mkdir()
    if row is not None and row.file("proc-cpuinfo.txt"):
        shutil.copyfile(row.folder / "proc-cpuinfo.txt", proc / "cpuinfo")
    elif cpuinfo is not None:
        (proc / "cpuinfo").write_text(cpuinfo)
    if row is not None and (row.folder / "sys").is_dir():
        shutil.copytree(row.folder / "sys", root / "sys")
    else:
        (root / "sys").mkdir()
    return root


# ----------------------------------------------------------------------------- stand-in nvidia-smi

# A stand-in answering `nvidia-smi --query-gpu=F,... --format=csv[,noheader][,nounits]` from
# nvml.json the way the real one formats it (MiB with a unit; "Field ... is not a valid field").
_SMI = r'''import json, sys
data = json.load(open(%(path)r))
args = sys.argv[1:]
query = next((a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")), None)
fmt = next((a.split("=", 1)[1] for a in args if a.startswith("--format=")), "")
if query is None or "csv" not in fmt.split(","):
    print("stand-in nvidia-smi: only --query-gpu=... --format=csv is answered", file=sys.stderr)
    sys.exit(2)
units = "nounits" not in fmt.split(",")
def value(gpu, field):
    mem = {"memory.total": "memory_total_mib", "memory.used": "memory_used_mib", "memory.free": "memory_free_mib",
           "memory.reserved": "memory_reserved_mib"}
    if field in mem:
        return str(gpu[mem[field]]) + (" MiB" if units else "")
    simple = {"name": gpu["name"], "uuid": gpu["uuid"], "index": str(gpu["index"]), "compute_cap": gpu["compute_cap"],
              "driver_version": data["driver_version"], "count": str(len(data["gpus"])),
              "mig.mode.current": gpu["mig_mode"]}
    if field not in simple:
        print('Field "%%s" is not a valid field to query.' %% field)
        sys.exit(2)
    return simple[field]
fields = query.split(",")
if "noheader" not in fmt.split(","):
    print(", ".join(f + (" [MiB]" if units and f.startswith("memory.") else "") for f in fields))
for gpu in data["gpus"]:
    print(", ".join(value(gpu, f) for f in fields))
'''


def nvidia_smi_standin(bin_dir: Path, nvml_json: Path | None = None, *, garbage: str | None = None,
                       exit_code: int = 0) -> Path:
    """Write ``nvidia-smi`` into ``bin_dir``: answering from ``nvml_json``, or printing ``garbage``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    if garbage is not None:
        body = f"import sys\nprint({garbage!r})\nsys.exit({exit_code})\n"
    else:
        assert nvml_json is not None
        body = _SMI % {"path": str(nvml_json)}
    script.write_text(f"#!{sys.executable}\n{body}")
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


# ----------------------------------------------------------------------------- stand-in pynvml


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(f"NVML error {value}")
        self.value = value


NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6


def nvml_from(data: dict[str, Any]) -> SimpleNamespace:
    """A stand-in ``pynvml`` answering as NVML does on the captured machine: physical GPUs by
    index; a GPU in MIG mode has MIG device handles (by index and by MIG- UUID); memory in bytes."""
    gpus = [dict(g, mig=False) for g in data["gpus"]]
    migs = [dict(m, mig=True, processes=[], parent=g["uuid"]) for g in data["gpus"] for m in g.get("mig_devices", ())]

    def handle_by_uuid(uuid: str) -> dict[str, Any]:
        for h in gpus + migs:
            if h["uuid"] == uuid:
                return h
        raise NVMLError(NVML_ERROR_NOT_FOUND)

    def mig_mode(h: dict[str, Any]) -> list[int]:
        if h["mig"] or h.get("mig_mode") in (None, "N/A", "[N/A]"):
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        on = int(h["mig_mode"] == "Enabled")
        return [on, on]

    def mig_by_index(h: dict[str, Any], i: int) -> dict[str, Any]:
        devices = [m for m in migs if m["uuid"] in {x["uuid"] for x in h.get("mig_devices", ())}]
        if i >= len(devices):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return devices[i]

    def compute_capability(h: dict[str, Any]) -> tuple[int, int]:
        # A MIG device's handle is not asked here: hotfit must go through its GPU (no capture says
        # what NVML answers for one, so the stand-in takes the stricter reading).
        if h["mig"]:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        major, minor = h["compute_cap"].split(".")
        return int(major), int(minor)

    def parent_of(h: dict[str, Any]) -> dict[str, Any]:
        if not h["mig"]:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        return handle_by_uuid(h["parent"])

    def gpu_figure(key: str) -> Any:
        # speed: NVML's maximum memory clock and bus width; a MIG handle answers NOT_SUPPORTED (the
        # stricter reading, as for the compute capability): hotfit asks through its GPU
        def ask(h: dict[str, Any], *_: Any) -> int:
            if h["mig"] or key not in h:
                raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
            return int(h[key])
        return ask

    def memory(h: dict[str, Any]) -> SimpleNamespace:
        total, free = h["memory_total_mib"] * MiB, h["memory_free_mib"] * MiB
        return SimpleNamespace(total=total, free=free, used=total - free)

    def procs(kinds: set[str]):
        return lambda h: [SimpleNamespace(usedGpuMemory=p["used_memory_mib"] * MiB)
                          for p in h["processes"] if set(p["type"].split("+")) & kinds]

    return SimpleNamespace(
        NVMLError=NVMLError,
        NVML_ERROR_LIBRARY_NOT_FOUND=12,
        NVML_DEVICE_MIG_ENABLE=1,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=lambda i: gpus[i],
        nvmlDeviceGetHandleByUUID=handle_by_uuid,
        nvmlDeviceGetName=lambda h: h["name"],
        nvmlDeviceGetUUID=lambda h: h["uuid"],
        nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetCudaComputeCapability=compute_capability,
        nvmlDeviceGetDeviceHandleFromMigDeviceHandle=parent_of,
        nvmlDeviceGetMigMode=mig_mode,
        nvmlDeviceGetMaxMigDeviceCount=lambda h: 7 if h.get("mig_mode") == "Enabled" else 0,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_by_index,
        nvmlDeviceGetComputeRunningProcesses=procs({"C"}),
        nvmlDeviceGetGraphicsRunningProcesses=procs({"G"}),
        NVML_CLOCK_MEM=2,
        nvmlDeviceGetMaxClockInfo=gpu_figure("max_memory_clock_mhz"),
        nvmlDeviceGetMemoryBusWidth=gpu_figure("memory_bus_width_bits"),
    )


# ----------------------------------------------------------------------------- the captures, read again


def _mib(text: str | None) -> int:
    assert text is not None
    return int(text.split()[0])


def facts_from_xml(path: Path) -> dict[str, Any]:
    """``nvidia-smi -q -x``: the fields nvml.json transcribes (not the derived compute_cap)."""
    root = ET.fromstring(path.read_bytes())
    gpus = []
    for i, g in enumerate(root.findall("gpu")):
        fb = g.find("fb_memory_usage")
        mig = g.find("mig_mode")
        assert fb is not None and mig is not None
        gpus.append({"index": i, "name": g.findtext("product_name"), "uuid": g.findtext("uuid"),
                     "memory_total_mib": _mib(fb.findtext("total")), "memory_used_mib": _mib(fb.findtext("used")),
                     "memory_free_mib": _mib(fb.findtext("free")), "mig_mode": mig.findtext("current_mig"),
                     "max_memory_clock_mhz": _mib(g.findtext("max_clocks/mem_clock")),
                     "processes": [{"type": p.findtext("type"), "used_memory_mib": _mib(p.findtext("used_memory"))}
                                   for p in g.iter("process_info")]})
    return {"driver_version": root.findtext("driver_version"), "cuda_version": root.findtext("cuda_version"),
            "gpus": gpus}


def facts_from_exporter_capture(path: Path) -> dict[str, Any]:
    """nvidia_gpu_exporter's capture: the ``--query-gpu`` csv, ``-L`` and the ``-q`` MIG blocks."""
    text = path.read_text()
    # the section: its title, its command, a rule, then the csv up to the next rule
    section = text.split("# idle :: query-gpu (csv, what the exporter parses)", 1)[1].split("#" * 80 + "\n")[1]
    lines = [ln for ln in section.splitlines() if ln.strip()]
    table = list(csv.reader(io.StringIO("\n".join(lines)), skipinitialspace=True))
    header = [h.split(" [")[0] for h in table[0]]
    gpus = []
    for values in table[1:]:
        row = dict(zip(header, values))
        gpus.append({"index": int(row["index"]), "name": row["name"], "uuid": row["uuid"],
                     "memory_total_mib": _mib(row["memory.total"]), "memory_used_mib": _mib(row["memory.used"]),
                     "memory_free_mib": _mib(row["memory.free"]), "compute_cap": row["compute_cap"],
                     "mig_mode": row["mig.mode.current"], "driver_version": row["driver_version"]})
    listed = re.findall(r"^\s+MIG (\S+)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)", text, re.M)
    blocks = re.findall(r"MIG Device\n\s+Index\s+: (\d+)\n.*?Shared FB Memory Usage\n\s+Total\s+: (\d+) MiB\n"
                        r"\s+Reserved\s+: \d+ MiB\n\s+Used\s+: (\d+) MiB\n\s+Free\s+: (\d+) MiB", text, re.S)
    migs = [{"index": int(i), "profile": p, "uuid": u, "memory_total_mib": int(t), "memory_used_mib": int(us),
             "memory_free_mib": int(f)} for (p, i, u), (_, t, us, f) in zip(listed, blocks)]
    clocks = [int(c) for c in re.findall(r"Max Clocks\n(?:.*\n)*?\s+Memory\s+: (\d+) MHz", text)]
    for gpu, clock in zip(gpus, clocks):
        gpu["max_memory_clock_mhz"] = clock
    return {"gpus": gpus, "mig_devices": migs}
