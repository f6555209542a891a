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
import functools
import hashlib
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

from hotfit.core import errors
from hotfit.core.errors import UsageError
from hotfit.planner.probe import Device, ProbeResult
from hotfit.pipeline.cli import main
from hotfit.pipeline.systemd_unit import GPU_DEVICE_ALLOW, PERMANENT_EXIT_CODES, UnitSpec, systemd_unit, unit_user
from hotfit.pipeline.status import label_value, nfd_labels
from tests.e2e_support import LARGE, GiB, World, write_probe, write_provisioned_home
from tests.gguf_fixtures import tool_template_text, write_standin_llama_server
from tests.hubserver import LocalHub

TIER = "integration"

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
                                        uuid="GPU-8a1c2f0e-0000-4000-8000-000000000001"),))
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


def pod_failure_action(job: dict[str, Any], container: str, exit_code: int) -> str:
    """What Kubernetes does with a pod of ``job`` whose ``container`` exited ``exit_code``: the first
    podFailurePolicy rule that matches (onExitCodes, In / NotIn), else Count (the Job's back-off)."""
    for rule in job["spec"].get("podFailurePolicy", {}).get("rules", []):
        codes = rule.get("onExitCodes")
        if codes is None or codes.get("containerName", container) != container:
            continue
        if (exit_code in codes["values"]) == (codes["operator"] == "In"):
            return str(rule["action"])
    return "Count"


def test_kubernetes_job_retries_a_passing_fault_and_stops_on_a_permanent_one() -> None:
    (job,) = __import__("yaml").safe_load_all((RECIPES / "kubernetes" / "hotfit-job.yaml").read_text())
    (container,) = job["spec"]["template"]["spec"]["containers"]
    act = functools.partial(pod_failure_action, job, container["name"])
    # before: 4 covered a network blip too, and the Job failed for good on it
    assert act(errors.TransientTransferError.exit_code) == act(errors.HubUnreachable.exit_code) == "Count"
    assert act(errors.LockedError.exit_code) == act(errors.HardwareProbeError.exit_code) == "Count"
    for permanent in (errors.UsageError, errors.NoModelQualifies, errors.IntegrityError, errors.PinMismatch,
                      errors.DiskSpaceError, errors.BackendNotFound):
        assert act(permanent.exit_code) == "FailJob", permanent.__name__
    assert job["spec"]["backoffLimit"] >= 3


