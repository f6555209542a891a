"""pipeline.registry_lock / `hotfit registry lock`: pin open revisions, sizes and sha256 from a (local) Hub."""

from __future__ import annotations

import copy
import hashlib
import io
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from hotfit.pipeline.cli import main
from hotfit.core.errors import UsageError
from hotfit.pipeline.registry_file import bundled_registry_path, load_registry
from hotfit.pipeline.registry_lock import (
    FileFacts,
    HubFacts,
    apply_hub_facts,
    lock_registry,
    needs_lock,
    write_atomic,
)
from hotfit.core.model_files import snapshot_listing_sha256
from tests.hubserver import LocalHub, git_blob_sha1

TIER = "integration"

GGUF = b"GGUF" + bytes(range(256)) * 64  # content is irrelevant; the Hub reports its size and sha256
TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"
BUNDLED = json.loads(bundled_registry_path().read_text(encoding="utf-8"))


def _entry(name: str, *, artifact: dict[str, Any], template: dict[str, Any] | None) -> dict[str, Any]:
    """A schema-valid, not-auto-eligible entry (so null facts are allowed) pointing at local repos."""
    base = copy.deepcopy(next(e for e in BUNDLED["entries"] if e["name"] == "gpt-oss-20b"))
    base.update(name=name, auto_eligible=False, ineligible_cause="unverified",
                ineligible_reason="not yet pinned", artifact=artifact, chat_template=template)
    return base


def _art(repo: str, revision: str | None, file: str | None, size: int | None = None,
         sha: str | None = None) -> dict[str, Any]:
    return {"repo": repo, "revision": revision, "file": file, "size_bytes": size, "sha256": sha}


@pytest.fixture
def repos(local_hub: LocalHub) -> dict[str, str]:
    """org/m-GGUF (two commits: the file changed), org/m (template), org/snap (OpenVINO-like snapshot)."""
    first = local_hub.store.create_repo("org/m-GGUF", {"m-Q4_K_M.gguf": GGUF}, lfs=["m-Q4_K_M.gguf"])
    second = local_hub.store.commit("org/m-GGUF", {"m-Q4_K_M.gguf": GGUF + b"requant"}, lfs=["m-Q4_K_M.gguf"])
    tpl = local_hub.store.create_repo("org/m", {"chat_template.jinja": TEMPLATE, "config.json": "{}"})
    snap = local_hub.store.create_repo("org/snap", {"openvino_model.bin": b"\0" * 5000, "tokenizer_config.json": "{}"},
                                 lfs=["openvino_model.bin"])
    return {"first": first, "second": second, "tpl": tpl, "snap": snap}


def _write(tmp_path: Path, entries: list[dict[str, Any]]) -> Path:
    path = tmp_path / "registry.json"
    path.write_text(json.dumps({"schema": 1, "description": "kept", "entries": entries}, indent=2))
    return path


def _by_name(path: Path) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in json.loads(path.read_text())["entries"]}


# --------------------------------------------------------------------------- against the local Hub


