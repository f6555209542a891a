"""Proxies from the environment (download.proxy, docs/network.md): every request hotfit makes goes
through ``HTTP_PROXY``/``HTTPS_PROXY``/``ALL_PROXY`` unless ``NO_PROXY`` says otherwise — shown with a
real tinyproxy on loopback whose own log counts the requests — and bad values are exit 2 naming the
variable."""

from __future__ import annotations

import hashlib
import json
import ssl
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from hotfit.core.errors import TransferError, UsageError
from hotfit.core.settings import load_settings
from hotfit.download import proxy_config
from hotfit.download.proxy import parse_proxy
from tests.conftest import REPO_ROOT
from tests.hubserver import LocalHub, free_port_closed
from tests.proxyserver import TinyProxy
from tests.test_fetch_weights import fetch_m, make_entry, make_gguf
from tests.test_pull_cli import env_for, model, pull_cmd  # noqa: F401 - `model` is a fixture

PROXY_NAMES = ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
TOKEN = "hf_proxytesttoken0123456789"


# --------------------------------------------------------------------------- the reading of the variables


@pytest.mark.parametrize(("value", "url", "auth"), [
    ("http://proxy.corp:3128", "http://proxy.corp:3128", None),
    ("proxy.corp:3128", "http://proxy.corp:3128", None),  # no scheme: http://, as curl and httpx
    ("http://proxy.corp", "http://proxy.corp:80", None),  # no port: the scheme's, as httpx
    ("http://[::1]:3128/", "http://[::1]:3128", None),
    ("http://al%40ice:p%3Ass@proxy:8080", "http://proxy:8080", "Basic YWxAaWNlOnA6c3M="),  # al@ice:p:ss
])
def test_a_proxy_value_is_read_like_httpx(value: str, url: str, auth: str | None) -> None:
    proxy = parse_proxy("HTTPS_PROXY", value)
    assert (proxy.url, proxy.authorization, proxy.variable) == (url, auth, "HTTPS_PROXY")
    assert "p%3Ass" not in repr(proxy) and proxy.named == f"{url} (HTTPS_PROXY)"


@pytest.mark.parametrize(("value", "why"), [
    ("http://[::1", "Invalid IPv6 URL"),
    ("http://127.0.0.1:99999", "out of range"),
    ("http://proxy:port", "Port could not be cast"),
    ("socks5://127.0.0.1:1080", "socks5:// proxies are not supported"),
    ("https://proxy:443", "https:// proxies are not supported"),
    ("http://", "no host"),
    ("http://proxy:3128/some/path", "no path"),
])
def test_a_malformed_proxy_is_a_usage_error_naming_the_variable(value: str, why: str) -> None:
    with pytest.raises(UsageError, match=why) as exc:
        proxy_config({"https_proxy": value})
    assert exc.value.exit_code == 2 and exc.value.details["variable"] == "https_proxy"
    assert exc.value.what.startswith("https_proxy=")


def test_a_password_never_reaches_the_message() -> None:
    with pytest.raises(UsageError) as exc:
        proxy_config({"HTTP_PROXY": "http://user:s3cret@proxy:99999"})
    assert "s3cret" not in str(exc.value) and "s3cret" not in json.dumps(exc.value.to_json())
    assert "user:***@proxy" in exc.value.what


def test_lowercase_wins_and_empty_means_none() -> None:
    cfg = proxy_config({"HTTP_PROXY": "http://upper:1", "http_proxy": "http://lower:2"})
    chosen = cfg.for_url("http://hub/x")
    assert chosen is not None and chosen.host == "lower"
    assert proxy_config({"HTTP_PROXY": "http://upper:1", "http_proxy": ""}).for_url("http://hub/x") is None
    # HTTP_PROXY is for http:// targets only; ALL_PROXY covers both
    assert proxy_config({"HTTP_PROXY": "http://p:1"}).for_url("https://hub/x") is None
    assert proxy_config({"ALL_PROXY": "http://p:1"}).for_url("https://hub/x") is not None


