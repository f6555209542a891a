"""`install-llama-server --from` / `--export` on damaged archives and hostile places (docs/faults.md,
"Build archives"): each is a refusal with a message and exit 1, never a traceback, and the cache
is as it was. Only known flavours are installed; the cache swap is one atomic step under a lock,
and what a killed import leaves is cleaned by the next one.

Most archives here are made from a small stand-in build folder (two scripts named llama-server and
llama-fit-params, a build-info.json with this checkout's pin): these faults are refused before any
binary runs, so no real build is needed to show them. The ones that run the binary (an accepted
build, the swap) use the real portable CPU build's export (tests/test_build_archive.py).
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import tarfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.settings import LLAMA_SDIST_VERSION
from tests.conftest import REPO_ROOT
from tests.test_build_archive import _llama_build, _refused, _script, exported  # noqa: F401 - a fixture
from tests.test_fault_matrix_disk import tmpfs
from tests.polling import wait_until

TIER = "integration"

SCRIPT_TEXT = (REPO_ROOT / "scripts" / "install-llama-server").read_text()
PIN = {"sdist_version": LLAMA_SDIST_VERSION,
       "sdist_sha256": re.search(r'SDIST_SHA256="([0-9a-f]{64})"', SCRIPT_TEXT).group(1)}
MiB = 1 << 20


def _standin_build(root: Path, flavour: str = "cpu", info: object | None = None, payload_bytes: int = 0) -> Path:
    """A build folder as install-llama-server leaves it, with stand-in binaries."""
    bin_dir = root / flavour / "bin"
    bin_dir.mkdir(parents=True)
    for name in ("llama-server", "llama-fit-params"):
        (bin_dir / name).write_text("#!/bin/sh\necho 'stand-in: never run by these tests' >&2\nexit 1\n")
        (bin_dir / name).chmod(0o755)
    if payload_bytes:
        (bin_dir / "libggml-base.so").write_bytes(os.urandom(payload_bytes))
    record = info if info is not None else {**PIN, "backend": "cpu", "variant": "portable", "arch": os.uname().machine,
                                            "cpu_features": [], "cpu_variants": {}}
    (bin_dir / "build-info.json").write_text(json.dumps(record))
    return bin_dir


def _export(tmp_path: Path, name: str = "build", **kw: object) -> Path:
    bin_dir = _standin_build(tmp_path / f"{name}-src", **kw)  # type: ignore[arg-type]
    out = tmp_path / f"{name}.tar.gz"
    _llama_build().export(bin_dir, bin_dir.parent.name, out)
    return out


def _tar(path: Path, members: list[tuple[str, bytes | None]]) -> Path:
    """An archive of exactly these members (bytes: a file; None: a folder)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type, info.mode = tarfile.DIRTYPE, 0o755
                tar.addfile(info)
            else:
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
    return path


# ----------------------------------------------------------------------------- damage (refused, no traceback)


def test_a_truncated_archive_is_refused_as_cut_short(tmp_path: Path) -> None:
    """A copy cut short (the likeliest fleet failure): the gzip stream ends inside a member."""
    whole = _export(tmp_path, payload_bytes=2 * MiB)
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    _refused(cut, tmp_path, "is damaged or cut short")


def test_a_manifest_that_is_not_utf8_is_refused(tmp_path: Path) -> None:
    src = _standin_build(tmp_path / "src")
    members: list[tuple[str, bytes | None]] = [("SHA256SUMS", b"\xff\xfe" + b"0" * 64 + b"  cpu/bin/llama-server\n")]
    members += [(f"cpu/bin/{p.name}", p.read_bytes()) for p in sorted(src.iterdir())]
    _refused(_tar(tmp_path / "latin.tar.gz", members), tmp_path, "SHA256SUMS is not UTF-8 text")


