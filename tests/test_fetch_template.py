"""fetch-template: tokenizer_config variants, the tool-call check, and the stage against the local Hub."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from hotfit.core.errors import TemplateError
from hotfit.core.entry import Entry, TemplateSource
from hotfit.core.model_files import TemplateResult
from hotfit.core.settings import Settings, load_settings
from hotfit.stages.fetch_template import (
    MAX_TEMPLATE_SOURCE_BYTES,
    TEMPLATE_FILENAME,
    check_tool_capable,
    extract_template,
    fetch_template,
)
from hotfit.stages.fetch_weights import fetch_weights
from hotfit.stages.verify import verify
from tests.gguf_fixtures import pinned_template
from tests.hubserver import LocalHub
from tests.test_fetch_weights import FAST, make_entry, make_gguf, settings_for, sha256_of

TIER = "integration"

TOOLS = "{%- if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
CHATML = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"


def cfg(value: Any) -> bytes:
    return json.dumps({"bos_token": "<s>", "chat_template": value}).encode()


# --------------------------------------------------------------------------- pure parsing


@pytest.mark.parametrize("filename, data, text, variant", [
    ("chat_template.jinja", TOOLS.encode(), TOOLS, "jinja"),
    ("tokenizer_config.json", cfg(TOOLS), TOOLS, "tokenizer_config:string"),
    ("tokenizer_config.json", cfg([{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOLS}]),
     TOOLS, "tokenizer_config:tool_use"),
    ("tokenizer_config.json", cfg([{"name": "rag", "template": "x"}, {"name": "default", "template": TOOLS}]),
     TOOLS, "tokenizer_config:default"),
])
def test_extract_template_variants(filename: str, data: bytes, text: str, variant: str) -> None:
    assert extract_template(filename, data) == (text, variant)


@pytest.mark.parametrize("filename, data, why", [
    ("tokenizer_config.json", json.dumps({"bos_token": "<s>"}).encode(), "no chat_template"),
    ("tokenizer_config.json", cfg([{"name": "rag", "template": TOOLS}]), "neither 'tool_use' nor 'default'"),
    ("tokenizer_config.json", cfg(42), "not a string or list"),
    ("tokenizer_config.json", b"[1, 2]", "not an object"),
    ("tokenizer_config.json", b"{\"chat_template\": ", "not valid JSON"),
    ("tokenizer_config.json", cfg("   "), "empty"),
    ("chat_template.jinja", b"\xff\xfe{{ tools }}", "not UTF-8"),
])
def test_bad_template_sources_are_template_errors(filename: str, data: bytes, why: str) -> None:
    with pytest.raises(TemplateError, match=why):
        extract_template(filename, data)


@pytest.mark.parametrize("filename, data", [
    ("tokenizer_config.json", json.dumps({"bos_token": "<s>"}).encode()),
    ("tokenizer_config.json", cfg([{"name": "rag", "template": TOOLS}])),
    ("tokenizer_config.json", cfg(42)),
    ("tokenizer_config.json", cfg({"default": TOOLS})),
    ("tokenizer_config.json", b"[1, 2]"),
    ("tokenizer_config.json", b"{\"chat_template\": "),
    ("tokenizer_config.json", cfg("   ")),
    ("tokenizer_config.json", cfg("{{ tools }}" + " " * (1 << 20))),
    ("chat_template.jinja", b"\xff\xfe{{ tools }}"),
])
def test_every_bad_template_source_says_what_to_do(filename: str, data: bytes) -> None:
    with pytest.raises(TemplateError) as exc:
        extract_template(filename, data)
    assert filename in str(exc.value) and exc.value.hint


def test_tool_capability_check() -> None:
    assert "tools" in check_tool_capable(TOOLS, source="t")
    assert "<tool_call>" in check_tool_capable("{{ m }}<tool_call>{{ x }}</tool_call>", source="t")
    assert "[TOOL_CALLS]" in check_tool_capable("[TOOL_CALLS]{{ calls }}", source="t")
    with pytest.raises(TemplateError, match="cannot express tool calls"):
        check_tool_capable(CHATML, source="chatml")
    with pytest.raises(TemplateError):  # the word outside a Jinja tag is prose, not the variable
        check_tool_capable("You may use tools. {{ messages }}", source="prose")


def test_pinned_llama_cpp_templates() -> None:
    # The pinned llama.cpp tree (scripts/install-llama-server): absent, this skips with the reason
    # (and fails under HOTFIT_REQUIRE_LLAMA), like the tests that need the server.
    qwen = pinned_template("Qwen-Qwen3-0.6B.jinja").read_text()
    assert {"tools", "<tool_call>"} <= set(check_tool_capable(qwen, source="qwen3"))
    hermes = pinned_template("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja").read_text()
    assert check_tool_capable(hermes, source="hermes3")
    with pytest.raises(TemplateError):  # gemma-2's template has no tool support at all
        check_tool_capable(pinned_template("google-gemma-2-2b-it.jinja").read_text(), source="gemma2")


# --------------------------------------------------------------------------- the stage


@pytest.fixture
def hub_repo(local_hub: LocalHub, tmp_path: Path) -> dict[str, Any]:
    weights = make_gguf(tmp_path / "model.gguf", pad_bytes=200_000, template=CHATML)
    commit = local_hub.create_repo("org/m-GGUF", {"model.gguf": weights}, lfs=["model.gguf"])
    src = local_hub.create_repo("org/m", {
        "tokenizer_config.json": cfg([{"name": "default", "template": CHATML}, {"name": "tool_use", "template": TOOLS}]),
        "no_tools.jinja": CHATML,
        "chat_template.jinja": TOOLS,
    })
    return {"weights": weights, "commit": commit, "src": src}


async def _fetched(local_hub: LocalHub, tmp_path: Path, repo: dict[str, Any], template: TemplateSource | None) -> Any:
    w = repo["weights"]
    entry = make_entry("m", "org/m-GGUF", repo["commit"], "model.gguf", w.stat().st_size, sha256_of(w),
                       template=template)
    settings = settings_for(local_hub, tmp_path / "home")
    fetched = await fetch_weights(entry, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
    return entry, settings, fetched


def _path(result: TemplateResult) -> Path:
    """The fetched template's file (a result without one fails here, by name)."""
    assert result.path is not None, result
    return Path(result.path)


