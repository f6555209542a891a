#!/usr/bin/env python3
"""The record, export and import steps of scripts/install-llama-server (standard library only: it
runs with the system python3 before any virtualenv exists). docs/builds.md describes the layout.

    llama_build.py record  BIN_DIR BUILD_DIR FIELDS_JSON   write BIN_DIR/build-info.json
    llama_build.py export  BIN_DIR FLAVOUR ARCHIVE         pack a finished build (+ sha256 manifest)
    llama_build.py import  ARCHIVE|URL CACHE_VERSION_DIR PIN_JSON [SHA256]
                                                           check an archive and install it; prints
                                                           the installed llama-server path. A URL
                                                           (http/https) is downloaded first, resumably,
                                                           and checked against SHA256 or URL.sha256

``record`` reads the exact compile commands of ggml-cpu (compile_commands.json) and asks the
compiler which ISA macros they define, so ``cpu_features`` (what the binary itself needs) and, for
a build with ggml's CPU variants, ``cpu_variants`` (what each ``libggml-cpu-<tag>.so`` needs) are
the instruction sets the code can execute (core/isa.py drops the intrinsic-only ones).

``import`` never trusts the archive: members must be plain files or directories under one
``<flavour>/bin/`` folder, every file must be listed in ``SHA256SUMS`` with its hash, the build
record must name this script's pin, and the unpacked binary must answer ``--version`` and list
its devices on this machine (``--list-devices``) before it replaces anything in the cache.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import http.client
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from hotfit.core.cuda_arch import arch_numbers, compiled_archs, cuda_arch_serves  # noqa: E402
from hotfit.core.isa import (AMX_CPUINFO, cpuinfo_flags, features_from_macros,  # noqa: E402
                             ggml_cpu_variant, loaded_cpu_variant, missing_features)

MANIFEST = "SHA256SUMS"
ARCHIVE_FORMAT = 1
RUN_TIMEOUT_S = 60
# The builds install-llama-server makes, by folder name (docs/builds.md): nothing else is ever
# installed into the cache, whatever an archive's record says (its pinned source tree lives there).
FLAVOURS = ("cpu", "cpu-native", "cpu-generic", "vulkan", "cuda", "cpu-aarch64")
BACKENDS = ("cpu", "vulkan", "cuda")
VARIANTS = ("portable", "native", "generic")
# Bounds on an archive, checked on each header before any data is read: a real build is a few dozen
# files (the CUDA one: cuBLASLt alone 542 MB, the folder 668-772 MB; docs/builds.md, "CUDA on a
# build server without a GPU").
MAX_MEMBERS = 512
MAX_MEMBER_BYTES = 4 << 30
MAX_TOTAL_BYTES = 8 << 30
# Free space asked beyond the unpacked size (the rename and the file system's own bookkeeping).
UNPACK_MARGIN_BYTES = 64 << 20
# --from URL: each socket operation's timeout; the download resumes from its .part on a rerun.
HTTP_TIMEOUT_S = 60
DOWNLOAD_CHUNK_BYTES = 1 << 20
SHA256_RE = re.compile(r"[0-9a-f]{64}")
# The build's own ggml asked in a child process (the same file as hotfit's discovery runs).
GGML_ASK = HERE.parent / "backends" / "llama_server" / "ggml_ask.py"
_VARIANT_OBJECT_RE = re.compile(r"ggml-cpu-(?P<tag>[A-Za-z0-9_.]+)\.dir/")
# ggml-cuda's device line at start-up (logged with -v): "Device 0: NVIDIA H100 80GB HBM3, compute capability 9.0, ..."
_CUDA_DEVICE_RE = re.compile(r"Device \d+: (?P<name>[^,\n]+), compute capability (?P<major>\d+)\.(?P<minor>\d)")


class BuildArchiveError(Exception):
    """A build archive or build that must not be installed; the message says why and what to do."""


def _say(text: str) -> None:
    print(f"install-llama-server: {text}", file=sys.stderr)


# ----------------------------------------------------------------------------------- record
def _compiler_features(entry: dict) -> list[str]:
    args = entry.get("arguments") or shlex.split(entry["command"])
    keep = [a for a in args[1:] if a.startswith(("-m", "-f", "-O", "-D", "-std"))]
    proc = subprocess.run([args[0], *keep, "-dM", "-E", "-x", "c", "/dev/null"], capture_output=True,
                          text=True, check=True)
    return features_from_macros(proc.stdout)


def isa_record(compile_commands: Path) -> tuple[list[str], dict[str, list[str]]]:
    """(features of the binary's own code, {variant tag: features}) from compile_commands.json.

    Without CPU variants ggml-cpu is linked in, so its flags are the binary's; with them the
    binary's own code is the rest (ggml-base's ggml.c) and each variant is a module of its own."""
    entries = json.loads(compile_commands.read_text())
    variants: dict[str, list[str]] = {}
    single: list[str] | None = None
    base: list[str] | None = None
    for entry in entries:
        file = entry["file"]
        if file.endswith("/ggml-cpu/ggml-cpu.c"):
            where = " ".join([entry.get("output", ""), entry.get("command", ""), *entry.get("arguments", [])])
            match = _VARIANT_OBJECT_RE.search(where)
            if match:
                variants[match.group("tag")] = _compiler_features(entry)
            elif single is None:
                single = _compiler_features(entry)
        elif file.endswith("/ggml/src/ggml.c") and base is None:
            base = _compiler_features(entry)
    if single is not None and not variants:
        return single, {}
    if base is None:  # modules only (variants, or a GPU build whose CPU code is another build's)
        raise BuildArchiveError(f"no compile command for ggml.c or ggml-cpu.c in {compile_commands}")
    return base, variants


def record(bin_dir: Path, build_dir: Path, fields: dict) -> None:
    features, variants = isa_record(build_dir / "compile_commands.json")
    variants = variants or fields.pop("cpu_variants", {})  # a GPU build records the modules it reuses
    amx = sorted({f for fs in [features, *variants.values()] for f in fs} & AMX_CPUINFO)
    if amx:
        raise BuildArchiveError(f"the CPU code was compiled with AMX ({', '.join(amx)}); refusing the build "
                                "(ggml's AMX kernels crash on quantized models: docs/builds.md)")
    info = {**fields, "cpu_features": features}
    if variants:
        info["cpu_variants"] = dict(sorted(variants.items()))
    if fields.get("backend") == "cuda":
        info["cuda_architectures_compiled"] = list(_checked_cuda_archs(bin_dir, fields))
    _write_json(bin_dir / "build-info.json", info)


def ask_ggml(bin_dir: Path, stub_libcuda: str | None = None) -> str:
    """What the build's own ggml says here (backends/llama_server/ggml_ask.py): the modules it loads,
    ggml-cuda's device lines, each backend's features ("CUDA : ARCHS = 750,860"); empty when it
    cannot say. llama-server logs the same lines through a logger thread its exit() may beat.
    ``stub_libcuda``: on a build server without a driver, the stub the build linked against lets
    the CUDA module load (no device: nothing runs on it)."""
    env = {**os.environ}
    with tempfile.TemporaryDirectory(prefix="hotfit-libcuda-") as stub_dir:
        if stub_libcuda:
            os.symlink(stub_libcuda, Path(stub_dir) / "libcuda.so.1")
            env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [stub_dir, env.get("LD_LIBRARY_PATH")]))
        try:
            proc = subprocess.run([sys.executable, str(GGML_ASK), str(bin_dir)], capture_output=True, text=True,
                                  timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL, env=env, cwd=bin_dir)
        except (OSError, subprocess.TimeoutExpired):
            return ""
    return proc.stdout + proc.stderr


def reported_cuda_archs(bin_dir: Path, stub_libcuda: str | None = None) -> tuple[str, ...] | None:
    """The CUDA architectures the build's ggml-cuda module was compiled for, as it reports them
    (its "ARCHS" feature, what llama-server's system_info prints); None when the module does not
    load here."""
    return compiled_archs(ask_ggml(bin_dir, stub_libcuda))


def _checked_cuda_archs(bin_dir: Path, fields: dict) -> tuple[str, ...]:
    """Ask the new CUDA build which architectures it holds; refuse it unless they are the ones asked
    for (HOTFIT_CUDA_ARCHS, or this machine's GPUs): a GPU it lacks code for fails at its first kernel."""
    stub = fields.get("libcuda") if fields.get("driver") is None else None
    reported = reported_cuda_archs(bin_dir, stub)
    if reported is None:
        raise BuildArchiveError(f"{bin_dir / 'libggml-cuda.so'} did not load (llama-server reported no CUDA "
                                "architectures): the CUDA build is broken; its log is in the cache's work folder")
    wanted = arch_numbers(fields.get("cuda_architectures") or [])
    if set(reported) != wanted:
        raise BuildArchiveError(f"the CUDA module holds code for architectures {';'.join(reported)}, but "
                                f"{';'.join(sorted(wanted))} were asked for: refusing the build")
    return reported


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------- export
def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _unwritable(path: Path, exc: OSError, what: str) -> BuildArchiveError:
    """A write that failed (a read-only or full disk, a folder in the way) as a refusal that says what to do."""
    full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
    todo = "free space there" if full else "make it writable"
    return BuildArchiveError(f"cannot write {what} {path}: {exc.strerror or exc}; {todo}, or choose another place")


def export(bin_dir: Path, flavour: str, archive: Path) -> None:
    if not (bin_dir / "llama-server").is_file() or not (bin_dir / "build-info.json").is_file():
        raise BuildArchiveError(f"no finished {flavour} build at {bin_dir}: build it first "
                                f"(scripts/install-llama-server --backend ...)")
    if archive.is_dir():
        raise BuildArchiveError(f"--export {archive} is a folder: name the archive file to write, "
                                f"e.g. {archive / f'llama-server-{flavour}.tar.gz'}")
    try:
        _export(bin_dir, flavour, archive)
    except OSError as exc:
        raise _unwritable(archive, exc, "the archive") from None


def _export(bin_dir: Path, flavour: str, archive: Path) -> None:
    files = sorted(p for p in bin_dir.iterdir() if p.is_file() and not p.name.endswith(".tmp")
                   and p.name != MANIFEST)
    lines = [f"{_sha256(p)}  {flavour}/bin/{p.name}\n" for p in files]
    archive = archive.absolute()
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=archive.name + ".", suffix=".tmp", dir=archive.parent)
    os.close(fd)
    try:
        with tarfile.open(tmp_name, "w:gz") as tar:
            manifest_bytes = "".join(lines).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mode = len(manifest_bytes), 0o644
            tar.addfile(info, io.BytesIO(manifest_bytes))
            for p in files:
                tar.add(p, arcname=f"{flavour}/bin/{p.name}", recursive=False)
        # mkstemp makes the file 0600; the archive is for other machines (a web server, a shared
        # folder), so it gets the mode any new file gets here: 0666 less the umask.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp_name, 0o666 & ~umask)
        os.replace(tmp_name, archive)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    _say(f"exported {flavour} ({len(files)} files, {archive.stat().st_size} bytes) to {archive}")


# ----------------------------------------------------------------------------------- import
# What reading a damaged archive raises: gzip/xz/bz2 cut short or corrupt, a bad tar header.
_DAMAGED = (tarfile.TarError, EOFError, zlib.error, OSError)


def _damaged(archive: Path, exc: BaseException) -> BuildArchiveError:
    return BuildArchiveError(f"{archive} is damaged or cut short ({type(exc).__name__}: {str(exc)[:200]}): copy it "
                             "again (or make it with `scripts/install-llama-server --export FILE` on the build machine)")


def _checked_members(archive: Path, tar: tarfile.TarFile) -> tuple[str, list[tarfile.TarInfo]]:
    """Every header of the archive, checked as it is read (shape, count, declared sizes), so a
    hostile archive is refused at its first bad header, not after unpacking: (flavour, members)."""
    members: list[tarfile.TarInfo] = []
    flavours: set[str] = set()
    total = 0
    for m in tar:
        if len(members) >= MAX_MEMBERS:
            raise BuildArchiveError(f"{archive} has more than {MAX_MEMBERS} members (a build has a few dozen); "
                                    "re-export the build")
        parts = Path(m.name).parts
        members.append(m)
        if m.size > MAX_MEMBER_BYTES or total + m.size > MAX_TOTAL_BYTES:
            raise BuildArchiveError(f"{archive}: member '{m.name[:120]}' declares {m.size} bytes (limits: "
                                    f"{MAX_MEMBER_BYTES} a file, {MAX_TOTAL_BYTES} in all); re-export the build")
        total += m.size
        if m.name == MANIFEST and m.isfile():
            continue
        in_bin = len(parts) >= 2 and parts[1] == "bin"
        shape_ok = (m.isfile() and in_bin and len(parts) == 3) or (m.isdir() and (len(parts) == 1 or
                                                                               (in_bin and len(parts) == 2)))
        unsafe = m.name.startswith("/") or ".." in parts or not shape_ok
        if unsafe:
            raise BuildArchiveError(f"{archive}: member '{m.name[:120]}' is not a file under <flavour>/bin/ "
                                    "(links, devices and paths outside are refused); re-export the build")
        flavours.add(parts[0])
        if len(flavours) > 1:
            raise BuildArchiveError(f"{archive} holds more than one build ({', '.join(sorted(flavours))}); "
                                    "an archive holds exactly one")
    if not flavours:
        raise BuildArchiveError(f"{archive} holds no build (no <flavour>/bin/ folder): re-export it with --export")
    flavour = flavours.pop()
    if flavour not in FLAVOURS:
        raise BuildArchiveError(f"{archive}: folder '{flavour[:60]}' is not a build install-llama-server makes "
                                f"({', '.join(FLAVOURS)}); re-export a build made by it")
    if not any(m.isfile() and Path(m.name).parts[1:2] == ("bin",) for m in members):
        raise BuildArchiveError(f"{archive} has no files under {flavour}/bin/: re-export the build")
    return flavour, members


def _unpack(archive: Path, into: Path) -> str:
    """Unpack a checked archive into ``into``; returns the flavour."""
    try:
        tar = tarfile.open(archive, "r:*")
    except _DAMAGED as exc:
        raise BuildArchiveError(f"{archive} is not a readable build archive ({exc}): make it with "
                                "`scripts/install-llama-server --export FILE` on the build machine") from None
    with tar:
        try:
            flavour, members = _checked_members(archive, tar)
        except BuildArchiveError:
            raise
        except _DAMAGED as exc:
            raise _damaged(archive, exc) from None
        need = sum(m.size for m in members) + UNPACK_MARGIN_BYTES
        free = shutil.disk_usage(into).free
        if free < need:
            raise BuildArchiveError(f"not enough space in {into.parent} to unpack {archive}: need {need} bytes, "
                                    f"{free} free; free space there, or point HOTFIT_LLAMA_CACHE at a larger disk")
        try:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(into, members=members, filter="data")
            else:
                tar.extractall(into, members=members)
        except OSError as exc:
            if exc.errno is None:  # a stream error on the second pass: the file changed under us
                raise _damaged(archive, exc) from None
            raise _unwritable(into.parent, exc, "the build cache") from None
        except (tarfile.TarError, EOFError, zlib.error) as exc:
            raise _damaged(archive, exc) from None
    return flavour


def decode_manifest(data: bytes, archive: Path) -> str:
    """An archive's ``SHA256SUMS`` as text (ASCII hex and member names; anything else is damage)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise BuildArchiveError(f"{archive}: {MANIFEST} is not UTF-8 text (byte {exc.start}): the archive is "
                                "damaged or not an export; copy it again or re-export it") from None


def parse_manifest(text: str, archive: Path) -> dict[str, str]:
    """An archive's ``SHA256SUMS`` ("<sha256>  <flavour>/bin/<name>" a line) -> {member: sha256}."""
    listed: dict[str, str] = {}
    for line in text.splitlines():
        digest, _, name = line.partition("  ")
        if not re.fullmatch(r"[0-9a-f]{64}", digest) or not name:
            raise BuildArchiveError(f"{archive}: malformed {MANIFEST} line '{line[:80]}'")
        listed[name] = digest
    return listed


def _check_manifest(root: Path, flavour: str, archive: Path) -> None:
    manifest = root / MANIFEST
    if not manifest.is_file():
        raise BuildArchiveError(f"{archive} has no {MANIFEST}: re-export it with --export")
    listed = parse_manifest(decode_manifest(manifest.read_bytes(), archive), archive)
    present = {f"{flavour}/bin/{p.name}" for p in (root / flavour / "bin").iterdir()}
    if present != set(listed):
        raise BuildArchiveError(f"{archive}: {MANIFEST} and the files disagree "
                                f"(unlisted: {sorted(present - set(listed))}, missing: {sorted(set(listed) - present)})")
    for name, digest in sorted(listed.items()):
        got = _sha256(root / name)
        if got != digest:
            raise BuildArchiveError(f"{archive}: {name} has sha256 {got}, the manifest says {digest}; "
                                    "the archive is damaged: copy it again")


def _run(binary: Path, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([str(binary), *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                              stdin=subprocess.DEVNULL, cwd=binary.parent)
    except OSError as exc:
        raise BuildArchiveError(f"{binary} cannot be started here: {exc}") from None
    except subprocess.TimeoutExpired:
        raise BuildArchiveError(f"{binary} {' '.join(args)} did not answer within {RUN_TIMEOUT_S} s") from None


def _module_load_error(module: Path) -> str | None:
    """Why the dynamic loader refuses ``module`` (ggml skips a backend module it cannot load, and
    says nothing): the missing library, e.g. the driver's libcuda.so.1. Asked in a child process,
    so nothing of a GPU runtime is loaded into this one."""
    if not module.is_file():
        return f"the build has no {module.name}"
    proc = subprocess.run([sys.executable, "-c", "import ctypes, sys; ctypes.CDLL(sys.argv[1])", str(module)],
                          capture_output=True, text=True, timeout=RUN_TIMEOUT_S, stdin=subprocess.DEVNULL)
    if proc.returncode == 0:
        return None
    lines = proc.stderr.strip().splitlines()
    return f"{module.name} does not load here: " + (lines[-1].removeprefix("OSError: ") if lines else f"exit {proc.returncode}")


def check_runs_here(bin_dir: Path, info: dict, cpuinfo_text: str) -> str:
    """Refuse a build that cannot run on this machine; returns a one-line summary."""
    flags = cpuinfo_flags(cpuinfo_text)
    arch = os.uname().machine
    if info.get("arch") and info["arch"] != arch:
        raise BuildArchiveError(f"the build is for {info['arch']}, this machine is {arch}: export one built for {arch}")
    variants = info.get("cpu_variants") or {}
    if flags:
        missing = missing_features(info.get("cpu_features") or [], flags)
        if missing:
            raise BuildArchiveError(f"the build needs CPU features this CPU lacks: {', '.join(missing)} "
                                    "(it would stop with SIGILL); export a portable CPU build "
                                    "(--variant portable) or build on a machine like this one")
        if variants and ggml_cpu_variant(variants, flags) is None:
            raise BuildArchiveError("none of the build's CPU variants runs on this CPU "
                                    f"({', '.join(sorted(variants))})")
    server = bin_dir / "llama-server"
    version = _run(server, "--version")
    if version.returncode != 0:
        tail = (version.stderr or version.stdout).strip().splitlines()[-3:]
        raise BuildArchiveError(f"{server} --version failed here (exit {version.returncode}): {' | '.join(tail)} "
                                "— a library it needs is missing on this machine, or the build is broken")
    devices = _run(server, "-v", "--list-devices")
    out = devices.stdout + devices.stderr
    if devices.returncode != 0:
        raise BuildArchiveError(f"{server} --list-devices failed here (exit {devices.returncode}): "
                                f"{' | '.join(out.strip().splitlines()[-3:])}")
    # ggml's own lines (the CPU variant loaded, ggml-cuda's devices with their compute capability),
    # asked of the build's ggml: llama-server's log of them can be lost at its exit.
    asked = ask_ggml(bin_dir)
    said = out + "\n" + asked
    backend = info.get("backend", "cpu")
    if backend in ("cuda", "vulkan"):
        want = "CUDA" if backend == "cuda" else "Vulkan"
        listed = [line.strip() for line in out.splitlines() if re.match(rf"\s*{want}\d+:", line)]
        if not listed:
            unloadable = _module_load_error(bin_dir / f"libggml-{backend}.so")
            raise BuildArchiveError(f"this {backend} build sees no {want} device here "
                                    f"({' | '.join(out.strip().splitlines()[-3:]) or 'no output'})"
                                    + (f"; {unloadable}" if unloadable else "")
                                    + ": install the driver, or use a CPU build on this machine")
    archs = [str(a) for a in info.get("cuda_architectures") or []]
    if backend == "cuda":  # what the module holds, asked (build-info.json could be another build's)
        reported = compiled_archs(asked)
        if reported is not None and set(reported) != arch_numbers(archs):
            raise BuildArchiveError(f"its build-info.json says CUDA architectures {';'.join(archs) or 'none'}, but "
                                    f"libggml-cuda.so holds code for {';'.join(reported)}: the archive does not "
                                    "describe its build; export it again from the build server")
    if backend == "cuda" and archs:  # a GPU the build has no code for fails at its first kernel
        unserved = sorted({f"{m['name'].strip()} (compute capability {m['major']}.{m['minor']})"
                           for m in _CUDA_DEVICE_RE.finditer(said)
                           if not cuda_arch_serves(archs, int(m["major"]) * 10 + int(m["minor"]))})
        if unserved:
            raise BuildArchiveError(f"this cuda build has code for CUDA architectures {';'.join(archs)} only, "
                                    f"not for {', '.join(unserved)}: build it with those GPUs' architectures "
                                    "added to HOTFIT_CUDA_ARCHS (e.g. \"75;86;89;90\")")
    variant = loaded_cpu_variant(said)
    if variants:
        if variant is None:
            raise BuildArchiveError(f"{server}'s ggml loaded no CPU variant here "
                                    f"({' | '.join(said.strip().splitlines()[-3:])})")
        if flags:
            missing = missing_features(variants.get(variant, []), flags)
            if missing:
                raise BuildArchiveError(f"ggml loaded its {variant} CPU variant, which needs {', '.join(missing)} "
                                        "that this CPU's kernel does not offer")
    return f"{backend} build runs here" + (f" (CPU variant {variant})" if variant else "")


# The fields of build-info.json an import reads, with the JSON types they must have.
_INFO_TYPES: dict[str, tuple[type, ...]] = {
    "sdist_version": (str,), "sdist_sha256": (str,), "backend": (str,), "variant": (str,), "arch": (str,),
    "cpu_features": (list,), "cpu_variants": (dict,), "cuda_architectures": (list,),
}


def read_build_info(path: Path, archive: Path) -> dict:
    """An archive's build-info.json, checked for the types the import relies on."""
    try:
        info = json.loads(path.read_bytes().decode("utf-8"))
    except (OSError, ValueError) as exc:
        raise BuildArchiveError(f"{archive}: build-info.json is missing or not JSON ({str(exc)[:200]})") from None
    if not isinstance(info, dict):
        raise BuildArchiveError(f"{archive}: build-info.json is a JSON {type(info).__name__}, not an object; re-export it")
    for key, types in _INFO_TYPES.items():
        if key in info and info[key] is not None and not isinstance(info[key], types):
            raise BuildArchiveError(f"{archive}: build-info.json's {key} is a JSON {type(info[key]).__name__}, "
                                    f"expected {' or '.join(t.__name__ for t in types)}; re-export the build")
    lists = [info.get("cpu_features") or [], info.get("cuda_architectures") or [],
             *(info.get("cpu_variants") or {}).values()]
    if not all(isinstance(v, list) and all(isinstance(x, (str, int)) and not isinstance(x, bool) for x in v)
               for v in lists):
        raise BuildArchiveError(f"{archive}: build-info.json's cpu_features, cpu_variants or cuda_architectures "
                                "hold something other than lists of names; re-export the build")
    if info.get("backend", "cpu") not in BACKENDS or info.get("variant") not in (None, *VARIANTS):
        raise BuildArchiveError(f"{archive}: build-info.json names backend {str(info.get('backend'))[:40]!r} "
                                f"variant {str(info.get('variant'))[:40]!r}; only the builds install-llama-server "
                                f"makes are installed ({', '.join(FLAVOURS)})")
    return info


def flavour_of(info: dict) -> str:
    """The cache folder a build's record names: cpu, cpu-native, cpu-generic, vulkan, cuda."""
    backend = info.get("backend", "cpu")
    variant = info.get("variant")
    return backend if backend != "cpu" or variant in (None, "portable") else f"cpu-{variant}"


# renameat2(2)'s RENAME_EXCHANGE: swap two paths in one step (Linux >= 3.15; ext4, xfs, btrfs, tmpfs).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the directories ``a`` and ``b`` atomically; False where the kernel or file system cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a))


def _old_name(version_dir: Path, flavour: str) -> Path:
    return version_dir / f".old-{flavour}"


def _recover(version_dir: Path) -> list[str]:
    """What a killed import left (under the lock, so no import is running): a build moved aside
    but not yet replaced is put back, staging folders and replaced builds are removed."""
    done = []
    for old in sorted(version_dir.glob(".old-*")):
        dest = version_dir / re.sub(r"-\d+$", "", old.name.removeprefix(".old-"))  # earlier imports added a pid
        if dest.name in FLAVOURS and not dest.exists():
            os.replace(old, dest)
            done.append(f"restored {dest.name}/")
        else:
            shutil.rmtree(old)
            done.append(f"removed {old.name}/")
    for staging in sorted(version_dir.glob(".import-*")):
        shutil.rmtree(staging)
        done.append(f"removed {staging.name}/")
    return done


def _install(staged: Path, dest: Path) -> None:
    """Put ``staged`` at ``dest``: one atomic step where the kernel can (a new folder: a rename; an
    existing one: an exchange, the old build then removed). Elsewhere two renames, which
    _recover finishes or undoes if a kill falls between them."""
    if not dest.exists():
        os.replace(staged, dest)
        return
    if _exchange(staged, dest):
        shutil.rmtree(staged)
        return
    old = _old_name(dest.parent, dest.name)
    os.replace(dest, old)
    os.replace(staged, dest)
    shutil.rmtree(old)


class _ImportLock:
    """One import per cache version at a time (flock on a file beside the version folder, so the
    folder holds builds only); a second import waits for the first and says so."""

    def __init__(self, version_dir: Path) -> None:
        self.path = version_dir.parent / f".import-{version_dir.name}.lock"
        self.fd = -1

    def __enter__(self) -> "_ImportLock":
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _say(f"another import into {self.path.parent} is running; waiting for it to finish")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self.fd)


def is_url(source: str) -> bool:
    return source.startswith(("http://", "https://"))


def import_archive(archive: Path | str, version_dir: Path, pin: dict, cpuinfo_path: Path,
                   sha256: str | None = None) -> Path:
    """Install the build in ``archive`` (a file, or an http(s) URL downloaded first) into
    ``version_dir``; ``sha256``: the archive's, checked before anything is unpacked."""
    url = str(archive) if is_url(str(archive)) else None
    if url is None and not Path(archive).is_file():
        raise BuildArchiveError(f"no build archive at {archive}")
    try:
        version_dir.mkdir(parents=True, exist_ok=True)
        with _ImportLock(version_dir):
            for what in _recover(version_dir):
                _say(f"a previous import was interrupted: {what}")
            if url is None:
                local = Path(archive)
                if sha256 is not None and _sha256(local) != sha256:
                    raise BuildArchiveError(f"{local} has sha256 {_sha256(local)}, not {sha256} (--sha256): "
                                            "copy it again, or check which build the sum names")
                return _import_locked(local, version_dir, pin, cpuinfo_path)
            downloaded = fetch_archive(url, version_dir.parent / "downloads", sha256)
            installed = _import_locked(downloaded, version_dir, pin, cpuinfo_path)
            downloaded.unlink()  # installed: the download has served (a refused one is kept for the rerun)
            return installed
    except OSError as exc:
        raise _unwritable(version_dir, exc, "the build cache") from None


# ----------------------------------------------------------------------------------- --from URL
def _http_error(url: str, exc: Exception) -> BuildArchiveError:
    if isinstance(exc, urllib.error.HTTPError):
        why = f"HTTP {exc.code} {exc.reason}"
    elif isinstance(exc, urllib.error.URLError):
        why = str(exc.reason)
    else:
        why = f"{type(exc).__name__}: {exc}"
    return BuildArchiveError(f"could not download {url}: {why}; check the URL and that the mirror is "
                             "reachable from here, then run it again (a partial download is resumed)")


def _expected_sha256(url: str, given: str | None) -> str:
    """The archive's sha256: --sha256 when given, else the first word of URL.sha256 (the format
    `sha256sum FILE > FILE.sha256` writes)."""
    if given is not None:
        return given
    try:
        with urllib.request.urlopen(url + ".sha256", timeout=HTTP_TIMEOUT_S) as answer:
            text = answer.read(4096).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        if exc.code == 404:
            raise BuildArchiveError(f"no checksum beside {url} ({url}.sha256: HTTP 404): publish one "
                                    "(sha256sum FILE > FILE.sha256) or pass --sha256 HEX") from None
        raise _http_error(url + ".sha256", exc) from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise _http_error(url + ".sha256", exc) from None
    word = (text.split() or [""])[0].lower()
    if not SHA256_RE.fullmatch(word):
        raise BuildArchiveError(f"{url}.sha256 does not start with a sha256 ('{text[:80].strip()}'): publish "
                                "the output of sha256sum, or pass --sha256 HEX")
    return word


def fetch_archive(url: str, downloads: Path, sha256: str | None) -> Path:
    """Download ``url`` into ``downloads`` (resuming a ``.part`` left by an interrupted run), check
    its sha256, and return the checked file (renamed from ``.part`` only once it matches)."""
    expected = _expected_sha256(url, sha256)
    name = Path(urllib.parse.urlsplit(url).path).name or "llama-server.tar.gz"
    name = re.sub(r"[^A-Za-z0-9._-]", "_", name)
    downloads.mkdir(parents=True, exist_ok=True)
    final = downloads / f"{expected[:16]}-{name}"  # the sum names the file: another build never resumes it
    if final.is_file() and _sha256(final) == expected:
        _say(f"using {final} (downloaded before, sha256 checked)")
        return final
    part = final.with_name(final.name + ".part")
    for attempt in ("resume", "fresh"):
        have = part.stat().st_size if part.is_file() else 0
        _download(url, part, have)
        got = _sha256(part)
        if got == expected:
            os.replace(part, final)
            return final
        part.unlink()
        if have == 0 or attempt == "fresh":
            raise BuildArchiveError(f"{url} has sha256 {got}, expected {expected}"
                                    f"{' (--sha256)' if sha256 else f' ({url}.sha256)'}: the mirror holds another "
                                    "file than the sum names; nothing was installed")
        _say(f"the resumed download of {url} did not match its sha256: downloading it again from the start")
    raise AssertionError("unreachable")


def _download(url: str, part: Path, have: int) -> None:
    request = urllib.request.Request(url, headers={"Range": f"bytes={have}-"} if have else {})
    try:
        with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as answer:
            resumed = have > 0 and answer.status == 206
            if have and not resumed:
                _say(f"{url}: the server does not resume (HTTP {answer.status}); downloading from the start")
            _say(f"downloading {url}" + (f" from byte {have}" if resumed else ""))
            with open(part, "ab" if resumed else "wb") as out:
                while block := answer.read(DOWNLOAD_CHUNK_BYTES):
                    out.write(block)
                out.flush()
                os.fsync(out.fileno())
            if answer.length:  # http.client ends a body cut short quietly: the bytes it still expected
                raise _http_error(url, ConnectionError(f"the transfer was cut short, {answer.length} bytes "
                                                       f"missing ({part.stat().st_size} kept in {part.name})"))
    except urllib.error.HTTPError as exc:
        if exc.code == 416 and have:  # the .part is already whole: its sha256 decides
            return
        raise _http_error(url, exc) from None
    except OSError as exc:
        if isinstance(exc, urllib.error.URLError) or exc.errno is None or isinstance(exc, (TimeoutError, ConnectionError)):
            raise _http_error(url, exc) from None
        raise _unwritable(part.parent, exc, "the download folder") from None
    except (ValueError, http.client.HTTPException) as exc:
        raise _http_error(url, exc) from None


def _import_locked(archive: Path, version_dir: Path, pin: dict, cpuinfo_path: Path) -> Path:
    staging = Path(tempfile.mkdtemp(prefix=".import-", dir=version_dir))
    try:
        flavour = _unpack(archive, staging)
        _check_manifest(staging, flavour, archive)
        bin_dir = staging / flavour / "bin"
        info = read_build_info(bin_dir / "build-info.json", archive)
        for key in ("sdist_version", "sdist_sha256"):
            if info.get(key) != pin[key]:
                raise BuildArchiveError(f"{archive} was built from {key} {str(info.get(key))[:80]}, this checkout pins "
                                        f"{pin[key]}: export it from a build machine on the same hotfit version")
        expected_flavour = flavour_of(info)
        # A cross build's folder names its architecture (cpu-aarch64, docs/builds.md): on a machine of
        # that architecture it installs as the plain flavour; anywhere else check_runs_here refuses it.
        if flavour not in (expected_flavour, f"{expected_flavour}-{info.get('arch')}"):
            raise BuildArchiveError(f"{archive}: folder '{flavour}' does not match its record ({expected_flavour})")
        for name in ("llama-server", "llama-fit-params"):
            if not (bin_dir / name).is_file():
                raise BuildArchiveError(f"{archive} has no {flavour}/bin/{name}")
        try:
            cpuinfo = cpuinfo_path.read_text(errors="replace")
        except OSError:
            cpuinfo = ""
        summary = check_runs_here(bin_dir, info, cpuinfo)
        _install(staging / flavour, version_dir / expected_flavour)
        _say(f"installed {expected_flavour} from {archive}: {summary}")
        return version_dir / expected_flavour / "bin" / "llama-server"
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def cuda_rebuild_reason(info: dict, asked: str, gpu_caps: str) -> str:
    """Why the cached CUDA build is not the one asked for now ("" when it is): HOTFIT_CUDA_ARCHS
    (``asked``) names other architectures than it was built for, or, with none named, a GPU of
    this machine (``gpu_caps``: "86;90", nvidia-smi's compute capabilities) has no code in it."""
    recorded = [str(a).strip() for a in info.get("cuda_architectures") or []]
    wanted = [a.strip() for a in asked.split(";") if a.strip()]
    if wanted:
        if sorted(wanted) == sorted(recorded):
            return ""
        return (f"it was built for CUDA architectures {';'.join(recorded) or 'none'}, "
                f"HOTFIT_CUDA_ARCHS asks for {';'.join(wanted)}")
    unserved = [int(c) for c in gpu_caps.split(";") if c.strip().isdigit()
                and not cuda_arch_serves(recorded, int(c))]
    if not unserved:
        return ""
    return (f"it has code for CUDA architectures {';'.join(recorded) or 'none'}, not for this machine's GPUs "
            f"of compute capability {', '.join(f'{c // 10}.{c % 10}' for c in unserved)}")


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["record"] and len(argv) == 4:
            record(Path(argv[1]), Path(argv[2]), json.loads(argv[3]))
        elif argv[:1] == ["export"] and len(argv) == 4:
            export(Path(argv[1]), argv[2], Path(argv[3]))
        elif argv[:1] == ["cuda-rebuild-reason"] and len(argv) == 4:
            try:
                info = json.loads(Path(argv[1]).read_text())
            except (OSError, ValueError):
                info = {}
            print(cuda_rebuild_reason(info if isinstance(info, dict) else {}, argv[2], argv[3]))
        elif argv[:1] == ["import"] and len(argv) in (4, 5):
            cpuinfo = Path(os.environ.get("HOTFIT_DETECT_ROOT", "") + "/proc/cpuinfo")
            source = argv[1] if is_url(argv[1]) else Path(argv[1])
            print(import_archive(source, Path(argv[2]), json.loads(argv[3]), cpuinfo, argv[4] if len(argv) == 5 else None))
        else:
            print(__doc__, file=sys.stderr)
            return 2
    except BuildArchiveError as exc:
        _say(f"refused: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