@pytest.mark.parametrize(("record", "says"), [
    ([], "build-info.json is a JSON list, not an object"),
    ({**PIN, "backend": 5}, "build-info.json's backend is a JSON int, expected str"),
    ({**PIN, "backend": "cpu", "cpu_variants": ["zen4"]}, "build-info.json's cpu_variants is a JSON list, expected dict"),
    ({**PIN, "backend": "cpu", "cpu_variants": {"zen4": "avx2"}}, "hold something other than lists of names"),
    ({**PIN, "backend": "cpu", "arch": ["x86_64"]}, "build-info.json's arch is a JSON list, expected str"),
])
def test_a_build_record_of_the_wrong_types_is_refused(tmp_path: Path, record: object, says: str) -> None:
    _refused(_export(tmp_path, info=record), tmp_path, says)


@pytest.mark.parametrize(("members", "says"), [
    ([("SHA256SUMS", b""), ("cpu", None)], "has no files under cpu/bin/"),
    ([("SHA256SUMS", b""), ("cpu", None), ("cpu/bin", None)], "has no files under cpu/bin/"),
    ([("SHA256SUMS", b"")], "holds no build"),
])
def test_an_archive_without_a_bin_folder_is_refused(tmp_path: Path, members: list, says: str) -> None:
    _refused(_tar(tmp_path / "empty.tar.gz", members), tmp_path, says)


# ----------------------------------------------------------------------------- hostile places


@contextmanager
def _read_only_fs(where: Path) -> Iterator[Path]:
    with tmpfs(where, 4 * MiB) as fs:
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        yield fs


def test_a_read_only_cache_is_refused_naming_it(tmp_path: Path) -> None:
    archive = _export(tmp_path)
    with _read_only_fs(tmp_path / "ro") as fs:
        proc = _script("--from", str(archive), cache=fs / "llama.cpp")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot write the build cache" in proc.stderr and "Read-only file system" in proc.stderr, proc.stderr


def test_a_full_cache_is_refused_before_unpacking_naming_the_bytes(tmp_path: Path) -> None:
    archive = _export(tmp_path, payload_bytes=3 * MiB)
    with tmpfs(tmp_path / "small", 2 * MiB) as fs:
        proc = _script("--from", str(archive), cache=fs / "llama.cpp")
        left = sorted(p.name for p in (fs / "llama.cpp" / LLAMA_SDIST_VERSION).iterdir())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "not enough space" in proc.stderr and "HOTFIT_LLAMA_CACHE" in proc.stderr, proc.stderr
    assert left == []


def _fake_cache(tmp_path: Path, payload_bytes: int = 0) -> Path:
    """A cache holding a finished stand-in cpu build, for --export."""
    cache = tmp_path / "cache"
    _standin_build(cache / LLAMA_SDIST_VERSION, payload_bytes=payload_bytes)
    return cache


def test_export_to_a_read_only_disk_is_refused(tmp_path: Path) -> None:
    cache = _fake_cache(tmp_path)
    with _read_only_fs(tmp_path / "ro") as fs:
        proc = _script("--backend", "cpu", "--export", str(fs / "out" / "cpu.tar.gz"), cache=cache)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot write the archive" in proc.stderr and "Read-only file system" in proc.stderr, proc.stderr


def test_export_to_a_full_disk_is_refused_and_leaves_nothing(tmp_path: Path) -> None:
    cache = _fake_cache(tmp_path, payload_bytes=3 * MiB)  # random bytes: gzip cannot shrink them
    with tmpfs(tmp_path / "small", 1 * MiB) as fs:
        proc = _script("--backend", "cpu", "--export", str(fs / "cpu.tar.gz"), cache=cache)
        left = list(fs.iterdir())
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "cannot write the archive" in proc.stderr and "free space there" in proc.stderr, proc.stderr
    assert left == []


def test_export_onto_a_folder_is_refused_naming_a_file_to_write(tmp_path: Path) -> None:
    cache = _fake_cache(tmp_path)
    (tmp_path / "exports").mkdir()
    proc = _script("--backend", "cpu", "--export", str(tmp_path / "exports"), cache=cache)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "is a folder: name the archive file" in proc.stderr
    assert list((tmp_path / "exports").iterdir()) == []


