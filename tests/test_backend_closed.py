"""The closed backend boundary (CONTRIBUTING.md "Adding a backend"): what the callers outside
``backends/`` once decided by comparing a backend's name is asked of the backend or of the entry's
layout, with the same answers; and no such comparison is left outside ``backends/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hotfit.backends.base import BuildUnavailable, ServeCommand
from hotfit.backends.select import BACKENDS, backend_for
from hotfit.core.entry import BACKENDS as BACKEND_NAMES
from hotfit.core.entry import DEFAULT_BACKEND, WEIGHTS_LAYOUTS
from hotfit.core.errors import UsageError
from hotfit.core.settings import load_settings
from hotfit.pipeline.evidence import EvidenceUnavailable, backend_build
from tests.entries import entry

TIER = "unit"

REPO = Path(__file__).resolve().parent.parent


def test_every_backend_name_has_an_implementation_and_a_layout() -> None:
    assert set(BACKENDS) == set(BACKEND_NAMES) == set(WEIGHTS_LAYOUTS) and DEFAULT_BACKEND in BACKENDS
    assert WEIGHTS_LAYOUTS["llama"].file_suffix == ".gguf" and not WEIGHTS_LAYOUTS["llama"].snapshot
    assert WEIGHTS_LAYOUTS["openvino"].snapshot and WEIGHTS_LAYOUTS["openvino"].paged_kv


def test_auto_summary_lines_come_from_the_backend() -> None:
    llama, openvino = backend_for("llama"), backend_for("openvino")
    assert llama.template_summary(None) == "(none: the GGUF template)"
    assert llama.template_summary("/h/models/m/chat_template.jinja") == "/h/models/m/chat_template.jinja"
    assert openvino.template_summary(None) == "the export's own"
    assert openvino.template_summary("/h/t.jinja") == "the export's own (registry copy checked: /h/t.jinja)"
    assert llama.serve_hint == "hotfit serve   (or --print-systemd-unit)"
    assert openvino.serve_hint == "hotfit serve --print-command   (OpenVINO Model Server; see the README)"


def test_serve_runs_llama_server_itself_and_refuses_openvino_naming_the_command() -> None:
    command = ServeCommand("ovms", ("ovms", "--rest_port", "8080"))
    assert backend_for("llama").serve_execs and backend_for("llama").serve_refusal("m", command) is None
    refusal = backend_for("openvino").serve_refusal("qwen3-8b-ov", command)
    assert not backend_for("openvino").serve_execs
    assert isinstance(refusal, UsageError) and refusal.exit_code == 2
    assert refusal.what.startswith("qwen3-8b-ov is an OpenVINO model: hotfit serve runs llama-server only")
    assert refusal.hint is not None and refusal.hint.endswith("verified settings: ovms --rest_port 8080")
    assert refusal.to_json()["details"] == {"backend": "openvino", "argv": ["ovms", "--rest_port", "8080"]}


def test_grade_evidence_is_refused_for_an_openvino_entry_by_its_backend(tmp_path: Path) -> None:
    ov = entry("ov-model", backend="openvino")
    with pytest.raises(BuildUnavailable, match="grade evidence is kept for llama-server models only"):
        backend_for("openvino").grade_build(ov, "cpu", load_settings(home=str(tmp_path)))
    with pytest.raises(EvidenceUnavailable) as caught:
        backend_build(ov, "cpu", load_settings(home=str(tmp_path)))
    assert caught.value.what == ("ov-model is an openvino entry: grade evidence is kept for llama-server models "
                                 "only (an OpenVINO snapshot has no single model sha256)")


def _name_comparisons(path: Path) -> list[int]:
    names = set(BACKEND_NAMES)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare) and any(isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn))
                                                 for op in node.ops):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in names for o in operands):
                found.append(node.lineno)
    return found


def test_nothing_outside_backends_compares_a_backends_name() -> None:
    offenders = []
    for package in ("core", "registry", "state", "grading", "download", "stages", "pipeline"):
        for path in sorted((REPO / package).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            offenders += [f"{rel}:{n}" for n in _name_comparisons(path)]
    assert offenders == [], "ask the backend (backends.select.backend_for) or the entry's layout instead:\n" + \
        "\n".join(offenders)


def test_the_name_check_sees_one(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('def f(e):\n    return e.backend == "openvino" or "llama" != e.backend or e.x == "other"\n')
    assert _name_comparisons(probe) == [2, 2]
