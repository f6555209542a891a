"""The fleet recipes in recipes/ and the unit `hotfit serve --print-systemd-unit` prints, each
checked by the real tool that consumes it (docs/recipes.md):

- cloud-init user-data: ``cloud-init schema --config-file`` (Debian's cloud-init);
- the Ansible playbook: ``ansible-playbook -c local`` (ansible-core) driving ``hotfit auto``
  against the local Hub — changed, then unchanged, a refusal failing with hotfit's exit code and
  message, and ``ansible_local.hotfit`` from the facts.d executable;
- the Kubernetes Job: kubernetes-validate (strict), and the NFD features file hotfit writes;
- the systemd unit: ``systemd-analyze verify`` and ``systemd-analyze security --offline=yes``.

A missing tool skips its tests unless ``HOTFIT_REQUIRE_TOOLS`` is set (scripts/run-tests sets it;
``scripts/bootstrap --test`` installs them).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.errors import UsageError
from hotfit.core.plan import Device, ProbeResult
from hotfit.pipeline.cli import main
from hotfit.pipeline.systemd_unit import GPU_DEVICE_ALLOW, PERMANENT_EXIT_CODES, UnitSpec, systemd_unit, unit_user
from hotfit.pipeline.status import label_value, nfd_labels
from tests.e2e_support import LARGE, GiB, World, write_probe, write_provisioned_home
from tests.gguf_fixtures import tool_template_text, write_standin_llama_server
from tests.hubserver import LocalHub

REPO = Path(__file__).resolve().parent.parent
RECIPES = REPO / "recipes"
VENV_BIN = Path(sys.executable).parent
REQUIRE_ENV = "HOTFIT_REQUIRE_TOOLS"
EXPOSURE_MAX = 5.0  # systemd-analyze: ≤ 5.0 is "OK"/"MEDIUM", above is "EXPOSED"/"UNSAFE"
# Kubernetes label values (a features.d line's value becomes one)
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


def require_tool(name: str, package: str) -> str:
    """The tool's path: in the virtualenv (PyPI tools) or on PATH (Debian's)."""
    found = shutil.which(name, path=f"{VENV_BIN}{os.pathsep}{os.environ.get('PATH', '')}")
    if found:
        return found
    why = f"{name} not installed (package {package}; scripts/bootstrap --test installs it)"
    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{why}; {REQUIRE_ENV} is set, so this is a failure, not a skip")
    pytest.skip(why)


# ----------------------------------------------------------------------------- a provisioned home


@pytest.fixture(scope="module")
def provisioned_home(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A home as `hotfit auto` leaves it for an NVIDIA card: model, template, manifest."""
    root = tmp_path_factory.mktemp("recipes")
    probe = ProbeResult(devices=(Device(0, "nvidia", "big card", 24 * GiB, 20 * GiB,
                                        uuid="GPU-8a1c2f0e-0000-4000-8000-000000000001"),), selected=0)
    made = write_provisioned_home(root / "home", probe, kv_cache_type="q8_0", template_text=tool_template_text(),
                                  opened_context_tokens=49152,
                                  device={"index": 0, "kind": "nvidia", "name": "big card"})
    return {"home": made.home, "root": root, "manifest": made.manifest, "plan": made.plan}


def cli(home: Path, *args: str) -> tuple[int, str]:
    out = io.StringIO()
    code = main(["--home", str(home), "--log-format", "json", *args], out=out)
    return code, out.getvalue()


# ----------------------------------------------------------------------------- systemd


def verified_unit(unit_text: str, where: Path) -> tuple[str, Path]:
    """The unit written under ``where``, which ``systemd-analyze verify`` must pass without a word."""
    tool = require_tool("systemd-analyze", "systemd")
    where.mkdir(parents=True, exist_ok=True)
    unit = where / "hotfit.service"
    unit.write_text(unit_text)
    verify = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    assert verify.returncode == 0 and verify.stderr.strip() == "", verify.stderr
    return tool, unit


def analyze_unit(unit_text: str, where: Path) -> tuple[float, str]:
    """``systemd-analyze verify`` must be clean; returns the offline security exposure and its table."""
    tool, unit = verified_unit(unit_text, where)
    security = subprocess.run([tool, "security", "--offline=yes", "--no-pager", str(unit)], capture_output=True,
                              text=True, timeout=60)
    found = re.search(r"Overall exposure level for hotfit\.service: (\d+\.\d+)", security.stdout)
    assert found, security.stdout + security.stderr
    return float(found.group(1)), security.stdout


def unit_lines(text: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in text.splitlines() if line.startswith(f"{key}=")]


