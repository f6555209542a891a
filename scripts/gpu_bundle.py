#!/usr/bin/env python3
"""gpu_bundle: carry a CUDA build to a GPU machine that can fetch nothing, and install it there
with ``install-llama-server --from`` (standard library only).

The GPU machine scripts/gpu-check runs on reaches no network and takes at most 64 MiB with it
(docs/builds.md, "Checking a CUDA build on a GPU machine"). A CUDA export archive is ~0.5 GB, most
of it NVIDIA's cuBLAS (libcublasLt.so.13 alone is 540 MB), which such a machine already has in its
Python's ``nvidia`` packages. So the bundle keeps every file of the archive but cuBLAS, xz-packed,
with the sha256 of each file left out; on the GPU machine ``reassemble`` puts the archive back
together from that machine's own copies. When those are the same bytes (same sha256 as the
archive's manifest) the reassembled archive holds exactly the exported files; when not, the
machine's copies are used, the manifest says so, and the result names them as substituted — an
import of a different cuBLAS than the build's, which the check reports rather than hides.

    gpu_bundle.py make ARCHIVE OUT_DIR [--wheels]   write OUT_DIR/build.tar.xz + bundle.json
                                                    (--wheels: + wheels/ of the hotfit dependencies
                                                    the GPU machine lacks, from PyPI, here)
    gpu_bundle.py reassemble OUT_DIR ARCHIVE        write ARCHIVE (.tar.gz) from the bundle and
                                                    this machine's copies of the files left out
"""

from __future__ import annotations

import fnmatch
import importlib
import io
import json
import lzma
import os
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_build import MANIFEST, BuildArchiveError, decode_manifest, parse_manifest, _sha256 as sha256_file  # noqa: E402
BUNDLE_FORMAT = 1
# Carried as files the GPU machine already has (its Python's nvidia-cublas wheel): the two libraries
# that make a CUDA archive too large to carry.
LEFT_OUT = ("libcublas.so.*", "libcublasLt.so.*")
# hotfit's dependencies the GPU machine's Python lacks (its package list: anyio, httpx,
# huggingface_hub and nvidia-ml-py are there), for Python 3.12 on x86-64 manylinux.
MISSING_ON_GPU_MACHINE = ("gguf", "structlog", "tenacity")
GPU_MACHINE_PYTHON = "3.12"


class BundleError(BuildArchiveError):
    """A bundle that cannot be made or put back together; the message says why and what to do.
    (The archive's own checks, scripts/llama_build.py, raise their BuildArchiveError.)"""


@dataclass(frozen=True)
class LeftOut:
    member: str  # the archive member, "<flavour>/bin/<name>"
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class Reassembled:
    archive: str
    members: int
    found: dict[str, str]  # member -> the path on this machine it was taken from
    substituted: dict[str, str]  # member -> the sha256 of this machine's copy (differs from the build's)