async def _template(entry: Entry, settings: Settings) -> TemplateResult:
    """fetch-template for ``entry`` into model directory "m"."""
    return await fetch_template(entry, settings.model_dir("m"), settings=settings)


@pytest.mark.anyio
async def test_tokenizer_config_tool_use_written_beside_weights(local_hub: LocalHub, tmp_path: Path,
                                                               hub_repo: dict[str, Any]) -> None:
    src = TemplateSource("org/m", hub_repo["src"], "tokenizer_config.json")
    entry, settings, fetched = await _fetched(local_hub, tmp_path, hub_repo, src)
    result = await _template(entry, settings)
    assert _path(result).read_text() == TOOLS and _path(result).name == TEMPLATE_FILENAME
    assert result.variant == "tokenizer_config:tool_use"
    verified = await verify(entry, settings.model_dir("m"), fetched=fetched, template=result)
    assert verified.gguf_embeds_chat_template is True  # the GGUF carries (a ChatML) template; verify records it
    assert verified.chat_template_path == result.path
    assert result.source == f"org/m@{hub_repo['src']}/tokenizer_config.json"
    assert not list((settings.model_dir("m") / ".partial").glob("*.part"))


@pytest.mark.anyio
async def test_unpinned_source_resolves_and_records_the_commit(local_hub: LocalHub, tmp_path: Path,
                                                              hub_repo: dict[str, Any]) -> None:
    entry, settings, fetched = await _fetched(local_hub, tmp_path, hub_repo,
                                              TemplateSource("org/m", None, "chat_template.jinja"))
    result = await _template(entry, settings)
    assert result.source == f"org/m@{hub_repo['src']}/chat_template.jinja" and result.variant == "jinja"