# Every routing decision agrees with httpx's own reading of the environment (trust_env), which is what
# huggingface_hub's metadata calls use in the same process.
ROUTES = [
    ({"HTTPS_PROXY": "http://p:3128"}, ["https://huggingface.co/x", "http://huggingface.co/x"]),
    ({"ALL_PROXY": "http://p:3128", "HTTP_PROXY": "http://q:3128"}, ["https://hf.co/", "http://hf.co/"]),
    ({"ALL_PROXY": "http://p:3128", "NO_PROXY": "huggingface.co"},
     ["https://huggingface.co/", "https://cdn.huggingface.co/", "https://nothuggingface.co/", "https://hf.co/"]),
    ({"ALL_PROXY": "http://p:3128", "NO_PROXY": ".huggingface.co"},
     ["https://huggingface.co/", "https://cas.huggingface.co/"]),
    ({"ALL_PROXY": "http://p:3128", "NO_PROXY": "127.0.0.1, localhost ,::1"},
     ["http://127.0.0.1:8080/", "http://localhost:8080/", "http://[::1]:8080/", "http://127.0.0.2:8080/",
      "http://localhost.example:8080/"]),
    ({"ALL_PROXY": "http://p:3128"}, ["http://127.0.0.1:8080/", "http://localhost/"]),  # loopback is proxied
    ({"ALL_PROXY": "http://p:3128", "NO_PROXY": "*"}, ["https://huggingface.co/"]),
    ({"ALL_PROXY": "http://p:3128", "NO_PROXY": "http://mirror.lan"},
     ["http://mirror.lan/", "https://mirror.lan/"]),
    ({"ALL_PROXY": "http://p:3128", "NO_PROXY": "mirror.lan:8080"},
     ["http://mirror.lan:8080/", "http://mirror.lan:9090/"]),
    ({"ALL_PROXY": "http://p:3128", "NO_PROXY": "10.0.0.0/8"}, ["http://10.0.0.0/", "http://10.1.2.3/"]),
]


