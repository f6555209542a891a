"""backends.llama_server finds llama-server in the documented order (flag > env > cache > PATH), says
which one it used, and refuses clearly when none is usable. The binaries here are
real executables written to temporary directories; one test runs the real pinned build."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import structlog

from hotfit.backends.llama_server.discovery import (
    ServerBinary,
    build_info_from_json,
    cache_bin_dir,
    find_llama_server,
    parse_version_text,
    pinned_source_tree,
)
from hotfit.core.errors import BackendError, BackendNotFound
from hotfit.core.settings import LLAMA_SDIST_VERSION, load_settings
from tests import gguf_fixtures as gf

TIER = "integration"


def _fake_server(directory: Path, *, version: str = "7.7.7", exit_code: int = 0, mode: int = 0o755) -> Path:
    """A real executable that answers --version the way llama-server does (on stderr)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "llama-server"
    path.write_text(
        "#!/bin/sh\n"
        f'echo "version: {version} (build 42, commit abc1234)" >&2\n'
        'echo "built with test for Linux" >&2\n'
        f"exit {exit_code}\n"
    )
    path.chmod(mode)
    return path


@pytest.fixture
def places(tmp_path: Path) -> dict[str, Path]:
    """Empty directories standing for the four places; nothing from the real machine leaks in."""
    out = {name: tmp_path / name for name in ("flag", "env", "cache", "path")}
    out["path"].mkdir()
    return out


def _settings(places: dict[str, Path], *, flag: Path | None = None, env: Path | None = None):
    environ = {"HOME": str(places["path"].parent), "HOTFIT_LLAMA_CACHE": str(places["cache"])}
    if env is not None:
        environ["HOTFIT_LLAMA_SERVER"] = str(env)
    return load_settings(environ, llama_server=flag)


def _cache_server(places: dict[str, Path], **kw) -> Path:
    return _fake_server(places["cache"] / LLAMA_SDIST_VERSION / "cpu" / "bin", **kw)


def test_flag_beats_env_cache_and_path(places: dict[str, Path]) -> None:
    flag = _fake_server(places["flag"], version="1.0.flag")
    env = _fake_server(places["env"])
    _cache_server(places)
    _fake_server(places["path"])
    backend = find_llama_server(_settings(places, flag=flag, env=env), path_env=str(places["path"]))
    assert (backend.server_path, backend.source) == (flag, "flag")
    assert backend.build.version == "1.0.flag"


def test_env_beats_cache_and_path(places: dict[str, Path]) -> None:
    env = _fake_server(places["env"], version="2.0.env")
    _cache_server(places)
    _fake_server(places["path"])
    backend = find_llama_server(_settings(places, env=env), path_env=str(places["path"]))
    assert (backend.server_path, backend.source, backend.build.version) == (env, "env", "2.0.env")


def test_cache_beats_path_and_reads_build_info_json(places: dict[str, Path]) -> None:
    cached = _cache_server(places, version="3.0.cache")
    info = {
        "sdist": "llama-cpp-python",
        "sdist_version": LLAMA_SDIST_VERSION,
        "sdist_sha256": "ab" * 32,
        "llama_cpp_version": "version: 0.5.0-dev (build 1, commit 0c1e570)",
    }
    (cached.parent / "build-info.json").write_text(json.dumps(info))
    _fake_server(places["path"])
    settings = _settings(places)
    backend = find_llama_server(settings, path_env=str(places["path"]))
    assert (backend.server_path, backend.source) == (cached, "cache")
    assert cached.parent == cache_bin_dir(settings)
    # build-info.json wins over asking the binary (which would say 3.0.cache)
    assert backend.build.origin == "build-info.json"
    assert (backend.build.version, backend.build.commit, backend.build.sdist_version) == (
        "0.5.0-dev",
        "0c1e570",
        LLAMA_SDIST_VERSION,
    )


def test_path_is_the_last_resort_and_version_comes_from_the_binary(places: dict[str, Path]) -> None:
    on_path = _fake_server(places["path"], version="4.0.path")
    backend = find_llama_server(_settings(places), path_env=str(places["path"]))
    assert (backend.server_path, backend.source) == (on_path, "path")
    assert backend.build.origin == "--version"
    assert (backend.build.version, backend.build.build_number, backend.build.commit) == ("4.0.path", 42, "abc1234")
    assert backend.fit_params_path is None


