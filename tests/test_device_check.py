"""The planned device against what the llama-server build sees, before any download
(backends/llama_server/device_check.py; docs/faults-state.md, "The planned device").

The table reads listings in llama.cpp's own ``--list-devices`` format: the lavapipe line copied from a
real run of the Vulkan build (tests/test_probe.py), the NVIDIA lines as llama.cpp prints CUDA and Vulkan
devices (tests/test_cuda_build.py builds the CUDA ones from nvidia-smi). The real case — a probe naming
a 24 GiB NVIDIA card, the Vulkan build on a machine whose only Vulkan device is lavapipe — runs
`hotfit auto` with the real build and the local Hub, and counts the Hub's bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hotfit.backends.llama_server.device_check import PlannedDevice, device_problem
from hotfit.backends.llama_server.devices import parse_list_devices
from hotfit.planner.probe import Device, ProbeResult
from tests.e2e_support import SMALL, World
from tests.hubserver import LocalHub
from tests.test_vulkan import LAVAPIPE_ENV, vulkan_server

TIER = "unit"

REPO = Path(__file__).resolve().parent.parent
MiB, GiB = 1 << 20, 1 << 30
LAVAPIPE = "  Vulkan0: llvmpipe (LLVM 15.0.6, 256 bits) (2048 MiB, 2048 MiB free)\n"
RTX_4090 = PlannedDevice("nvidia", "NVIDIA GeForce RTX 4090", 24564 * MiB, uuid="GPU-8a1c2f0e")
LAVAPIPE_PLAN = PlannedDevice("vulkan", "llvmpipe (LLVM 15.0.6, 256 bits)", 2048 * MiB, ggml_device="Vulkan0")
RX_7600 = PlannedDevice("amd", "Radeon RX 7600", 8 * GiB, ggml_device="Vulkan0")


@pytest.mark.parametrize(("planned", "listing", "refusal"), [
    # the adversarial run's case: an NVIDIA plan, lavapipe the only Vulkan device the build sees
    (RTX_4090, "Available devices:\n" + LAVAPIPE, "a software device that runs on the CPU"),
    # the card is gone, lavapipe hidden by ggml (no GGML_VK_VISIBLE_DEVICES): nothing at all
    (RTX_4090, "Available devices:\n  (none)\n", "it sees no device the session would use"),
    # the card and lavapipe both visible: llama.cpp would split the model over the two
    (RTX_4090, "  Vulkan0: NVIDIA GeForce RTX 4090 (24564 MiB, 23000 MiB free)\n" + LAVAPIPE.replace("0:", "1:"),
     "a software device"),
    # another card than the plan's (a probe saved elsewhere)
    (RTX_4090, "  Vulkan0: NVIDIA GeForce RTX 3060 (12288 MiB, 12000 MiB free)\n", "is the planned one"),
    # pinned with -dev to a device the build no longer lists
    (RX_7600, "  Vulkan1: AMD Radeon RX 7600 (RADV NAVI33) (7000 MiB, 6000 MiB free)\n", "(pinned to Vulkan0)"),
    # the planned card itself, through the Vulkan build, the CUDA build (pinned by UUID), or by name
    # with the other memory figure RADV reports
    (RTX_4090, "  Vulkan0: NVIDIA GeForce RTX 4090 (24564 MiB, 23000 MiB free)\n", None),
    (RTX_4090, "  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23000 MiB free)\n", None),
    (RX_7600, "  Vulkan0: AMD Radeon RX 7600 (RADV NAVI33) (7000 MiB, 6000 MiB free)\n", None),
    # lavapipe planned as what it is (the probe listed it; the CI's Vulkan tests): not a stand-in
    (LAVAPIPE_PLAN, LAVAPIPE, None),
])
def test_the_planned_device_against_the_listing(planned: PlannedDevice, listing: str, refusal: str | None) -> None:
    problem = device_problem(planned, parse_list_devices(listing))
    if refusal is None:
        assert problem is None
    else:
        assert problem is not None and refusal in problem, problem


# ----------------------------------------------------------------------------- the real build


def _nvidia_probe(path: Path) -> Path:
    """A probe saved on a machine with a 24 GiB NVIDIA card (none here)."""
    probe = ProbeResult(devices=(Device(index=0, kind="nvidia", name="NVIDIA GeForce RTX 4090", total_bytes=24 * GiB,
                                        free_bytes=23 * GiB, uuid="GPU-8a1c2f0e-0000-4000-8000-000000000001",
                                        compute_capability="8.9"),
                                 Device(index=1, kind="cpu", name="host", total_bytes=16 * GiB,
                                        free_bytes=12 * GiB)))
    path.write_text(json.dumps(probe.to_json()))
    return path


@pytest.mark.integration
@pytest.mark.llama
@pytest.mark.vulkan
@pytest.mark.parametrize("lavapipe_visible", [True, False])
def test_an_nvidia_plan_is_not_served_on_lavapipe_and_nothing_is_fetched(
        hub: LocalHub, plain_world: World, tmp_path: Path, lavapipe_visible: bool) -> None:
    """The Vulkan build on a machine without the planned card: with lavapipe made visible the session
    would run on it, without it on no device at all; either way exit 5 before a byte is fetched."""
    binary = vulkan_server()
    hub.reset_counters()
    env = {k: v for k, v in os.environ.items()
           if k not in ("HOTFIT_HOME", "HF_TOKEN", "HOTFIT_LLAMA_SERVER", "GGML_VK_VISIBLE_DEVICES")}
    env.update(hub.env())
    if lavapipe_visible:
        env.update(LAVAPIPE_ENV)
    home = tmp_path / "home"
    proc = subprocess.run(
        [sys.executable, "-m", "hotfit", "--home", str(home), "--llama-server", str(binary), "--json", "auto",
         "--registry", str(plain_world.registry_path), "--probe-file", str(_nvidia_probe(tmp_path / "probe.json")),
         "--model", SMALL], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 5, (proc.stdout, proc.stderr[-3000:])
    error = json.loads(proc.stdout)["error"]
    assert error["code"] == "device_mismatch"
    assert "NVIDIA GeForce RTX 4090" in error["message"] and "GPU-8a1c2f0e" in error["message"]
    assert ("llvmpipe" in error["message"] and "software device" in error["message"]) if lavapipe_visible \
        else "sees no device" in error["message"]
    assert "hotfit probe --save" in error["hint"]
    assert hub.bytes_sent() == 0
    assert not any((home / "models").rglob("*.gguf*")) if (home / "models").exists() else True
