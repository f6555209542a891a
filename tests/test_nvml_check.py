"""scripts/nvml-check (scripts/gpu-check's probe step on an NVIDIA machine), run here against the
hardware matrix's captured machines: hotfit's NVML probe through a stand-in ``pynvml`` and a
stand-in ``nvidia-smi``, both answering from the row's nvml.json (tests/hardware_matrix.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hardware_matrix import MATRIX, nvidia_smi_standin

TIER = "integration"

REPO = Path(__file__).resolve().parent.parent
# A pynvml module that is the matrix's stand-in for the machine named by HOTFIT_TEST_NVML_JSON.
PYNVML_SHIM = """import json, os
from tests.hardware_matrix import nvml_from
globals().update(vars(nvml_from(json.load(open(os.environ["HOTFIT_TEST_NVML_JSON"])))))
"""


def _run(tmp_path: Path, nvml_json: Path, smi_json: Path) -> subprocess.CompletedProcess[str]:
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "pynvml.py").write_text(PYNVML_SHIM)
    bin_dir = tmp_path / "bin"
    nvidia_smi_standin(bin_dir, smi_json)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shim), str(REPO)]), "HOTFIT_TEST_NVML_JSON": str(nvml_json),
           "PATH": f"{bin_dir}:/usr/bin:/bin", "HOTFIT_LLAMA_CACHE": str(tmp_path / "no-builds")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.run([sys.executable, str(REPO / "scripts" / "nvml-check")], capture_output=True, text=True,
                          env=env, timeout=60, cwd=tmp_path)


@pytest.mark.parametrize("row", ["nvidia-tesla-t4", "nvidia-h100-80gb"])
def test_nvml_check_agrees_with_nvidia_smi_on_a_captured_machine(tmp_path: Path, row: str) -> None:
    nvml_json = MATRIX / row / "nvml.json"
    proc = _run(tmp_path, nvml_json, nvml_json)
    assert proc.returncode == 0, proc.stderr
    gpu = json.loads(nvml_json.read_text())["gpus"][0]
    probed = [d for d in json.loads(proc.stdout)["devices"] if d["kind"] == "nvidia"]
    assert [(d["name"], d["compute_capability"]) for d in probed] == [(gpu["name"], gpu["compute_cap"])]
    cap = gpu["compute_cap"]
    assert f"compute capability NVML {cap} vs nvidia-smi {cap} (ok)" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_nvml_check_reports_a_compute_capability_nvidia_smi_contradicts(tmp_path: Path) -> None:
    nvml_json = MATRIX / "nvidia-rtx-4090" / "nvml.json"
    data = json.loads(nvml_json.read_text())
    data["gpus"][0]["compute_cap"] = "8.6"
    smi_json = tmp_path / "smi.json"
    smi_json.write_text(json.dumps(data))
    proc = _run(tmp_path, nvml_json, smi_json)
    assert proc.returncode == 1, proc.stderr
    assert "compute capability NVML 8.9 vs nvidia-smi 8.6 (MISMATCH)" in proc.stderr
