"""CLI start-up: importing the CLI loads no run-time-only third-party library.

gguf (and the numpy it imports) is needed only to read a GGUF header, httpx/httpcore only to open a
connection; ``hotfit --help``, ``status`` and a usage error must not pay for them. The timings are
in the commit message (``python -X importtime``), not asserted here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gguf

from hotfit.core.lazy_import import lazy_module
from hotfit.stages import _gguf_header

TIER = "integration"

REPO = Path(__file__).resolve().parent.parent

# Submodules a package's own __init__ imports: they appear only once it really ran (a lazy module
# object alone sits in sys.modules under the package's name: core.lazy_import).
HEAVY = ("gguf.constants", "numpy", "httpcore", "httpx._client", "click")


def _loaded_after(code: str) -> list[str]:
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_importing_the_cli_loads_no_run_time_library() -> None:
    assert _loaded_after("import pipeline.cli") == []


def test_hotfit_help_loads_no_run_time_library() -> None:
    code = ("import sys\nsys.argv = ['hotfit', '--help']\nfrom pipeline.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass")
    assert _loaded_after(code) == []


def test_reading_a_header_loads_gguf_on_first_use() -> None:
    # a run that reads a header gets the real package, and the names the reader keeps match its own
    assert _loaded_after("from stages._gguf_header import gguf\ngguf.Keys") == ["gguf.constants", "numpy"]
    assert _gguf_header.gguf is gguf
    assert _gguf_header._CHAT_TEMPLATE_KEY == gguf.Keys.Tokenizer.CHAT_TEMPLATE


def test_a_lazy_module_is_the_real_module_once_used() -> None:
    import httpx

    lazy = lazy_module("httpx")
    assert lazy.HTTPError is httpx.HTTPError and lazy.AsyncClient is httpx.AsyncClient
    code = ("from core.lazy_import import lazy_module\nh = lazy_module('httpx')\nimport sys\n"
            "assert 'httpx._client' not in sys.modules\nh.AsyncClient\nassert 'httpx._client' in sys.modules")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True)