def test_nothing_found_names_every_place_and_the_fix(places: dict[str, Path]) -> None:
    with pytest.raises(BackendNotFound) as caught:
        find_llama_server(_settings(places), path_env=str(places["path"]))
    err = caught.value
    searched = err.details["searched"]
    assert len(searched) == 6  # flag, env, the cpu/vulkan/cuda builds in the cache, PATH
    assert searched[0].startswith("--llama-server") and searched[1].startswith("HOTFIT_LLAMA_SERVER")
    for i, backend in enumerate(("cpu", "vulkan", "cuda"), start=2):
        assert str(places["cache"] / LLAMA_SDIST_VERSION / backend / "bin" / "llama-server") in searched[i]
    assert "PATH" in searched[5]
    assert "scripts/install-llama-server" in (err.hint or "")
    assert err.exit_code == 5
    for described in searched:
        assert described in err.what


def test_named_path_that_does_not_exist_is_an_error_not_a_fallback(places: dict[str, Path]) -> None:
    _fake_server(places["path"])  # would be found, but the operator named another binary
    missing = places["env"] / "llama-server"
    with pytest.raises(BackendNotFound, match="does not exist") as caught:
        find_llama_server(_settings(places, env=missing), path_env=str(places["path"]))
    assert caught.value.details == {"path": str(missing), "source": "env"}


def test_named_path_not_executable(places: dict[str, Path]) -> None:
    flag = _fake_server(places["flag"], mode=0o644)
    with pytest.raises(BackendNotFound, match="not executable") as caught:
        find_llama_server(_settings(places, flag=flag), path_env="")
    assert "chmod +x" in (caught.value.hint or "")


def test_named_path_is_a_directory(places: dict[str, Path]) -> None:
    places["flag"].mkdir()
    with pytest.raises(BackendNotFound, match="not a file"):
        find_llama_server(_settings(places, flag=places["flag"]), path_env="")


def test_cache_binary_not_executable_says_rebuild(places: dict[str, Path]) -> None:
    _cache_server(places, mode=0o644)
    _fake_server(places["path"])
    with pytest.raises(BackendNotFound, match="not executable") as caught:
        find_llama_server(_settings(places), path_env=str(places["path"]))
    assert "install-llama-server --force" in (caught.value.hint or "")


def test_binary_whose_version_fails_is_refused(places: dict[str, Path]) -> None:
    broken = _fake_server(places["flag"], exit_code=3)
    with pytest.raises(BackendError, match="exited with 3"):
        find_llama_server(_settings(places, flag=broken), path_env="")


def test_fit_params_found_beside_the_server(places: dict[str, Path]) -> None:
    server = _fake_server(places["flag"])
    fit = server.parent / "llama-fit-params"
    fit.write_text("#!/bin/sh\nexit 0\n")
    fit.chmod(0o755)
    assert find_llama_server(_settings(places, flag=server), path_env="").fit_params_path == fit
    fit.chmod(0o644)  # present but not runnable: treated as absent (it is optional)
    assert find_llama_server(_settings(places, flag=server), path_env="").fit_params_path is None


def test_relative_flag_path_is_made_absolute(places: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    server = _fake_server(places["flag"])
    monkeypatch.chdir(places["flag"])
    backend = find_llama_server(_settings(places, flag=Path("llama-server")), path_env="")
    assert backend.server_path == server and backend.server_path.is_absolute()


def test_backend_found_event_names_binary_and_source(places: dict[str, Path]) -> None:
    env = _fake_server(places["env"], version="5.5")
    with structlog.testing.capture_logs() as events:
        find_llama_server(_settings(places, env=env), path_env="")
    [found] = [e for e in events if e["event"] == "backend.found"]
    assert (found["path"], found["source"], found["version"]) == (str(env), "env", "5.5")


def test_settings_record_where_the_server_path_came_from(tmp_path: Path) -> None:
    env = {"HOTFIT_LLAMA_SERVER": str(tmp_path / "a")}
    assert load_settings(env).llama_server_source == "env"
    flagged = load_settings(env, llama_server=tmp_path / "b")
    assert (flagged.llama_server, flagged.llama_server_source) == (tmp_path / "b", "flag")
    assert load_settings({}).llama_server_source is None


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version: 0.5.0-dev (build 1, commit 0c1e570)\nbuilt with GNU 12.2.0", ("0.5.0-dev", 1, "0c1e570")),
        ("load_backend: x\nversion: 7016 (abcdef12)\n", ("7016", None, "abcdef12")),
        ("no version here", (None, None, None)),
    ],
)
def test_parse_version_text(text: str, expected: tuple[str | None, int | None, str | None]) -> None:
    info = parse_version_text(text)
    assert (info.version, info.build_number, info.commit) == expected