def test_printed_unit_is_hardened_keeps_the_gpu_and_verifies(provisioned_home: dict, tmp_path: Path) -> None:
    code, unit = cli(provisioned_home["home"], "serve", "--print-systemd-unit", "--unit-user", "hotfit")
    assert code == 0, unit
    exposure, table = analyze_unit(unit, tmp_path / "cli")
    assert exposure <= EXPOSURE_MAX, table
    # not root, no capabilities, but the NVIDIA device nodes stay reachable under a closed policy
    assert unit_lines(unit, "User") == ["hotfit"]
    assert unit_lines(unit, "CapabilityBoundingSet") == [""]
    assert unit_lines(unit, "DevicePolicy") == ["closed"] and "PrivateDevices" not in unit
    allowed = unit_lines(unit, "DeviceAllow")
    assert "char-nvidia-frontend rw" in allowed and "char-nvidia-uvm rw" in allowed
    assert "char-nvidia-frontend:rw" in table  # systemd read the ACL as we meant it
    # the home (a tmp dir here, not under /var/lib) is the one writable path
    assert unit_lines(unit, "ReadWritePaths") == [str(provisioned_home["home"])]
    assert unit_lines(unit, "ProtectSystem") == ["strict"]
    # network-online ordering, and no restart loop on a permanent failure
    assert unit_lines(unit, "Wants") == ["network-online.target"]
    assert unit_lines(unit, "After") == ["network-online.target"]
    assert unit_lines(unit, "RestartPreventExitStatus") == [" ".join(map(str, PERMANENT_EXIT_CODES))]
    assert {2, 3, 5} <= set(PERMANENT_EXIT_CODES)
    assert int(unit_lines(unit, "StartLimitBurst")[0]) > 0 and int(unit_lines(unit, "StartLimitIntervalSec")[0]) > 0
    assert "Environment=CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0" in unit


@pytest.mark.parametrize("kind", ["nvidia", "vulkan", "cpu"])
def test_fleet_unit_under_var_lib_uses_a_state_directory(kind: str, tmp_path: Path) -> None:
    spec = UnitSpec(hotfit_argv=[sys.executable, "-m", "hotfit", "--home", "/var/lib/hotfit", "serve"],
                    env={}, description="hotfit test", user="hotfit", home=Path("/var/lib/hotfit"),
                    device_kind=kind, paths=(Path("/opt/hotfit/.venv/bin/hotfit"),))
    unit = systemd_unit(spec)
    exposure, table = analyze_unit(unit, tmp_path)
    assert exposure <= EXPOSURE_MAX, table
    assert unit_lines(unit, "StateDirectory") == ["hotfit"] and unit_lines(unit, "ProtectHome") == ["yes"]
    assert unit_lines(unit, "DeviceAllow") == [*GPU_DEVICE_ALLOW[kind]]
    if kind == "vulkan":
        assert "char-drm rw" in unit_lines(unit, "DeviceAllow")
        assert unit_lines(unit, "SupplementaryGroups") == ["render video"]


def test_the_old_unit_was_unsafe_so_the_check_can_fail(tmp_path: Path) -> None:
    """The check above can fail: the unit hotfit printed before it ran as root, unhardened."""
    old = ("[Unit]\nDescription=x\nAfter=network-online.target\n\n[Service]\nType=exec\n"
           f"ExecStart={sys.executable} -m hotfit serve\nRestart=on-failure\nRestartSec=5\n"
           "RestartPreventExitStatus=3\n\n[Install]\nWantedBy=multi-user.target\n")
    exposure, _ = analyze_unit(old, tmp_path)
    assert exposure > EXPOSURE_MAX


def test_a_home_under_home_dirs_is_read_only_except_itself(tmp_path: Path) -> None:
    spec = UnitSpec(hotfit_argv=[sys.executable, "serve"], env={}, description="d", user="alice",
                    home=Path("/home/alice/.local/share/hotfit"), device_kind="cpu")
    unit = systemd_unit(spec)
    assert unit_lines(unit, "ProtectHome") == ["read-only"]
    assert unit_lines(unit, "ReadWritePaths") == ["/home/alice/.local/share/hotfit"]
    exposure, table = analyze_unit(unit, tmp_path)
    assert exposure <= EXPOSURE_MAX, table


