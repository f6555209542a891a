"""Eligibility evidence is checked, not asserted.

Reads the pinned llama.cpp source tree that ``scripts/install-llama-server`` builds from
(``<llama cache>/<sdist version>/work/src/vendor/llama.cpp``) and confirms that every auto-eligible
llama entry's architecture is in ``src/llama-arch.cpp``'s name table, that every entry excluded
for its architecture is absent from it, and that the tool-call handler or template an eligible entry
names exists in ``common/chat.cpp`` / ``models/templates``. A backend upgrade that adds or drops an
architecture then shows up here as a failing test, not as a silent change of selection.

The tree is absent on a machine that never ran the install script: the checks skip there, and fail
when ``HOTFIT_REQUIRE_LLAMA`` is set (CI).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from hotfit.core.settings import LLAMA_SDIST_VERSION, default_llama_cache
from hotfit.pipeline.registry_file import load_registry
from hotfit.registry.catalog import Registry

TIER = "unit"

REQUIRE_ENV = "HOTFIT_REQUIRE_LLAMA"

# One row of the table: `    { LLM_ARCH_QWEN35, "qwen35" },`
_ARCH_ROW = re.compile(r'\{\s*LLM_ARCH_[A-Z0-9_]+\s*,\s*"([^"]+)"\s*\}')
_HANDLER = re.compile(r"^([a-z0-9_]+) \(")


def llama_source_tree(env: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    """Where the install script unpacks the vendored llama.cpp (core/settings.py cache layout)."""
    return default_llama_cache(env) / LLAMA_SDIST_VERSION / "work" / "src" / "vendor" / "llama.cpp"


def architecture_names(arch_cpp: str) -> frozenset[str]:
    """The names of ``LLM_ARCH_NAMES`` in a ``src/llama-arch.cpp`` text (pure)."""
    start = arch_cpp.find("LLM_ARCH_NAMES")
    if start < 0:
        raise ValueError("no LLM_ARCH_NAMES table in llama-arch.cpp")
    end = arch_cpp.find("};", start)
    names = frozenset(_ARCH_ROW.findall(arch_cpp[start:end]))
    if not names:
        raise ValueError("LLM_ARCH_NAMES table is empty or its format changed")
    return names


@pytest.fixture(scope="module")
def tree() -> Path:
    root = llama_source_tree()
    if not (root / "src" / "llama-arch.cpp").is_file():
        message = (f"pinned llama.cpp source tree not found at {root} "
                   "(run scripts/install-llama-server; set HOTFIT_LLAMA_CACHE if it lives elsewhere)")
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(message + f" — {REQUIRE_ENV} is set, so this is a failure")
        pytest.skip(message)
    return root


@pytest.fixture(scope="module")
def arch_names(tree: Path) -> frozenset[str]:
    return architecture_names((tree / "src" / "llama-arch.cpp").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry()


# --------------------------------------------------------------------------- pure parser


def test_architecture_table_parser_reads_names_and_stops_at_the_table_end() -> None:
    text = """
    static const std::map<llm_arch, const char *> LLM_ARCH_NAMES = {
        { LLM_ARCH_LLAMA,            "llama"            },
        { LLM_ARCH_MUSE_GLIMMER,     "muse-glimmer"     },
        { LLM_ARCH_UNKNOWN,          "(unknown)"        },
    };
    static const std::map<llm_kv, const char *> LLM_KV_NAMES = {
        { LLM_KV_GENERAL_TYPE, "general.type" },
    };
    """
    assert architecture_names(text) == {"llama", "muse-glimmer", "(unknown)"}


def test_architecture_table_parser_refuses_a_changed_format() -> None:
    with pytest.raises(ValueError):
        architecture_names("nothing here")
    with pytest.raises(ValueError):
        architecture_names("LLM_ARCH_NAMES = { LLM_ARCH_LLAMA => llama };")


def test_tree_path_follows_the_settings_cache_layout(tmp_path: Path) -> None:
    root = llama_source_tree({"HOTFIT_LLAMA_CACHE": str(tmp_path)})
    assert root == tmp_path / LLAMA_SDIST_VERSION / "work" / "src" / "vendor" / "llama.cpp"


# --------------------------------------------------------------------------- against the pinned tree


def test_every_auto_eligible_llama_entry_has_an_architecture_the_pin_knows(
        registry: Registry, arch_names: frozenset[str]) -> None:
    eligible = [e for e in registry.filter(backend="llama") if e.auto_eligible]
    assert eligible
    missing = {e.name: e.architecture for e in eligible if e.architecture not in arch_names}
    assert not missing, f"auto-eligible entries whose architecture the pinned llama.cpp lacks: {missing}"


def test_every_entry_excluded_for_its_architecture_is_absent_from_the_pin(
        registry: Registry, arch_names: frozenset[str]) -> None:
    for e in registry.filter(backend="llama"):
        if e.ineligible_cause == "architecture":
            assert e.architecture, f"{e.name}: excluded for its architecture but records none"
            assert e.architecture not in arch_names, (
                f"{e.name}: excluded because its architecture {e.architecture!r} is absent, "
                "but the pinned llama.cpp has it — re-check the exclusion")


def test_muse_glimmer_is_not_excluded_for_an_architecture_the_pin_has(
        registry: Registry, arch_names: frozenset[str], tree: Path) -> None:
    # The spec says muse_glimmer is absent from the pinned llama.cpp; in our pin it is present,
    # converted and parsed, so its recorded exclusion must rest on something else.
    muse = registry.get("muse-glimmer-30b")
    assert muse.architecture in arch_names
    assert (tree / "common" / "parsers" / "muse-glimmer.cpp").is_file()
    assert not muse.auto_eligible and muse.ineligible_cause != "architecture"


def test_every_eligible_entry_names_a_tool_call_handler_or_template_the_pin_has(
        registry: Registry, tree: Path) -> None:
    chat_cpp = (tree / "common" / "chat.cpp").read_text(encoding="utf-8")
    templates = {p.name for p in (tree / "models" / "templates").glob("*.jinja")}
    for e in registry.filter(backend="llama"):
        if not e.auto_eligible:
            continue
        assert e.tool_parser, f"{e.name}: no tool parser recorded"
        match = _HANDLER.match(e.tool_parser)
        assert match, f"{e.name}: tool_parser {e.tool_parser!r} does not start with a handler name"
        handler = match.group(1)
        if handler == "autoparser":
            named = re.findall(r"([\w.\-]+\.jinja)", e.tool_parser)
            assert named and all(t in templates for t in named), (
                f"{e.name}: template(s) {named} not in the pinned models/templates")
        else:
            assert f"common_chat_params_init_{handler}(" in chat_cpp, (
                f"{e.name}: common/chat.cpp of the pin has no common_chat_params_init_{handler}")