@pytest.mark.anyio
async def test_template_without_tools_fails_and_keeps_the_weights(local_hub: LocalHub, tmp_path: Path,
                                                                  hub_repo: dict[str, Any]) -> None:
    entry, settings, fetched = await _fetched(local_hub, tmp_path, hub_repo,
                                              TemplateSource("org/m", hub_repo["src"], "no_tools.jinja"))
    with pytest.raises(TemplateError, match="cannot express tool calls"):
        await _template(entry, settings)
    assert not (settings.model_dir("m") / TEMPLATE_FILENAME).exists()
    # nothing downloaded is lost: the hashed partial waits for verify
    assert Path(fetched.weights.partial_path).read_bytes() == hub_repo["weights"].read_bytes()


@pytest.mark.anyio
async def test_missing_named_template_is_a_template_error(local_hub: LocalHub, tmp_path: Path,
                                                          hub_repo: dict[str, Any]) -> None:
    entry, settings, _f = await _fetched(local_hub, tmp_path, hub_repo,
                                         TemplateSource("org/m", hub_repo["src"], "gone.jinja"))
    with pytest.raises(TemplateError, match="could not be fetched") as exc:
        await _template(entry, settings)
    assert exc.value.exit_code == 4


@pytest.mark.anyio
async def test_corrupt_small_file_fails_its_git_blob_check(local_hub: LocalHub, tmp_path: Path,
                                                           hub_repo: dict[str, Any]) -> None:
    entry, settings, _f = await _fetched(local_hub, tmp_path, hub_repo,
                                         TemplateSource("org/m", hub_repo["src"], "chat_template.jinja"))
    local_hub.inject(file="chat_template.jinja", method="GET", corrupt=True, times=1)
    with pytest.raises(TemplateError, match="git blob"):
        await _template(entry, settings)
    assert not (settings.model_dir("m") / TEMPLATE_FILENAME).exists()


@pytest.mark.anyio
async def test_no_template_named_records_the_gguf_one(local_hub: LocalHub, tmp_path: Path,
                                                      hub_repo: dict[str, Any]) -> None:
    entry, settings, fetched = await _fetched(local_hub, tmp_path, hub_repo, None)
    result = await _template(entry, settings)
    assert result.path is None
    verified = await verify(entry, settings.model_dir("m"), fetched=fetched, template=result)
    assert verified.gguf_embeds_chat_template is True and verified.chat_template_path is None


@pytest.mark.anyio
async def test_relative_redirect_to_resolve_cache_is_followed(tmp_path: Path) -> None:
    # The real Hub answers small files with 307 to /api/resolve-cache/... (hf-protocol.md §1.4).
    with LocalHub(tmp_path / "hub", redirect_small=True) as hub:
        weights = make_gguf(tmp_path / "model.gguf", pad_bytes=100_000)
        commit = hub.create_repo("org/m", {"model.gguf": weights, "chat_template.jinja": TOOLS}, lfs=["model.gguf"])
        entry = make_entry("m", "org/m", commit, "model.gguf", weights.stat().st_size, sha256_of(weights),
                           template=TemplateSource("org/m", commit, "chat_template.jinja"))
        settings = settings_for(hub, tmp_path / "home")
        result = await _template(entry, settings)
        assert _path(result).read_text() == TOOLS
        assert any(r.status == 307 for r in hub.requests_for(file="chat_template.jinja"))


@pytest.mark.anyio
async def test_template_in_place_is_not_fetched_again_and_works_offline(local_hub: LocalHub, tmp_path: Path,
                                                                        hub_repo: dict[str, Any]) -> None:
    src = TemplateSource("org/m", hub_repo["src"], "tokenizer_config.json")
    entry, settings, fetched = await _fetched(local_hub, tmp_path, hub_repo, src)
    first = await _template(entry, settings)
    local_hub.reset_counters()
    offline = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": local_hub.endpoint,
                             "HF_HUB_OFFLINE": "1"})
    again = await fetch_template(entry, offline.model_dir("m"), settings=offline)
    assert local_hub.requests == []
    assert (again.path, again.sha256, again.variant, again.tool_markers) == (
        first.path, first.sha256, first.variant, first.tool_markers)
    _path(first).write_text("{{ tampered }}")  # text no longer what the receipt vouches for: fetched again
    third = await _template(entry, settings)
    assert _path(third).read_text() == TOOLS and local_hub.requests


@pytest.mark.anyio
async def test_an_oversized_template_source_is_refused_before_it_is_downloaded(local_hub: LocalHub,
                                                                                tmp_path: Path) -> None:
    # A template source far past any real one (a wrong file, a hostile repo) must not be fetched
    # in full and read into memory before extract_template's bound says no.
    weights = make_gguf(tmp_path / "model.gguf", pad_bytes=100_000)
    big = b"{{ tools }}" + b" " * (MAX_TEMPLATE_SOURCE_BYTES + 1)
    commit = local_hub.create_repo("org/big", {"model.gguf": weights, "chat_template.jinja": big},
                                   lfs=["model.gguf"])
    entry = make_entry("m", "org/big", commit, "model.gguf", weights.stat().st_size, sha256_of(weights),
                       template=TemplateSource("org/big", commit, "chat_template.jinja"))
    settings = settings_for(local_hub, tmp_path / "home")
    with pytest.raises(TemplateError, match="too large|exceeds"):
        await _template(entry, settings)
    assert local_hub.bytes_sent("chat_template.jinja") == 0
    assert not (settings.model_dir("m") / TEMPLATE_FILENAME).exists()


@pytest.mark.anyio
async def test_a_template_from_a_server_that_is_not_a_hub_says_so(not_a_hub: str, tmp_path: Path) -> None:
    settings = load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": not_a_hub})
    for src in (TemplateSource("org/m", "1" * 40, "chat_template.jinja"),
                TemplateSource("org/m", None, "chat_template.jinja")):  # pinned, and resolved from main
        entry = make_entry("m", "org/m-GGUF", "2" * 40, "model.gguf", 1000, "a" * 64, template=src)
        with pytest.raises(TemplateError) as exc:
            await fetch_template(entry, settings.model_dir("m"), settings=settings, options=FAST)
        assert "HF_ENDPOINT does not answer like a Hugging Face Hub" in exc.value.what
        assert not_a_hub in exc.value.what and "renamed" not in str(exc.value)


# --------------------------------------------------------------------------- a template inside an OpenVINO snapshot


def _ov_entry_with_template(repo_id: str, template_file: str, revision: str | None = None) -> Entry:
    """An entry shaped like the bundled OpenVINO ones: the template is a file of the snapshot itself."""
    from dataclasses import replace

    from hotfit.core.entry import Artifact

    base = make_entry("ov", repo_id, "0" * 40, "x", None, None, backend="openvino")
    return replace(base, artifact=Artifact(repo_id, None, None, None, None), architecture=None,
                   chat_template=TemplateSource(repo_id, revision, template_file))


SNAPSHOT_SOURCES = {"tokenizer_config.json": cfg(TOOLS), "chat_template.jinja": TOOLS.encode()}