def systemd_reading(unit_text: str, where: Path) -> dict[str, list[str]]:
    """What systemd itself parsed from the unit: the settings ``systemd-analyze verify`` dumps at debug
    level (after its quoting, escapes and specifier expansion), as key -> values; verify must be clean."""
    tool, unit = verified_unit(unit_text, where)
    run = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "SYSTEMD_LOG_LEVEL": "debug"})
    reading: dict[str, list[str]] = {}
    for line in run.stdout.splitlines():  # the unit's dump (the debug log goes to stderr)
        found = re.match(r"^\t\t\t?([A-Za-z ]+): (.*)$", line)
        if found:
            reading.setdefault(found.group(1), []).append(found.group(2))
    return reading


# a home a person may well type: a space, a percent sign (systemd's specifier prefix: %h is the home
# of the unit's user), a dollar (ExecStart's variable prefix), a backslash and a double quote
AWKWARD_HOME_NAME = 'hot fit %h 50% $HOME \\x "q"'


def test_unit_quotes_and_escapes_a_home_with_spaces_and_percent(tmp_path: Path) -> None:
    """systemd reads the home back as written: one ReadWritePaths= path (not three, the relative ones
    ignored under ProtectSystem=strict), no specifier expanded, the same --home argument in ExecStart.
    Checked against systemd's own parse (systemd.exec, systemd.unit "Specifiers", systemd.syntax "Quoting")."""
    root = tmp_path / "root"
    home = root / AWKWARD_HOME_NAME
    tools = root / "bin %n" / "hotfit"  # the executable itself under an awkward name: verify checks it exists
    tools.parent.mkdir(parents=True)
    tools.write_text("#!/bin/sh\n")
    tools.chmod(0o755)
    spec = UnitSpec(hotfit_argv=[str(tools), "--home", str(home), "serve"],
                    env={"A": "b %i $HOME c", "CONTENOX_LLAMA_KV_CACHE_TYPE": "q8_0"}, description="hotfit 100%",
                    user="hotfit", home=home, device_kind="cpu")
    unit = systemd_unit(spec)
    reading = systemd_reading(unit, tmp_path / "unit")
    assert reading["ReadWritePaths"] == [str(home)]
    assert reading["Environment"] == ["A=b %i $HOME c", "CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0"]
    # the dump shows ExecStart as it stands before run time, shell-quoted: "\\$\\$" is "$$", which
    # systemd.service's "Command lines" turn into one literal "$" when the service starts
    argv = [word.replace("\\$\\$", "$") for word in shlex.split(reading["Command Line"][0])]
    assert argv == spec.hotfit_argv
    assert reading["Description"] == ["hotfit 100%"]

    # a home under /var/lib is the StateDirectory= (a path relative to /var/lib), read back the same;
    # one whose name StateDirectory= cannot hold (a backslash, quote or colon) is a ReadWritePaths=
    spaced = "hot fit %h 50% $HOME 'q'"
    state_unit = systemd_unit(dataclasses.replace(spec, home=Path("/var/lib") / spaced))
    assert systemd_reading(state_unit, tmp_path / "state")["StateDirectory"] == [spaced]
    state_unit = systemd_unit(dataclasses.replace(spec, home=Path("/var/lib") / AWKWARD_HOME_NAME))
    reading = systemd_reading(state_unit, tmp_path / "state-rw")
    assert reading["ReadWritePaths"] == [f"/var/lib/{AWKWARD_HOME_NAME}"] and "StateDirectory" not in reading


def test_unit_refuses_a_home_systemd_cannot_name(tmp_path: Path) -> None:
    spec = UnitSpec(hotfit_argv=[sys.executable, "serve"], env={}, description="d", user="hotfit",
                    home=tmp_path / "line\nbreak", device_kind="cpu")
    with pytest.raises(UsageError) as refused:
        systemd_unit(spec)
    assert "line\\nbreak" in str(refused.value) and refused.value.hint


def test_unit_user_is_named_or_the_homes_owner_never_root(provisioned_home: dict, tmp_path: Path) -> None:
    assert unit_user(tmp_path, "svc") == "svc"
    owner = tmp_path.stat().st_uid
    expected = "hotfit" if owner == 0 else __import__("pwd").getpwuid(owner).pw_name
    assert unit_user(tmp_path, None) == expected != "root"
    code, out = cli(provisioned_home["home"], "serve", "--json", "--print-command", "--unit-user", "svc")
    assert code == 2 and "--print-systemd-unit" in json.loads(out)["error"]["hint"]


# ----------------------------------------------------------------------------- NFD labels, Kubernetes


