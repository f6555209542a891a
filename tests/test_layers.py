"""The layer contract (CONTRIBUTING.md "Layout"): each package imports only the packages below it.

Checks over the real source tree: import-linter's contracts in pyproject.toml (run by its own
CLI, as CI would) — the layers, the CLI on top, and the closed backend boundary, each contract
naming every module it must; a walk of every module for imports of project modules inside a
function — those existed only to dodge import cycles, which the layers make impossible; and the one
installed namespace: the layers are the repository's top-level folders, imported only as
``hotfit.<layer>`` (a bare ``core`` would load a second copy of every module it reaches).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

TIER = "integration"

REPO = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("core", "registry", "state", "grading", "planner", "download", "backends", "stages", "pipeline")


def _modules() -> list[tuple[str, Path]]:
    """(import name under the namespace, path) of every module of the layers."""
    out = []
    for package in PROJECT_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(("hotfit", *(parts[:-1] if parts[-1] == "__init__" else parts)))
            out.append((name, path))
    return out


def _lint_imports() -> Path:
    exe = Path(sys.executable).with_name("lint-imports")
    if exe.exists():
        return exe
    found = shutil.which("lint-imports")
    assert found, "import-linter is a test dependency: pip install -e '.[test]'"
    return Path(found)


def test_import_linter_contracts_hold() -> None:
    proc = subprocess.run([str(_lint_imports()), "--no-cache"], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout, proc.stdout


def test_the_contract_names_every_package_and_every_non_cli_pipeline_module() -> None:
    # A new package or pipeline module the contract does not name would escape it silently.
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config["root_packages"] == ["hotfit"]
    layers = next(c for c in config["contracts"] if c["type"] == "layers")
    named = {name.strip() for layer in layers["layers"] for name in layer.split("|")}
    assert named == set(PROJECT_PACKAGES)
    on_disk = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists() and p.name not in ("tests", "hotfit")}
    assert on_disk <= set(PROJECT_PACKAGES), f"packages outside the contract: {on_disk - set(PROJECT_PACKAGES)}"
    forbidden = next(c for c in config["contracts"] if c.get("forbidden_modules") == ["hotfit.pipeline.cli"])
    pipeline_modules = {name for name, _ in _modules()
                        if name.startswith("hotfit.pipeline.") and not name.startswith("hotfit.pipeline.cli")
                        and name != "hotfit.pipeline.__main__"}
    assert pipeline_modules == set(forbidden["source_modules"])


def _function_local_project_imports(path: Path, root: Path = REPO) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if in_function and isinstance(child, (ast.Import, ast.ImportFrom)):
                names = ([a.name for a in child.names] if isinstance(child, ast.Import)
                         else ["." if child.level else (child.module or "")])
                if any(n == "." or n.split(".")[0] in (*PROJECT_PACKAGES, "hotfit") for n in names):
                    found.append(f"{path.relative_to(root)}:{child.lineno}")
            visit(child, inside)

    visit(tree, False)
    return found


def test_no_function_local_imports_of_project_modules() -> None:
    offenders = [hit for _, path in _modules() for hit in _function_local_project_imports(path)]
    assert offenders == [], "imports inside functions (move them to the top; the layers allow it):\n" + "\n".join(offenders)


def test_the_local_import_check_sees_one(tmp_path: Path) -> None:
    # The walk above must be able to fail: a deferred project import is reported, a stdlib one is not.
    probe = tmp_path / "probe.py"
    probe.write_text("import json\n\ndef f():\n    import os\n    from hotfit.core import errors\n    return errors, os, json\n")
    assert _function_local_project_imports(probe, tmp_path) == ["probe.py:5"]


def test_the_backend_boundary_contract_closes_every_concrete_backend() -> None:
    # Outside backends/, only the protocol and the selector (CONTRIBUTING.md "Adding a backend"): the
    # contract must name every other module of backends/ and every other package as a source.
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    boundary = [c for c in config["contracts"] if c["type"] == "forbidden"
                and any(m.startswith("hotfit.backends.") for m in c["forbidden_modules"])]
    assert len(boundary) == 1, "one forbidden contract closes the backend boundary"
    concrete = {".".join(name.split(".")[:3]) for name, _ in _modules()
                if name.startswith("hotfit.backends.")
                and name not in ("hotfit.backends.base", "hotfit.backends.select")}
    assert set(boundary[0]["forbidden_modules"]) == concrete
    assert set(boundary[0]["source_modules"]) == {f"hotfit.{p}" for p in PROJECT_PACKAGES} - {"hotfit.backends"}


def test_the_planner_is_declared_pure() -> None:
    # planner/ decides from data (CONTRIBUTING.md "Layout"): a contract forbids it, directly or through
    # what it imports, every effectful layer, the log, and the standard and third-party modules that
    # do I/O, run processes or reach the network (test_import_linter_contracts_hold runs it).
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert config.get("include_external_packages") is True  # else the external names are not checked
    pure = [c for c in config["contracts"] if c["type"] == "forbidden" and c["source_modules"] == ["hotfit.planner"]]
    assert len(pure) == 1 and not pure[0].get("allow_indirect_imports", False)
    assert {"hotfit.state", "hotfit.download", "hotfit.backends", "hotfit.stages", "hotfit.pipeline", "hotfit.core.log",
            "subprocess", "socket", "httpx", "anyio", "asyncio"} <= set(pure[0]["forbidden_modules"])


def _bare_layer_imports(path: Path, root: Path = REPO) -> list[str]:
    """Imports of a layer by its bare folder name (``from core.x import``, ``-m pipeline``)."""
    text = path.read_text(errors="replace")
    found = []
    if path.suffix == ".py":
        for node in ast.walk(ast.parse(text, str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            if any(n.split(".")[0] in PROJECT_PACKAGES for n in names):
                found.append(f"{path.relative_to(root)}:{node.lineno}")
    else:  # shell scripts with embedded Python
        layer = "|".join(PROJECT_PACKAGES)
        for lineno, line in enumerate(text.splitlines(), 1):
            if re.search(rf"^\s*(from ({layer})(\.\w+)* import|import ({layer})\b)|-m ({layer})\b", line):
                found.append(f"{path.relative_to(root)}:{lineno}")
    return found


def test_the_layers_are_imported_only_through_the_one_namespace() -> None:
    # The distribution installs one package, hotfit (pyproject [tool.setuptools.packages.find]); its
    # layers are real folders under hotfit/ (the paths tracebacks print and git keeps), and the
    # design card's top-level names link to them: code, tests and scripts name hotfit.<layer>.
    for package in PROJECT_PACKAGES:
        real, link = REPO / "hotfit" / package, REPO / package
        assert real.is_dir() and not real.is_symlink(), real
        assert link.is_symlink() and link.resolve() == real.resolve(), link
    files = [p for _, p in _modules()] + sorted((REPO / "tests").rglob("*.py"))
    files += [p for p in sorted((REPO / "scripts").iterdir()) if p.is_file()]
    offenders = [hit for path in files for hit in _bare_layer_imports(path)]
    assert offenders == [], "import the layers as hotfit.<layer>:\n" + "\n".join(offenders)


def test_a_traceback_names_a_path_git_keeps() -> None:
    # A traceback from the installed package prints hotfit/<layer>/<module>.py: git must know that
    # path (git log, git blame), and grep/find must see the code there without following links.
    code = "import hotfit.core.settings as s; s.endpoint_url('ftp://nowhere')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    frames = re.findall(r'File "([^"]+)"', proc.stderr)
    ours = [Path(f) for f in frames if "/hotfit/" in f]
    assert ours, proc.stderr
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.fail("git and the checkout's .git are needed to check the paths a traceback prints")
    for frame in ours:
        relative = frame.resolve().relative_to(REPO.resolve())
        assert str(frame).endswith(str(relative)), (frame, relative)  # printed as git keeps it, no link between
        blame = subprocess.run(["git", "blame", "-L", "1,1", "--", str(relative)], cwd=REPO,
                               capture_output=True, text=True, timeout=60)
        assert blame.returncode == 0, blame.stderr
    defs = subprocess.run(["grep", "-rl", "^def \\|^class ", str(REPO / "hotfit")], capture_output=True, text=True)
    assert len(defs.stdout.splitlines()) > 50, defs.stdout


def test_the_namespace_check_sees_a_bare_import(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("import json\nfrom hotfit.core import errors\nfrom core.errors import UsageError\n")
    (tmp_path / "b").write_text("#!/bin/sh\npython -m hotfit --version\npython -m pipeline --version\n")
    assert _bare_layer_imports(tmp_path / "a.py", tmp_path) == ["a.py:3"]
    assert _bare_layer_imports(tmp_path / "b", tmp_path) == ["b:3"]


def test_the_wheel_installs_one_top_level_package(tmp_path: Path) -> None:
    # What pip installs: one import package named after the product, the console script inside it.
    # built from a copy: an in-tree build leaves build/ and *.egg-info behind in the checkout
    source = tmp_path / "source"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".mypy_cache", ".pytest_cache", "tests", "docs"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = tmp_path.glob("hotfit-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
        entry_points = next(zf.read(n).decode() for n in names if n.endswith("entry_points.txt"))
    assert top == {"hotfit"}, top
    assert "hotfit = hotfit.pipeline.cli:main" in entry_points
    for package in PROJECT_PACKAGES:
        assert f"hotfit/{package}/__init__.py" in names
    assert any(n.startswith("hotfit/registry/data/") and n.endswith(".json") for n in names)
    # Installed, and run away from the checkout: every name resolves inside the one package (a bare
    # `registry` in an importlib.resources call once read the bundled registry from the checkout).
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = "import hotfit, sys; print(hotfit.__file__); sys.argv[0] = 'hotfit'; from hotfit.pipeline.cli import main; sys.exit(main())"
    run = subprocess.run([sys.executable, "-c", code, "--json", "registry", "list"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    where, _, listing = run.stdout.partition("\n")
    assert Path(where).is_relative_to(site), where
    assert json.loads(listing)["entries"], listing


def test_a_module_loaded_by_a_bare_name_is_caught_at_the_end_of_the_run() -> None:
    # Dynamic imports (import_module strings, mock targets) escape the static walk above; the suite's
    # sessionfinish hook (tests/conftest.py) fails the run when one loaded a second copy.
    code = ("import importlib, hotfit.stages.plan; from tests.conftest import bare_layer_modules; "
            "before = bare_layer_modules(); importlib.import_module('stages.plan'); print(before, bare_layer_modules())")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[]", "['stages',", "'stages.plan']"]