def test_lock_fills_open_values_from_the_hub_and_keeps_the_rest(tmp_path: Path, local_hub: LocalHub,
                                                                   repos: dict[str, str]) -> None:
    requant = GGUF + b"requant"
    src = _write(tmp_path, [
        _entry("open", artifact=_art("org/m-GGUF", None, "m-Q4_K_M.gguf"),
               template={"repo": "org/m", "revision": None, "file": "chat_template.jinja"}),
        _entry("pinned-old", artifact=_art("org/m-GGUF", repos["first"], "m-Q4_K_M.gguf"),
               template={"repo": "org/m", "revision": repos["tpl"], "file": "chat_template.jinja"}),
        _entry("snapshot", artifact=_art("org/snap", None, None, 5002), template=None),
    ])
    before = src.read_text()
    out = tmp_path / "locked.json"
    report = lock_registry(src, out, endpoint=local_hub.endpoint)

    assert report.problems == () and report.exit_code == 0
    assert src.read_text() == before, "--output leaves the source untouched"
    locked = _by_name(out)
    # unpinned → main's head, with that commit's bytes and LFS sha256
    assert locked["open"]["artifact"] == _art("org/m-GGUF", repos["second"], "m-Q4_K_M.gguf",
                                              len(requant), hashlib.sha256(requant).hexdigest())
    # the template kept in git: its bytes read at that commit, pinned by size and sha256 (what a
    # static mirror is trusted for)
    assert locked["open"]["chat_template"] == {"repo": "org/m", "revision": repos["tpl"], "file": "chat_template.jinja",
                                               "size_bytes": len(TEMPLATE),
                                               "sha256": hashlib.sha256(TEMPLATE.encode()).hexdigest()}
    assert locked["pinned-old"]["chat_template"]["sha256"] == hashlib.sha256(TEMPLATE.encode()).hexdigest()
    # pinned to the older commit → its own (older) bytes, never main's
    assert locked["pinned-old"]["artifact"]["revision"] == repos["first"]
    assert locked["pinned-old"]["artifact"]["size_bytes"] == len(GGUF)
    assert locked["pinned-old"]["artifact"]["sha256"] == hashlib.sha256(GGUF).hexdigest()
    # a snapshot: the whole repository, recorded total confirmed, revision pinned, and its file list
    # pinned by its sha256 (each file's path, size and LFS sha256 or git blob id)
    assert locked["snapshot"]["artifact"]["revision"] == repos["snap"]
    assert locked["snapshot"]["artifact"]["size_bytes"] == 5002
    assert locked["snapshot"]["artifact"]["sha256"] == snapshot_listing_sha256([
        ("openvino_model.bin", 5000, hashlib.sha256(b"\0" * 5000).hexdigest(), None),
        ("tokenizer_config.json", 2, None, git_blob_sha1(b"{}"))])
    assert json.loads(out.read_text())["description"] == "kept"
    assert load_registry(out).get("open").artifact.revision == repos["second"]  # still schema-valid
    assert {c.field for c in report.changes if c.entry == "open"} == {
        "artifact.revision", "artifact.size_bytes", "artifact.sha256", "chat_template.revision",
        "chat_template.size_bytes", "chat_template.sha256"}


def test_a_recorded_value_that_disagrees_is_reported_never_overwritten(tmp_path: Path, local_hub: LocalHub,
                                                                       repos: dict[str, str]) -> None:
    wrong_sha = "0" * 64
    src = _write(tmp_path, [
        _entry("bad-size", artifact=_art("org/m-GGUF", repos["first"], "m-Q4_K_M.gguf", 123), template=None),
        _entry("bad-sha", artifact=_art("org/m-GGUF", None, "m-Q4_K_M.gguf", None, wrong_sha), template=None),
        _entry("bad-snapshot", artifact=_art("org/snap", None, None, 999), template=None),
    ])
    report = lock_registry(src, None, endpoint=local_hub.endpoint)

    locked = _by_name(src)  # in place
    assert locked["bad-size"]["artifact"]["size_bytes"] == 123
    assert locked["bad-size"]["artifact"]["sha256"] is None, "nothing of a disagreeing artifact is written"
    assert locked["bad-sha"]["artifact"]["sha256"] == wrong_sha
    assert locked["bad-sha"]["artifact"]["revision"] is None, "main's commit is not paired with other bytes"
    assert locked["bad-snapshot"]["artifact"]["revision"] is None
    kinds = {(p.entry, p.field, p.kind) for p in report.problems}
    assert kinds == {("bad-size", "artifact.size_bytes", "mismatch"),
                     ("bad-sha", "artifact.sha256", "mismatch"),
                     ("bad-snapshot", "artifact.size_bytes", "mismatch")}
    assert report.exit_code == 4 and report.output is None
    assert any(str(len(GGUF)) in p.message for p in report.problems if p.entry == "bad-size")


def test_missing_repo_file_or_template_is_reported_and_left_alone(tmp_path: Path, local_hub: LocalHub,
                                                                  repos: dict[str, str]) -> None:
    src = _write(tmp_path, [
        _entry("no-repo", artifact=_art("org/missing", None, "x.gguf"), template=None),
        _entry("no-file", artifact=_art("org/m-GGUF", None, "other.gguf"), template=None),
        _entry("no-template", artifact=_art("org/m-GGUF", repos["first"], "m-Q4_K_M.gguf", len(GGUF),
                                            hashlib.sha256(GGUF).hexdigest()),
               template={"repo": "org/m", "revision": None, "file": "tokenizer_config.json"}),
        _entry("no-revision", artifact=_art("org/m-GGUF", "f" * 40, "m-Q4_K_M.gguf"), template=None),
    ])
    before = src.read_text()
    report = lock_registry(src, None, endpoint=local_hub.endpoint)
    assert src.read_text() == before
    by_entry = {p.entry: p for p in report.problems}
    assert set(by_entry) == {"no-repo", "no-file", "no-template", "no-revision"}
    assert all(p.kind == "error" for p in report.problems)
    assert "not found" in by_entry["no-repo"].message
    assert "other.gguf is not in org/m-GGUF" in by_entry["no-file"].message
    assert "tokenizer_config.json is not in org/m" in by_entry["no-template"].message
    assert "f" * 40 in by_entry["no-revision"].message
    assert report.exit_code == 4