@pytest.mark.anyio
@pytest.mark.parametrize("template_file", sorted(SNAPSHOT_SOURCES))
async def test_a_template_inside_the_snapshot_is_read_from_it_not_downloaded_again(
        local_hub: LocalHub, tmp_path: Path, template_file: str) -> None:
    from hotfit.pipeline.pull import pull_entry

    files = {"openvino_model.xml": b"<net/>" * 50, "openvino_model.bin": b"\x01" * 300_000,
             template_file: SNAPSHOT_SOURCES[template_file]}
    commit = local_hub.create_repo("OpenVINO/t-ov", files, lfs=["openvino_model.bin"])
    entry = _ov_entry_with_template("OpenVINO/t-ov", template_file)
    settings = settings_for(local_hub, tmp_path / "home")
    pulled = await pull_entry(entry, settings, progress=False)
    dest = settings.model_dir("ov")
    # verify found every file of the snapshot, the template's source among them, in place
    assert pulled.verify.files_checked == 3
    for name, data in files.items():
        assert (dest / "snapshot" / name).read_bytes() == data
    # the template is the snapshot's own file, at the snapshot's commit, fetched once
    assert pulled.template.source == f"OpenVINO/t-ov@{commit}/{template_file}"
    assert _path(pulled.template).read_text() == TOOLS
    assert len(local_hub.requests_for(file=template_file, method="GET")) == 1
    assert not [p for p in (dest / ".partial").rglob("*.part")]
    # a second pull changes nothing and downloads nothing
    local_hub.reset_counters()
    again = await pull_entry(entry, settings, progress=False)
    assert again.template.sha256 == pulled.template.sha256 and again.verify.files_checked == 3
    assert local_hub.requests_for(method="GET", file=template_file) == []
    # the written template lost: it is extracted again from the snapshot's placed copy, offline from the Hub
    _path(pulled.template).unlink()
    third = await pull_entry(entry, settings, progress=False)
    assert _path(third.template).read_text() == TOOLS and third.template.source == pulled.template.source
    assert local_hub.requests_for(method="GET", file=template_file) == []
    # and a snapshot copy changed behind our back is refused, not trusted
    (dest / "snapshot" / template_file).write_bytes(SNAPSHOT_SOURCES[template_file].replace(b"tools", b"tool5"))
    _path(third.template).unlink()
    with pytest.raises(TemplateError, match="not the bytes"):
        await fetch_template(entry, dest, settings=settings, snapshot=third.fetch.snapshot)


@pytest.mark.anyio
async def test_a_template_pinned_to_another_commit_of_the_snapshot_repo_never_shares_its_partials(
        local_hub: LocalHub, tmp_path: Path) -> None:
    # The template is pinned to an older commit of the repository whose main the snapshot follows:
    # it is downloaded on its own, into fetch-template's partial directory, and the snapshot's own
    # tokenizer_config.json (main's) is placed untouched.
    from hotfit.pipeline.pull import pull_entry

    old = local_hub.create_repo("OpenVINO/p-ov", {"openvino_model.xml": b"<net/>", "tokenizer_config.json": cfg(TOOLS)})
    new = local_hub.commit("OpenVINO/p-ov", {"tokenizer_config.json": cfg(CHATML)})
    entry = _ov_entry_with_template("OpenVINO/p-ov", "tokenizer_config.json", revision=old)
    settings = settings_for(local_hub, tmp_path / "home")
    pulled = await pull_entry(entry, settings, progress=False)
    dest = settings.model_dir("ov")
    assert pulled.fetch.snapshot is not None and pulled.fetch.snapshot.commit == new
    assert pulled.template.source == f"OpenVINO/p-ov@{old}/tokenizer_config.json"
    assert _path(pulled.template).read_text() == TOOLS
    assert (dest / "snapshot" / "tokenizer_config.json").read_bytes() == cfg(CHATML)
    revisions = sorted(r.revision or "" for r in local_hub.requests_for(file="tokenizer_config.json", method="GET"))
    assert revisions == sorted([old, new])  # each commit's file once: one for the snapshot, one for the template


