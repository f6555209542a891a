"""scripts/gpu_bundle.py: a build archive carried to a GPU machine that fetches nothing, without
the libraries that machine already has, and put back together there for ``--from``
(docs/builds.md, "Checking a CUDA build on a GPU machine"). Shown on the real CPU export: the
CUDA archive's cuBLAS is played by two of its CPU modules."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from hotfit.core.settings import LLAMA_SDIST_VERSION
from tests.conftest import REPO_ROOT
from tests.gguf_fixtures import QWEN3_TEMPLATE_NAME, pinned_template
from tests.test_build_archive import _llama_build, _script, exported  # noqa: F401 - `exported` is a fixture

TIER = "integration"

LEFT = ("libggml-cpu-x64.so", "libggml-cpu-zen4.so")  # stand-ins for libcublas*.so.13


sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gpu_bundle as gb  # noqa: E402 - a script module, beside llama_build.py


def _members(archive: Path) -> dict[str, bytes]:
    with tarfile.open(archive) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


@pytest.fixture(scope="module")
def bundle(exported: Path,  # noqa: F811
           tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, bytes]]:
    out = tmp_path_factory.mktemp("bundle")
    record = gb.make(exported, out, left_out=LEFT, preset=1)  # the level only trades time for size
    assert sorted(Path(d["member"]).name for d in record["left_out"]) == sorted(LEFT)
    assert not any(Path(k).name in LEFT for k in record["kept"])
    assert record["packed_bytes"] < record["archive_bytes"]
    return out, _members(exported)


def test_reassembled_from_the_same_bytes_is_the_exported_build_and_installs(bundle, tmp_path: Path) -> None:
    out, original = bundle
    machine = tmp_path / "machine-lib" / "nvidia" / "cu13" / "lib"  # found below a search root, as in a wheel
    machine.mkdir(parents=True)
    for name in LEFT:
        (machine / name).write_bytes(original[f"cpu/bin/{name}"])
    archive = tmp_path / "reassembled.tar.gz"
    done = gb.reassemble(out, archive, roots=[tmp_path / "machine-lib"])
    assert done.substituted == {}
    assert set(done.found) == {f"cpu/bin/{n}" for n in LEFT}
    assert _members(archive) == original, "every exported file, byte for byte, the manifest unchanged"
    cache = tmp_path / "cache"
    proc = _script("--from", str(archive), cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert Path(proc.stdout.strip().splitlines()[-1]).is_file()
    # the pinned tree's chat templates (the check's fixtures are served with one), where hotfit looks
    record = json.loads((out / "bundle.json").read_text())
    tree = tmp_path / "tree"
    assert gb.place_templates(out, tree) == len(record["templates"]) > 0
    assert (tree / "models" / "templates" / QWEN3_TEMPLATE_NAME).read_text() == pinned_template().read_text()


def test_another_copy_is_used_named_as_substituted_and_the_manifest_says_so(bundle, tmp_path: Path) -> None:
    out, original = bundle
    machine = tmp_path / "lib"
    machine.mkdir()
    (machine / LEFT[0]).write_bytes(original[f"cpu/bin/{LEFT[0]}"])
    other = original[f"cpu/bin/{LEFT[1]}"] + b"\0"  # another build of the library
    (machine / LEFT[1]).write_bytes(other)
    archive = tmp_path / "substituted.tar.gz"
    done = gb.reassemble(out, archive, roots=[machine])
    member = f"cpu/bin/{LEFT[1]}"
    assert list(done.substituted) == [member]
    assert done.substituted[member] == gb.sha256_file(machine / LEFT[1]) != \
        gb.parse_manifest(original["SHA256SUMS"].decode(), archive)[member]
    got = _members(archive)
    assert got[member] == other
    # the archive is consistent (import's own manifest check passes), and says what it holds
    lb = _llama_build()
    unpacked = tmp_path / "unpacked"
    with tarfile.open(archive) as tar:
        tar.extractall(unpacked, filter="data")
    lb._check_manifest(unpacked, "cpu", archive)


def test_a_library_this_machine_lacks_is_refused_naming_it(bundle, tmp_path: Path) -> None:
    out, _ = bundle
    with pytest.raises(gb.BundleError, match=f"{LEFT[0]} .left out of the bundle. is not on this machine"):
        gb.reassemble(out, tmp_path / "x.tar.gz", roots=[tmp_path])
    assert not (tmp_path / "x.tar.gz").exists()
    assert not list(tmp_path.glob("x.tar.gz.*.tmp"))


def test_a_damaged_or_foreign_bundle_is_refused(tmp_path: Path, exported: Path,  # noqa: F811
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(gb.BundleError, match="bundle.json is missing"):
        gb.reassemble(tmp_path, tmp_path / "x.tar.gz", roots=[])
    (tmp_path / "bundle.json").write_text(json.dumps({"format": 99}))
    with pytest.raises(gb.BundleError, match="bundle format 99"):
        gb.reassemble(tmp_path, tmp_path / "x.tar.gz", roots=[])
    not_tar = tmp_path / "not.tar.gz"
    not_tar.write_bytes(b"not an archive")
    with pytest.raises(gb.BundleError, match="not a readable build archive"):
        gb.make(not_tar, tmp_path / "b")
    no_manifest = tmp_path / "no-manifest.tar.gz"
    with tarfile.open(exported) as src, tarfile.open(no_manifest, "w:gz") as dst:
        for m in src.getmembers():
            if m.name != "SHA256SUMS":
                dst.addfile(m, src.extractfile(m))
    with pytest.raises(gb.BundleError, match="has no SHA256SUMS"):
        gb.make(no_manifest, tmp_path / "c")
    monkeypatch.setenv("HOTFIT_LLAMA_CACHE", str(tmp_path / "no-tree"))
    with pytest.raises(gb.BundleError, match=f"no chat templates under .*no-tree/{LLAMA_SDIST_VERSION}/work/src"):
        gb.make(exported, tmp_path / "d", preset=0)


def test_the_cli_says_what_it_left_out(exported: Path, tmp_path: Path) -> None:  # noqa: F811
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu_bundle.py"), "make", str(exported),
                           str(tmp_path / "b")], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "left out: nothing" in proc.stderr, "a CPU archive holds no cuBLAS"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu_bundle.py"), "reassemble",
                           str(tmp_path / "b"), str(tmp_path / "back.tar.gz")], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["substituted"] == {}
    assert _members(tmp_path / "back.tar.gz") == _members(exported)
    shutil.rmtree(tmp_path / "b")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu_bundle.py"), "reassemble",
                           str(tmp_path / "b"), str(tmp_path / "x.tar.gz")], capture_output=True, text=True)
    assert proc.returncode == 1 and "refused" in proc.stderr and "Traceback" not in proc.stderr


def _gpu_check(bundle_dir: Path, out: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """gpu-check --bundle on the CPU build, installing into ``tmp_path/imported`` (its own cache)."""
    env = {**os.environ, "HOTFIT_MODEL_CACHE": str(tmp_path / "no-models"), "PYTHONUNBUFFERED": "1"}
    env.pop("HOTFIT_LLAMA_CACHE", None)
    return subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu-check"), "--backend", "cpu",
                           "--bundle", str(bundle_dir), "--out", str(out), "--budget-s", "600",
                           "--import-cache", str(tmp_path / "imported")],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO_ROOT)


def test_gpu_check_with_a_bundle_on_a_machine_without_real_models(bundle, tmp_path: Path) -> None:
    """The path the lent GPU machine takes (its self-test with the CPU build): the build imported
    from the bundle into a fresh cache, the fixture pipeline on it, the real-model steps skipped
    and said to be; a step that fails makes the check fail."""
    out_dir, original = bundle
    lib = tmp_path / "machine-lib"
    lib.mkdir()
    for name in LEFT:
        (lib / name).write_bytes(original[f"cpu/bin/{name}"])
    usable = tmp_path / "usable-bundle"
    shutil.copytree(out_dir, usable)
    # the bundle's left-out files are found under /usr/local/cuda*/lib64, the system or the nvidia
    # wheels; here none has them, so the check runs on a bundle that left nothing out
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "gpu_bundle.py"), "reassemble", str(usable),
                           str(tmp_path / "whole.tar.gz")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "is not on this machine" in proc.stderr
    whole = gb.reassemble(usable, tmp_path / "whole.tar.gz", roots=[lib])
    assert whole.substituted == {}
    gb.make(tmp_path / "whole.tar.gz", usable, left_out=(), preset=0)

    out = tmp_path / "out"
    proc = _gpu_check(usable, out, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    status = {s["name"]: s["status"] for s in report["steps"]}
    assert status == {"venv": "PASS", "import": "PASS", "probe": "PASS", "hub": "PASS", "pipeline": "PASS",
                      "real": "SKIP", "speed": "SKIP"}
    assert report["passed"] and report["skipped"] == ["real", "speed"]
    assert "PASS (real, speed skipped)" in proc.stdout
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["import"]["summary"].startswith("--from accepted it")
    imported = tmp_path / "imported" / LLAMA_SDIST_VERSION / "cpu" / "bin" / "llama-server"
    assert steps["import"]["details"]["server"] == str(imported) and imported.is_file()
    assert steps["pipeline"]["details"]["manifest"]["backend_build"]["server_path"] == str(imported)

    proc = _gpu_check(out_dir, tmp_path / "out-failed", tmp_path)  # its left-out files are nowhere here
    assert proc.returncode == 1
    assert "| import | FAIL |" in proc.stdout and "is not on this machine" in proc.stdout
