"""Faults of the home and its surroundings (docs/faults.md, docs/faults-state.md): the metrics that
cannot be written after a run, a home the kernel turns read-only mid-run, a hang-up, a copied home,
a certificate the Hub's client cannot trust.

Real parts where the fault is theirs: a tmpfs the test mounts (root), filled, or remounted read-only
while nothing is open; an ext4 image loop-mounted with ``errors=remount-ro`` whose error trigger turns
it read-only under a running ``hotfit`` — what the kernel does after a disk error (``mount -o
remount,ro`` refuses while a file is open for writing); the local Hub behind TLS with certificates
openssl makes. A mount the machine refuses skips, and fails under ``HOTFIT_REQUIRE_TOOLS``
(tests/test_fault_matrix_disk.skip_unless_required).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from hotfit.core.errors import CertificateError
from hotfit.planner.probe import ProbeResult
from hotfit.download.hub_errors import hub_error_from_hf_exception, is_retryable_hf_exception
from hotfit.core.settings import load_settings
from hotfit.pipeline.cli import main
from hotfit.pipeline.metrics import shared_textfile_name
from hotfit.state.store import SyncStateStore
from tests.e2e_support import LARGE, GiB, World, write_probe, write_provisioned_home, write_registry
from tests.gguf_fixtures import tool_template_text
from tests.test_auto_e2e import auto, env_for, events, sidecar_done_bytes, standin_server, start  # noqa: F401 - standin_server is a fixture
from tests.polling import wait_until
from tests.test_fault_matrix_disk import MiB, fill, skip_unless_required, tmpfs

TIER = "e2e"

REPO = Path(__file__).resolve().parent.parent


def hotfit(home: Path, *args: str, env: dict[str, str] | None = None,
           timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``hotfit --home HOME ARGS`` as a subprocess (what an operator's cron runs)."""
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", *args],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