def test_status_writes_nfd_features_atomically(provisioned_home: dict, tmp_path: Path) -> None:
    features = tmp_path / "features.d" / "hotfit"
    code, out = cli(provisioned_home["home"], "status", "--json", "--nfd-features", str(features))
    assert code == 0, out
    lines = [line for line in features.read_text().splitlines() if not line.startswith("#")]
    labels = dict(line.split("=", 1) for line in lines)
    assert labels == {"hotfit.io/provisioned": "true", "hotfit.io/model": "fx-agent", "hotfit.io/context": "49152",
                      "hotfit.io/kv-type": "q8_0", "hotfit.io/backend": "llama", "hotfit.io/device": "nvidia"}
    assert json.loads(out)["nfd_features"]["labels"] == labels
    assert all(LABEL_VALUE.match(v) and len(v) <= 63 for v in labels.values())
    assert [p.name for p in features.parent.iterdir()] == ["hotfit"]  # no temporary file left beside it

    # nothing provisioned: the model labels are withdrawn (NFD drops labels a file no longer names)
    code, _ = cli(tmp_path / "empty-home", "status", "--nfd-features", str(features))
    assert code == 0
    assert [ln for ln in features.read_text().splitlines() if not ln.startswith("#")] == ["hotfit.io/provisioned=false"]


def test_nfd_features_into_an_unwritable_place_names_the_file(provisioned_home: dict, tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    code, out = cli(provisioned_home["home"], "status", "--json", "--nfd-features", str(blocker / "hotfit"))
    assert code == 2
    assert str(blocker / "hotfit") in json.loads(out)["error"]["message"]


@pytest.mark.parametrize("name", ["Qwen3 8B (Q4_K_M)", "-x-", "a" * 80, "gemma-3-12b-it@q8_0"])
def test_label_values_are_valid_kubernetes_label_values(name: str) -> None:
    value = label_value(name)
    assert LABEL_VALUE.match(value) and len(value) <= 63 and value


def test_nfd_labels_withdraw_a_damaged_provisioning(provisioned_home: dict) -> None:
    assert nfd_labels(provisioned_home["manifest"], ["model file missing"]) == {"hotfit.io/provisioned": "false"}


def kubernetes_validate(path: Path) -> subprocess.CompletedProcess[str]:
    tool = require_tool("kubernetes-validate", "kubernetes-validate (PyPI)")
    return subprocess.run([tool, "--strict", str(path)], capture_output=True, text=True, timeout=120)


def test_kubernetes_job_is_valid_and_publishes_the_nfd_file(tmp_path: Path) -> None:
    job_path = RECIPES / "kubernetes" / "hotfit-job.yaml"
    done = kubernetes_validate(job_path)
    assert done.returncode == 0, done.stdout + done.stderr
    text = job_path.read_text()
    # per node: the documented substitution gives another valid Job pinned to that node
    other = tmp_path / "job.yaml"
    other.write_text(text.replace("gpu-node-1", "worker-7"))
    done = kubernetes_validate(other)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "kubernetes.io/hostname: worker-7" in other.read_text()
    # the Job writes NFD's features.d file through hotfit, into the mounted features.d directory
    assert "--nfd-features /etc/kubernetes/node-feature-discovery/features.d/hotfit" in text
    assert "mountPath: /etc/kubernetes/node-feature-discovery/features.d" in text
    # a broken Job fails the check, so the check means something
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace("restartPolicy: Never", "restartPolicy: Never\n      restartPolicyy: x"))
    assert kubernetes_validate(broken).returncode != 0


# ----------------------------------------------------------------------------- cloud-init


def cloud_init_schema(path: Path) -> subprocess.CompletedProcess[str]:
    tool = require_tool("cloud-init", "cloud-init (Debian)")
    return subprocess.run([tool, "schema", "--config-file", str(path)], capture_output=True, text=True, timeout=120)


def test_cloud_init_user_data_is_valid(tmp_path: Path) -> None:
    user_data = RECIPES / "cloud-init" / "user-data.yaml"
    done = cloud_init_schema(user_data)
    assert done.returncode == 0 and "Valid cloud-config" in done.stdout, done.stdout + done.stderr
    text = user_data.read_text()
    assert text.startswith("#cloud-config\n")
    # it provisions as the service account and installs the unit hotfit prints
    assert "hotfit -q auto" in text and "serve --print-systemd-unit > /etc/systemd/system/hotfit.service" in text
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace("package_update: true", "package_update: maybe"))
    assert cloud_init_schema(broken).returncode != 0


# ----------------------------------------------------------------------------- Ansible


