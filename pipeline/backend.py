"""Find the llama-server binary hotfit runs, and say which one it used (issue 2 item 4).

Search order, first hit wins:

1. ``--llama-server PATH``           (source ``"flag"``)
2. ``HOTFIT_LLAMA_SERVER``           (source ``"env"``)
3. the build cache of ``scripts/install-llama-server``:
   ``<HOTFIT_LLAMA_CACHE>/<LLAMA_SDIST_VERSION>/bin/llama-server``  (source ``"cache"``)
4. ``llama-server`` on ``PATH``       (source ``"path"``)

An explicit path (flag or env) that does not exist, is not a file, or is not executable is an
error, never a silent fall-back to another binary: the operator named that one. Nothing found →
:class:`BackendNotFound` listing every place searched and how to get a binary.

The core (:func:`candidates`, :func:`parse_version_text`, :func:`build_info_from_json`) is pure;
:func:`find_llama_server` does the file-system checks and runs ``--version`` when there is no
``build-info.json`` beside the binary.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping

from pipeline.errors import BackendError, BackendNotFound
from pipeline.log import get_logger
from pipeline.settings import LLAMA_SDIST_VERSION, Settings

__all__ = [
    "INSTALL_HINT",
    "SERVER_NAME",
    "FIT_PARAMS_NAME",
    "Source",
    "Candidate",
    "BuildInfo",
    "Backend",
    "candidates",
    "cache_bin_dir",
    "pinned_source_tree",
    "parse_version_text",
    "build_info_from_json",
    "find_llama_server",
]

SERVER_NAME = "llama-server"
FIT_PARAMS_NAME = "llama-fit-params"
BUILD_INFO_NAME = "build-info.json"
INSTALL_HINT = (
    "build the pinned one with `scripts/install-llama-server` (about 5 minutes on 2 cores), "
    "or pass --llama-server PATH / set HOTFIT_LLAMA_SERVER"
)
# `llama-server --version` answers at once; a binary that hangs here will not serve either.
VERSION_TIMEOUT_S = 15.0

Source = Literal["flag", "env", "cache", "path"]

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

    def describe(self) -> str:
        parts = [f"llama.cpp {self.version or 'unknown version'}"]
        if self.commit:
            parts.append(f"commit {self.commit}")
        if self.sdist_version:
            parts.append(f"sdist {self.sdist_version}")
        return ", ".join(parts)


@dataclass(frozen=True)
class Backend:
    """The llama-server hotfit will run."""

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
            },
        }


# ---------------------------------------------------------------- pure core


def cache_bin_dir(settings: Settings) -> Path:
    """Where scripts/install-llama-server puts the binaries for the pinned sdist."""
    return settings.llama_cache / LLAMA_SDIST_VERSION / "bin"


def pinned_source_tree(settings: Settings) -> Path:
    """The llama.cpp source tree the pinned build came from (templates, llama-arch.cpp, server).

    Kept by scripts/install-llama-server; it may be absent (check ``.is_dir()``)."""
    return settings.llama_cache / LLAMA_SDIST_VERSION / "work" / "src" / "vendor" / "llama.cpp"


def candidates(settings: Settings, path_hit: Path | None) -> list[Candidate]:
    """The places searched, in order. ``path_hit`` is what a PATH lookup found (or None)."""
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
    cached = cache_bin_dir(settings) / SERVER_NAME
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
    return BuildInfo(
        origin="build-info.json",
        version=parsed.version,
        build_number=parsed.build_number,
        commit=parsed.commit,
        sdist_version=data.get("sdist_version"),
        sdist_sha256=data.get("sdist_sha256"),
    )


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


def _read_build_info(server: Path) -> BuildInfo:
    info_file = server.parent / BUILD_INFO_NAME
    if info_file.is_file():
        try:
            data = json.loads(info_file.read_text(encoding="utf-8"))
            if isinstance(data, dict):
                return build_info_from_json(data)
        except (OSError, ValueError):
            pass  # unreadable record: ask the binary itself
    try:
        proc = subprocess.run(
            [str(server), "--version"],
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
        raise BackendError(
            f"`{server} --version` exited with {proc.returncode}: {tail}",
            hint=f"that binary is unusable; {INSTALL_HINT}",
            path=str(server),
        )
    return parse_version_text(text)


def find_llama_server(settings: Settings, *, path_env: str | None = None) -> Backend:
    """Locate llama-server (order in the module docstring) and log ``backend.found``.

    ``path_env`` replaces ``$PATH`` for the last step (tests pass their own)."""
    log = get_logger()
    path_env = os.environ.get("PATH", "") if path_env is None else path_env
    which = shutil.which(SERVER_NAME, path=path_env)
    searched = candidates(settings, Path(which) if which else None)

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
        raise BackendNotFound(
            f"no llama-server found (searched: {places})",
            hint=INSTALL_HINT,
            searched=[c.described for c in searched],
        )

    assert chosen.path is not None
    server = chosen.path.absolute()
    build = _read_build_info(server)
    fit = server.parent / FIT_PARAMS_NAME
    backend = Backend(
        server_path=server,
        source=chosen.source,
        build=build,
        fit_params_path=fit if _is_executable_file(fit) else None,
    )
    log.info(
        "backend.found",
        path=str(server),
        source=chosen.source,
        version=build.version,
        commit=build.commit,
        build_info_origin=build.origin,
        fit_params=str(backend.fit_params_path) if backend.fit_params_path else None,
    )
    return backend