def test_build_info_from_json_keeps_the_pin() -> None:
    info = build_info_from_json({"llama_cpp_version": "version: 9 (build 3, commit ff00)", "sdist_version": "0.3.36"})
    assert (info.origin, info.version, info.build_number, info.commit, info.sdist_version) == (
        "build-info.json",
        "9",
        3,
        "ff00",
        "0.3.36",
    )


def test_pinned_source_tree_is_under_the_cache(tmp_path: Path) -> None:
    settings = load_settings({"HOTFIT_LLAMA_CACHE": str(tmp_path)})
    assert pinned_source_tree(settings) == tmp_path / LLAMA_SDIST_VERSION / "work" / "src" / "vendor" / "llama.cpp"


@pytest.mark.llama
def test_real_pinned_build_version_agrees_with_its_build_info(tmp_path: Path) -> None:
    real = gf.require_llama_server()
    recorded = find_llama_server(load_settings(llama_server=real))
    # a link without build-info.json beside it makes discovery ask the binary itself
    link_dir = tmp_path / "bin"
    link_dir.mkdir()
    (link_dir / "llama-server").symlink_to(real)
    asked = find_llama_server(load_settings(llama_server=link_dir / "llama-server"), path_env="")
    assert asked.build.origin == "--version"
    if recorded.build.origin == "build-info.json":
        assert (asked.build.version, asked.build.commit) == (recorded.build.version, recorded.build.commit)
    assert asked.build.version  # the pinned build reports a version
    assert isinstance(recorded, ServerBinary) and os.access(recorded.server_path, os.X_OK)
    assert recorded.server_path.stat().st_mode & stat.S_IXUSR


# ---------------------------------------------------------------- this machine, this plan


def _with_build_info(server: Path, **fields) -> Path:
    record = {"llama_cpp_version": "version: 7.7.7 (build 42, commit abc1234)", "sdist_version": "0.3.36",
              "backend": "cpu", "variant": "native", "cpu_features": ["avx2", "fma"], **fields}
    (server.parent / "build-info.json").write_text(json.dumps(record))
    return server


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: GenuineIntel\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    return path


def test_a_binary_built_for_features_this_cpu_lacks_is_refused_before_it_runs(
        places: dict[str, Path], tmp_path: Path) -> None:
    server = _with_build_info(_cache_server(places), cpu_features=["avx2", "avx512f", "avx512_vnni"])
    with pytest.raises(BackendError) as caught:
        find_llama_server(_settings(places), path_env="", cpuinfo_path=_cpuinfo(tmp_path, "fpu sse2 avx avx2 fma"))
    err = caught.value
    assert "avx512_vnni" in err.what and "avx512f" in err.what and "SIGILL" in err.what
    assert err.details["missing_features"] == ["avx512_vnni", "avx512f"]
    assert "scripts/install-llama-server --backend cpu --force" in (err.hint or "")
    assert str(server) in err.what
    # the same binary on a CPU that has them is accepted
    ok = find_llama_server(_settings(places), path_env="",
                           cpuinfo_path=_cpuinfo(tmp_path, "sse2 avx avx2 fma avx512f avx512_vnni"))
    assert ok.build.cpu_features == ("avx2", "avx512f", "avx512_vnni")
    assert ok.build.backend == "cpu" and ok.build.variant == "native"