def test_kubernetes_serve_daemonset_runs_hotfit_serve_where_the_job_labelled(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = RECIPES / "kubernetes" / "hotfit-serve.yaml"
    done = kubernetes_validate(path)
    assert done.returncode == 0, done.stdout + done.stderr
    docs = {d["kind"]: d for d in __import__("yaml").safe_load_all(path.read_text())}
    pod = docs["DaemonSet"]["spec"]["template"]["spec"]
    # a home as the Job leaves it (a CPU plan: the stand-in llama-server is a CPU build)
    probe_file = write_probe(tmp_path / "probe.json", 8 * GiB)
    home = write_provisioned_home(tmp_path / "home", ProbeResult.decode(json.loads(probe_file.read_text())),
                                  template_text=tool_template_text()).home
    # scheduled on exactly the nodes the Job's features file labels provisioned
    code, _ = cli(home, "status", "--nfd-features", str(tmp_path / "hotfit"))
    assert code == 0
    written = dict(ln.split("=", 1) for ln in (tmp_path / "hotfit").read_text().splitlines() if "=" in ln)
    assert pod["nodeSelector"].items() <= written.items()
    (container,) = pod["containers"]
    command = container["command"]
    # hotfit's own parser accepts the command (on a provisioned home, with the key file in place)
    key = tmp_path / "api-key"
    key.write_text("k" * 32)
    monkeypatch.setenv("HOTFIT_LLAMA_SERVER", str(write_standin_llama_server(tmp_path / "llama-server")))
    argv = [str(home) if a == "/var/lib/hotfit" else str(key) if a == "/etc/hotfit/api-key"
            else a for a in command[1:]]
    out = io.StringIO()
    assert main([*argv, "--print-command", "--probe-file", str(probe_file)], out=out) == 0
    port = command[command.index("--port") + 1]
    assert f"--port {port}" in out.getvalue() and "--host 0.0.0.0" in out.getvalue()
    (named,) = container["ports"]
    assert named["containerPort"] == int(port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": named["name"]}, probe
    # the home the Job provisioned, and a headless Service: one address per node (models differ)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["home"]["hostPath"]["path"] == mounts["home"] == "/var/lib/hotfit"
    assert docs["Service"]["spec"]["clusterIP"] == "None"
    assert docs["Service"]["spec"]["selector"] == docs["DaemonSet"]["spec"]["selector"]["matchLabels"]


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
    # what it runs is run below (test_cloud_init_cron_keeps_every_setting_…)
    broken = tmp_path / "broken.yaml"
    broken.write_text(text.replace("package_update: true", "package_update: maybe"))
    assert cloud_init_schema(broken).returncode != 0


STANDIN_HOTFIT = """#!/bin/sh
# stand-in for hotfit: records its argv and the settings it was given; auto exits with the code
# in $RECIPE_TEST/auto-rc; serve --print-systemd-unit prints a unit naming the KV type it saw
log="$RECIPE_TEST/hotfit.log"
printf '%s\\t%s\\t%s\\t%s\\t%s\\n' "$*" "${HF_ENDPOINT:-}" "${CONTENOX_LLAMA_KV_CACHE_TYPE:-}" \\
  "${HTTPS_PROXY:-}" "${HOTFIT_LLAMA_CACHE:-}" >> "$log"
case "$*" in
  *" auto"*) exit "$(cat "$RECIPE_TEST/auto-rc")" ;;
  *"--print-systemd-unit"*) printf '[Service]\\nEnvironment=CONTENOX_LLAMA_KV_CACHE_TYPE=%s\\n' \\
       "${CONTENOX_LLAMA_KV_CACHE_TYPE:-f16}" ;;
esac
"""
RECORDER = """#!/bin/sh
# stand-in: records its name and argv
printf '%s %s\\n' "$(basename "$0")" "$*" >> "$RECIPE_TEST/calls.log"
"""


class CloudInitNode:
    """The files cloud-init writes from the user-data, under a scratch root instead of /, and the
    commands this container cannot run for real (no systemd as PID 1, no service account, no git
    server) as recording stand-ins; the shell programs themselves run for real with /bin/sh."""

    ROOTED = re.compile(r"(?<![\w.])/(etc|opt|usr/local/sbin|var)/")

    def __init__(self, where: Path, settings: str) -> None:
        self.where = where
        self.root = where / "root"
        self.bin = where / "bin"
        self.bin.mkdir(parents=True)
        for there in ("var/log", "etc/systemd/system"):  # on every Debian machine
            (self.root / there).mkdir(parents=True)
        user_data = __import__("yaml").safe_load((RECIPES / "cloud-init" / "user-data.yaml").read_text())
        self.files = {item["path"]: item for item in user_data["write_files"]}
        for path, item in self.files.items():
            target = self.rooted_path(path)
            target.parent.mkdir(parents=True, exist_ok=True)
            content = self.rooted(item["content"]) + (settings if path == "/etc/default/hotfit" else "")
            target.write_text(content)
            target.chmod(int(item["permissions"], 8))
        self.runcmd = user_data["runcmd"]
        for name in ("git", "runuser", "systemctl", "install"):
            tool = self.bin / name
            tool.write_text(RECORDER + {"git": 'mkdir -p "$6/.git"\n', "runuser": 'shift 3; exec "$@"\n',
                                        "install": "", "systemctl": ""}[name])
            tool.chmod(0o755)
        hotfit = self.root / "opt/hotfit/.venv/bin/hotfit"
        hotfit.parent.mkdir(parents=True)
        hotfit.write_text(STANDIN_HOTFIT)
        installer = self.root / "opt/hotfit/scripts/install-llama-server"
        installer.parent.mkdir(parents=True)
        installer.write_text(RECORDER)
        for made in (hotfit, installer):
            made.chmod(0o755)

    def rooted(self, text: str) -> str:
        return self.ROOTED.sub(lambda m: f"{self.root}/{m.group(1)}/", text)

    def rooted_path(self, path: str) -> Path:
        return self.root / path.lstrip("/")

    def env(self) -> dict[str, str]:
        return {"PATH": f"{self.bin}:/usr/bin:/bin", "RECIPE_TEST": str(self.where), "HOME": str(self.where)}

    def run(self, argv: list[str], env: dict[str, str], auto_rc: int) -> subprocess.CompletedProcess[str]:
        (self.where / "auto-rc").write_text(str(auto_rc))
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)

    def first_boot(self, auto_rc: int) -> subprocess.CompletedProcess[str]:
        (command,) = self.runcmd
        return self.run([self.rooted(part) for part in command], self.env(), auto_rc)

    def cron(self, auto_rc: int) -> subprocess.CompletedProcess[str]:
        """The cron entry as cron runs it: its user field, its variables (SHELL, PATH; the stand-ins
        first on PATH), ``$SHELL -c`` on the command, and nothing else of this environment."""
        lines = [ln for ln in self.rooted(self.files["/etc/cron.d/hotfit"]["content"]).splitlines()
                 if ln.strip() and not ln.startswith("#")]
        env = self.env()
        for line in lines:
            if re.match(r"^[A-Z_]+=", line):
                name, value = line.split("=", 1)
                env[name] = value if name != "PATH" else f"{self.bin}:{value}"
        (entry,) = [ln for ln in lines if not re.match(r"^[A-Z_]+=", ln)]
        fields = entry.split(None, 6)
        assert fields[5] == "root", "the provisioning installs a unit: it runs as root"
        return self.run([env["SHELL"], "-c", fields[6]], env, auto_rc)

    def hotfit_calls(self) -> list[list[str]]:
        log = self.where / "hotfit.log"
        return [line.split("\t") for line in log.read_text().splitlines()] if log.exists() else []

    def calls(self) -> list[str]:
        log = self.where / "calls.log"
        return log.read_text().splitlines() if log.exists() else []

    @property
    def unit(self) -> Path:
        return self.rooted_path("/etc/systemd/system/hotfit.service")


MIRROR_SETTINGS = ("HF_ENDPOINT=https://mirror.example.internal\n"
                   "HOTFIT_BUILD_URL=https://mirror.example.internal/builds/llama-server-cpu.tar.gz\n"
                   "CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0\nHTTPS_PROXY=http://proxy.example.internal:3128\n"
                   'HOTFIT_SERVE_ARGS="--host 0.0.0.0 --api-key-file /etc/hotfit/api-key"\n')


def test_cloud_init_cron_keeps_every_setting_and_installs_the_unit_a_failed_first_boot_left_out(
        tmp_path: Path) -> None:
    node = CloudInitNode(tmp_path, MIRROR_SETTINGS)
    # first boot: a network blip makes auto fail (11): no unit, nothing started
    boot = node.first_boot(auto_rc=11)
    assert boot.returncode == 11, boot.stdout + boot.stderr
    assert not node.unit.exists() and not [c for c in node.calls() if c.startswith("systemctl")]
    # the build came from the mirror (no compiler), once
    assert node.calls().count(f"install-llama-server --from {MIRROR_SETTINGS.split()[1].split('=', 1)[1]}") == 1

    # the daily cron run, as cron runs it: every setting reaches hotfit, and the unit is installed
    cron = node.cron(auto_rc=0)
    assert cron.returncode == 0, cron.stdout + cron.stderr
    auto = [c for c in node.hotfit_calls() if c[0].endswith(" -q auto")][-1]
    assert auto[1:] == ["https://mirror.example.internal", "q8_0", "http://proxy.example.internal:3128",
                        f"{node.root}/opt/hotfit-cache/llama.cpp"], auto
    assert "Environment=CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0" in node.unit.read_text()
    printed = [c[0] for c in node.hotfit_calls() if "--print-systemd-unit" in c[0]][-1]
    assert printed.endswith("serve --print-systemd-unit --host 0.0.0.0 --api-key-file /etc/hotfit/api-key")
    systemctl = [c for c in node.calls() if c.startswith("systemctl")]
    assert systemctl == ["systemctl daemon-reload", "systemctl enable hotfit.service",
                         "systemctl restart hotfit.service"]
    assert [c for c in node.calls() if c.startswith("install-llama-server")] == [
        node.calls()[[c.startswith("install-llama-server") for c in node.calls()].index(True)]]  # not again

    # the next day: nothing changed, the service is kept running and not restarted
    again = node.cron(auto_rc=0)
    assert again.returncode == 0, again.stdout + again.stderr
    assert [c for c in node.calls() if c.startswith("systemctl")][3:] == ["systemctl enable --now hotfit.service"]


def test_cloud_init_without_a_mirror_builds_here(tmp_path: Path) -> None:
    node = CloudInitNode(tmp_path, "")
    bootstrap = node.root / "opt/hotfit/scripts/bootstrap"
    bootstrap.write_text(RECORDER)
    bootstrap.chmod(0o755)
    boot = node.first_boot(auto_rc=0)
    assert boot.returncode == 0, boot.stdout + boot.stderr
    assert "bootstrap " in node.calls() and not [c for c in node.calls() if c.startswith("install-llama-server")]
    assert node.unit.exists()


# ----------------------------------------------------------------------------- Ansible


def ansible_playbook(hub: LocalHub, world: World, home: Path, probe: Path, tmp_path: Path, server: Path | None,
                     *auto_args: str) -> tuple[int, dict[str, Any]]:
    """Run recipes/ansible/hotfit.yml on localhost for real; its json-callback report."""
    extra = {
        "hotfit_command": [sys.executable, "-m", "hotfit"],
        "hotfit_home": str(home),
        "hotfit_auto_args": ["--registry", str(world.registry_path), "--probe-file", str(probe), *auto_args],
        "hotfit_environment": hub.env() | ({"HOTFIT_LLAMA_SERVER": str(server)} if server else {}),
        "hotfit_fact_path": str(tmp_path / "facts.d"),
        "ansible_python_interpreter": sys.executable,
    }
    return run_playbook(RECIPES / "ansible" / "hotfit.yml", extra, tmp_path)


def run_playbook(playbook: Path, extra: dict[str, Any], tmp_path: Path, *args: str) -> tuple[int, dict[str, Any]]:
    """``ansible-playbook -c local -i localhost,`` on ``playbook`` with ``extra`` vars; the report."""
    tool = require_tool("ansible-playbook", "ansible-core (PyPI)")
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
    done = subprocess.run([tool, "-c", "local", "-i", "localhost,", str(playbook), "-e", f"@{vars_file}", *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
                          stdin=subprocess.DEVNULL)  # ansible refuses a non-blocking stdin
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


# ----------------------------------------------------------------------------- Ansible: the fleet flow

FLEET_PLAYBOOK = RECIPES / "ansible" / "hotfit-fleet.yml"


def fleet_commands_exist() -> bool:
    return main(["fleet", "plan", "--help"], out=io.StringIO()) == 0


def plan_row_from_hotfit_plan(probe: Path, name: str, plan_args: list[str]) -> dict[str, Any]:
    """Where `hotfit fleet plan` is not on this branch: one machine's row in its documented shape
    (docs/recipes.md), from `hotfit plan` on the gathered probe — the rules fleet plan applies."""
    out = io.StringIO()
    code = main(["--json", "plan", "--probe-file", str(probe), *plan_args], out=out)
    planned = json.loads(out.getvalue())
    chosen = planned.get("selected")
    return {"name": name, "probe_file": str(probe), "status": "planned" if code == 0 and chosen else "refused",
            "reason": None if chosen else planned["error"]["message"].splitlines()[0],
            "model": chosen and chosen["name"], "kv_cache_type": planned.get("kv_cache_type"),
            "hot_context_tokens": chosen and planned["budget"]["hot_context_tokens"], "build": None}


def fleet_flow(hub: LocalHub, world: World, tmp_path: Path, server: Path | None, plan_args: list[str], *,
               mirror: Path | None = None) -> tuple[dict[str, Any], dict[str, Any], int, dict[str, Any]]:
    """The playbook's three plays on localhost: probe (real), plan (real where `hotfit fleet` exists),
    provision (real, the local Hub standing for the fleet's mirror). The plan row, and the
    provision play's rc and report."""
    fleet_dir = tmp_path / "fleet"
    extra = {"hotfit_command": [sys.executable, "-m", "hotfit"], "hotfit_controller_command": [sys.executable, "-m",
                                                                                                "hotfit"],
             "hotfit_home": str(tmp_path / "home"), "hotfit_probe_file": str(tmp_path / "probe.json"),
             "hotfit_fleet_dir": str(fleet_dir), "hotfit_plan_args": plan_args,
             "hotfit_mirror_url": hub.endpoint, "hotfit_transient_delay_s": 0,
             "hotfit_mirror_dir": str(mirror) if mirror else "", "hotfit_controller_environment": hub.env(),
             "hotfit_mirror_args": ["--registry", str(world.registry_path)],
             "hotfit_environment": {k: v for k, v in hub.env().items() if k != "HF_ENDPOINT"}
             | ({"HOTFIT_LLAMA_SERVER": str(server)} if server else {}),
             "ansible_python_interpreter": sys.executable}
    rc, report = run_playbook(FLEET_PLAYBOOK, extra, tmp_path, "--tags", "probe")
    assert rc == 0, [(t["task"], t["result"].get("msg")) for t in report["tasks"]]
    gathered = fleet_dir / "probes" / "localhost.json"
    assert ProbeResult.decode(json.loads(gathered.read_text())).devices  # this machine's real probe
    if fleet_commands_exist():
        rc, report = run_playbook(FLEET_PLAYBOOK, extra, tmp_path, "--tags", "plan")
        assert rc == 0, [(t["task"], t["result"].get("msg"), t["result"].get("stdout", "")[-1500:],
                          t["result"].get("stderr", "")[-1500:]) for t in report["tasks"] if t["failed"]]
    else:  # said in docs/recipes.md: the plan play was not run on this branch
        (fleet_dir / "plan.json").write_text(json.dumps(
            {"machines": [plan_row_from_hotfit_plan(gathered, "localhost", plan_args)]}))
    (row,) = json.loads((fleet_dir / "plan.json").read_text())["machines"]
    hub.reset_counters()
    rc, report = run_playbook(FLEET_PLAYBOOK, extra, tmp_path, "--tags", "provision")
    return row, extra, rc, report


def test_ansible_fleet_flow_provisions_the_planned_model_from_the_mirror(hub: LocalHub, plain_world: World,
                                                                        tmp_path: Path) -> None:
    """Without a real llama-server: the host gets the planned model from the mirror, and fails at
    load with hotfit's exit code (the stand-in cannot serve)."""
    standin = write_standin_llama_server(tmp_path / "llama-server")
    plan_args = ["--registry", str(plain_world.registry_path), "--kv-cache-type", "q8_0"]
    row, _, rc, report = fleet_flow(hub, plain_world, tmp_path, standin, plan_args)
    assert row["status"] == "planned" and row["kv_cache_type"] == "q8_0", row
    results = task_results(report)
    assert rc != 0 and results["Provision the planned model at the planned KV type from the mirror"]["rc"] == 5
    assert "hotfit auto exited 5:" in results[FAIL_TASK]["msg"]
    planned = plain_world.entry(row["model"])
    fetched = {r.file for r in hub.requests_for(method="GET")}
    assert planned.artifact.file in fetched, fetched  # from the mirror the play pointed HF_ENDPOINT at
    assert "Refuse a host the plan refused (the plan's reason)" not in [
        t["task"] for t in report["tasks"] if t["failed"]]


def test_ansible_fleet_flow_refuses_a_host_the_plan_refused(hub: LocalHub, plain_world: World,
                                                          tmp_path: Path) -> None:
    # an origin no fixture entry has: the plan refuses, the host fails with its reason, auto never runs
    plan_args = ["--registry", str(plain_world.registry_path), "--origin", "china"]
    row, _, rc, report = fleet_flow(hub, plain_world, tmp_path, None, plan_args)
    assert row["status"] == "refused" and row["reason"], row
    results = task_results(report)
    refused = results["Refuse a host the plan refused (the plan's reason)"]
    assert rc != 0 and refused["failed"] and row["reason"] in refused["msg"]
    assert "Provision the planned model at the planned KV type from the mirror" not in results
    assert hub.requests_for(method="GET") == []


@pytest.mark.llama
def test_ansible_fleet_flow_provisions_then_is_a_noop(hub: LocalHub, world: World, tmp_path: Path) -> None:
    """Where `hotfit fleet` exists the plan play also fills a mirror directory once from the Hub
    (`hotfit fleet mirror`, for real). The host then provisions from the Hub-protocol endpoint: a
    plain static server of that directory refuses the fixture registry's template, which is not
    pinned by size and sha256 (docs/recipes.md)."""
    plan_args = ["--registry", str(world.registry_path), "--kv-cache-type", "q8_0"]
    mirror = tmp_path / "mirror"
    row, extra, rc, report = fleet_flow(hub, world, tmp_path, None, plan_args,
                                        mirror=mirror if fleet_commands_exist() else None)
    if fleet_commands_exist():
        assert list(mirror.rglob("*.gguf")), "the plan play filled no mirror"
    results = task_results(report)
    auto = results["Provision the planned model at the planned KV type from the mirror"]
    assert rc == 0 and auto["changed"] is True, results
    status = io.StringIO()
    assert main(["--home", extra["hotfit_home"], "--json", "status"], out=status) == 0
    provisioned = json.loads(status.getvalue())["provisioned"]
    assert provisioned["entry_name"] == row["model"] and provisioned["kv_cache_type"] == "q8_0"
    hub.reset_counters()
    rc, report = run_playbook(FLEET_PLAYBOOK, extra, tmp_path, "--tags", "provision")
    auto = task_results(report)["Provision the planned model at the planned KV type from the mirror"]
    assert rc == 0 and auto["changed"] is False and hub.requests_for(method="GET") == []


def test_cloud_init_takes_llama_server_from_nginx_serving_the_fleet_mirror(tmp_path: Path) -> None:
    """The recipe's `--from "$HOTFIT_BUILD_URL"` for real: a real export (install-llama-server
    --export) placed by `hotfit fleet mirror --builds`, Debian's nginx serving the mirror on
    loopback, and the provision script running the real install-llama-server: the build is
    downloaded, checked against the sha256 the mirror wrote beside it, installed without a compiler,
    and not fetched again by the daily run. A checksum the archive does not match installs nothing."""
    from hotfit.core.settings import LLAMA_SDIST_VERSION
    from tests.test_fleet_mirror import Nginx
    from tests.test_portable_build import _require_build

    _require_build("cpu")
    script = Path(__file__).resolve().parent.parent / "scripts" / "install-llama-server"
    exports = tmp_path / "exports"
    exports.mkdir()
    archive = exports / "llama-server-cpu.tar.gz"
    done = subprocess.run([str(script), "--backend", "cpu", "--export", str(archive)], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"machines": [], "builds": [
        {"flavour": "cpu", "export_command": "scripts/install-llama-server --backend cpu --export "
                                             "llama-server-cpu.tar.gz"}]}))
    mirror = tmp_path / "mirror"
    out = io.StringIO()
    assert main(["--home", str(tmp_path / "filler"), "--json", "fleet", "mirror", str(mirror), "--plan", str(plan),
                 "--builds", str(exports)], out=out) == 0
    assert [b["status"] for b in json.loads(out.getvalue())["builds"]] == ["placed"]
    nginx = Nginx(mirror, tmp_path / "nginx")
    try:
        url = f"{nginx.url}/builds/llama-server-cpu.tar.gz"
        node = CloudInitNode(tmp_path / "node", f"HOTFIT_BUILD_URL={url}\n")
        installer = node.root / "opt/hotfit/scripts/install-llama-server"
        installer.write_text(f'#!/bin/sh\nexec {shlex.quote(str(script))} "$@"\n')  # the real one
        boot = node.first_boot(auto_rc=0)
        assert boot.returncode == 0, boot.stdout + boot.stderr
        cache = node.root / "opt/hotfit-cache/llama.cpp"
        server = cache / LLAMA_SDIST_VERSION / "cpu" / "bin" / "llama-server"
        assert subprocess.run([str(server), "--version"], capture_output=True, timeout=60).returncode == 0
        assert (cache / ".installed-from").read_text().strip() == url
        assert not (cache / LLAMA_SDIST_VERSION / "work").exists()  # nothing compiled
        served = nginx.requests()
        assert "GET /builds/llama-server-cpu.tar.gz.sha256 200 auth=-" in served, served
        assert "GET /builds/llama-server-cpu.tar.gz 200 auth=-" in served, served
        assert node.unit.exists()
        cron = node.cron(auto_rc=0)  # the daily run: the build is in place, not fetched again
        assert cron.returncode == 0, cron.stdout + cron.stderr
        assert nginx.requests() == served

        # a mirror whose checksum the archive does not match: refused, nothing installed
        sums = mirror / "builds" / "llama-server-cpu.tar.gz.sha256"
        sums.write_text("0" * 64 + "  llama-server-cpu.tar.gz\n")
        other = CloudInitNode(tmp_path / "other", f"HOTFIT_BUILD_URL={url}\n")
        (other.root / "opt/hotfit/scripts/install-llama-server").write_text(installer.read_text())
        boot = other.first_boot(auto_rc=0)
        assert boot.returncode != 0 and "0" * 64 in boot.stderr, boot.stderr
        other_cache = other.root / "opt/hotfit-cache/llama.cpp"
        assert not (other_cache / LLAMA_SDIST_VERSION / "cpu").exists()
        assert not (other_cache / ".installed-from").exists() and not other.unit.exists()

        # HOTFIT_BUILD_SHA256 pins the build apart from the mirror: its checksum is not asked, and
        # the archive must match the pin
        true_sha = hashlib.sha256(archive.read_bytes()).hexdigest()
        for name, pin, installs in (("pinned", true_sha, True), ("mispinned", "1" * 64, False)):
            node = CloudInitNode(tmp_path / name, f"HOTFIT_BUILD_URL={url}\nHOTFIT_BUILD_SHA256={pin}\n")
            (node.root / "opt/hotfit/scripts/install-llama-server").write_text(installer.read_text())
            boot = node.first_boot(auto_rc=0)
            built = node.root / "opt/hotfit-cache/llama.cpp" / LLAMA_SDIST_VERSION / "cpu" / "bin" / "llama-server"
            assert (boot.returncode == 0) is installs and built.is_file() is installs, boot.stderr
    finally:
        nginx.stop()