def test_cli_lock_json_report_and_exit_code(tmp_path: Path, local_hub: LocalHub, repos: dict[str, str],
                                            monkeypatch: pytest.MonkeyPatch, hotfit_home: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", local_hub.endpoint)
    src = _write(tmp_path, [_entry("open", artifact=_art("org/m-GGUF", None, "m-Q4_K_M.gguf"), template=None)])
    out = tmp_path / "out.json"
    buf = io.StringIO()
    code = main(["--json", "registry", "lock", "--registry", str(src), "--output", str(out)], out=buf)
    data = json.loads(buf.getvalue())
    assert code == 0 and data["exit_code"] == 0
    assert data["output"] == str(out) and data["checked"] == ["open"]
    assert {c["field"] for c in data["changes"]} == {"artifact.revision", "artifact.size_bytes", "artifact.sha256"}
    assert _by_name(out)["open"]["artifact"]["revision"] == repos["second"]


def test_cli_lock_verify_reports_a_pinned_value_the_hub_contradicts(tmp_path: Path, local_hub: LocalHub,
                                                                    repos: dict[str, str],
                                                                    monkeypatch: pytest.MonkeyPatch,
                                                                    hotfit_home: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", local_hub.endpoint)
    src = _write(tmp_path, [_entry("full", artifact=_art("org/m-GGUF", repos["first"], "m-Q4_K_M.gguf",
                                                         len(GGUF), "1" * 64), template=None)])
    buf = io.StringIO()
    assert main(["registry", "lock", "--registry", str(src)], out=buf) == 0  # nothing open: nothing asked
    assert "none needed it" in buf.getvalue()
    buf = io.StringIO()
    code = main(["registry", "lock", "--registry", str(src), "--verify"], out=buf)
    assert code == 4 and "mismatch: full artifact.sha256" in buf.getvalue()
    assert _by_name(src)["full"]["artifact"]["sha256"] == "1" * 64


def test_lock_refuses_offline_and_a_broken_registry_before_any_request(tmp_path: Path) -> None:
    src = _write(tmp_path, [_entry("open", artifact=_art("org/m-GGUF", None, "m.gguf"), template=None)])
    with pytest.raises(UsageError, match="HF_HUB_OFFLINE"):
        lock_registry(src, None, endpoint="http://127.0.0.1:9", offline=True)
    broken = tmp_path / "broken.json"
    broken.write_text('{"schema": 1, "entries": [{"name": "x"}]}')
    with pytest.raises(UsageError, match="'display_name' is missing"):
        lock_registry(broken, None, endpoint="http://127.0.0.1:9")  # nothing listens there: never asked


def test_unreachable_hub_is_an_error_per_entry(tmp_path: Path) -> None:
    src = _write(tmp_path, [_entry("open", artifact=_art("org/m-GGUF", None, "m.gguf"), template=None)])
    report = lock_registry(src, None, endpoint="http://127.0.0.1:9")  # discard port: connection refused
    assert [p.kind for p in report.problems] == ["error"] and report.exit_code == 4
    assert "cannot reach the Hub" in report.problems[0].message


def _ov_entry(name: str, *, artifact: dict[str, Any], template_revision: str | None) -> dict[str, Any]:
    """A not-auto-eligible OpenVINO entry whose template is a file of its own snapshot (as every
    bundled OpenVINO entry's is)."""
    base = copy.deepcopy(next(e for e in BUNDLED["entries"] if e["backend"] == "openvino"))
    base.update(name=name, auto_eligible=False, ineligible_cause="unverified", ineligible_reason="not yet pinned",
                artifact=artifact,
                chat_template={"repo": artifact["repo"], "revision": template_revision,
                               "file": "tokenizer_config.json"})
    return base


def test_a_template_in_its_snapshot_is_pinned_with_the_snapshot_never_alone(tmp_path: Path, local_hub: LocalHub,
                                                                           repos: dict[str, str]) -> None:
    pinned_first = repos["snap"]
    main_now = local_hub.store.commit("org/snap", {"tokenizer_config.json": '{"chat_template": "new"}'})
    src = _write(tmp_path, [
        _ov_entry("open", artifact=_art("org/snap", None, None), template_revision=None),
        _ov_entry("at-first", artifact=_art("org/snap", pinned_first, None, 5002), template_revision=None),
        _ov_entry("size-moved", artifact=_art("org/snap", None, None, 999), template_revision=None),
    ])
    report = lock_registry(src, tmp_path / "out.json", endpoint=local_hub.endpoint)
    locked = _by_name(tmp_path / "out.json")
    # both to main's commit, together
    assert locked["open"]["artifact"]["revision"] == locked["open"]["chat_template"]["revision"] == main_now
    # the snapshot was pinned before: the template takes that commit, not main's
    assert locked["at-first"]["chat_template"]["revision"] == pinned_first != main_now
    # the snapshot disagrees with its recorded size: neither is pinned, and the template says why
    assert locked["size-moved"]["artifact"]["revision"] is None
    assert locked["size-moved"]["chat_template"]["revision"] is None
    problems = {(p.entry, p.field, p.kind): p.message for p in report.problems}
    assert set(problems) == {("size-moved", "artifact.size_bytes", "mismatch"),
                             ("size-moved", "chat_template.revision", "error")}
    assert "snapshot, whose revision was not pinned" in problems[("size-moved", "chat_template.revision", "error")]
    assert report.exit_code == 4
    assert load_registry(tmp_path / "out.json").get("at-first").chat_template.revision == pinned_first


def test_the_schema_refuses_a_snapshot_template_pinned_apart_from_its_snapshot(tmp_path: Path) -> None:
    for artifact_revision, said in ((None, "unpinned (it follows main)"), ("a" * 40, f"pinned at {'a' * 40}")):
        src = _write(tmp_path, [_ov_entry("apart", artifact=_art("org/snap", artifact_revision, None, 5002),
                                          template_revision="b" * 40)])
        with pytest.raises(UsageError, match="chat_template.revision") as info:
            load_registry(src)
        assert said in str(info.value) and "pins them together" in (info.value.hint or "")
    together = _write(tmp_path, [_ov_entry("together", artifact=_art("org/snap", "a" * 40, None, 5002),
                                           template_revision="a" * 40)])
    assert load_registry(together).get("together").chat_template.revision == "a" * 40


# --------------------------------------------------------------------------- pure core


def test_needs_lock_only_for_open_values() -> None:
    full = _entry("x", artifact=_art("o/r", "a" * 40, "m.gguf", 1, "b" * 64),
                  template={"repo": "o/r", "revision": "c" * 40, "file": "chat_template.jinja", "size_bytes": 3,
                            "sha256": "d" * 64})
    assert not needs_lock(full)
    for path, value in (("revision", None), ("size_bytes", None), ("sha256", None)):
        e = copy.deepcopy(full)
        e["artifact"][path] = value
        assert needs_lock(e), path
    for path in ("revision", "size_bytes", "sha256"):
        e = copy.deepcopy(full)
        e["chat_template"][path] = None
        assert needs_lock(e), f"chat_template.{path}"
    snapshot = _entry("s", artifact=_art("o/r", "a" * 40, None, 5), template=None)
    assert needs_lock(snapshot), "a snapshot's file list is pinned by its sha256"
    snapshot["artifact"]["sha256"] = "e" * 64
    assert not needs_lock(snapshot)


def test_apply_hub_facts_is_pure_and_never_overwrites() -> None:
    facts = HubFacts("o/r", "d" * 40, {"m.gguf": FileFacts(10, "e" * 64), "t.jinja": FileFacts(3, None)})
    asked: list[tuple[str, str | None]] = []

    def lookup(repo: str, revision: str | None) -> HubFacts | str:
        asked.append((repo, revision))
        return facts

    entry = _entry("x", artifact=_art("o/r", None, "m.gguf", 10, None),
                   template={"repo": "o/r", "revision": None, "file": "t.jinja"})
    changes, problems = apply_hub_facts(entry, lookup)
    assert problems == []
    assert entry["artifact"] == _art("o/r", "d" * 40, "m.gguf", 10, "e" * 64)
    assert entry["chat_template"]["revision"] == "d" * 40
    # no reader for the template's bytes: its size from the listing, its sha256 left open
    assert [c.field for c in changes] == ["artifact.sha256", "artifact.revision", "chat_template.revision",
                                          "chat_template.size_bytes"]
    assert entry["chat_template"].get("sha256") is None
    assert asked == [("o/r", None), ("o/r", None)]

    disagreeing = _entry("y", artifact=_art("o/r", None, "m.gguf", 11, None), template=None)
    changes, problems = apply_hub_facts(disagreeing, lambda r, v: facts)
    assert changes == [] and [p.kind for p in problems] == ["mismatch"]
    assert disagreeing["artifact"]["revision"] is None and disagreeing["artifact"]["sha256"] is None


# --------------------------------------------------------------------------- atomic write


def test_write_atomic_replaces_whole_file_keeps_mode_and_leaves_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "reg.json"
    path.write_text("old")
    os.chmod(path, 0o640)
    write_atomic(path, "new content\n")
    assert path.read_text() == "new content\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["reg.json"]


def test_lock_against_a_server_that_is_not_a_hub_says_so_and_writes_nothing(tmp_path: Path, not_a_hub: str,
                                                                             hotfit_home: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from hotfit.core.errors import HubError

    src = _write(tmp_path, [_entry("open", artifact=_art("org/m-GGUF", None, "m.gguf"), template=None),
                            _entry("other", artifact=_art("org/n-GGUF", None, "n.gguf"), template=None)])
    before = src.read_text()
    with pytest.raises(HubError) as exc:
        lock_registry(src, None, endpoint=not_a_hub)
    assert "HF_ENDPOINT does not answer like a Hugging Face Hub" in exc.value.what and not_a_hub in exc.value.what
    monkeypatch.setenv("HF_ENDPOINT", not_a_hub)
    buf = io.StringIO()
    assert main(["--json", "registry", "lock", "--registry", str(src)], out=buf) == 4
    assert "HF_ENDPOINT does not answer like a Hugging Face Hub" in json.loads(buf.getvalue())["error"]["message"]
    assert src.read_text() == before


def test_cli_lock_with_every_lookup_failing_does_not_claim_mismatches(tmp_path: Path, hotfit_home: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    src = _write(tmp_path, [_entry("open", artifact=_art("org/m-GGUF", None, "m.gguf"), template=None)])
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: connection refused
    buf = io.StringIO()
    assert main(["registry", "lock", "--registry", str(src)], out=buf) == 4
    text = buf.getvalue()
    assert "mismatch" not in text
    assert "no lookup succeeded" in text and "nothing to write" in text


def test_a_template_in_git_is_read_once_and_a_recorded_sha256_that_differs_is_a_mismatch(
        tmp_path: Path, local_hub: LocalHub, repos: dict[str, str]) -> None:
    good = hashlib.sha256(TEMPLATE.encode()).hexdigest()
    src = _write(tmp_path, [
        _entry("revision-only", artifact=_art("org/m-GGUF", repos["first"], "m-Q4_K_M.gguf", len(GGUF),
                                              hashlib.sha256(GGUF).hexdigest()),
               template={"repo": "org/m", "revision": repos["tpl"], "file": "chat_template.jinja"}),
        _entry("wrong-sha", artifact=_art("org/m-GGUF", repos["first"], "m-Q4_K_M.gguf", len(GGUF),
                                          hashlib.sha256(GGUF).hexdigest()),
               template={"repo": "org/m", "revision": None, "file": "chat_template.jinja", "size_bytes": None,
                         "sha256": "0" * 64}),
    ])
    local_hub.reset_counters()
    report = lock_registry(src, tmp_path / "out.json", endpoint=local_hub.endpoint)
    locked = _by_name(tmp_path / "out.json")
    assert locked["revision-only"]["chat_template"]["size_bytes"] == len(TEMPLATE)
    assert locked["revision-only"]["chat_template"]["sha256"] == good
    # a recorded sha256 the bytes contradict: reported, and nothing of that template is written
    assert locked["wrong-sha"]["chat_template"] == {"repo": "org/m", "revision": None, "file": "chat_template.jinja",
                                                    "size_bytes": None, "sha256": "0" * 64}
    assert [(p.entry, p.field, p.kind) for p in report.problems] == [("wrong-sha", "chat_template.sha256", "mismatch")]
    assert good in report.problems[0].message and report.exit_code == 4
    reads = [r for r in local_hub.requests if r.method == "GET" and (r.file or "") == "chat_template.jinja"]
    assert len(reads) == 1  # main is the pinned commit here: its bytes are read once for both entries


def test_a_template_whose_bytes_are_not_the_listed_blob_is_not_pinned(tmp_path: Path) -> None:
    class Api:  # a Hub whose file is not the blob it lists (a mirror serving another file)
        endpoint = "http://mirror.invalid"

        def hf_hub_download(self, *, repo_id: str, filename: str, revision: str, local_dir: str) -> str:
            path = Path(local_dir) / filename
            path.write_text("{{ other }}")
            return str(path)

    from hotfit.pipeline.registry_lock import file_content_facts

    said = file_content_facts(Api(), "o/r", "a" * 40, "t.jinja", FileFacts(11, None, "b" * 40))
    assert isinstance(said, str) and "not the file the Hub lists" in said
