"""Build once, install on many machines: ``install-llama-server --export FILE`` packs a finished
build, ``--from FILE`` installs it into another cache without compiling — after checking the
archive's hashes, its pin, and that the binary runs here (docs/builds.md). Everything refused
leaves the target cache as it was."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import subprocess
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from hotfit.backends.llama_server.discovery import find_llama_server
from hotfit.core.isa import cpuinfo_flags
from hotfit.core.settings import LLAMA_SDIST_VERSION, load_settings
from tests.conftest import REPO_ROOT
from tests.test_portable_build import _require_build
from tests.test_vulkan import LAVAPIPE_ENV

TIER = "integration"

SCRIPT = REPO_ROOT / "scripts" / "install-llama-server"


def _llama_build() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama_build", REPO_ROOT / "scripts" / "llama_build.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _script(*args: str, cache: Path | None = None, root: Path | None = None,
            extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(extra_env or {})}
    if cache is not None:
        env["HOTFIT_LLAMA_CACHE"] = str(cache)
    if root is not None:
        env["HOTFIT_DETECT_ROOT"] = str(root)
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, timeout=300, env=env)


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require_build("cpu")
    archive = tmp_path_factory.mktemp("export") / "llama-server-cpu.tar.gz"
    proc = _script("--backend", "cpu", "--export", str(archive))
    assert proc.returncode == 0, proc.stderr
    return archive


def test_the_archive_is_readable_as_any_new_file_here(exported: Path, tmp_path: Path) -> None:
    """Seen: the archive was 0600 (mkstemp's mode), so the web server or the other users a build
    server shares it with could not read it. It gets 0666 less the umask, like any new file."""
    umask = os.umask(0)
    os.umask(umask)
    assert exported.stat().st_mode & 0o777 == 0o666 & ~umask
    archive = tmp_path / "group.tar.gz"
    proc = subprocess.run(["sh", "-c", f'umask 002 && exec "{SCRIPT}" --backend cpu --export "{archive}"'],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert archive.stat().st_mode & 0o777 == 0o664


def _repack(source: Path, into: Path, change) -> Path:
    """Unpack ``source``, let ``change(bin_dir)`` edit the files, and pack it again with a manifest
    that matches the edited files (so only the check under test can refuse it)."""
    root = into / "unpacked"
    with tarfile.open(source) as tar:
        tar.extractall(root, filter="data")
    bin_dir = root / "cpu" / "bin"
    change(bin_dir)
    flavour = json.loads((bin_dir / "build-info.json").read_text()).get("backend", "cpu")
    if flavour != "cpu":
        (root / "cpu").rename(root / flavour)
        bin_dir = root / flavour / "bin"
    out = into / f"changed-{flavour}.tar.gz"
    _llama_build().export(bin_dir, flavour, out)
    return out


def _edit_info(**fields: object):
    def change(bin_dir: Path) -> None:
        path = bin_dir / "build-info.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
    return change


def test_export_then_from_into_a_fresh_cache_installs_without_compiling(exported: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    with tarfile.open(exported) as tar:
        names = tar.getnames()
        manifest = tar.extractfile("SHA256SUMS").read().decode()
    assert "cpu/bin/llama-server" in names and "cpu/bin/build-info.json" in names
    assert any(n.startswith("cpu/bin/libggml-cpu-") for n in names)
    assert all(len(line.split("  ")[0]) == 64 for line in manifest.splitlines())
    assert {line.split("  ")[1] for line in manifest.splitlines()} == {n for n in names if n != "SHA256SUMS"}

    cache = tmp_path / "fresh-cache"
    proc = _script("--from", str(exported), cache=cache)
    assert proc.returncode == 0, proc.stderr
    server = cache / LLAMA_SDIST_VERSION / "cpu" / "bin" / "llama-server"
    assert proc.stdout.strip() == str(server)
    assert "CPU variant" in proc.stderr
    assert not (cache / LLAMA_SDIST_VERSION / "work").exists()  # nothing was compiled or downloaded
    # hotfit finds and accepts it as it would the locally built one.
    monkeypatch.setenv("HOTFIT_LLAMA_CACHE", str(cache))
    monkeypatch.delenv("HOTFIT_LLAMA_SERVER", raising=False)
    found = find_llama_server(load_settings(), path_env="")
    assert found.server_path == server and found.source == "cache" and found.build.cpu_variant
    # A second import replaces the first atomically; the install script then sees a finished build.
    again = _script("--from", str(exported), cache=cache)
    assert again.returncode == 0, again.stderr
    noop = _script("--backend", "cpu", cache=cache)
    assert noop.returncode == 0 and "no-op" in noop.stderr
    assert [p.name for p in (cache / LLAMA_SDIST_VERSION).iterdir()] == ["cpu"]  # no staging left


def _refused(archive: Path, tmp_path: Path, match: str, **kw) -> subprocess.CompletedProcess[str]:
    cache = tmp_path / "target-cache"
    proc = _script("--from", str(archive), cache=cache, **kw)
    assert proc.returncode == 1, proc.stderr
    assert "refused" in proc.stderr and match in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    version_dir = cache / LLAMA_SDIST_VERSION
    assert not version_dir.exists() or list(version_dir.iterdir()) == []
    return proc


def test_a_damaged_file_is_refused_naming_it_and_both_hashes(exported: Path, tmp_path: Path) -> None:
    damaged = tmp_path / "damaged.tar.gz"
    with tarfile.open(exported) as src, tarfile.open(damaged, "w:gz") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else None
            if member.name == "cpu/bin/llama-server":
                data = data[:1000] + bytes([data[1000] ^ 1]) + data[1001:]
            dst.addfile(member, io.BytesIO(data) if data is not None else None)
    _refused(damaged, tmp_path, "cpu/bin/llama-server has sha256")


@pytest.mark.parametrize("kind", ["parent", "symlink", "absolute"])
def test_members_outside_the_build_folder_are_refused(exported: Path, tmp_path: Path, kind: str) -> None:
    hostile = tmp_path / f"{kind}.tar.gz"
    with tarfile.open(exported) as src, tarfile.open(hostile, "w:gz") as dst:
        for member in src.getmembers():
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
        evil = tarfile.TarInfo({"parent": "cpu/bin/../../../escaped", "symlink": "cpu/bin/libevil.so",
                                "absolute": "/tmp/hotfit-escaped"}[kind])
        if kind == "symlink":
            evil.type, evil.linkname = tarfile.SYMTYPE, "/etc/passwd"
            dst.addfile(evil)
        else:
            evil.size = 1
            dst.addfile(evil, io.BytesIO(b"x"))
    _refused(hostile, tmp_path, "is not a file under <flavour>/bin/")
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/hotfit-escaped").exists()


def test_an_archive_of_another_pin_is_refused(exported: Path, tmp_path: Path) -> None:
    other = _repack(exported, tmp_path, _edit_info(sdist_version="0.0.1"))
    _refused(other, tmp_path, "sdist_version 0.0.1")


def test_a_build_needing_an_isa_this_cpu_lacks_is_refused(exported: Path, tmp_path: Path) -> None:
    """A native AVX-512 build offered to a CPU without it (this machine's flags less AVX-512)."""
    native = _repack(exported, tmp_path, _edit_info(cpu_features=["avx2", "avx512f", "fma"], cpu_variants={},
                                                    variant="portable"))
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    flags = sorted(f for f in cpuinfo_flags(Path("/proc/cpuinfo").read_text()) if not f.startswith("avx512"))
    (root / "proc" / "cpuinfo").write_text(f"processor\t: 0\nflags\t\t: {' '.join(flags)}\n")
    _refused(native, tmp_path, "needs CPU features this CPU lacks: avx512f", root=root)


@pytest.mark.parametrize(("backend", "device"), [("vulkan", "Vulkan"), ("cuda", "CUDA")])
def test_a_gpu_build_that_sees_no_gpu_here_is_refused(exported: Path, tmp_path: Path, backend: str,
                                                      device: str) -> None:
    """The record says GPU build; its binary lists no such device on this machine (no driver,
    no GPU): refused before it could be planned for."""
    gpu = _repack(exported, tmp_path, _edit_info(backend=backend))
    _refused(gpu, tmp_path, f"sees no {device} device here")


def test_a_build_missing_a_library_it_loads_is_refused(exported: Path, tmp_path: Path) -> None:
    broken = _repack(exported, tmp_path, lambda bin_dir: (bin_dir / "libllama.so.0").unlink())
    _refused(broken, tmp_path, "--version failed here")


def test_not_an_archive_is_refused_with_what_to_do(tmp_path: Path) -> None:
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"not a tar file at all")
    _refused(junk, tmp_path, "--export FILE")
    _refused(tmp_path / "absent.tar.gz", tmp_path, "no build archive at")


def test_export_without_a_build_says_how_to_make_one(tmp_path: Path) -> None:
    proc = _script("--backend", "cpu", "--export", str(tmp_path / "x.tar.gz"), cache=tmp_path / "empty")
    assert proc.returncode == 1 and "no finished cpu build" in proc.stderr
    assert not (tmp_path / "x.tar.gz").exists()


def test_a_real_vulkan_build_round_trips_and_is_refused_without_a_vulkan_driver(tmp_path: Path) -> None:
    """The Vulkan build (its CPU modules are the portable build's) exported and installed into a
    fresh cache where Mesa's lavapipe is the device; the same archive on a machine whose Vulkan
    loader finds no driver is refused before anything is installed."""
    _require_build("vulkan")
    archive = tmp_path / "llama-server-vulkan.tar.gz"
    proc = _script("--backend", "vulkan", "--export", str(archive))
    assert proc.returncode == 0, proc.stderr
    with tarfile.open(archive) as tar:
        names = tar.getnames()
    assert "vulkan/bin/libggml-vulkan.so" in names and "vulkan/bin/libggml-cpu-x64.so" in names
    lavapipe = LAVAPIPE_ENV
    ok = _script("--from", str(archive), cache=tmp_path / "with-driver", extra_env=lavapipe)
    assert ok.returncode == 0, ok.stderr
    assert "vulkan build runs here" in ok.stderr
    no_driver = {**lavapipe, "VK_DRIVER_FILES": str(tmp_path / "none.json"), "VK_ICD_FILENAMES": str(tmp_path / "none.json")}
    _refused(archive, tmp_path, "sees no Vulkan device here", extra_env=no_driver)


def test_an_archive_repacked_with_tar_including_its_folders_is_accepted(exported: Path, tmp_path: Path) -> None:
    """An operator may unpack and repack with plain `tar` (folder entries included): still one build."""
    root = tmp_path / "unpacked"
    with tarfile.open(exported) as tar:
        tar.extractall(root, filter="data")
    repacked = tmp_path / "repacked.tar.gz"
    subprocess.run(["tar", "-C", str(root), "-czf", str(repacked), "SHA256SUMS", "cpu"], check=True)
    with tarfile.open(repacked) as tar:
        assert any(m.isdir() for m in tar.getmembers())
    proc = _script("--from", str(repacked), cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr
