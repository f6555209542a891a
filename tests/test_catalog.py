"""registry.catalog: the bundled registry loads, and a broken one fails naming file, entry and field."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any, Callable

import pytest

from hotfit.core.errors import RegistryError, UsageError
from hotfit.pipeline.registry_file import bundled_registry_path, load_registry
from hotfit.registry.catalog import Registry, parse_registry, parse_registry_text
from hotfit.core.entry import BACKENDS, INELIGIBLE_CAUSES, ORIGINS, PERMISSIVE_LICENSES

TIER = "unit"

BUNDLED_JSON = json.loads(bundled_registry_path().read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def bundled() -> Registry:
    return load_registry()


def _doc_with(entry: dict[str, Any]) -> dict[str, Any]:
    return {"schema": 1, "entries": [entry]}


def _valid_entry() -> dict[str, Any]:
    """A real, auto-eligible entry of the bundled file (mutated by the table below)."""
    entry = next(e for e in BUNDLED_JSON["entries"] if e["name"] == "gpt-oss-20b")
    return copy.deepcopy(entry)


# --------------------------------------------------------------------------- the bundled file


def test_bundled_registry_loads_with_unique_names(bundled: Registry) -> None:
    assert len(bundled.entries) == len(BUNDLED_JSON["entries"]) >= 20
    assert len(set(bundled.names)) == len(bundled.names)
    assert BUNDLED_JSON["schema"] == 1


def test_bundled_file_records_every_field_of_every_entry() -> None:
    keys = {frozenset(e) for e in BUNDLED_JSON["entries"]}
    assert len(keys) == 1, "every entry records the same full set of fields"


@pytest.mark.parametrize("name", [
    "minicpm5-2b", "nanbeige4-3b-thinking", "qwen3.5-0.8b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.8-27b",
    "gemma4-e4b", "gemma4-12b", "gemma4-26b-a4b", "granite4.1-3b", "granite4.1-8b", "granite4.1-30b",
    "ministral3-8b", "ministral3-14b", "gigachat3.1-10b-a1.8b", "gpt-oss-20b", "qwen3-coder-30b-a3b",
    "muse-glimmer-30b", "qwen3-8b-ov", "phi4-mini-ov", "gemma4-e4b-ov",
])
def test_required_entries_are_present(bundled: Registry, name: str) -> None:
    assert bundled.get(name).name == name


def test_every_origin_and_both_backends_are_represented(bundled: Registry) -> None:
    assert {e.origin for e in bundled.entries} == set(ORIGINS)
    assert {e.backend for e in bundled.entries} == set(BACKENDS)


def test_every_auto_eligible_entry_has_every_fact_selection_needs(bundled: Registry) -> None:
    eligible = [e for e in bundled.entries if e.auto_eligible]
    assert eligible
    for e in eligible:
        assert e.license in PERMISSIVE_LICENSES, e.name
        assert e.artifact is not None, e.name
        # GGUFs are pinned; OpenVINO snapshots follow the current commit (spec).
        assert e.artifact.revision is not None or e.backend == "openvino", e.name
        assert e.weights_bytes is not None and e.weights_bytes > 0, e.name
        assert e.context_limit is not None and e.context_limit > 0, e.name
        assert e.config.layer_groups and e.config.n_layers, e.name
        assert e.chat_template is not None, e.name
        assert e.params_total_b is not None, e.name
        assert e.ineligible_reason is None and e.ineligible_cause is None, e.name
        if e.backend == "llama":
            assert e.architecture and e.artifact.file and e.artifact.file.endswith(".gguf"), e.name


def test_unverified_facts_keep_an_entry_out_of_automatic_selection(bundled: Registry) -> None:
    for e in bundled.entries:
        unverified = (
            e.context_limit is None or e.config.layer_groups is None or e.artifact is None
            or (e.artifact.revision is None and e.backend == "llama") or e.weights_bytes is None
        )
        if unverified:
            assert not e.auto_eligible, e.name
            assert e.ineligible_reason and e.ineligible_cause in INELIGIBLE_CAUSES, e.name


def test_nanbeige_is_listed_but_not_eligible_because_its_geometry_is_unverified(bundled: Registry) -> None:
    nanbeige = bundled.get("nanbeige4-3b-thinking")
    assert nanbeige.agentic_tier == "agentic" and not nanbeige.auto_eligible
    assert nanbeige.config.layer_groups is None and nanbeige.context_limit is None
    assert "geometry" in (nanbeige.ineligible_reason or "")


def test_agentic_entries_carry_sourced_evidence(bundled: Registry) -> None:
    for e in bundled.entries:
        if e.agentic_tier == "agentic":
            assert e.evidence, e.name
            assert all(ev.source and ev.summary for ev in e.evidence), e.name


# Files only this project's authors can see: a registry reader must be able to follow every citation.
_OUTSIDE_THE_PROJECT = re.compile(
    r"\.\./|shared/(?:reference|design)|reference/|model-facts|pinned-artifacts|contenox-(auto-)?facts|contenox-curated"
    r"|code index|index files? \d|\b\d{11}\b")
# A public locator: a URL, or an arXiv id.
_PUBLIC_LOCATOR = re.compile(r"https?://\S+|arXiv:\d{4}\.\d{4,5}")


def _cited_texts(entry: dict[str, Any]) -> list[tuple[str, str]]:
    out = [(f"evidence[{i}].source", ev["source"]) for i, ev in enumerate(entry.get("evidence") or [])]
    if entry.get("config") and entry["config"].get("source") is not None:  # null: the geometry is unverified
        out.append(("config.source", entry["config"]["source"]))
    return out


def test_every_source_cites_a_public_locator_and_nothing_outside_the_project() -> None:
    for entry in BUNDLED_JSON["entries"]:
        for where, text in _cited_texts(entry):
            assert not _OUTSIDE_THE_PROJECT.search(text), f"{entry['name']} {where}: {text}"
            assert _PUBLIC_LOCATOR.search(text), f"{entry['name']} {where} names no URL or arXiv id: {text}"


def test_notes_and_reasons_point_nowhere_outside_the_project() -> None:
    for entry in BUNDLED_JSON["entries"]:
        for field in ("notes", "ineligible_reason"):
            text = entry.get(field) or ""
            assert not _OUTSIDE_THE_PROJECT.search(text), f"{entry['name']} {field}: {text}"


def test_hybrid_and_sliding_geometry_is_recorded_as_the_sources_state(bundled: Registry) -> None:
    qwen = bundled.get("qwen3.5-9b").config
    assert qwen.recurrent and qwen.n_layers == 32
    assert sum(g.count for g in qwen.layer_groups or ()) == 8  # the full-attention layers
    gemma = bundled.get("gemma4-12b").config
    groups = gemma.layer_groups or ()
    assert len(groups) == 2 and sum(g.count for g in groups) == gemma.n_layers == 48
    sliding = [g for g in groups if g.window_tokens is not None]
    assert len(sliding) == 1 and sliding[0].window_tokens == 1024
    assert {(g.n_kv_heads, g.head_dim_k) for g in groups} == {(8, 256), (1, 512)}
    gpt = bundled.get("gpt-oss-20b").config
    assert [g.window_tokens for g in gpt.layer_groups or ()] == [128, None]
    assert bundled.get("gigachat3.1-10b-a1.8b").config.mla


def test_openvino_context_ceilings_are_the_exported_ones(bundled: Registry) -> None:
    assert bundled.get("qwen3-8b-ov").context_limit == 40960
    assert bundled.get("phi4-mini-ov").context_limit == 4096
    vlm = bundled.get("gemma4-e4b-ov")
    assert not vlm.auto_eligible and vlm.ineligible_cause == "vision-path"


def test_the_tool_chat_smoke_entry_has_the_largest_window_of_its_origin(bundled: Registry) -> None:
    smoke = bundled.get("qwen3.5-0.8b")
    assert smoke.agentic_tier == "tool-chat" and smoke.auto_eligible
    china = [e for e in bundled.filter(backend="llama", origin="china") if e.context_limit]
    assert smoke.context_limit == max(e.context_limit or 0 for e in china)


# --------------------------------------------------------------------------- Registry API


def test_get_unknown_name_lists_close_names(bundled: Registry) -> None:
    with pytest.raises(UsageError) as info:
        bundled.get("qwen3.5-9")
    assert "qwen3.5-9b" in str(info.value)
    assert "qwen3.5-9b" in info.value.details["close_matches"]
    assert "registry list" in (info.value.hint or "")


def test_filter_by_backend_and_origin(bundled: Registry) -> None:
    eu = bundled.filter(backend="llama", origin="eu")
    assert eu and all(e.origin == "eu" and e.backend == "llama" for e in eu)
    assert bundled.filter(origin="auto") == bundled.entries
    assert all(e.backend == "openvino" for e in bundled.filter(backend="openvino"))


def test_entries_are_frozen(bundled: Registry) -> None:
    with pytest.raises(AttributeError):
        bundled.entries[0].name = "x"  # type: ignore[misc]


def test_load_registry_from_a_file_path(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"
    path.write_text(json.dumps(_doc_with(_valid_entry())))
    reg = load_registry(path)
    assert reg.names == ("gpt-oss-20b",) and reg.source == str(path)


def test_missing_registry_file_is_a_registry_error(tmp_path: Path) -> None:
    with pytest.raises(RegistryError) as info:
        load_registry(tmp_path / "nope.json")
    assert "nope.json" in str(info.value) and info.value.hint


def test_a_deeply_nested_registry_file_is_a_registry_error() -> None:
    with pytest.raises(RegistryError) as info:
        parse_registry_text("[" * 100_000 + "]" * 100_000, "deep.json")
    assert "deep.json" in str(info.value) and info.value.hint


@pytest.mark.parametrize("field", ["params_total_b", "params_active_b"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_non_finite_parameter_counts_are_refused(field: str, value: float) -> None:
    entry = _valid_entry()
    entry[field] = value
    with pytest.raises(RegistryError) as info:
        parse_registry_text(json.dumps(_doc_with(entry)), "nan.json")
    assert repr(field) in str(info.value)


def test_invalid_json_names_line_and_column() -> None:
    with pytest.raises(RegistryError) as info:
        parse_registry_text('{"schema": 1,\n "entries": [}', "bad.json")
    assert "bad.json" in str(info.value) and "line 2" in str(info.value)


# --------------------------------------------------------------------------- schema errors (table)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(entry: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = entry
        for key in parents:
            target = target[int(key)] if key.isdigit() else target[key]
        target[int(last) if last.isdigit() else last] = value
    return apply


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    return lambda entry: entry.pop(key)


BROKEN: list[tuple[str, Callable[[dict[str, Any]], None], str]] = [
    ("missing field", _drop("context_limit"), "'context_limit' is missing"),
    ("unknown field", _set("vram_tier", 8), "'vram_tier' is not a registry field"),
    ("bad backend", _set("backend", "vllm"), "'backend' is 'vllm', not one of llama, openvino"),
    ("bad origin", _set("origin", "asia"), "'origin' is 'asia'"),
    ("bad tier", _set("agentic_tier", "smart"), "'agentic_tier'"),
    ("short revision", _set("artifact.revision", "e1dc459f"), "'artifact.revision' is 'e1dc459f', not a 40-hex"),
    ("branch revision", _set("artifact.revision", "main"), "'artifact.revision'"),
    ("bad sha256", _set("artifact.sha256", "XYZ"), "'artifact.sha256'"),
    ("float size", _set("artifact.size_bytes", 12.1e9), "'artifact.size_bytes' must be a positive whole number"),
    ("zero size", _set("artifact.size_bytes", 0), "'artifact.size_bytes'"),
    ("bool size", _set("artifact.size_bytes", True), "'artifact.size_bytes'"),
    ("bad repo", _set("artifact.repo", "gpt-oss-20b-GGUF"), "'artifact.repo'"),
    ("not gguf", _set("artifact.file", "model.safetensors"), "'artifact.file' is 'model.safetensors', not a .gguf"),
    ("template file", _set("chat_template.file", "README.md"), "'chat_template.file'"),
    ("negative context", _set("context_limit", -1), "'context_limit'"),
    ("zero kv heads", _set("config.layer_groups.0.n_kv_heads", 0), "'config.layer_groups[0].n_kv_heads'"),
    ("groups exceed layers", _set("config.n_layers", 20), "'config.layer_groups' cover 24 layers but n_layers is 20"),
    ("groups short of layers", _set("config.n_layers", 30), "'config.layer_groups' cover 24 of 30 layers"),
    ("bad date", _set("release_date", "August 2025"), "'release_date' is 'August 2025', not an ISO date"),
    ("bad month", _set("release_date", "2025-13"), "'release_date'"),
    ("active above total", _set("params_active_b", 30.0), "'params_active_b'"),
    ("bad name", _set("name", "GPT OSS"), "'name' is 'GPT OSS'"),
    ("evidence kind", _set("evidence.0.kind", "vibes"), "'evidence[0].kind'"),
    ("agentic without evidence", _set("evidence", []), "'evidence' is empty for an agentic entry"),
    ("eligible non-permissive", _set("license", "Gemma"), "'license' is 'Gemma'; automatic selection requires Apache-2.0 or MIT"),
    ("eligible unknown context", _set("context_limit", None), "'context_limit' is null on an auto-eligible entry"),
    ("eligible unknown geometry", _set("config.layer_groups", None), "'config.layer_groups' is null on an auto-eligible entry"),
    ("eligible unpinned", _set("artifact.revision", None), "'artifact.revision' is null on an auto-eligible entry"),
    ("eligible unknown size", _set("artifact.size_bytes", None), "'artifact.size_bytes' is null on an auto-eligible entry"),
    ("eligible no template", _set("chat_template", None), "'chat_template' is null on an auto-eligible entry"),
    ("eligible no architecture", _set("architecture", None), "'architecture' is null on an auto-eligible llama entry"),
    ("eligible with reason", _set("ineligible_reason", "because"), "'ineligible_reason' is set on an auto-eligible entry"),
    ("ineligible without reason", _set("auto_eligible", False), "'ineligible_reason' is null for an entry that is not auto-eligible"),
    ("bad cause", _set("ineligible_cause", "vibes"), "'ineligible_cause'"),
]


@pytest.mark.parametrize("label,mutate,expected", BROKEN, ids=[b[0] for b in BROKEN])
def test_schema_errors_name_the_file_entry_and_field(label: str, mutate: Callable[[dict[str, Any]], None],
                                                      expected: str) -> None:
    entry = _valid_entry()
    parse_registry(_doc_with(copy.deepcopy(entry)), "x.json")  # the base entry itself is valid
    mutate(entry)
    with pytest.raises(RegistryError) as info:
        parse_registry(_doc_with(entry), "curated-test.json")
    message = str(info.value)
    assert message.startswith("curated-test.json: entry "), message
    assert expected in message, message
    assert info.value.hint, "every schema error says what to do"
    assert info.value.exit_code == 2


def test_duplicate_names_are_refused() -> None:
    entry = _valid_entry()
    with pytest.raises(RegistryError) as info:
        parse_registry({"schema": 1, "entries": [entry, copy.deepcopy(entry)]}, "dup.json")
    assert "'name' repeats entry #0" in str(info.value)


@pytest.mark.parametrize("doc,expected", [
    ([], "top level must be an object"),
    ({"schema": 2, "entries": []}, "'schema' is 2"),
    ({"entries": []}, "'schema' is None"),
    ({"schema": 1, "entries": []}, "'entries' must be a non-empty list"),
    ({"schema": 1, "entries": ["x"]}, "must be an object"),
])
def test_document_level_errors(doc: Any, expected: str) -> None:
    with pytest.raises(RegistryError) as info:
        parse_registry(doc, "doc.json")
    assert expected in str(info.value)


def test_a_non_eligible_entry_may_leave_unverified_facts_null() -> None:
    entry = _valid_entry()
    entry.update(auto_eligible=False, ineligible_cause="unverified", ineligible_reason="context not verified",
                 context_limit=None)
    entry["config"]["layer_groups"] = None
    entry["artifact"].update(revision=None, size_bytes=None, sha256=None)
    reg = parse_registry(_doc_with(entry), "x.json")
    assert reg.entries[0].weights_bytes is None and not reg.entries[0].auto_eligible


# --------------------------------------------------------------------------- `hotfit registry list`


def test_cli_registry_list_json_lists_every_entry_with_its_facts(hotfit_home: Path) -> None:
    import io

    from hotfit.pipeline.cli import main

    buf = io.StringIO()
    assert main(["--json", "registry", "list"], out=buf) == 0
    data = json.loads(buf.getvalue())
    rows = {r["name"]: r for r in data["entries"]}
    assert set(rows) == {e["name"] for e in BUNDLED_JSON["entries"]}  # every entry; PULL marks what cannot be fetched
    minicpm = rows["minicpm5-2b"]
    assert minicpm["agentic_tier"] == "agentic" and minicpm["origin"] == "china" and minicpm["backend"] == "llama"
    assert minicpm["download_bytes"] == 1561318368 and minicpm["context_limit"] == 131072
    assert minicpm["auto_eligible"] is True and minicpm["ineligible_reason"] is None
    assert rows["nanbeige4-3b-thinking"]["auto_eligible"] is False
    assert "geometry" in rows["nanbeige4-3b-thinking"]["ineligible_reason"]


def test_cli_registry_list_text_and_custom_file(tmp_path: Path, hotfit_home: Path) -> None:
    import io

    from hotfit.pipeline.cli import main

    entry = _valid_entry()
    entry.update(auto_eligible=False, ineligible_cause="license", ineligible_reason="custom licence", license="Other")
    path = tmp_path / "reg.json"
    path.write_text(json.dumps(_doc_with(entry)))
    buf = io.StringIO()
    assert main(["registry", "list", "--registry", str(path)], out=buf) == 0
    text = buf.getvalue()
    assert "gpt-oss-20b" in text and "11.28 GiB" in text and "128K" in text
    assert "gpt-oss-20b: custom licence" in text and str(path) in text


def test_cli_registry_list_broken_file_exits_2_naming_the_field(tmp_path: Path, hotfit_home: Path) -> None:
    import io

    from hotfit.pipeline.cli import main

    entry = _valid_entry()
    entry["backend"] = "vllm"
    path = tmp_path / "reg.json"
    path.write_text(json.dumps(_doc_with(entry)))
    buf = io.StringIO()
    assert main(["--json", "registry", "list", "--registry", str(path)], out=buf) == 2
    error = json.loads(buf.getvalue())["error"]
    assert error["code"] == "registry" and "'backend'" in error["message"]
    assert error["details"]["entry"] == "gpt-oss-20b" and error["details"]["field"] == "backend"


def test_cli_registry_list_marks_entries_that_cannot_be_downloaded(hotfit_home: Path) -> None:
    import io

    from hotfit.pipeline.cli import main

    buf = io.StringIO()
    assert main(["--json", "registry", "list"], out=buf) == 0
    rows = {r["name"]: r for r in json.loads(buf.getvalue())["entries"]}
    nanbeige = rows["nanbeige4-3b-thinking"]  # its GGUF has no pinned revision: `pull` refuses it
    assert nanbeige["downloadable"] is False and "not pinned to a commit" in nanbeige["download_blocker"]
    assert rows["minicpm5-2b"]["downloadable"] is True and rows["minicpm5-2b"]["download_blocker"] is None
    assert rows["qwen3-8b-ov"]["downloadable"] is True  # an OpenVINO snapshot follows the current commit (spec)
    buf = io.StringIO()
    assert main(["registry", "list"], out=buf) == 0
    text = buf.getvalue()
    header = next(line for line in text.splitlines() if line.startswith("NAME"))
    assert "PULL" in header.split()
    row = next(line for line in text.splitlines() if line.startswith("nanbeige4-3b-thinking "))
    assert row.split()[header.split().index("PULL")] == "no"
    minicpm = next(line for line in text.splitlines() if line.startswith("minicpm5-2b "))
    assert minicpm.split()[header.split().index("PULL")] == "yes"
    assert "cannot be downloaded (no pinned artifact)" in text
    assert "  nanbeige4-3b-thinking: " in text.split("cannot be downloaded (no pinned artifact)")[1]


def test_cli_registry_list_shows_an_entry_without_an_artifact_as_not_downloadable(tmp_path: Path,
                                                                                  hotfit_home: Path) -> None:
    import io

    from hotfit.pipeline.cli import main

    entry = _valid_entry()
    entry.update(auto_eligible=False, ineligible_cause="unverified", ineligible_reason="no artifact yet",
                 artifact=None)
    path = tmp_path / "reg.json"
    path.write_text(json.dumps(_doc_with(entry)))
    buf = io.StringIO()
    assert main(["--json", "registry", "list", "--registry", str(path)], out=buf) == 0
    (row,) = json.loads(buf.getvalue())["entries"]
    assert row["name"] == "gpt-oss-20b" and row["downloadable"] is False and "no artifact" in row["download_blocker"]
