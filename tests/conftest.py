"""Shared test set-up: no network beyond loopback, no Xet, no telemetry, isolated homes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Never let huggingface_hub reach the real Hub or send Xet headers / telemetry from tests.
os.environ["HF_HUB_DISABLE_XET"] = "1"
os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
os.environ.pop("HF_TOKEN", None)
os.environ.pop("CONTENOX_LLAMA_KV_CACHE_TYPE", None)

REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def hotfit_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("HOTFIT_HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    return home
