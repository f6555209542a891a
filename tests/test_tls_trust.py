"""A mirror behind a private CA that the machine trusts (the CA in the system store, no
SSL_CERT_FILE): hotfit's downloads trust the same store as huggingface_hub's requests
(download.tls), so `registry lock` and `pull` both work. Before, hotfit's engine trusted certifi
only: `registry lock` answered and `pull` failed on the certificate.

The CA is added for real with Debian's update-ca-certificates (root only; removed afterwards),
and the mirror is the local Hub behind TLS on loopback.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from hotfit.core.entry import TemplateSource
from tests.conftest import REPO_ROOT
from tests.hubserver import LocalHub
from tests.test_proxy import _TlsHub
from tests.test_pull_cli import TOOL_TEMPLATE, write_registry
from tests.test_fetch_weights import make_entry, make_gguf, sha256_of
from tests.test_recipes import require_tool

SYSTEM_CA_DIR = Path("/usr/local/share/ca-certificates")


def openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


@pytest.fixture
def private_ca(tmp_path: Path) -> Iterator[tuple[Path, Path, Path]]:
    """A CA in the system store, and a server certificate for 127.0.0.1 it signed: (ca, cert, key)."""
    tool = require_tool("update-ca-certificates", "ca-certificates")
    require_tool("openssl", "openssl")
    if os.geteuid() != 0:
        pytest.skip("adding a CA to the system store needs root")
    ca_key, ca, key, csr, cert = (tmp_path / n for n in ("ca.key", "ca.pem", "srv.key", "srv.csr", "srv.pem"))
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=hotfit test private CA",
            "-keyout", str(ca_key), "-out", str(ca))
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(csr))
    ext = tmp_path / "ext.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial", "-days", "1",
            "-extfile", str(ext), "-out", str(cert))
    installed = SYSTEM_CA_DIR / f"hotfit-test-{uuid.uuid4().hex[:12]}.crt"
    SYSTEM_CA_DIR.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ca, installed)
    try:
        subprocess.run([tool], check=True, capture_output=True, timeout=120)
        yield ca, cert, key
    finally:
        installed.unlink(missing_ok=True)
        subprocess.run([tool, "--fresh"], capture_output=True, timeout=120)


def hub_model(hub: LocalHub, tmp_path: Path) -> tuple[Path, Path]:
    """A pinned model with a tool-call template on ``hub``: (the registry file, the weights)."""
    (tmp_path / "src").mkdir()
    weights = make_gguf(tmp_path / "src" / "model.gguf")
    commit = hub.create_repo("org/m-GGUF", {"model.gguf": weights.read_bytes()}, lfs=["model.gguf"])
    tpl_commit = hub.create_repo("org/m", {"tokenizer_config.json": json.dumps(
        {"chat_template": [{"name": "default", "template": "{{ messages }}"},
                           {"name": "tool_use", "template": TOOL_TEMPLATE}]})})
    entry = make_entry("m", "org/m-GGUF", commit, "model.gguf", weights.stat().st_size, sha256_of(weights),
                       template=TemplateSource("org/m", tpl_commit, "tokenizer_config.json"))
    return write_registry(tmp_path / "registry.json", entry), weights


def test_a_mirror_behind_a_ca_in_the_system_store_serves_lock_and_pull(private_ca: tuple[Path, Path, Path],
                                                                       tmp_path: Path) -> None:
    _, cert, key = private_ca
    env = {k: v for k, v in os.environ.items()
           if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR", "HF_TOKEN", "HOTFIT_HOME", "HF_HUB_OFFLINE",
                        "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE")}
    with _TlsHub(tmp_path / "hub", cert, key) as hub:
        registry, weights = hub_model(hub, tmp_path)
        env |= {k: v for k, v in hub.env().items()}
        assert env["HF_ENDPOINT"].startswith("https://")
        base = [sys.executable, "-m", "hotfit", "--home", str(tmp_path / "home"), "--log-format", "json", "--json"]
        # huggingface_hub's requests (the registry lock's) trust the system store
        locked = subprocess.run([*base, "registry", "lock", "--registry", str(registry), "--verify"], env=env,
                                cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert locked.returncode == 0, locked.stdout[-2000:] + locked.stderr[-2000:]
        # and so do hotfit's own (the pull's HEAD and ranged GETs): before, certifi only (exit 11)
        pulled = subprocess.run([*base, "pull", "m", "--registry", str(registry)], env=env, cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=300)
        assert pulled.returncode == 0, pulled.stdout[-2000:] + pulled.stderr[-2000:]
        assert json.loads(pulled.stdout)["fetch"]["weights"]["sha256"] == sha256_of(weights)
        assert {r.where for r in hub.requests} >= {"hub"}


def test_a_certificate_nobody_trusts_is_exit_4_at_once_naming_the_store(tmp_path: Path) -> None:
    """Not a passing fault: exit 4 at once (CertificateError), never the transient 11."""
    require_tool("openssl", "openssl")
    cert, key = tmp_path / "self.pem", tmp_path / "self.key"
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
            "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert))
    env = {k: v for k, v in os.environ.items() if k not in ("SSL_CERT_FILE", "SSL_CERT_DIR", "HOTFIT_HOME")}
    with _TlsHub(tmp_path / "hub", cert, key) as hub:
        registry, _ = hub_model(hub, tmp_path)
        pulled = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(tmp_path / "home"), "--json",
                                 "pull", "m", "--registry", str(registry)], env=env | hub.env(), cwd=REPO_ROOT,
                                capture_output=True, text=True, timeout=300)
        assert pulled.returncode == 4, pulled.stdout[-2000:] + pulled.stderr[-2000:]
        err = json.loads(pulled.stdout)["error"]
        assert err["code"] == "tls_certificate" and "failed verification" in err["message"]
        assert "system trust store" in err["hint"]  # which pull now reads (download.tls)
        assert not [r for r in hub.requests if r.method == "HEAD"]  # the handshake failed: nothing was asked