@pytest.mark.anyio
async def test_verify_refuses_a_template_read_from_another_snapshot_commit(local_hub: LocalHub,
                                                                            tmp_path: Path) -> None:
    # fetch-template read the template from the snapshot at one commit; the snapshot then moved and
    # was placed without the template being read again: what was checked is not what GenAI renders.
    local_hub.create_repo("OpenVINO/m-ov", {"openvino_model.xml": b"<net/>", "tokenizer_config.json": cfg(TOOLS)})
    entry = _ov_entry_with_template("OpenVINO/m-ov", "tokenizer_config.json")
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("ov")
    first = await fetch_weights(entry, dest, settings=settings, options=FAST, progress=False)
    template = await fetch_template(entry, dest, settings=settings, snapshot=first.snapshot)
    await verify(entry, dest, fetched=first, template=template)
    local_hub.commit("OpenVINO/m-ov", {"tokenizer_config.json": cfg(TOOLS + " ")})
    moved = await fetch_weights(entry, dest, settings=settings, options=FAST, progress=False)
    with pytest.raises(TemplateError, match="snapshot in place is at") as exc:
        await verify(entry, dest, fetched=moved, template=template)
    assert exc.value.exit_code == 4
    again = await fetch_template(entry, dest, settings=settings, snapshot=moved.snapshot)
    assert moved.snapshot is not None and again.source.startswith(f"OpenVINO/m-ov@{moved.snapshot.commit}/")
    assert _path(again).read_text() == TOOLS + " "
    await verify(entry, dest, fetched=moved, template=again)


# --------------------------------------------------------------------------- the bundled OpenVINO entries


def _bundled_openvino_entries() -> list[Entry]:
    from hotfit.pipeline.registry_file import load_registry

    return [e for e in load_registry(None).entries if e.backend == "openvino"]


def test_every_bundled_openvino_entry_takes_its_template_from_its_own_snapshot() -> None:
    from hotfit.core.model_files import SnapshotFile, SnapshotResult
    from hotfit.stages.fetch_template import in_snapshot

    entries = _bundled_openvino_entries()
    assert len(entries) >= 5
    for entry in entries:
        src, art = entry.chat_template, entry.artifact
        assert src is not None and art is not None and art.file is None, entry.name
        assert src.repo == art.repo and src.file in ("tokenizer_config.json", "chat_template.jinja"), entry.name
        assert src.revision in (None, art.revision), entry.name  # follows the snapshot's commit
        commit = art.revision or "c" * 40
        listing = SnapshotResult(repo=art.repo, revision_requested=art.revision or "main", commit=commit,
                                 directory="/d", files=2, size_bytes=2, bytes_transferred=0, bytes_reread=0,
                                 files_already_present=0,
                                 listed=(SnapshotFile("openvino_model.xml", 1, None, "b" * 40),
                                         SnapshotFile(src.file, 1, None, "a" * 40)))
        assert in_snapshot(src, listing) is listing.listed[1], entry.name  # read from it, never fetched apart


@pytest.mark.anyio
@pytest.mark.parametrize("name", [e.name for e in _bundled_openvino_entries()])
async def test_each_bundled_openvino_entry_pulls_as_written(local_hub: LocalHub, tmp_path: Path, name: str) -> None:
    # The entry exactly as bundled, against a local Hub repository of the same name and file layout.
    from hotfit.pipeline.pull import pull_entry

    entry = next(e for e in _bundled_openvino_entries() if e.name == name)
    assert entry.chat_template is not None and entry.artifact is not None
    files = {"openvino_model.xml": b"<net/>", "openvino_model.bin": b"\x02" * 70_000,
             "openvino_tokenizer.xml": b"<t/>", "openvino_tokenizer.bin": b"\x03" * 10,
             "openvino_detokenizer.xml": b"<d/>", "openvino_detokenizer.bin": b"\x04" * 10,
             "config.json": b"{}", "tokenizer_config.json": cfg(TOOLS), "chat_template.jinja": TOOLS.encode()}
    commit = local_hub.create_repo(entry.artifact.repo, files, lfs=["openvino_model.bin"])
    settings = settings_for(local_hub, tmp_path / "home")
    pulled = await pull_entry(entry, settings, progress=False)
    assert pulled.verify.files_checked == len(files)
    assert pulled.template.source == f"{entry.artifact.repo}@{commit}/{entry.chat_template.file}"
    assert len(local_hub.requests_for(file=entry.chat_template.file, method="GET")) == 1
    assert (settings.model_dir(name) / "snapshot" / entry.chat_template.file).read_bytes() == files[
        entry.chat_template.file]