def named(evs: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [e for e in evs if e.get("event") == name]


# --------------------------------------------------------------------------- metrics that cannot be written


@dataclasses.dataclass(frozen=True)
class NoopHome:
    """A provisioned home whose ``auto --model`` is a no-op (exit 0, no llama-server needed)."""

    home: Path
    argv: tuple[str, ...]


def noop_home(root: Path) -> NoopHome:
    root.mkdir(parents=True, exist_ok=True)
    probe = write_probe(root / "probe.json", 8 * GiB)
    made = write_provisioned_home(root / "home", ProbeResult.decode(json.loads(probe.read_text())),
                                  template_text=tool_template_text())
    registry = root / "registry.json"
    write_registry(registry, [dataclasses.replace(made.entry, auto_eligible=False, ineligible_cause="tool-parser",
                                                  ineligible_reason="test: provisioned by name")])
    return NoopHome(made.home, ("auto", "--registry", str(registry), "--probe-file", str(probe),
                                "--model", made.entry.name))


def test_a_full_home_when_auto_ends_keeps_exit_4_and_its_message(plain_world: World, hub: Any,
                                                                   tmp_path: Path) -> None:
    """The home's disk full: `auto` fails with the documented exit 4 and message; last-run.json and
    the textfile cannot be written either, which is one `metrics.unwritable` warning — not a second
    DiskSpaceError, a traceback and exit 1."""
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    with tmpfs(tmp_path / "fs", 2 * MiB) as fs:
        home = fs / "home"
        (home / "logs").mkdir(parents=True)
        fill(fs)
        done = hotfit(home, "auto", "--registry", str(plain_world.registry_path), "--probe-file", str(probe),
                      env=env_for(hub))
        assert done.returncode == 4, done.stderr[-3000:]
        assert "Traceback" not in done.stderr, done.stderr[-3000:]
        assert "hotfit: error: disk full writing" in done.stderr
        warnings = [json.loads(line) for line in done.stderr.splitlines()
                    if line.startswith("{") and '"metrics.unwritable"' in line]
        assert len(warnings) == 1, done.stderr[-3000:]
        assert str(home / "metrics" / "last-run.json") in warnings[0]["paths"]
        assert warnings[0]["exit_code"] == 4 and "disk full" in warnings[0]["error"]


@pytest.mark.parametrize("textfile_dir", ["a file", "a full filesystem"])
def test_an_unwritable_textfile_dir_after_a_successful_run_keeps_exit_0(textfile_dir: str, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """HOTFIT_TEXTFILE_DIR a regular file, or on a full filesystem: the run's exit code stands
    (docs/operations.md), the home's metrics are written, and one `metrics.unwritable` names the
    path that was not."""
    made = noop_home(tmp_path)
    with tmpfs(tmp_path / "node-exporter", 1 * MiB) as collector:
        if textfile_dir == "a file":
            target = collector / "textfile"
            target.write_text("not a directory\n")
        else:
            target = collector
            fill(collector)
        monkeypatch.setenv("HOTFIT_TEXTFILE_DIR", str(target))
        out = io.StringIO()
        assert main(["--home", str(made.home), "--log-format", "json", "--json", *made.argv], out=out) == 0
        assert json.loads(out.getvalue())["noop"] is True
        warnings = named(events(made.home), "metrics.unwritable")
        shared = target / shared_textfile_name(load_settings(home=str(made.home)))  # this home's own name there
        assert [w["paths"] for w in warnings] == [[str(shared)]], warnings
        assert warnings[0]["exit_code"] == 0 and warnings[0]["error"]
        written = (made.home / "metrics" / "hotfit.prom").read_text()
        assert re.search(r"^hotfit_last_run_exit_code(\{[^}]*\})? 0$", written, re.MULTILINE), written
        last = json.loads((made.home / "metrics" / "last-run.json").read_text())
        assert last["exit_code"] == 0 and last["outcome"] == "noop"
        assert [p.name for p in collector.iterdir() if p.name.endswith(".tmp")] == []  # no temp file left


# --------------------------------------------------------------------------- a home turned read-only mid-run


@contextlib.contextmanager
def ext4_image(where: Path, size_bytes: int) -> Iterator[Path]:
    """An ext4 filesystem in a file, loop-mounted at ``where`` with ``errors=remount-ro``: the mount a
    kernel turns read-only after a disk error (:func:`disk_error`). Root only; skips where refused,
    fails under HOTFIT_REQUIRE_TOOLS."""
    image = where.with_name(where.name + ".img")
    with open(image, "wb") as fh:
        fh.truncate(size_bytes)
    where.mkdir(parents=True, exist_ok=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, text=True)
    got = made if made.returncode else subprocess.run(
        ["mount", "-o", "loop,errors=remount-ro", str(image), str(where)], capture_output=True, text=True)
    if got.returncode != 0:
        skip_unless_required(f"cannot make and loop-mount an ext4 image here ({got.stderr.strip()}): a read-only "
                             "turn needs one (root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)
        image.unlink()


def disk_error(mountpoint: Path) -> None:
    """What a failing disk makes the kernel do: an ext4 error (its sysfs trigger), which under
    ``errors=remount-ro`` turns the mounted filesystem read-only at once — open files included,
    unlike ``mount -o remount,ro``, which refuses while a file is open for writing."""
    device = next(line.split()[0] for line in Path("/proc/mounts").read_text().splitlines()
                  if line.split()[1] == str(mountpoint))
    trigger = Path(f"/sys/fs/ext4/{Path(os.path.realpath(device)).name}/trigger_fs_error")
    if not trigger.exists():
        skip_unless_required(f"this kernel has no {trigger} (ext4's error trigger): no real read-only turn")
    trigger.write_text("hotfit test\n")
    with pytest.raises(OSError) as refused:  # the kernel says so (recent kernels: "emergency_ro" in the options)
        (mountpoint / "probe-write").mkdir()
    assert refused.value.errno == errno.EROFS


def remount_read_write(mountpoint: Path) -> None:
    """The operator's repair: unmount, mount again (the journal replays), as after a fsck."""
    image = mountpoint.with_name(mountpoint.name + ".img")
    subprocess.run(["umount", str(mountpoint)], check=True)
    subprocess.run(["mount", "-o", "loop,errors=remount-ro", str(image), str(mountpoint)], check=True)


def test_a_home_turned_read_only_mid_download_is_exit_4_and_the_rerun_resumes(plain_world: World, hub: Any,
                                                                              standin_server: Path,
                                                                              tmp_path: Path) -> None:
    large = plain_world.entry(LARGE)
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    with ext4_image(tmp_path / "fs", 1024 * MiB) as fs:  # room for auto's 512 MiB margin (a sparse image)
        home = fs / "home"
        hub.inject(file="*.gguf", throughput_bps=24_000, times=None)
        proc = start(hub, home, plain_world, probe, "--json", server=standin_server)
        try:
            wait_until(lambda: proc.poll() is not None or sidecar_done_bytes(home / "models" / LARGE) > 0,
                       "a checkpoint")
            # ext4 commits its journal every 5 s; a disk error aborts the journal, losing what came
            # after the last commit. The sync stands for that commit, then the download goes on.
            os.sync()
            synced = sidecar_done_bytes(home / "models" / LARGE)
            wait_until(lambda: proc.poll() is not None or sidecar_done_bytes(home / "models" / LARGE) > synced,
                       "a checkpoint after the journal commit")
            disk_error(fs)
            out, err = proc.communicate(timeout=120)
        finally:
            proc.kill()
            hub.clear_faults()
        assert proc.returncode == 4, err[-4000:]
        assert "Traceback" not in err and "During handling" not in err, err[-4000:]
        assert err.count("hotfit: error:") == 1, err[-4000:]
        error = json.loads(out)["error"]
        assert error["code"] == "disk_unwritable" and error["details"]["errno"] == "EROFS"
        assert error["details"]["path"].startswith(str(home / "models" / LARGE)), error  # the first write refused
        assert error["details"]["mount"] == str(fs) and "read-only" in error["message"]
        assert "downloaded bytes are kept" in error["hint"] and "remount" in error["hint"] and "resumes" in error["hint"]
        remount_read_write(fs)  # the operator's repair
        hub.reset_counters()
        kept = sidecar_done_bytes(home / "models" / LARGE)
        again = auto(hub, home, plain_world, probe, "--json", server=standin_server)
        assert again.returncode == 5, again.stderr[-3000:]  # through verify; the stand-in cannot load
        fetched = [e for e in events(home) if e["event"] == "stage.done" and e["stage"] == "fetch-weights"]
        assert fetched[-1]["sha256"] == large.artifact.sha256
        assert fetched[-1]["resumed_from_bytes"] == kept > 0, (fetched[-1], kept)
        assert hub.bytes_sent(large.artifact.file) <= large.artifact.size_bytes - kept + 65536  # not the whole file again
        print(f"read-only mid-download; {kept} of {large.artifact.size_bytes} bytes survived the disk error "
              "and the rerun resumed from them")


# --------------------------------------------------------------------------- an ssh session that drops


def test_sighup_mid_download_is_exit_130_with_a_message_and_the_rerun_resumes(plain_world: World, hub: Any,
                                                                               standin_server: Path,
                                                                               tmp_path: Path) -> None:
    """SIGHUP (the ssh session or terminal went away) ends `auto` as SIGTERM does: exit 130, the
    message, a `command.failed` event naming the signal, the stage recorded interrupted; the rerun
    resumes the bytes (was: Python's default, exit 129, no message, no event)."""
    large = plain_world.entry(LARGE)
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", 8 * GiB)
    hub.inject(file="*.gguf", throughput_bps=24_000, times=None)
    proc = start(hub, home, plain_world, probe, "--json", server=standin_server)
    try:
        wait_until(lambda: proc.poll() is not None or sidecar_done_bytes(home / "models" / LARGE) > 0,
                   "a checkpoint")
        proc.send_signal(signal.SIGHUP)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        hub.clear_faults()
    assert proc.returncode == 130, err[-3000:]
    assert "hotfit: error: interrupted by SIGHUP; rerun the same command to resume" in err
    assert json.loads(out)["error"]["details"]["signal"] == "SIGHUP"
    failed = named(events(home), "command.failed")
    assert [(e["exit_code"], e["signal"]) for e in failed] == [(130, "SIGHUP")]
    stages = {e["stage"]: e["event"] for e in events(home) if e["event"].startswith("stage.")}
    assert stages["fetch-weights"] == "stage.interrupted"
    kept = sidecar_done_bytes(home / "models" / LARGE)
    again = auto(hub, home, plain_world, probe, "--json", server=standin_server)
    assert again.returncode == 5, again.stderr[-3000:]  # through verify; the stand-in cannot load
    fetched = named(events(home), "stage.done")
    weights = [e for e in fetched if e["stage"] == "fetch-weights"][-1]
    assert weights["resumed_from_bytes"] == kept > 0 and weights["sha256"] == large.artifact.sha256


# --------------------------------------------------------------------------- status on a read-only home


def test_status_reads_a_read_only_home_and_auto_says_to_remount(tmp_path: Path) -> None:
    """The operator's first look after a disk error turned the home read-only: `status` reads it
    (the run, the provisioned model; exit 0 here) and writes nothing; `auto` refuses with exit 4
    naming EROFS and the remount (was: both exit 2, "cannot be used as hotfit's home")."""
    with tmpfs(tmp_path / "fs", 64 * MiB) as fs:
        made = noop_home(fs)
        assert hotfit(made.home, "--json", *made.argv).returncode == 0  # a real no-op: log, metrics
        store = SyncStateStore(made.home / "state.db")  # and a recorded run, as a provisioning leaves one
        run_id = store.create_run(["probe"], {}).run_id
        store.finish_run(run_id, "done")
        store.close()
        before = sorted((p.relative_to(fs), p.stat().st_size) for p in fs.rglob("*") if p.is_file())
        subprocess.run(["mount", "-o", "remount,ro", str(fs)], check=True)
        done = hotfit(made.home, "status", "--json")
        assert done.returncode == 0, done.stderr[-3000:]
        status = json.loads(done.stdout)
        assert status["provisioned"]["entry_name"] == "fx-agent" and status["last_auto"]["outcome"] == "noop"
        assert status["run"]["run_id"] == run_id and status["run"]["status"] == "done"
        assert [json.loads(line)["event"] for line in done.stderr.splitlines() if line.startswith("{")] == [
            "home.read_only"]
        text = hotfit(made.home, "status")
        assert text.returncode == 0 and "fx-agent" in text.stdout, text.stderr[-2000:]
        refused = hotfit(made.home, "--json", *made.argv)
        assert refused.returncode == 4, refused.stderr[-3000:]
        error = json.loads(refused.stdout)["error"]
        assert error["code"] == "disk_unwritable" and error["details"]["errno"] == "EROFS"
        assert f"remount {fs} read-write" in error["hint"] and "Traceback" not in refused.stderr
        assert sorted((p.relative_to(fs), p.stat().st_size) for p in fs.rglob("*") if p.is_file()) == before


# --------------------------------------------------------------------------- a certificate that cannot be trusted

_CA_CONFIG = """[ca]
default_ca = hub
[hub]
database = index.txt
new_certs_dir = .
serial = serial
default_md = sha256
policy = any
copy_extensions = copy
[any]
commonName = supplied
"""


def throwaway_certificate(where: Path, *, not_before: str | None = None) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and localhost and its key (openssl); ``not_before`` (YYYYMMDDHHMMSSZ)
    dates it in the future: what a machine whose clock is wrong sees."""
    where.mkdir(parents=True, exist_ok=True)
    cert, key = where / "hub.pem", where / "hub.key"
    san = "subjectAltName=DNS:localhost,IP:127.0.0.1"
    if not_before is None:
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=localhost", "-addext", san, "-keyout", str(key), "-out", str(cert)],
                       check=True, capture_output=True, timeout=60)
        return cert, key
    (where / "ca.cnf").write_text(_CA_CONFIG)
    (where / "index.txt").write_text("")
    (where / "serial").write_text("01\n")
    subprocess.run(["openssl", "req", "-new", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
                    "-addext", san, "-keyout", str(key), "-out", str(where / "hub.csr")],
                   check=True, capture_output=True, timeout=60)
    subprocess.run(["openssl", "ca", "-batch", "-config", "ca.cnf", "-selfsign", "-keyfile", str(key), "-in",
                    "hub.csr", "-out", str(cert), "-startdate", not_before, "-enddate", "21000101000000Z"],
                   check=True, capture_output=True, timeout=60, cwd=where)
    return cert, key


@pytest.mark.parametrize("fault, reason", [
    ("not yet valid", "certificate is not yet valid"),
    ("not trusted", "self-signed certificate"),
])
def test_a_certificate_that_fails_verification_is_not_retried_and_named(fault: str, reason: str,
                                                                         tmp_path: Path) -> None:
    from tests.test_fetch_weights import make_entry, make_gguf, sha256_of
    from tests.test_proxy import _TlsHub
    from tests.test_pull_cli import pull_cmd, write_registry as write_pull_registry

    cert, key = throwaway_certificate(tmp_path / "tls", not_before="20991231000000Z" if fault == "not yet valid"
                                      else None)
    (tmp_path / "src").mkdir()
    weights = make_gguf(tmp_path / "src" / "model.gguf")
    with _TlsHub(tmp_path / "tlshub", cert, key) as hub:
        commit = hub.create_repo("org/m", {"model.gguf": weights}, lfs=["model.gguf"])
        entry = dataclasses.replace(make_entry("m", "org/m", commit, "model.gguf", weights.stat().st_size,
                                               sha256_of(weights)), auto_eligible=False,
                                    ineligible_cause="tool-parser", ineligible_reason="test: no template")
        registry = write_pull_registry(tmp_path / "registry.json", entry)
        env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_TOKEN", "SSL_CERT_DIR")}
        env.update(hub.env())
        env.pop("SSL_CERT_FILE", None)
        if fault == "not yet valid":  # trusted, but dated after this machine's clock
            env["SSL_CERT_FILE"] = str(cert)
        done = subprocess.run(pull_cmd(tmp_path / "home", registry, "m"), env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=300)
        # the Hub API calls (registry lock, OpenVINO snapshots) go through huggingface_hub's httpx: the
        # same refusal, not retried
        trust = ssl.create_default_context(cafile=str(cert)) if fault == "not yet valid" else ssl.create_default_context()
        api_url = f"{hub.endpoint}/api/models/org/m"
        with pytest.raises(httpx.ConnectError) as real:
            httpx.get(api_url, verify=trust)
        assert not is_retryable_hf_exception(real.value)
        mapped = hub_error_from_hf_exception(real.value, repo="org/m", revision=commit, endpoint=hub.endpoint,
                                             url=api_url)
        assert isinstance(mapped, CertificateError) and mapped.details["reason"] == reason
    assert done.returncode == 4, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "download.retry" not in done.stderr  # one attempt, no retry
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "tls_certificate" and error["details"]["reason"] == reason
    assert f"failed verification: {reason}" in error["message"] and "127.0.0.1" in error["message"]
    if fault == "not yet valid":
        assert "clock" in error["hint"] and "timedatectl" in error["hint"]
    else:
        assert "SSL_CERT_FILE" in error["hint"] and "CA bundle" in error["hint"]
    assert "network" not in error["hint"]
    assert len([r for r in hub.requests if r.method == "HEAD"]) == 0  # no request got through TLS


# --------------------------------------------------------------------------- a home copied with cp -a


def test_a_home_copied_with_cp_a_serves_its_own_files(standin_server: Path, tmp_path: Path) -> None:
    """`cp -a` of a provisioned home (a bigger disk, an image cloned to many machines): the copy's
    manifest and stage records name the original home's files. Read in the copy they are re-rooted
    there: `serve` runs the copy's model, `status` shows it, `auto` keeps it and writes the manifest
    anew, and a reopened state.db re-roots its records once (was: the original's files, silently)."""
    original = noop_home(tmp_path / "a")
    model = json.loads((original.home / "manifest.json").read_text())["model_path"]
    store = SyncStateStore(original.home / "state.db")
    run_id = store.create_run(["fetch-weights"], {}).run_id
    store.stage_running(run_id, "fetch-weights", "h1", None)
    store.stage_done(run_id, "fetch-weights", {"weights": {"path": model, "sha256": "x"}, "url": "https://hub/x"})
    store.close()
    copy = tmp_path / "b" / "home"
    copy.parent.mkdir()
    subprocess.run(["cp", "-a", str(original.home), str(copy)], check=True)
    moved = model.replace(str(original.home), str(copy))
    env = {**os.environ, "HOTFIT_LLAMA_SERVER": str(standin_server)}
    probe = original.argv[original.argv.index("--probe-file") + 1]

    served = hotfit(copy, "serve", "--print-command", "--probe-file", probe, env=env)
    assert served.returncode == 0, served.stderr[-3000:]
    assert moved in served.stdout and str(original.home) not in served.stdout, served.stdout
    status = json.loads(hotfit(copy, "status", "--json").stdout)
    assert status["provisioned"]["model_path"] == moved
    done = hotfit(copy, "--json", *original.argv)
    assert done.returncode == 0 and json.loads(done.stdout)["model_path"] == moved, done.stderr[-3000:]
    assert json.loads((copy / "manifest.json").read_text())["model_path"] == moved  # written anew
    assert json.loads((original.home / "manifest.json").read_text())["model_path"] == model  # untouched
    copied = named(events(copy), "home.copied")
    assert [(e["from_home"], e["file"]) for e in copied] == [(str(original.home), str(copy / "manifest.json"))]

    store = SyncStateStore(copy / "state.db")
    outputs = store.stages(run_id)[0].outputs
    store.close()
    assert outputs == {"weights": {"path": moved, "sha256": "x"}, "url": "https://hub/x"}
    store = SyncStateStore(original.home / "state.db")
    assert store.stages(run_id)[0].outputs["weights"]["path"] == model  # the original keeps its own
    store.close()
