"""Find the llama-server binary hotfit runs, and say which one it used.

Search order, first hit wins:

1. ``--llama-server PATH``           (source ``"flag"``)
2. ``HOTFIT_LLAMA_SERVER``           (source ``"env"``)
3. the build cache of ``scripts/install-llama-server``:
   ``<HOTFIT_LLAMA_CACHE>/<LLAMA_SDIST_VERSION>/<backend>/bin/llama-server``  (source ``"cache"``),
   the backends in the order that suits the device being planned for (:func:`cache_backends`)
4. ``llama-server`` on ``PATH``       (source ``"path"``)

An explicit path (flag or env) that does not exist, is not a file, or is not executable is an
error, never a silent fall-back to another binary: the operator named that one. Nothing found →
:class:`BackendNotFound` listing every place searched and how to get a binary.

Every binary found is then checked for this machine: the ISA features its
``build-info.json`` records must all be in ``/proc/cpuinfo`` (else it would die by SIGILL mid-run),
and its backend (cpu, vulkan, cuda) must suit the kind of device the plan is for
(:func:`compatibility_problem`). Both fail with the fix named, before any weight is fetched.

The core (:func:`candidates`, :func:`parse_version_text`, :func:`build_info_from_json`,
:func:`compatibility_problem`) is pure; :func:`find_llama_server` does the file-system checks and
runs ``--version`` when there is no ``build-info.json`` beside the binary.

Over 400 lines because the search, the build record and both machine checks are one job (which
binary, and may it run here), each error naming its fix; splitting them would spread one search
order over modules.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from hotfit.backends.base import AllocationReport, ManifestFacts
from hotfit.core.records import decode_record
from hotfit.core.errors import BackendError, BackendNotFound
from hotfit.core.cuda_arch import capability_number, unserved_reason
from hotfit.core.isa import (cpuinfo_flags, executable_features, ggml_cpu_variant, loaded_cpu_variant,
                             missing_features)
from hotfit.core.log import get_logger
from hotfit.core.settings import LLAMA_SDIST_VERSION, Settings
from hotfit.state.receipts import sha256_file

__all__ = [
    "INSTALL_HINT",
    "SERVER_NAME",
    "FIT_PARAMS_NAME",
    "Source",
    "Candidate",
    "BuildInfo",
    "ServerBinary",
    "candidates",
    "cache_bin_dir",
    "pinned_source_tree",
    "parse_version_text",
    "build_info_from_json",
    "find_llama_server",
    "check_cpu_features",
    "loaded_cpu_variant",
    "with_loaded_variant",
    "install_command",
    "BACKENDS",
    "cache_backends",
    "compatibility_problem",
    "backend_from_libraries",
]

SERVER_NAME = "llama-server"
FIT_PARAMS_NAME = "llama-fit-params"
BUILD_INFO_NAME = "build-info.json"
INSTALL_HINT = (
    "build the pinned one for this machine with `scripts/install-llama-server` (5-15 minutes on 2 cores), "
    "or pass --llama-server PATH / set HOTFIT_LLAMA_SERVER"
)
# `llama-server --version` answers at once; a binary that hangs here will not serve either.
VERSION_TIMEOUT_S = 15.0

Source = Literal["flag", "env", "cache", "path"]
BackendKind = Literal["cpu", "vulkan", "cuda"]
BACKENDS: tuple[BackendKind, ...] = ("cpu", "vulkan", "cuda")
# Which builds can serve a device of each kind, best first. NVIDIA runs CUDA, or Vulkan where no
# CUDA toolkit/driver fits; AMD and Intel run Vulkan; the host runs the CPU build. A GPU build
# could run a host plan with ``-dev none`` too, but its CPU code was never checked for this plan's
# machine class and a CPU-only operator would not expect a GPU build; ask for the CPU build.
SERVES: dict[str, tuple[BackendKind, ...]] = {
    "nvidia": ("cuda", "vulkan"),
    "amd": ("vulkan",),
    "vulkan": ("vulkan",),
    "cpu": ("cpu",),
}

# "version: 0.5.0-dev (build 1, commit 0c1e570)" (the pinned sdist's build) or upstream's
# "version: 7016 (abcdef12)"
_VERSION_RE = re.compile(
    r"version:\s*(?P<version>\S+)"
    r"(?:\s*\((?:build\s*(?P<build>\d+),\s*commit\s*(?P<commit>[0-9a-fA-F]+)|(?P<bare_commit>[0-9a-fA-F]{6,40}))\))?"
)


@dataclass(frozen=True)
class Candidate:
    """One place searched, in search order."""

    source: Source
    path: Path | None  # None: the place was not configured (no flag, env var unset, not on PATH)
    described: str  # how the report names the place, e.g. "HOTFIT_LLAMA_SERVER (unset)"


@dataclass(frozen=True)
class BuildInfo:
    """What the binary says it is. ``origin`` says where these facts were read."""

    origin: Literal["build-info.json", "--version"]
    version: str | None  # llama.cpp's version string, e.g. "0.5.0-dev"
    build_number: int | None
    commit: str | None  # short llama.cpp commit the binary was built from
    sdist_version: str | None = None  # llama-cpp-python sdist pin (build-info.json only)
    sdist_sha256: str | None = None
    backend: BackendKind | None = None  # None: unknown (no build-info.json, libraries unreadable)
    variant: str | None = None  # "native" (this CPU, AMX compiled out) or "generic" (GGML_NATIVE=OFF)
    cpu_features: tuple[str, ...] | None = None  # cpuinfo names the CPU code may execute; None: unknown
    cuda_architectures: tuple[str, ...] = ()
    # A portable build (ggml's CPU variants): the variants it ships, and the one ggml loaded on this
    # machine, as the binary itself reported it (cpu_features then includes that variant's ISA).
    cpu_variants: tuple[str, ...] = ()
    cpu_variant: str | None = None

    def describe(self) -> str:
        parts = [f"llama.cpp {self.version or 'unknown version'}"]
        if self.commit:
            parts.append(f"commit {self.commit}")
        if self.sdist_version:
            parts.append(f"sdist {self.sdist_version}")
        parts.append(f"{self.backend or 'unknown'} backend")
        if self.variant:
            parts.append(f"{self.variant} build")
        return ", ".join(parts)


@dataclass(frozen=True)
class ServerBinary:
    """The llama-server hotfit will run (llama's :class:`backends.base.BackendBinary`)."""

    server_path: Path
    source: Source
    build: BuildInfo
    fit_params_path: Path | None  # llama-fit-params beside the server, when present and executable

    def to_json(self) -> dict[str, Any]:
        return {
            "server_path": str(self.server_path),
            "source": self.source,
            "fit_params_path": str(self.fit_params_path) if self.fit_params_path else None,
            "build": {
                "origin": self.build.origin,
                "version": self.build.version,
                "build_number": self.build.build_number,
                "commit": self.build.commit,
                "sdist_version": self.build.sdist_version,
                "backend": self.build.backend,
                "variant": self.build.variant,
                "cpu_features": list(self.build.cpu_features) if self.build.cpu_features is not None else None,
                "cuda_architectures": list(self.build.cuda_architectures),
                "cpu_variants": list(self.build.cpu_variants),
                "cpu_variant": self.build.cpu_variant,
            },
        }

    def build_identity(self) -> tuple[str, str]:
        """Its build facts and the binary's sha256 (a rebuild of the same version is another build:
        pipeline/evidence.py), and the build described."""
        facts = self.to_json()["build"]
        identity = hashlib.sha256(json.dumps({"build": facts, "binary_sha256": sha256_file(self.server_path)},
                                             sort_keys=True).encode()).hexdigest()
        return identity, self.build.describe()

    def manifest_facts(self, *, report: AllocationReport, session: Mapping[str, Any], snapshot_commit: str | None,
                       call_facts: Mapping[str, Any]) -> ManifestFacts:
        data, recheck = self.to_json(), report.to_json()  # recheck: backends.llama_server.allocation's report
        return ManifestFacts(
            measured={"actual_kv_bytes_uncertainty": recheck.get("actual_kv_bytes_uncertainty"),
                      "flash_attn": recheck.get("flash_attn"),
                      # where the session really put things: "offloaded N/N layers", KV buffers by device
                      "offloaded_layers": recheck.get("offloaded_layers"), "kv_buffers": recheck.get("kv_buffers")},
            build={"server_path": data["server_path"], "source": data["source"], **data["build"],
                   "build_info": recheck.get("build_info")},
            extra={"load_argv": session.get("argv")})  # the command line the session ran

    @classmethod
    def decode(cls, record: Mapping[str, Any], *, path: str = "") -> ServerBinary:
        """The binary back from its :meth:`to_json` (the plan stage's record); StageRecordError names
        a damaged field."""
        return decode_record(cls, record, path=path)


# ---------------------------------------------------------------- pure core


def cache_bin_dir(settings: Settings, backend: str = "cpu") -> Path:
    """Where ``scripts/install-llama-server --backend <backend>`` puts the binaries of the pin."""
    return settings.llama_cache / LLAMA_SDIST_VERSION / backend / "bin"


def cache_backends(device_kind: str | None) -> tuple[BackendKind, ...]:
    """The cached builds to look for, best first, for a plan on ``device_kind``.

    None (no plan yet: ``status``, ``serve`` without a manifest) looks for any build, CPU first."""
    if device_kind is None:
        return BACKENDS
    return SERVES.get(device_kind, BACKENDS)


def backend_from_libraries(ldd_text: str) -> BackendKind:
    """A binary's backend from the shared libraries it links (``ldd`` output): builds of the pin
    are static apart from the GPU runtime, which is always dynamic."""
    if re.search(r"lib(cuda|cudart|cublas)\.so", ldd_text):
        return "cuda"
    if re.search(r"libvulkan\.so", ldd_text):
        return "vulkan"
    return "cpu"


def install_command(backend: str) -> str:
    return f"scripts/install-llama-server --backend {backend}"


def compatibility_problem(device_kind: str, build: BuildInfo) -> tuple[str, str] | None:
    """Why a binary of ``build`` cannot serve a plan on ``device_kind`` (message, hint), or None."""
    wanted = SERVES.get(device_kind)
    if wanted is None or build.backend is None or build.backend in wanted:
        return None
    fix = install_command(wanted[0])
    if device_kind == "cpu":
        return (f"the plan is for host memory (CPU) but llama-server is a {build.backend} build",
                f"build the CPU backend: `{fix}`, or plan for the GPU (--device)")
    return (f"the plan is for a {device_kind} GPU but llama-server is a {build.backend}-only build, "
            "so the weights and KV would sit in host memory and the re-check would fail after the download",
            f"build the GPU backend: `{fix}`" + (f" (or `{install_command(wanted[1])}`)" if len(wanted) > 1 else "")
            + ", or plan for the host with --device cpu")


def pinned_source_tree(settings: Settings) -> Path:
    """The llama.cpp source tree the pinned build came from (templates, llama-arch.cpp, server).

    Kept by scripts/install-llama-server; it may be absent (check ``.is_dir()``)."""
    return settings.llama_cache / LLAMA_SDIST_VERSION / "work" / "src" / "vendor" / "llama.cpp"


def candidates(settings: Settings, path_hit: Path | None,
               backends: tuple[str, ...] = BACKENDS) -> list[Candidate]:
    """The places searched, in order. ``path_hit`` is what a PATH lookup found (or None);
    ``backends`` the cached builds to try, best first."""
    out: list[Candidate] = []
    explicit = settings.llama_server
    source = settings.llama_server_source
    if explicit is not None and source == "flag":
        out.append(Candidate("flag", explicit, f"--llama-server {explicit}"))
    else:
        out.append(Candidate("flag", None, "--llama-server (not given)"))
    if explicit is not None and source != "flag":
        out.append(Candidate("env", explicit, f"HOTFIT_LLAMA_SERVER={explicit}"))
    else:
        env_note = "(not consulted: the flag wins)" if source == "flag" else "(unset)"
        out.append(Candidate("env", None, f"HOTFIT_LLAMA_SERVER {env_note}"))
    for backend in backends:
        cached = cache_bin_dir(settings, backend) / SERVER_NAME
        out.append(Candidate("cache", cached, f"build cache {cached}"))
    out.append(
        Candidate("path", path_hit, f"PATH ({path_hit})" if path_hit else f"{SERVER_NAME} on PATH (none)")
    )
    return out


def parse_version_text(text: str) -> BuildInfo:
    """Parse ``llama-server --version`` output (it prints to stderr)."""
    match = _VERSION_RE.search(text)
    if not match:
        return BuildInfo(origin="--version", version=None, build_number=None, commit=None)
    build = match.group("build")
    return BuildInfo(
        origin="--version",
        version=match.group("version"),
        build_number=int(build) if build else None,
        commit=match.group("commit") or match.group("bare_commit"),
    )


def build_info_from_json(data: Mapping[str, Any]) -> BuildInfo:
    """Read the record scripts/install-llama-server writes beside the binary."""
    parsed = parse_version_text(str(data.get("llama_cpp_version") or ""))
    backend = data.get("backend", "cpu")  # records older than the backend field were CPU builds
    features = data.get("cpu_features")
    archs = data.get("cuda_architectures")
    variants = data.get("cpu_variants")
    return BuildInfo(
        origin="build-info.json",
        version=parsed.version,
        build_number=parsed.build_number,
        commit=parsed.commit,
        sdist_version=data.get("sdist_version"),
        sdist_sha256=data.get("sdist_sha256"),
        backend=backend if backend in BACKENDS else None,
        variant=data.get("variant") if isinstance(data.get("variant"), str) else None,
        cpu_features=tuple(str(f) for f in features) if isinstance(features, list) else None,
        cuda_architectures=tuple(str(a) for a in archs) if isinstance(archs, list) else (),
        cpu_variants=tuple(sorted(str(v) for v in variants)) if isinstance(variants, dict) else (),
    )


def with_loaded_variant(build: BuildInfo, data: Mapping[str, Any], loaded: str | None,
                        cpu_flags: frozenset[str]) -> BuildInfo:
    """A portable build's record completed by what ggml loaded here (pure).

    ``cpu_features`` becomes the binary's own ISA plus the loaded variant's, so the ISA check and
    a crash diagnosis judge the code that really runs. When the binary names no variant (an older
    build), the variant ggml's scoring would pick for these flags stands in (core.isa)."""
    variants = data.get("cpu_variants")
    if not isinstance(variants, dict) or not variants:
        return build
    chosen = loaded if loaded is not None else ggml_cpu_variant(variants, cpu_flags)
    needs = variants.get(chosen, []) if chosen is not None else []
    own = build.cpu_features or ()
    features = tuple(sorted(set(own) | {str(f) for f in needs if isinstance(f, str)}))
    return dataclasses.replace(build, cpu_variant=chosen, cpu_features=features)


# ---------------------------------------------------------------- effects


def _is_executable_file(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def _check_named(candidate: Candidate) -> None:
    """A binary someone named (flag, env) or the cache holds must be usable, else say why."""
    path = candidate.path
    assert path is not None
    if not path.exists():
        raise BackendNotFound(
            f"llama-server named by {candidate.described} does not exist",
            hint=f"fix the path, or unset it to use the build cache / PATH; {INSTALL_HINT}",
            path=str(path),
            source=candidate.source,
        )
    if not path.is_file():
        raise BackendNotFound(
            f"llama-server named by {candidate.described} is not a file",
            hint="point it at the llama-server binary itself, not its directory",
            path=str(path),
            source=candidate.source,
        )
    if not os.access(path, os.X_OK):
        hint = (
            "rebuild it: `scripts/install-llama-server --force`"
            if candidate.source == "cache"
            else f"make it executable (chmod +x {path}) or point at another binary"
        )
        raise BackendNotFound(
            f"llama-server at {path} ({candidate.described}) is not executable",
            hint=hint,
            path=str(path),
            source=candidate.source,
        )


def _run_version(server: Path) -> str:
    """``llama-server --version``'s text; the binary must answer it, or it will not serve either."""
    try:
        proc = subprocess.run(
            [str(server), "--version"],
            cwd=server.parent,  # ggml searches the working directory for backend modules too
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=VERSION_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise BackendError(
            f"`{server} --version` did not answer within {VERSION_TIMEOUT_S:.0f} s",
            hint=f"that binary is unusable; {INSTALL_HINT}",
            path=str(server),
        ) from None
    except OSError as exc:
        raise BackendError(
            f"`{server} --version` could not be run: {exc}",
            hint=f"is it a llama-server binary for this machine? {INSTALL_HINT}",
            path=str(server),
        ) from None
    text = (proc.stdout or "") + (proc.stderr or "")
    if proc.returncode != 0:
        tail = " | ".join(text.strip().splitlines()[-3:])
        why = ""
        if proc.returncode < 0:
            try:
                why = f" (killed by {signal.Signals(-proc.returncode).name})"
            except ValueError:
                why = f" (killed by signal {-proc.returncode})"
        raise BackendError(
            f"`{server} --version` exited with {proc.returncode}{why}: {tail}",
            hint=f"that binary is unusable on this machine; {INSTALL_HINT}",
            path=str(server),
        )
    return text


GGML_ASK = Path(__file__).with_name("ggml_ask.py")


def ask_ggml(bin_dir: Path) -> str:
    """What the build's own ggml says on this machine (:mod:`ggml_ask`, in a child process): the
    modules it loads, by ggml's scoring, and each backend's features; empty when it cannot say (not
    a portable build). llama-server's ``-v --list-devices`` logs the same lines through a logger
    thread its exit() may beat, so a loaded machine can lose them; these are written as they happen."""
    try:
        proc = subprocess.run([sys.executable, str(GGML_ASK), str(bin_dir)], cwd=bin_dir, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=VERSION_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return (proc.stdout or "") + (proc.stderr or "")


def _read_build_info(server: Path, cpu_flags: frozenset[str]) -> BuildInfo:
    text = _run_version(server)  # always: a recorded build that no longer runs is caught here
    info_file = server.parent / BUILD_INFO_NAME
    if info_file.is_file():
        try:
            data = json.loads(info_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            data = None  # unreadable record: what the binary says and links
        if isinstance(data, dict):
            build = build_info_from_json(data)
            if build.cpu_variants:  # ask the build's ggml which CPU variant it loads on this machine
                build = with_loaded_variant(build, data, loaded_cpu_variant(ask_ggml(server.parent)), cpu_flags)
            return build
    parsed = parse_version_text(text)
    return dataclasses.replace(parsed, backend=_linked_backend(server))


def _linked_backend(server: Path) -> BackendKind | None:
    """Ask ``ldd`` which GPU runtime the binary links; None when it cannot be read."""
    try:
        proc = subprocess.run(["ldd", str(server)], stdin=subprocess.DEVNULL, capture_output=True,
                              text=True, timeout=VERSION_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0 and "not a dynamic executable" not in (proc.stdout + proc.stderr):
        return None
    return backend_from_libraries(proc.stdout)


def check_cpu_features(backend: ServerBinary, cpuinfo_text: str) -> None:
    """Refuse a binary built for ISA features this CPU lacks (it would die by SIGILL mid-run)."""
    # Records written before the intrinsic-only features were dropped still list them.
    required = executable_features(backend.build.cpu_features or ())
    if not required:
        return
    have = cpuinfo_flags(cpuinfo_text)
    if not have:
        return  # no flags line (not x86, or /proc hidden): nothing to compare against
    missing = missing_features(required, have)
    if missing:
        what = (f"loads its {backend.build.cpu_variant} CPU variant, which uses CPU features"
                if backend.build.cpu_variant else "was built for CPU features")
        raise BackendError(
            f"llama-server at {backend.server_path} {what} this CPU lacks: "
            f"{', '.join(missing)} (it would stop with SIGILL mid-run)",
            hint=f"build it on this machine: `{install_command(backend.build.backend or 'cpu')} --force`",
            path=str(backend.server_path),
            missing_features=missing,
            build_features=list(required),
        )


def check_cuda_architectures(backend: ServerBinary, gpu_capability: str | None) -> None:
    """Refuse a CUDA build without code for the planned GPU (it fails at its first kernel, after the
    download); docs/builds.md, "CUDA architectures"."""
    if backend.build.backend != "cuda":
        return
    archs = backend.build.cuda_architectures
    reason = unserved_reason(archs, gpu_capability)
    if reason is None:
        return
    wanted = ";".join([*archs, str(capability_number(gpu_capability or "") or "")])
    raise BackendError(
        f"llama-server at {backend.server_path} cannot run on the planned GPU: {reason}",
        hint=f"build one with code for it: `HOTFIT_CUDA_ARCHS=\"{wanted}\" {install_command('cuda')} --force` "
             "(or install such a build with --from), or plan for the host with --device cpu",
        path=str(backend.server_path),
        cuda_architectures=list(archs),
        compute_capability=gpu_capability,
    )


def find_llama_server(settings: Settings, *, path_env: str | None = None, device_kind: str | None = None,
                      gpu_capability: str | None = None,
                      cpuinfo_path: Path = Path("/proc/cpuinfo"), announce: bool = True) -> ServerBinary:
    """Locate llama-server (order in the module docstring), check it suits this CPU and, given
    ``device_kind``, the plan's device (an NVIDIA GPU of CUDA compute ``gpu_capability``, "8.9": a
    CUDA build must hold code for it); log ``backend.found`` (``announce``: a run logs it once, for
    the binary it starts; naming the build again, as the speed calibration does, logs nothing).

    ``path_env`` replaces ``$PATH`` for the last step, ``cpuinfo_path`` the CPU's flags (tests)."""
    log = get_logger()
    path_env = os.environ.get("PATH", "") if path_env is None else path_env
    which = shutil.which(SERVER_NAME, path=path_env)
    searched = candidates(settings, Path(which) if which else None, cache_backends(device_kind))

    chosen: Candidate | None = None
    for candidate in searched:
        if candidate.path is None:
            continue
        if candidate.source in ("flag", "env"):
            _check_named(candidate)  # named explicitly: an unusable path is an error, not a skip
            chosen = candidate
            break
        if candidate.source == "cache":
            if candidate.path.exists():
                _check_named(candidate)
                chosen = candidate
                break
            continue
        chosen = candidate  # PATH: shutil.which already checked it is an executable file
        break

    if chosen is None:
        places = "; ".join(c.described for c in searched)
        log.warning("backend.not_found", searched=[c.described for c in searched])
        wanted = cache_backends(device_kind)
        others = [b for b in BACKENDS if b not in wanted and (cache_bin_dir(settings, b) / SERVER_NAME).is_file()]
        if device_kind is not None and others:
            problem = compatibility_problem(device_kind, BuildInfo("build-info.json", None, None, None,
                                                                   backend=others[0]))
            if problem is not None:
                message, hint = problem
                raise BackendNotFound(f"{message} ({cache_bin_dir(settings, others[0]) / SERVER_NAME})",
                                      hint=hint, searched=[c.described for c in searched],
                                      device_kind=device_kind, cached_backends=others)
        hint = INSTALL_HINT if device_kind is None else (
            f"build the one this plan needs: `{install_command(wanted[0])}`, "
            "or pass --llama-server PATH / set HOTFIT_LLAMA_SERVER")
        raise BackendNotFound(
            f"no llama-server found (searched: {places})",
            hint=hint,
            searched=[c.described for c in searched],
        )

    assert chosen.path is not None
    server = chosen.path.absolute()
    try:
        cpuinfo = cpuinfo_path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        cpuinfo = ""
    build = _read_build_info(server, cpuinfo_flags(cpuinfo))
    fit = server.parent / FIT_PARAMS_NAME
    backend = ServerBinary(
        server_path=server,
        source=chosen.source,
        build=build,
        fit_params_path=fit if _is_executable_file(fit) else None,
    )
    check_cpu_features(backend, cpuinfo)
    if device_kind is not None:
        problem = compatibility_problem(device_kind, build)
        if problem is not None:
            message, hint = problem
            raise BackendError(f"{message} ({server}, {chosen.described})", hint=hint,
                               path=str(server), backend=build.backend, device_kind=device_kind)
        check_cuda_architectures(backend, gpu_capability)
    if announce:
        log.info(
            "backend.found",
            path=str(server),
            source=chosen.source,
            version=build.version,
            commit=build.commit,
            backend=build.backend,
            variant=build.variant,
            cpu_variant=build.cpu_variant,
            cpu_features=list(build.cpu_features) if build.cpu_features is not None else None,
            build_info_origin=build.origin,
            fit_params=str(backend.fit_params_path) if backend.fit_params_path else None,
        )
    return backend


def gpu_listing_binaries(settings: Settings) -> tuple[Path, ...]:
    """The GPU builds the probe asks which devices ggml sees (``--list-devices``): the binary the
    operator named, unless its record says it is a CPU build, else the cached Vulkan build.
    CUDA devices come from NVML, which names them by UUID; the CUDA build is not asked."""
    if settings.llama_server is not None:
        info = settings.llama_server.parent / BUILD_INFO_NAME
        try:
            backend = json.loads(info.read_text(encoding="utf-8")).get("backend")
        except (OSError, ValueError, AttributeError):
            backend = None
        named = settings.llama_server
        return () if backend == "cpu" or not _is_executable_file(named) else (named,)
    cached = cache_bin_dir(settings, "vulkan") / SERVER_NAME
    return (cached,) if _is_executable_file(cached) else ()
