"""The layer contract (README "Layout"): each package imports only the packages below it.

Checks over the real source tree: import-linter's contracts in pyproject.toml (run by
its own CLI, as CI would) — the layers, the CLI on top, and the closed backend boundary, each contract
naming every module it must — and a walk of every module for imports of project modules inside a
function — those existed only to dodge import cycles, which the layers make impossible.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROJECT_PACKAGES = ("core", "registry", "state", "grading", "download", "backends", "stages", "pipeline")


def _modules() -> list[tuple[str, Path]]:
    out = []
    for package in PROJECT_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
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
    assert sorted(config["root_packages"]) == sorted(PROJECT_PACKAGES)
    on_disk = {p.name for p in REPO.iterdir() if (p / "__init__.py").exists() and p.name not in ("tests",)}
    assert on_disk <= set(PROJECT_PACKAGES), f"packages outside the contract: {on_disk - set(PROJECT_PACKAGES)}"
    forbidden = next(c for c in config["contracts"] if c.get("forbidden_modules") == ["pipeline.cli"])
    pipeline_modules = {name for name, _ in _modules()
                        if name.startswith("pipeline.") and not name.startswith("pipeline.cli")
                        and name != "pipeline.__main__"}
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
                if any(n == "." or n.split(".")[0] in PROJECT_PACKAGES for n in names):
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
    probe.write_text("import json\n\ndef f():\n    import os\n    from core import errors\n    return errors, os, json\n")
    assert _function_local_project_imports(probe, tmp_path) == ["probe.py:5"]


def test_the_backend_boundary_contract_closes_every_concrete_backend() -> None:
    # Outside backends/, only the protocol and the selector (CONTRIBUTING.md "Adding a backend"): the
    # contract must name every other module of backends/ and every other package as a source.
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    boundary = [c for c in config["contracts"] if c["type"] == "forbidden"
                and any(m.startswith("backends.") for m in c["forbidden_modules"])]
    assert len(boundary) == 1, "one forbidden contract closes the backend boundary"
    concrete = {".".join(name.split(".")[:2]) for name, _ in _modules()
                if name.startswith("backends.") and name not in ("backends.base", "backends.select")}
    assert set(boundary[0]["forbidden_modules"]) == concrete
    assert set(boundary[0]["source_modules"]) == set(PROJECT_PACKAGES) - {"backends"}
