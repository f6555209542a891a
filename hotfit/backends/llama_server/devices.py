"""What llama-server's builds say of the GPUs they see: ``llama-server --list-devices``, parsed into
the probe's neutral :class:`~hotfit.backends.base.ListedDevice` (the probe merges it with NVML and
sysfs; stages/probe.py)."""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Mapping
from pathlib import Path

from hotfit.backends.base import DeviceListing, ListedDevice
from hotfit.core.log import get_logger

log = get_logger()

MiB = 1 << 20
# `--list-devices` initialises every backend; lavapipe's first start compiles nothing, a few s.
LIST_DEVICES_TIMEOUT_S = 60.0
# llama.cpp common/arg.cpp prints "  <dev>: <description> (<total> MiB, <free> MiB free)"
_GGML_DEVICE_RE = re.compile(r"^\s*(?P<dev>[A-Za-z][A-Za-z_-]*\d+): (?P<desc>.*) \((?P<total>\d+) MiB, (?P<free>\d+) MiB free\)\s*$")


def parse_list_devices(text: str) -> list[ListedDevice]:
    """Pure: the devices in ``--list-devices`` output (figures are whole MiB, rounded down); the API
    is the name without its number ("Vulkan0": vulkan)."""
    out = []
    for line in text.splitlines():
        if m := _GGML_DEVICE_RE.match(line):
            out.append(ListedDevice(m["dev"], re.sub(r"\d+$", "", m["dev"]).lower(), m["desc"].strip(),
                                    int(m["total"]) * MiB, int(m["free"]) * MiB))
    return out


def list_ggml_devices(binary: Path, env: Mapping[str, str] | None = None) -> DeviceListing:
    """Ask ``binary --list-devices`` which devices ggml sees. A binary that fails here is noted,
    not fatal: the probe still has NVML, sysfs and host memory; load checks the binary again."""
    try:
        proc = subprocess.run([str(binary), "--list-devices"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=LIST_DEVICES_TIMEOUT_S, check=False,
                              env=dict(os.environ if env is None else env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("probe.list_devices_failed", binary=str(binary), error=str(exc))
        return DeviceListing(notes=(f"{binary} --list-devices failed ({exc}); its devices are not listed",))
    devices = parse_list_devices(proc.stdout + "\n" + proc.stderr)
    notes: tuple[str, ...] = ()
    if proc.returncode != 0 and not devices:
        notes = (f"{binary} --list-devices exited with {proc.returncode}; its devices are not listed",)
        log.warning("probe.list_devices_failed", binary=str(binary), returncode=proc.returncode)
    for g in devices:
        log.info("probe.ggml_device", binary=str(binary), device=g.name, description=g.description,
                 total_bytes=g.total_bytes, free_bytes=g.free_bytes)
    return DeviceListing(tuple(devices), notes)