def make(archive: Path, out_dir: Path, left_out: tuple[str, ...] = LEFT_OUT, preset: int = 9,
         wheels: tuple[str, ...] = ()) -> dict:
    """Split ``archive`` (an ``install-llama-server --export`` file) into ``out_dir`` (``preset``: xz's
    level; 9 packs the CUDA module to about two thirds); ``wheels``: the packages to add as wheels."""
    try:
        tar = tarfile.open(archive, "r:*")
    except (OSError, tarfile.TarError) as exc:
        raise BundleError(f"{archive} is not a readable build archive ({exc}): make one with "
                          "scripts/install-llama-server --export FILE") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    kept: list[str] = []
    dropped: list[LeftOut] = []
    version = None
    with tar:
        members = tar.getmembers()
        try:
            listed = parse_manifest(decode_manifest(tar.extractfile(MANIFEST).read(), archive), archive)  # type: ignore[union-attr]
        except KeyError:
            raise BundleError(f"{archive} has no {MANIFEST}: re-export it with --export") from None
        tmp = out_dir / "build.tar.xz.tmp"
        try:
            with lzma.open(tmp, "wb", preset=preset) as packed, tarfile.open(fileobj=packed, mode="w") as xz:
                for m in members:
                    name = Path(m.name).name
                    if name == "build-info.json" and m.isfile():  # which pinned tree its templates come from
                        version = json.loads(tar.extractfile(m).read()).get("sdist_version")  # type: ignore[union-attr]
                    if m.isfile() and m.name != MANIFEST and any(fnmatch.fnmatch(name, p) for p in left_out):
                        if m.name not in listed:
                            raise BundleError(f"{archive}: {m.name} is not in its {MANIFEST}; re-export the build")
                        dropped.append(LeftOut(m.name, listed[m.name], m.size))
                        continue
                    xz.addfile(m, tar.extractfile(m) if m.isfile() else None)
                    kept.append(m.name)
            os.replace(tmp, out_dir / "build.tar.xz")
        finally:
            tmp.unlink(missing_ok=True)
    if version is None:
        raise BundleError(f"{archive} has no build-info.json naming its sdist_version: re-export the build")
    templates = _pack_templates(str(version), out_dir, preset)
    record = {"format": BUNDLE_FORMAT, "archive": archive.name, "archive_sha256": sha256_file(archive),
              "archive_bytes": archive.stat().st_size, "templates": templates, "kept": kept,
              "left_out": [asdict(d) for d in dropped], "packed_bytes": (out_dir / "build.tar.xz").stat().st_size,
              "wheels": download_wheels(out_dir, wheels) if wheels else []}
    (out_dir / "bundle.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


def pinned_tree(sdist_version: str) -> Path:
    """The llama.cpp tree install-llama-server keeps beside its builds (hotfit's
    ``pinned_source_tree``; the same cache root rule as the install script)."""
    root = os.environ.get("HOTFIT_LLAMA_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "hotfit" / "llama.cpp")
    return Path(root) / sdist_version / "work" / "src" / "vendor" / "llama.cpp"


TEMPLATES = "models/templates"  # in the pinned tree: the chat templates the check's fixtures are served with


def _pack_templates(version: str, out_dir: Path, preset: int) -> list[str]:
    """The chat templates of the pinned tree ``version`` (tests/e2e_support serves its tool-call
    fixtures with one; a GPU machine that builds nothing has no tree), packed as ``templates.tar.xz``."""
    tree = pinned_tree(version)
    files = sorted(p for p in (tree / TEMPLATES).glob("*") if p.is_file())
    if not files:
        raise BundleError(f"no chat templates under {tree / TEMPLATES}: the pinned llama.cpp tree "
                          f"{version} is kept by scripts/install-llama-server; build once here first")
    with lzma.open(out_dir / "templates.tar.xz", "wb", preset=preset) as packed, \
            tarfile.open(fileobj=packed, mode="w") as xz:
        for p in files:
            xz.add(p, arcname=f"{TEMPLATES}/{p.name}", recursive=False)
    return [p.name for p in files]


def place_templates(bundle_dir: Path, tree: Path) -> int:
    """Unpack the bundle's chat templates where hotfit's tests look for the pinned tree's."""
    with tarfile.open(bundle_dir / "templates.tar.xz", "r:xz") as xz:
        members = [m for m in xz.getmembers() if m.isfile() and m.name.startswith(TEMPLATES + "/")
                   and ".." not in Path(m.name).parts]
        xz.extractall(tree, members=members, filter="data")
    return len(members)


def download_wheels(out_dir: Path, names: tuple[str, ...] = MISSING_ON_GPU_MACHINE) -> list[str]:
    """The GPU machine's Python lacks these; fetched here (pip) for its Python and platform."""
    wheels = out_dir / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    platforms = [a for n in (28, 27, 17) for a in ("--platform", f"manylinux_2_{n}_x86_64")]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
           "--python-version", GPU_MACHINE_PYTHON, "--implementation", "cp", *platforms,
           "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(wheels), *names]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BundleError(f"pip download {' '.join(names)} failed: {proc.stderr.strip()[-400:]}")
    return sorted(p.name for p in wheels.glob("*.whl"))


def tested_versions(names: tuple[str, ...] = MISSING_ON_GPU_MACHINE) -> tuple[str, ...]:
    """``name==version`` as the project's virtualenv has them (the versions its tests ran with);
    a name without a version where there is no virtualenv."""
    venv_python = Path(__file__).resolve().parent.parent / ".venv" / "bin" / "python"
    if not venv_python.is_file():
        return names
    code = "import importlib.metadata as m, sys; print(' '.join(m.version(n) for n in sys.argv[1:]))"
    proc = subprocess.run([str(venv_python), "-c", code, *names], capture_output=True, text=True)
    versions = proc.stdout.split()
    if proc.returncode != 0 or len(versions) != len(names):
        return names
    return tuple(f"{n}=={v}" for n, v in zip(names, versions))


def default_search_roots() -> list[Path]:
    """Where a GPU machine keeps cuBLAS: its Python's nvidia packages, a CUDA toolkit, the system."""
    roots: list[Path] = []
    try:  # the namespace package of NVIDIA's CUDA wheels
        roots += [Path(p) for p in importlib.import_module("nvidia").__path__]
    except ImportError:
        pass
    roots += sorted(Path("/usr/local").glob("cuda*/lib64")) + [Path("/usr/lib/x86_64-linux-gnu")]
    return [r for r in roots if r.is_dir()]


def _candidates(name: str, roots: list[Path]) -> list[Path]:
    found: list[Path] = []
    for root in roots:
        direct = root / name
        found += [direct] if direct.is_file() else sorted(p for p in root.rglob(name) if p.is_file())
    return found


def reassemble(bundle_dir: Path, archive: Path, roots: list[Path] | None = None) -> Reassembled:
    """Write ``archive`` from the bundle and this machine's copies of the files it left out."""
    try:
        record = json.loads((bundle_dir / "bundle.json").read_text())
    except (OSError, ValueError) as exc:
        raise BundleError(f"{bundle_dir}/bundle.json is missing or not JSON ({exc}): "
                          "make the bundle with scripts/gpu_bundle.py make") from None
    if record.get("format") != BUNDLE_FORMAT:
        raise BundleError(f"{bundle_dir}: bundle format {record.get('format')}, this script reads {BUNDLE_FORMAT}")
    roots = default_search_roots() if roots is None else roots
    found: dict[str, str] = {}
    substituted: dict[str, str] = {}
    take: dict[str, Path] = {}
    for item in record["left_out"]:
        name = Path(item["member"]).name
        paths = _candidates(name, roots)
        if not paths:
            raise BundleError(f"{name} (left out of the bundle) is not on this machine under "
                              f"{', '.join(map(str, roots)) or 'any search root'}: carry the whole archive instead")
        digests = {p: sha256_file(p) for p in paths}
        same = [p for p, d in digests.items() if d == item["sha256"]]
        chosen = same[0] if same else paths[0]
        take[item["member"]], found[item["member"]] = chosen, str(chosen)
        if not same:
            substituted[item["member"]] = digests[chosen]
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=archive.name + ".", suffix=".tmp", dir=archive.parent)
    os.close(fd)
    count = 0
    try:
        # gzip level 1: cuBLAS makes this ~0.6 GB, unpacked once by --from right after
        with tarfile.open(bundle_dir / "build.tar.xz", "r:xz") as src, \
                tarfile.open(tmp, "w:gz", compresslevel=1) as dst:
            for m in src.getmembers():
                data = src.extractfile(m) if m.isfile() else None
                if m.name == MANIFEST and substituted:  # the manifest names what the archive now holds
                    listed = parse_manifest(decode_manifest(data.read(), bundle_dir), bundle_dir)  # type: ignore[union-attr]
                    text = "".join(f"{substituted.get(n, d)}  {n}\n" for n, d in listed.items())
                    m, data = _info(MANIFEST, len(text.encode()), m), io.BytesIO(text.encode())
                dst.addfile(m, data)
                count += 1
            for member, path in take.items():
                dst.add(path, arcname=member, recursive=False)
                count += 1
        os.replace(tmp, archive)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Reassembled(str(archive), count, found, substituted)


def _info(name: str, size: int, like: tarfile.TarInfo) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, like.mode, like.mtime
    return info


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["make"] and len(argv) in (3, 4) and argv[3:] in ([], ["--wheels"]):
            record = make(Path(argv[1]), Path(argv[2]), wheels=tested_versions() if argv[3:] else ())
            left = ", ".join(f"{Path(d['member']).name} ({d['size_bytes']} B)" for d in record["left_out"])
            print(f"gpu_bundle: {argv[2]}/build.tar.xz {record['packed_bytes']} B from {record['archive_bytes']} B; "
                  f"left out: {left or 'nothing'}; wheels: {', '.join(record['wheels']) or 'none'}",
                  file=sys.stderr)
        elif argv[:1] == ["reassemble"] and len(argv) == 3:
            done = reassemble(Path(argv[1]), Path(argv[2]))
            print(json.dumps(asdict(done)))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except BuildArchiveError as exc:  # BundleError, or the archive's own checks
        print(f"gpu_bundle: refused: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