# ----------------------------------------------------------------------------- bounds


def test_an_archive_of_many_members_is_refused_at_the_bound_with_a_short_message(tmp_path: Path) -> None:
    """Seen: 200,000 members refused after 56 s with a 4 MB one-line error."""
    archive = tmp_path / "many.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for i in range(20_000):
            tar.addfile(tarfile.TarInfo(f"cpu/bin/f{i}"), io.BytesIO(b""))
    proc = _refused(archive, tmp_path, "has more than 512 members")
    assert len(proc.stderr) < 1000


def test_a_huge_sparse_member_is_refused_from_its_header(tmp_path: Path) -> None:
    """Seen: a 16 GiB sparse member (a 182-byte archive) took 69 s of hashing zeros."""
    src = tmp_path / "src"
    (src / "cpu" / "bin").mkdir(parents=True)
    os.truncate(os.open(src / "cpu" / "bin" / "libggml-base.so", os.O_CREAT | os.O_WRONLY), 16 << 30)
    archive = tmp_path / "sparse.tar.gz"
    subprocess.run(["tar", "-C", str(src), "-cSzf", str(archive), "cpu"], check=True)
    assert archive.stat().st_size < 4096
    _refused(archive, tmp_path, f"declares {16 << 30} bytes")


# ----------------------------------------------------------------------------- known flavours only


def test_a_record_naming_another_folder_is_refused_and_the_cache_untouched(exported: Path, tmp_path: Path) -> None:
    """Seen: `"backend": "work"` passed every check, replaced the cache's pinned source tree and sdist
    and said "installed work", exit 0."""
    from tests.test_build_archive import _edit_info, _repack

    work = _repack(exported, tmp_path, _edit_info(backend="work"))
    cache = tmp_path / "cache"
    tree = cache / LLAMA_SDIST_VERSION / "work" / "src"
    tree.mkdir(parents=True)
    (tree / ".complete").write_text("")
    proc = _script("--from", str(work), cache=cache)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "refused" in proc.stderr and "folder 'work' is not a build install-llama-server makes" in proc.stderr
    assert sorted(p.name for p in (cache / LLAMA_SDIST_VERSION).iterdir()) == ["work"]
    assert (tree / ".complete").is_file()
    # the record alone naming it (folder cpu, backend work) is refused as well
    record_only = _export(tmp_path, name="record-only", info={**PIN, "backend": "work", "variant": "portable"})
    _refused(record_only, tmp_path / "second", "build-info.json names backend 'work'")


# ----------------------------------------------------------------------------- a good build, a spaced path


def test_a_good_build_installs_into_a_cache_whose_path_holds_a_space(exported: Path, tmp_path: Path) -> None:
    """Seen: refused, "loaded no CPU variant", because core/isa.py's pattern stopped at the space."""
    cache = tmp_path / "build cache" / "llama cpp"
    proc = _script("--from", str(exported), cache=cache)
    assert proc.returncode == 0, proc.stderr
    assert "(CPU variant " in proc.stderr
    assert (cache / LLAMA_SDIST_VERSION / "cpu" / "bin" / "llama-server").is_file()


# ----------------------------------------------------------------------------- the swap: atomic, locked, cleaned