def ansible_playbook(hub: LocalHub, world: World, home: Path, probe: Path, tmp_path: Path, server: Path | None,
                     *auto_args: str) -> tuple[int, dict[str, Any]]:
    """Run recipes/ansible/hotfit.yml on localhost for real; its json-callback report."""
    tool = require_tool("ansible-playbook", "ansible-core (PyPI)")
    extra = {
        "hotfit_command": [sys.executable, "-m", "hotfit"],
        "hotfit_home": str(home),
        "hotfit_auto_args": ["--registry", str(world.registry_path), "--probe-file", str(probe), *auto_args],
        "hotfit_environment": hub.env() | ({"HOTFIT_LLAMA_SERVER": str(server)} if server else {}),
        "hotfit_fact_path": str(tmp_path / "facts.d"),
        "ansible_python_interpreter": sys.executable,
    }
    vars_file = tmp_path / "vars.json"
    vars_file.write_text(json.dumps(extra))
    env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HOTFIT_LLAMA_SERVER")}
    report_path = tmp_path / "ansible-report.json"
    report_path.unlink(missing_ok=True)
    env |= {"ANSIBLE_CALLBACK_PLUGINS": str(Path(__file__).parent / "ansible_plugins"),
            "ANSIBLE_CALLBACKS_ENABLED": "result_file", "HOTFIT_ANSIBLE_REPORT": str(report_path),
            "ANSIBLE_HOME": str(tmp_path / "ansible-home"),
            "ANSIBLE_LOCAL_TEMP": str(tmp_path / "ansible-tmp"), "ANSIBLE_NOCOLOR": "1",
            "ANSIBLE_RETRY_FILES_ENABLED": "0", "PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"}
    done = subprocess.run([tool, "-c", "local", "-i", "localhost,", str(RECIPES / "ansible" / "hotfit.yml"),
                           "-e", f"@{vars_file}"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    if not report_path.exists():
        raise AssertionError(f"ansible-playbook wrote no report (rc {done.returncode}): "
                             f"{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return done.returncode, json.loads(report_path.read_text())


def task_results(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Task name -> localhost's result (with ``failed``)."""
    return {t["task"]: t["result"] | {"failed": t["failed"]} for t in report["tasks"] if t["host"] == "localhost"}


AUTO_TASK = "Run hotfit auto (a no-op while the provisioned model still fits)"
FAIL_TASK = "Fail with hotfit's exit code and message"
SHOW_TASK = "Show what is provisioned"


def test_ansible_refusal_fails_the_host_with_hotfits_exit_code_and_message(hub: LocalHub, plain_world: World,
                                                                         tmp_path: Path) -> None:
    home = tmp_path / "home"
    standin = write_standin_llama_server(tmp_path / "llama-server")
    tight = write_probe(tmp_path / "tight.json", plain_world.floor_free_bytes(LARGE) - 1)
    rc, report = ansible_playbook(hub, plain_world, home, tight, tmp_path, standin, "--model", LARGE)
    assert rc != 0
    results = task_results(report)
    assert results[AUTO_TASK]["rc"] == 3 and results[AUTO_TASK]["changed"] is False
    failed = results[FAIL_TASK]
    assert failed["failed"] is True
    assert "hotfit auto exited 3:" in failed["msg"] and LARGE in failed["msg"]
    assert report["stats"]["localhost"]["failures"] == 1, [(t["task"], t["failed"], t["result"].get("msg")) for t in report["tasks"]]
    # the facts are refreshed even so: the last run failed, nothing provisioned
    shown = results[SHOW_TASK]["msg"]
    assert shown["last_run"] == "failed" and shown["model"] is None


@pytest.mark.llama
def test_ansible_provisions_changed_then_unchanged_with_local_facts(hub: LocalHub, world: World,
                                                                  tmp_path: Path) -> None:
    home = tmp_path / "home"
    roomy = write_probe(tmp_path / "roomy.json", 8 * GiB)
    rc, report = ansible_playbook(hub, world, home, roomy, tmp_path, None)
    results = task_results(report)
    assert rc == 0, results
    assert results[AUTO_TASK]["changed"] is True and results[AUTO_TASK]["rc"] == 0
    shown = results[SHOW_TASK]["msg"]
    assert shown["model"] == LARGE and shown["last_run"] == "done"
    assert int(shown["context_tokens"]) >= 32768 and shown["kv_cache_type"] == "f16"
    facts = results["Read the local facts again"]["ansible_facts"]["ansible_local"]["hotfit"]
    assert facts["provisioned"]["entry_name"] == LARGE and facts["home"] == str(home)

    rc, report = ansible_playbook(hub, world, home, roomy, tmp_path, None)
    results = task_results(report)
    assert rc == 0 and results[AUTO_TASK]["changed"] is False  # hotfit's no-op
    assert json.loads(results[AUTO_TASK]["stdout"])["noop"] is True
    assert report["stats"]["localhost"]["changed"] == 0  # and the fact file is already in place