@pytest.mark.parametrize(
    ("device_kind", "built", "fix"),
    [("nvidia", "cpu", "--backend cuda"), ("amd", "cpu", "--backend vulkan"), ("vulkan", "cuda", "--backend vulkan"),
     ("cpu", "vulkan", "--backend cpu"), ("cpu", "cuda", "--backend cpu")],
)
def test_a_binary_whose_backend_cannot_serve_the_plan_is_refused_naming_the_fix(
        places: dict[str, Path], tmp_path: Path, device_kind: str, built: str, fix: str) -> None:
    flag = _with_build_info(_fake_server(places["flag"]), backend=built, cpu_features=[])
    with pytest.raises(BackendError) as caught:
        find_llama_server(_settings(places, flag=flag), path_env="", device_kind=device_kind,
                          cpuinfo_path=_cpuinfo(tmp_path, "avx2"))
    assert f"scripts/install-llama-server {fix}" in (caught.value.hint or "")
    assert built in caught.value.what


@pytest.mark.parametrize(("device_kind", "built"), [("nvidia", "cuda"), ("nvidia", "vulkan"), ("amd", "vulkan"),
                                                    ("vulkan", "vulkan"), ("cpu", "cpu")])
def test_a_binary_that_serves_the_plans_device_is_accepted(
        places: dict[str, Path], tmp_path: Path, device_kind: str, built: str) -> None:
    flag = _with_build_info(_fake_server(places["flag"]), backend=built, cpu_features=[])
    found = find_llama_server(_settings(places, flag=flag), path_env="", device_kind=device_kind,
                              cpuinfo_path=_cpuinfo(tmp_path, "avx2"))
    assert found.build.backend == built


def test_the_cache_is_searched_for_the_build_the_plans_device_needs(places: dict[str, Path], tmp_path: Path) -> None:
    cpu = _with_build_info(_cache_server(places))
    vulkan_dir = places["cache"] / LLAMA_SDIST_VERSION / "vulkan" / "bin"
    vulkan = _with_build_info(_fake_server(vulkan_dir), backend="vulkan")
    cpuinfo = _cpuinfo(tmp_path, "avx2 fma")
    assert find_llama_server(_settings(places), path_env="", device_kind="cpu", cpuinfo_path=cpuinfo).server_path == cpu
    assert find_llama_server(_settings(places), path_env="", device_kind="amd", cpuinfo_path=cpuinfo).server_path == vulkan
    # NVIDIA prefers CUDA, and takes the Vulkan build where no CUDA build exists
    assert find_llama_server(_settings(places), path_env="", device_kind="nvidia",
                             cpuinfo_path=cpuinfo).server_path == vulkan


def test_only_a_cpu_build_for_a_gpu_plan_names_the_gpu_build_to_make(places: dict[str, Path], tmp_path: Path) -> None:
    _with_build_info(_cache_server(places))
    with pytest.raises(BackendNotFound) as caught:
        find_llama_server(_settings(places), path_env="", device_kind="nvidia",
                          cpuinfo_path=_cpuinfo(tmp_path, "avx2 fma"))
    err = caught.value
    assert "cpu" in err.what and "nvidia" in err.what
    assert "scripts/install-llama-server --backend cuda" in (err.hint or "")
    assert err.details["cached_backends"] == ["cpu"]


def test_backend_from_the_libraries_a_binary_links() -> None:
    from hotfit.backends.llama_server.discovery import backend_from_libraries

    assert backend_from_libraries("\tlibvulkan.so.1 => /lib/x86_64-linux-gnu/libvulkan.so.1 (0x1)\n") == "vulkan"
    assert backend_from_libraries("\tlibcuda.so.1 => /usr/lib/libcuda.so.1\n\tlibvulkan.so.1 => x\n") == "cuda"
    assert backend_from_libraries("\tlibc.so.6 => /lib/x86_64-linux-gnu/libc.so.6\n") == "cpu"


def test_a_binary_that_crashes_on_version_is_refused_naming_the_signal(places: dict[str, Path]) -> None:
    directory = places["flag"]
    directory.mkdir(parents=True)
    server = directory / "llama-server"
    server.write_text("#!/bin/sh\nkill -ILL $$\n")  # stands in for a binary built for another ISA
    server.chmod(0o755)
    with pytest.raises(BackendError) as caught:
        find_llama_server(_settings(places, flag=server), path_env="")
    assert "SIGILL" in caught.value.what