def _server_bytes(cache: Path) -> bytes:
    return (cache / LLAMA_SDIST_VERSION / "cpu" / "bin" / "llama-server").read_bytes()


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_a_crash_at_any_step_of_the_swap_leaves_a_cpu_build(exported: Path, tmp_path: Path, exchange: bool,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """The import is stopped at each of its file-system steps in turn (the step raises, as a kill
    would end it there): afterwards a complete cpu/ is in place (the old build or the new), and the
    next import recovers and leaves nothing behind. Without renameat2 (some file systems) the two
    renames are recovered by the next run."""
    build = _llama_build()
    version_dir = tmp_path / "cache" / LLAMA_SDIST_VERSION
    cpuinfo = Path("/proc/cpuinfo")
    build.import_archive(exported, version_dir, PIN, cpuinfo)
    good = _server_bytes(tmp_path / "cache")
    if not exchange:
        monkeypatch.setattr(build, "_exchange", lambda a, b: False)
    steps = {"replace": os.replace, "rmtree": build.shutil.rmtree, "exchange": build._exchange}

    class Killed(BaseException):
        pass

    for kill_at in range(1, 8):
        calls = [0]

        def counted(name: str) -> Callable[..., object]:
            def step(*args: object, **kw: object) -> object:
                calls[0] += 1
                if calls[0] == kill_at:
                    raise Killed(name)
                return steps[name](*args, **kw)
            return step

        monkeypatch.setattr(build.os, "replace", counted("replace"))
        monkeypatch.setattr(build.shutil, "rmtree", counted("rmtree"))
        monkeypatch.setattr(build, "_exchange", counted("exchange"))
        try:
            build._install(*_staged(build, exported, version_dir))
        except Killed:
            pass
        monkeypatch.setattr(build.os, "replace", steps["replace"])
        monkeypatch.setattr(build.shutil, "rmtree", steps["rmtree"])
        monkeypatch.setattr(build, "_exchange", steps["exchange"])
        if exchange:  # one atomic step: a complete cpu/ at every moment
            assert _server_bytes(tmp_path / "cache") == good, f"no complete cpu/ after a kill at step {kill_at}"
        with build._ImportLock(version_dir):  # what the next import does first
            build._recover(version_dir)
        assert _server_bytes(tmp_path / "cache") == good, f"no complete cpu/ after recovering step {kill_at}"
        assert sorted(p.name for p in version_dir.iterdir()) == ["cpu"], kill_at


def _staged(build: Any, archive: Path, version_dir: Path) -> tuple[Path, Path]:
    """An import's staged build (unpacked beside the cache's, as import_archive stages it)."""
    staging = Path(build.tempfile.mkdtemp(prefix=".import-", dir=version_dir))
    flavour = build._unpack(archive, staging)
    return staging / flavour, version_dir / flavour


def test_a_killed_import_leaves_staging_that_the_next_one_removes(exported: Path, tmp_path: Path) -> None:
    """kill -9 while it unpacks: a .import-* folder is left (~0.1-0.7 GB); the next import removes it."""
    cache = tmp_path / "cache"
    version_dir = cache / LLAMA_SDIST_VERSION
    env = {**os.environ, "HOTFIT_LLAMA_CACHE": str(cache)}
    proc = subprocess.Popen([str(REPO_ROOT / "scripts" / "install-llama-server"), "--from", str(exported)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    def staged() -> bool:
        return version_dir.is_dir() and any(p.name.startswith(".import-") and any(p.rglob("libggml*"))
                                            for p in version_dir.iterdir())

    # looked at often: unpacking may take a fraction of a second, and the import must not finish first
    wait_until(staged, "a library staged in a .import-* folder (the import killed while unpacking)",
               timeout_s=120, proc=proc, interval_s=0.002)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    assert any(p.name.startswith(".import-") for p in version_dir.iterdir())
    again = _script("--from", str(exported), cache=cache)
    assert again.returncode == 0, again.stderr
    assert "a previous import was interrupted: removed .import-" in again.stderr
    assert sorted(p.name for p in version_dir.iterdir()) == ["cpu"]


def test_imports_at_once_all_succeed_one_after_the_other(exported: Path, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    env = {**os.environ, "HOTFIT_LLAMA_CACHE": str(cache)}
    argv = [str(REPO_ROOT / "scripts" / "install-llama-server"), "--from", str(exported)]
    procs = [subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and "Traceback" not in err, err
    assert sorted(p.name for p in (cache / LLAMA_SDIST_VERSION).iterdir()) == ["cpu"]
