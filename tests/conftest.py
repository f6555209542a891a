"""Shared test set-up: no network beyond loopback, no Xet, no telemetry, isolated homes."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.e2e_support import World, build_world
from tests.gguf_fixtures import pinned_template, require_llama_server, tool_template_text
from tests.hubserver import LocalHub, serve_handler
from tests.real_models import realmodels_script

pytest_plugins = ("tests.tiers",)  # each module's tier, and the unit tier's guard (CONTRIBUTING.md "Test tiers")

# Never let huggingface_hub reach the real Hub or send Xet headers / telemetry from tests.
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.pop("HF_TOKEN", None)
os.environ.pop("CONTENOX_LLAMA_KV_CACHE_TYPE", None)
# hotfit honours proxies (docs/network.md): one inherited from the machine would route the loopback
# Hub of every test through it. The proxy tests set them per subprocess / settings.
for _name in [k for k in os.environ if k.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")]:
    os.environ.pop(_name)
# The Hugging Face cache is read by fetch-weights (docs/network.md): never the developer's own (a real
# model cached there would be taken instead of the local Hub's bytes). An empty one per session.
os.environ.pop("HF_HOME", None)
os.environ.pop("HUGGINGFACE_HUB_CACHE", None)
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="hotfit-tests-hf-cache-")

REPO_ROOT = Path(__file__).resolve().parent.parent
# The layers, importable only as hotfit.<layer> (CONTRIBUTING.md "Layout"); the repository root is on
# sys.path under pytest, so a bare `stages.x` (an import_module string, a mock target) would load a
# second copy of a module — with its own classes, whose isinstance checks then fail elsewhere.
LAYERS = ("core", "registry", "state", "grading", "download", "backends", "stages", "pipeline")


def bare_layer_modules() -> list[str]:
    """Modules of this repository loaded under a bare layer name (``stages.plan``, not ``hotfit.…``)."""
    return sorted(name for name, module in list(sys.modules.items())
                  if name.split(".")[0] in LAYERS
                  and str(getattr(module, "__file__", "") or "").startswith(str(REPO_ROOT)))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    bare = bare_layer_modules()
    if bare:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print(f"\nconftest: modules loaded outside the hotfit namespace (import them as hotfit.<layer>): "
              f"{', '.join(bare[:10])}", file=sys.stderr)


@pytest.fixture(scope="module")
def realmodels() -> ModuleType:
    """scripts/realmodels.py as a module (tests/real_models.realmodels_script)."""
    return realmodels_script()


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def local_hub(tmp_path: Path) -> Iterator[LocalHub]:
    """A started local Hub (tests/hubserver.py) rooted in the test's tmp_path; stopped after the test."""
    with LocalHub(tmp_path / "localhub") as hub:
        yield hub


@pytest.fixture(scope="module")
def hub() -> Iterator[LocalHub]:
    """One local Hub per test module, for the end-to-end tests (they reset its faults and counters)."""
    with LocalHub() as h:
        yield h


@pytest.fixture(scope="module")
def plain_world(hub: LocalHub, tmp_path_factory: pytest.TempPathFactory) -> World:
    """The fixture models on the module's Hub; no llama-server needed (the pinned template when the
    llama.cpp tree is here, else a stand-in one)."""
    return build_world(tmp_path_factory.mktemp("world"), hub, template_text=tool_template_text())


@pytest.fixture
def world(plain_world: World) -> World:
    """``plain_world`` for a test that runs the real llama-server (skips, or fails under
    HOTFIT_REQUIRE_LLAMA, without it or without the pinned template the fixtures need)."""
    require_llama_server()
    pinned_template()
    return plain_world


@pytest.fixture
def hotfit_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("HOTFIT_HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return home


class _NotAHubHandler(BaseHTTPRequestHandler):
    """A web server that is not a Hub: every path answers ``mode`` (set on the server)."""

    def log_message(self, *_args: Any) -> None:
        pass

    def _answer(self, body: bool) -> None:
        mode = self.server.mode  # type: ignore[attr-defined]
        if mode == "bare-404":  # what `python -m http.server` says for any Hub path
            self.send_error(404, "File not found")
            return
        page = b"<!doctype html><html><body><h1>Welcome to our intranet</h1></body></html>"
        self.send_response(200 if mode == "html-200" else 404)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(page)))
        self.end_headers()
        if body:
            self.wfile.write(page)

    def do_GET(self) -> None:  # noqa: N802 - stdlib name
        self._answer(body=True)

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib name
        self._answer(body=False)


@pytest.fixture(params=["bare-404", "html-200", "html-404"])
def not_a_hub(request: pytest.FixtureRequest) -> Iterator[str]:
    """The endpoint of a plain web server on 127.0.0.1 that has none of the Hub's headers
    (X-Repo-Commit, X-Error-Code): a mistyped HF_ENDPOINT, a proxy's landing page."""
    with serve_handler(_NotAHubHandler, mode=request.param) as url:
        yield url
