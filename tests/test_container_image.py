"""recipes/kubernetes/Containerfile, built for real with Debian's buildah (docs/recipes.md, "The image").

No container registry is reachable here, so the base is Debian 12 made with debootstrap from the
Debian mirror (once; kept in the container storage as ``localhost/hotfit-test-base:bookworm``),
the wheels come from pip's cache (``pip wheel``, the Containerfile's ``PIP_FIND_LINKS``) and
llama-server from this machine's portable CPU build exported with ``install-llama-server --export``.
The build runs with ``--isolation chroot``: this container's cgroups (hybrid) make crun refuse the
default OCI isolation, and the same holds for ``podman run``, so the image is run with
``buildah run --isolation chroot``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT
from tests.test_portable_build import _require_build
from tests.test_recipes import require_tool

BASE_IMAGE = "localhost/hotfit-test-base:bookworm"
BASE_PACKAGES = "python3,python3-venv,libgomp1,ca-certificates"
IMAGE = "localhost/hotfit-test-image:latest"


def run(argv: list[str], timeout_s: int = 900, **kw: object) -> subprocess.CompletedProcess[str]:
    # stdin never the test run's: buildah run leaves a terminal it was given non-blocking, and
    # ansible-playbook, later in the same run, refuses to start then (seen)
    kw.setdefault("stdin", subprocess.DEVNULL)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, **kw)  # type: ignore[call-overload]


def base_image(buildah: str, where: Path) -> str:
    """Debian 12 without a registry: debootstrap once (about 3 minutes, 273 MB), then imported."""
    if run([buildah, "inspect", "--type", "image", BASE_IMAGE]).returncode == 0:
        return BASE_IMAGE
    debootstrap = require_tool("debootstrap", "debootstrap")
    podman = require_tool("podman", "podman")
    rootfs = where / "rootfs"
    made = run([debootstrap, "--variant=minbase", f"--include={BASE_PACKAGES}", "bookworm", str(rootfs),
                "http://deb.debian.org/debian"], timeout_s=1800)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imported = run([podman, "import", "-", BASE_IMAGE], stdin=tar.stdout)
    assert tar.wait() == 0 and imported.returncode == 0, imported.stderr
    shutil.rmtree(rootfs)
    return BASE_IMAGE


def build_context(where: Path) -> Path:
    """The checkout as an operator has it (tracked and new files, no .venv), the wheels for an
    offline pip, and the exported build."""
    context = where / "context"
    listed = run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT)
    for name in filter(None, listed.stdout.split("\0")):
        source, target = REPO_ROOT / name, context / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():  # the layer names at the root link into hotfit/
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    wheels = run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(context / "wheels"),
                  str(context), "setuptools", "wheel"])
    assert wheels.returncode == 0, wheels.stderr[-3000:]
    exported = run([str(REPO_ROOT / "scripts" / "install-llama-server"), "--backend", "cpu", "--export",
                    str(context / "exports" / "llama-server-cpu.tar.gz")])
    assert exported.returncode == 0, exported.stderr[-3000:]
    return context


def test_the_containerfile_builds_an_image_with_hotfit_and_the_exported_llama_server(tmp_path: Path) -> None:
    buildah = require_tool("buildah", "buildah")
    _require_build("cpu")
    (tmp_path / "exports").mkdir()
    context = build_context(tmp_path)
    built = run([buildah, "bud", "--isolation", "chroot", "--build-arg", f"BASE={base_image(buildah, tmp_path)}",
                 "--build-arg", "PIP_FIND_LINKS=wheels",
                 "--build-arg", "LLAMA_SERVER_FROM=exports/llama-server-cpu.tar.gz",
                 "-f", str(context / "recipes" / "kubernetes" / "Containerfile"), "-t", IMAGE, str(context)],
                timeout_s=1800)
    assert built.returncode == 0, built.stdout[-4000:] + built.stderr[-4000:]
    container = run([buildah, "from", IMAGE]).stdout.strip()
    try:
        def inside(*argv: str) -> subprocess.CompletedProcess[str]:
            return run([buildah, "run", "--isolation", "chroot", container, "--", *argv], timeout_s=300)

        # hotfit is on PATH and finds the exported llama-server the way the recipes' pods do
        found = inside("hotfit", "--json", "probe")
        assert found.returncode == 0, found.stderr[-3000:]
        assert json.loads(found.stdout)["devices"]
        server = inside("sh", "-c", 'ls "$HOTFIT_LLAMA_CACHE"/*/cpu/bin/llama-server')
        assert server.returncode == 0, server.stderr
        version = inside(server.stdout.strip(), "--version")
        assert version.returncode == 0 and "version:" in version.stdout + version.stderr
        # neither the sources nor the export archive stayed in the image (mounted for one step only)
        assert inside("test", "-e", "/src/exports").returncode != 0
    finally:
        run([buildah, "rm", container])
        run([buildah, "rmi", IMAGE])