@pytest.mark.parametrize(("env", "urls"), ROUTES)
def test_routing_agrees_with_httpx_trust_env(env: dict[str, str], urls: list[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_NAMES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    ours = proxy_config(env)
    with httpx.Client(trust_env=True) as client:
        for url in urls:
            transport = client._transport_for_url(httpx.URL(url))  # httpx's routing (a private method)
            pool = transport._pool  # type: ignore[attr-defined]  # httpx's private pool, as routing left it
            theirs = pool._proxy_url if hasattr(pool, "_proxy_url") else None
            mine = ours.for_url(url)
            assert (mine is not None) == (theirs is not None), (env, url)
            if mine is not None:
                assert (theirs.host.decode(), theirs.port) == (mine.host, mine.port), (env, url)


# --------------------------------------------------------------------------- through a real proxy


@pytest.fixture
def tinyproxy(tmp_path: Path) -> Iterator[TinyProxy]:
    with TinyProxy(tmp_path / "tinyproxy") as proxy:
        yield proxy


def _env(hub: LocalHub, **proxy_env: str) -> dict[str, str]:
    env = {k: v for k, v in env_for(hub).items() if k.lower() not in PROXY_NAMES}
    return {**env, "HF_TOKEN": TOKEN, **proxy_env}


def _pull(model: dict[str, Any], env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(pull_cmd(model["home"], model["registry"], "test-model"), env=env, cwd=REPO_ROOT,
                          capture_output=True, timeout=180)


def _hub_requests(hub: LocalHub) -> Counter[tuple[str, str, str]]:
    return Counter((r.method, r.where, r.url_path) for r in hub.requests)


def _proxied(hub: LocalHub, proxy: TinyProxy, since: int = 0) -> Counter[tuple[str, str, str]]:
    """What the proxy's log shows (from its ``since``-th request on), keyed like ``_hub_requests``."""
    where = {f"{hub.host}:{hub.port}": "hub", f"{hub.cdn_host}:{hub.port}": "cdn"}
    return Counter((r.method, where[r.host_port], r.path) for r in proxy.requests()[since:])


def test_every_hub_and_cdn_request_of_a_pull_goes_through_the_proxy(local_hub: LocalHub, model: dict[str, Any],
                                                                    tinyproxy: TinyProxy) -> None:
    # The Hub is on 127.0.0.1 and its CDN on localhost: neither httpx nor curl bypasses loopback
    # unless NO_PROXY says so, and neither does hotfit.
    out = _pull(model, _env(local_hub, HTTP_PROXY=tinyproxy.url))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert model["final"].read_bytes() == model["weights"].read_bytes()
    seen_by_hub = _hub_requests(local_hub)
    assert {w for _m, w, _p in seen_by_hub} == {"hub", "cdn"}  # the CDN redirect was followed
    assert sum(seen_by_hub.values()) >= 4  # HEADs, ranged GETs, the template
    assert _proxied(local_hub, tinyproxy) == seen_by_hub  # each one, through the proxy
    # the token reached the Hub, never the CDN; it goes to an endpoint once that has answered like a
    # Hub (X-Repo-Commit), so each session's first HEAD goes without it (docs/fleet.md)
    hub = [r for r in local_hub.requests if r.where == "hub"]
    assert any(r.authorization for r in hub) and all(r.authorization for r in hub if r.method != "HEAD")
    assert not any(r.authorization for r in local_hub.requests if r.where == "cdn")


def test_no_proxy_bypasses_the_proxy_per_host(local_hub: LocalHub, model: dict[str, Any],
                                              tinyproxy: TinyProxy) -> None:
    # NO_PROXY names the CDN's host only: the Hub's requests go through the proxy, the CDN's do not.
    out = _pull(model, _env(local_hub, http_proxy=tinyproxy.url, no_proxy="localhost"))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    seen_by_hub = _hub_requests(local_hub)
    proxied = _proxied(local_hub, tinyproxy)
    assert proxied == Counter({k: n for k, n in seen_by_hub.items() if k[1] == "hub"})
    assert any(k[1] == "cdn" for k in seen_by_hub) and not any(k[1] == "cdn" for k in proxied)


def test_no_proxy_for_every_host_leaves_the_proxy_unused(local_hub: LocalHub, model: dict[str, Any],
                                                         tinyproxy: TinyProxy) -> None:
    out = _pull(model, _env(local_hub, HTTP_PROXY=tinyproxy.url, NO_PROXY="127.0.0.1,localhost"))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert local_hub.requests and tinyproxy.requests() == []


def test_a_malformed_proxy_is_exit_2_before_any_request(local_hub: LocalHub, model: dict[str, Any]) -> None:
    out = _pull(model, _env(local_hub, HTTPS_PROXY="http://[::1", HTTP_PROXY="http://127.0.0.1:99999"))
    assert out.returncode == 2, out.stderr.decode()[-3000:]
    err = json.loads(out.stdout)["error"]
    assert err["details"]["variable"] in ("HTTP_PROXY", "HTTPS_PROXY")
    assert err["message"].startswith(err["details"]["variable"] + "=")
    assert "Traceback" not in out.stderr.decode()
    assert local_hub.requests == []


@pytest.mark.anyio
async def test_an_unreachable_proxy_is_named_in_the_error(local_hub: LocalHub, tmp_path: Path) -> None:
    commit = local_hub.create_repo("org/m", {"model.gguf": b"x" * 1000}, lfs=["model.gguf"])
    entry = make_entry("m", "org/m", commit, "model.gguf", 1000, None)
    dead = f"http://127.0.0.1:{free_port_closed()}"  # nothing listens there
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": local_hub.endpoint,
                              "HTTP_PROXY": dead})
    with pytest.raises(TransferError) as exc:
        await fetch_m(entry, settings)
    assert exc.value.exit_code == 11  # a passing fault (core.errors)
    assert f"through proxy {dead} (HTTP_PROXY)" in exc.value.what
    assert exc.value.details["proxy"] == dead and exc.value.details["variable"] == "HTTP_PROXY"
    assert exc.value.hint is not None and f"check the proxy {dead} (HTTP_PROXY" in exc.value.hint
    assert local_hub.requests == []  # nothing went around the proxy


def test_registry_lock_asks_the_hub_through_the_proxy(local_hub: LocalHub, model: dict[str, Any],
                                                      tinyproxy: TinyProxy) -> None:
    cmd = [sys.executable, "-m", "hotfit", "--home", str(model["home"]), "registry", "lock",
           "--registry", str(model["registry"]), "--verify", "--json"]
    out = subprocess.run(cmd, env=_env(local_hub, HTTP_PROXY=tinyproxy.url), cwd=REPO_ROOT,
                         capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr.decode()[-3000:] + out.stdout.decode()[-2000:]
    assert local_hub.requests and _proxied(local_hub, tinyproxy) == _hub_requests(local_hub)
    bad = subprocess.run(cmd, env=_env(local_hub, HTTP_PROXY="http://127.0.0.1:99999"), cwd=REPO_ROOT,
                         capture_output=True, timeout=120)
    assert bad.returncode == 2 and json.loads(bad.stdout)["error"]["details"]["variable"] == "HTTP_PROXY"



# --------------------------------------------------------------------------- https: CONNECT tunnels


class _TlsHub(LocalHub):
    """The local Hub behind TLS (a throwaway certificate for 127.0.0.1 and localhost): the shape of the
    real Hub, whose https:// requests a proxy only tunnels (CONNECT) and never sees inside."""

    def __init__(self, root: Path, cert: Path, key: Path) -> None:
        super().__init__(root)
        self._ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._ctx.load_cert_chain(cert, key)

    def start(self) -> LocalHub:
        super().start()
        assert self._server is not None  # the same descriptor, now answering TLS (handshakes in handlers)
        self._server.socket = self._ctx.wrap_socket(self._server.socket, server_side=True,
                                                    do_handshake_on_connect=False)
        return self

    @property
    def endpoint(self) -> str:
        return f"https://{self.host}:{self.port}"

    @property
    def cdn_endpoint(self) -> str:
        return f"https://{self.cdn_host}:{self.port}"


@pytest.fixture
def tls_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LocalHub]:
    cert, key = tmp_path / "hub.pem", tmp_path / "hub.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    # hotfit's one TLS context (the HEADs' and the byte-range engine's) reads it, as huggingface_hub does
    monkeypatch.setenv("SSL_CERT_FILE", str(cert))
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with _TlsHub(tmp_path / "tlshub", cert, key) as hub:
        yield hub


@pytest.mark.anyio
@pytest.mark.parametrize("no_proxy", [None, "127.0.0.1,localhost"])
async def test_https_goes_through_connect_tunnels(tls_hub: LocalHub, tinyproxy: TinyProxy, tmp_path: Path,
                                                  no_proxy: str | None) -> None:
    (tmp_path / "src").mkdir()
    data = make_gguf(tmp_path / "src" / "model.gguf").read_bytes()
    commit = tls_hub.create_repo("org/m", {"model.gguf": data}, lfs=["model.gguf"])
    entry = make_entry("m", "org/m", commit, "model.gguf", len(data), hashlib.sha256(data).hexdigest())
    env = {"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": tls_hub.endpoint, "HTTPS_PROXY": tinyproxy.url,
           **({"NO_PROXY": no_proxy} if no_proxy else {})}
    await fetch_m(entry, load_settings(env))
    assert (tmp_path / "home" / "models" / "m" / "model.gguf").read_bytes() == data
    assert {r.where for r in tls_hub.requests} == {"hub", "cdn"}
    tunnels = Counter(r.host_port for r in tinyproxy.requests() if r.method == "CONNECT")
    if no_proxy:
        assert tinyproxy.requests() == []
    else:
        # the HEAD (httpx) and the ranged GETs (download.wire) both tunnel; the proxy saw no request inside
        assert set(tunnels) == {f"127.0.0.1:{tls_hub.port}", f"localhost:{tls_hub.port}"}
        assert all(r.method == "CONNECT" for r in tinyproxy.requests())


# --------------------------------------------------------------------------- a proxy that wants credentials


@pytest.fixture
def auth_proxy(tmp_path: Path) -> Iterator[TinyProxy]:
    with TinyProxy(tmp_path / "authproxy", basic_auth=("alice", "s3cret")) as proxy:
        yield proxy


def test_proxy_credentials_from_the_url_are_sent_and_a_407_is_named(local_hub: LocalHub, model: dict[str, Any],
                                                                    auth_proxy: TinyProxy) -> None:
    refused = _pull(model, _env(local_hub, HTTP_PROXY=auth_proxy.url))
    assert refused.returncode == 4, refused.stderr.decode()[-3000:]
    err = json.loads(refused.stdout)["error"]
    assert "407" in err["message"] and auth_proxy.url in err["message"] and "HTTP_PROXY" in err["hint"]
    assert "download.retry" not in refused.stderr.decode()  # wrong credentials are not retried
    assert local_hub.requests == []
    refused_at_the_proxy = len(auth_proxy.requests())
    with_user = auth_proxy.url.replace("http://", "http://alice:s3cret@")
    out = _pull(model, _env(local_hub, HTTP_PROXY=with_user))
    assert out.returncode == 0, out.stderr.decode()[-3000:]
    assert _proxied(local_hub, auth_proxy, since=refused_at_the_proxy) == _hub_requests(local_hub)
    assert "s3cret" not in out.stdout.decode() + out.stderr.decode()


@pytest.mark.anyio
async def test_connect_tunnels_carry_the_proxy_credentials(tls_hub: LocalHub, auth_proxy: TinyProxy,
                                                           tmp_path: Path) -> None:
    (tmp_path / "src").mkdir()
    data = make_gguf(tmp_path / "src" / "model.gguf").read_bytes()
    commit = tls_hub.create_repo("org/m", {"model.gguf": data}, lfs=["model.gguf"])
    entry = make_entry("m", "org/m", commit, "model.gguf", len(data), hashlib.sha256(data).hexdigest())
    env = {"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": tls_hub.endpoint}
    with pytest.raises(TransferError, match="407 Proxy Authentication Required"):
        await fetch_m(entry, load_settings({**env, "HTTPS_PROXY": auth_proxy.url}))
    with_user = auth_proxy.url.replace("http://", "http://alice:s3cret@")
    await fetch_m(entry, load_settings({**env, "HTTPS_PROXY": with_user}))
    assert (tmp_path / "home" / "models" / "m" / "model.gguf").read_bytes() == data
    assert {r.where for r in tls_hub.requests} == {"hub", "cdn"}


def test_registry_lock_names_a_proxy_that_wants_credentials(model: dict[str, Any], local_hub: LocalHub,
                                                            auth_proxy: TinyProxy) -> None:
    cmd = [sys.executable, "-m", "hotfit", "--home", str(model["home"]), "registry", "lock",
           "--registry", str(model["registry"]), "--verify", "--json"]
    out = subprocess.run(cmd, env=_env(local_hub, HTTP_PROXY=auth_proxy.url), cwd=REPO_ROOT,
                         capture_output=True, timeout=120)
    assert out.returncode == 4, out.stderr.decode()[-3000:]
    problems = json.loads(out.stdout)["problems"]
    assert problems and all("407" in p["message"] and auth_proxy.url in p["message"] for p in problems)


@pytest.mark.anyio
async def test_the_snapshot_listing_goes_through_the_proxy_too(local_hub: LocalHub, tmp_path: Path,
                                                               tinyproxy: TinyProxy,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # The OpenVINO listing is a huggingface_hub call: its client reads the same variables from the
    # process environment (once per client, so the shared client is rebuilt around the test).
    from huggingface_hub import close_session

    from hotfit.stages.fetch_weights import fetch_weights
    from tests.test_fetch_weights import FAST, _openvino_entry

    files: dict[str, str | bytes] = {"openvino_model.xml": "<net/>", "openvino_model.bin": b"\0" * 300_000,
                                     "config.json": "{}"}
    local_hub.create_repo("OpenVINO/m-ov", files, lfs=["openvino_model.bin"])
    monkeypatch.setenv("HTTP_PROXY", tinyproxy.url)
    close_session()
    try:
        settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": local_hub.endpoint,
                                  "HTTP_PROXY": tinyproxy.url})
        await fetch_weights(_openvino_entry("OpenVINO/m-ov"), settings.model_dir("ov"), settings=settings,
                            options=FAST, progress=False)
    finally:
        monkeypatch.delenv("HTTP_PROXY")
        close_session()
    assert any(path.startswith("/api/models/OpenVINO/m-ov/tree/") for _m, _w, path in _hub_requests(local_hub))
    assert _proxied(local_hub, tinyproxy) == _hub_requests(local_hub)
