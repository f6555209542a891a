"""The planned device against the devices the llama-server build really sees, before any download.

A plan is computed for one device of the probe (its name, memory and, for NVIDIA, UUID). The probe may
be a file saved on another machine, or the card may have gone since; a build of another backend may
see other devices than the probe did (a Vulkan build on an NVIDIA plan ignores ``CUDA_VISIBLE_DEVICES``).
So the preflight asks the binary that will serve, under the environment the session gets (the device
pin included), which devices it sees (``llama-server --list-devices``), and refuses, with the fix
named, when

- it sees none of the devices the session would use (the card is gone, or the UUID pin matches none);
- one of them is a software device (Mesa's lavapipe/llvmpipe, SwiftShader) and the planned device is
  not: a software rasteriser never stands in for a planned GPU;
- none of them is the planned device by name or by memory (within 5 %): a plan for a 24 GiB card is
  not run on a 12 GiB one.

Identity: the UUID where the pin can say it (CUDA: ``CUDA_VISIBLE_DEVICES=<uuid>`` leaves that card
alone visible, or none), else the name and memory ``--list-devices`` prints (it prints no UUID or PCI
bus id). A host (CPU) plan opens no device (``-dev none``) and is not asked.

The plan's device is read in one place, :func:`planned_device`; the verdict is pure
(:func:`device_problem`, table-tested); :func:`check_planned_device` runs the listing.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from hotfit.backends.base import ListedDevice
from hotfit.backends.llama_server.devices import LIST_DEVICES_TIMEOUT_S, parse_list_devices
from hotfit.backends.llama_server.flags import child_env
from hotfit.core.errors import DeviceMismatch
from hotfit.core.log import get_logger
from hotfit.planner.plan import Plan

__all__ = ["PlannedDevice", "check_planned_device", "device_problem", "is_software_device", "planned_device"]

log = get_logger()

MiB = 1 << 20
# NVML/sysfs and ggml round differently (MiB, reserved regions); beyond this they are two devices.
SAME_DEVICE_TOTAL_RATIO = 0.05
# Software Vulkan/GL implementations (Mesa's lavapipe names its device "llvmpipe (LLVM …)", Google's
# SwiftShader "SwiftShader Device"): they run on the CPU, however ggml types them.
_SOFTWARE_DEVICE = re.compile(r"\b(llvmpipe|lavapipe|softpipe|swiftshader|swrast)\b", re.IGNORECASE)
@dataclass(frozen=True)
class PlannedDevice:
    """What the plan says of the device it was computed for."""

    kind: str  # the probe's device kind: nvidia, amd, vulkan, cpu
    name: str
    total_bytes: int
    uuid: str | None = None  # NVIDIA: the session is pinned to it (CUDA_VISIBLE_DEVICES)
    ggml_device: str | None = None  # the ggml name the session is pinned to with -dev ("Vulkan0")

    def describe(self) -> str:
        pin = f", {self.uuid}" if self.uuid else ""
        return f"{self.name} ({self.kind}, {self.total_bytes // MiB} MiB{pin})"


def planned_device(plan: Plan) -> PlannedDevice:
    """The one read of the plan's device in this backend's device check."""
    device = plan.placement.device
    pinned = device.ggml_device if device.kind in ("vulkan", "amd") else None  # as flags.llama_server_argv pins it
    return PlannedDevice(kind=device.kind, name=device.name, total_bytes=device.total_bytes, uuid=device.uuid,
                         ggml_device=pinned)


def is_software_device(description: str) -> bool:
    return bool(_SOFTWARE_DEVICE.search(description))


def _describe(listed: ListedDevice) -> str:
    return f"{listed.name}: {listed.description} ({listed.total_bytes // MiB} MiB)"


def _same_device(planned: PlannedDevice, listed: ListedDevice) -> bool:
    a, b = planned.name.lower(), listed.description.lower()
    same_name = bool(a) and (a in b or b.split(" (")[0] in a)
    same_memory = abs(listed.total_bytes - planned.total_bytes) <= SAME_DEVICE_TOTAL_RATIO * planned.total_bytes
    return same_name or same_memory


def device_problem(planned: PlannedDevice, listed: Sequence[ListedDevice]) -> str | None:
    """Pure: why a session started on what the build ``listed`` would not run on the ``planned``
    device (None: it would). The session uses the device it is pinned to with -dev, else every
    device listed (llama.cpp offloads to all of them)."""
    used = [g for g in listed if g.name == planned.ggml_device] if planned.ggml_device else list(listed)
    seen = "; ".join(map(_describe, listed)) or "none"
    if not used:
        pinned = f" (pinned to {planned.ggml_device})" if planned.ggml_device else ""
        return f"it sees no device the session would use{pinned}; it lists: {seen}"
    software = [g for g in used if is_software_device(g.description)]
    if software and not is_software_device(planned.name):
        return (f"the session would run on {_describe(software[0])}, a software device that runs on the CPU, "
                f"not on a GPU; it lists: {seen}")
    if not any(_same_device(planned, g) for g in used):
        return f"none of the devices it would use is the planned one (by name or memory); it lists: {seen}"
    return None


def _listing(binary: Path, env: Mapping[str, str]) -> list[ListedDevice]:
    try:
        proc = subprocess.run([str(binary), "--list-devices"], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=LIST_DEVICES_TIMEOUT_S, check=False, env=dict(env))
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise DeviceMismatch(f"{binary} --list-devices failed ({exc}): cannot confirm it runs on the planned device",
                             hint="check that this llama-server runs here (scripts/install-llama-server), then rerun",
                             binary=str(binary)) from None
    return parse_list_devices(proc.stdout + "\n" + proc.stderr)


def check_planned_device(plan: Plan, binary: Path, env: Mapping[str, str] | None = None) -> None:
    """Refuse (:class:`DeviceMismatch`) a GPU plan ``binary`` would not run on the planned device,
    asked under the session's own environment (``env``: its base, default ours); blocking."""
    planned = planned_device(plan)
    if planned.kind == "cpu":
        return  # a host plan opens no device
    listed = _listing(binary, child_env(plan, None, env))
    problem = device_problem(planned, listed)
    log.info("backend.device_check", planned=planned.describe(), listed=[_describe(g) for g in listed],
             verdict="refused" if problem else "ok")
    if problem is None:
        return
    raise DeviceMismatch(
        f"the plan is for {planned.describe()}, but {binary} would not run on it: {problem}",
        hint=("probe this machine again (drop --probe-file, or save a new probe here with `hotfit probe --save`); "
              "on a GPU machine install the build for its GPU (scripts/install-llama-server --backend cuda or "
              "vulkan) and check the driver; to plan for host memory install the CPU build"),
        planned=planned.describe(), binary=str(binary), listed=[_describe(g) for g in listed])
