"""``hotfit fleet mirror``: fill a directory laid out as the Hub's own URLs
(``{repo}/resolve/{commit}/{file}``) with the artifacts a fleet needs, each fetched once and verified
against the registry's pins, so any static file server can be the fleet's ``HF_ENDPOINT``
(docs/fleet.md, "The mirror").

The files come through the download engine (:mod:`download`: resumable partials under
``DIR/.partial``, retries, the pinned HEAD) from ``HF_ENDPOINT`` — the Hub or a Hub mirror — or from
the Hugging Face cache when it holds the pinned file. A file already in place at its pinned size and
sha256 is kept (a rerun fetches nothing twice). Each file's failure is reported and the others are
still filled. The pins come from the registry, never from the plan file, which only names the
entries (and the builds) wanted.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotfit.core import log
from hotfit.core.entry import Entry
from hotfit.core.errors import HotfitError, IntegrityError, UsageError
from hotfit.core.records import Fields, parse_json
from hotfit.core.settings import Settings
from hotfit.download import (CacheHit, HubSession, StaticPins, discard_partial, download_to_partial, finalize_file,
                             partial_paths, safe_relpath, take_into_partial)
from hotfit.pipeline.fleet import MirrorArtifact, artifacts_of
from hotfit.pipeline.registry_file import load_registry
from hotfit.state.files import read_text_document, write_text_atomic
from hotfit.stages.fetch_weights import ListedFile, list_snapshot, snapshot_file_pins
from hotfit.state.receipts import git_blob_sha1, sha256_file

__all__ = ["MirrorFile", "MirrorBuild", "MirrorResult", "fill_mirror", "wanted_from_plan", "resolve_path",
           "tree_listing_path"]

_log = log.get_logger()
BUILDS_DIR = "builds"  # beside the repositories: export archives and their SHA256SUMS
PARTIAL_DIR = ".partial"
_ARCHIVE = "llama-server-{flavour}.tar.gz"  # the name fleet plan's export commands write


@dataclass(frozen=True)
class MirrorFile:
    artifact: MirrorArtifact
    status: str  # fetched | present | hf-cache | skipped | failed
    path: str | None = None
    fetched_bytes: int = 0
    reason: str | None = None
    error: HotfitError | None = None

    def to_json(self) -> dict[str, Any]:
        return {**self.artifact.to_json(), "status": self.status, "path": self.path,
                "fetched_bytes": self.fetched_bytes, "reason": self.reason,
                "error": None if self.error is None else self.error.to_json()}


@dataclass(frozen=True)
class MirrorBuild:
    flavour: str
    status: str  # placed | present | missing
    path: str | None = None
    sha256: str | None = None
    size_bytes: int | None = None
    export_command: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"flavour": self.flavour, "status": self.status, "path": self.path, "sha256": self.sha256,
                "size_bytes": self.size_bytes, "export_command": self.export_command}


@dataclass(frozen=True)
class MirrorResult:
    directory: str
    files: tuple[MirrorFile, ...]
    builds: tuple[MirrorBuild, ...]

    @property
    def exit_code(self) -> int:
        failed = [f.error.exit_code for f in self.files if f.error is not None]
        return failed[0] if failed else 0

    def to_json(self) -> dict[str, Any]:
        return {"directory": self.directory, "files": [f.to_json() for f in self.files],
                "builds": [b.to_json() for b in self.builds],
                "fetched_bytes": sum(f.fetched_bytes for f in self.files),
                "mirror_bytes": sum(f.artifact.size_bytes or 0 for f in self.files if f.path is not None)}


def resolve_path(directory: Path, repo: str, revision: str, file: str) -> Path:
    """Where the Hub's ``{repo}/resolve/{revision}/{file}`` lies in the mirror: a static server
    rooted at ``directory`` answers ``HF_ENDPOINT/{repo}/resolve/{revision}/{file}`` with it."""
    return directory / repo / "resolve" / revision / file


# ------------------------------------------------------------------------ what is wanted


def wanted_from_plan(plan_file: Path, registry_file: Path | None) -> tuple[list[tuple[Entry, int]], list[dict[str, Any]]]:
    """The entries a saved ``hotfit --json fleet plan`` names (with how many machines each), looked
    up in the registry — whose pins are the only ones trusted — and the builds it lists."""
    def fail_document(problem: str, hint: str, **details: Any) -> UsageError:
        return UsageError(f"fleet plan {plan_file}: {problem}",
                          hint="pass the JSON of `hotfit --json fleet plan PATH…`", file=str(plan_file), **details)

    def fail(field: str, problem: str, hint: str) -> UsageError:
        return UsageError(f"fleet plan {plan_file}: {field} {problem}", hint=hint, file=str(plan_file), field=field)

    data = parse_json(read_text_document(plan_file, fail_document), fail_document, kind="a fleet plan",
                      shape="a fleet plan is what `hotfit --json fleet plan` prints")
    f = Fields(fail, noun="fleet plan")
    doc = f.object(data, "", ("machines", "builds"), extra=True)
    counts: dict[str, int] = {}
    for i, raw in enumerate(f.items(doc["machines"], "machines")):
        m = f.at(f"machines[{i}]").object(raw, "", ("model",), extra=True)
        name = f.at(f"machines[{i}]").string(m["model"], "model", nullable=True)
        if name:
            counts[name] = counts.get(name, 0) + 1
    builds = [f.at(f"builds[{i}]").object(b, "", ("flavour", "export_command"), extra=True)
              for i, b in enumerate(f.items(doc["builds"], "builds"))]
    return entries_named(counts, registry_file), [dict(b) for b in builds]


def entries_named(counts: dict[str, int], registry_file: Path | None) -> list[tuple[Entry, int]]:
    registry = load_registry(registry_file)
    by_name = {e.name: e for e in registry.entries}
    unknown = sorted(n for n in counts if n not in by_name)
    if unknown:
        raise UsageError(f"fleet mirror: {', '.join(unknown)} not in the registry "
                         f"({registry_file or 'the bundled one'})",
                         hint="pass the registry the plan was made with (--registry FILE)", entries=unknown)
    return [(by_name[n], counts[n]) for n in sorted(counts)]


# ------------------------------------------------------------------------ filling


async def fill_mirror(settings: Settings, directory: Path, wanted: Sequence[tuple[Entry, int]], *,
                      builds: Sequence[dict[str, Any]] = (), builds_from: Path | None = None) -> MirrorResult:
    """Bring every artifact of ``wanted`` into ``directory`` (each once), then place the builds."""
    directory.mkdir(parents=True, exist_ok=True)
    files = []
    async with HubSession(settings) as session:
        for artifact in artifacts_of(wanted):
            files.append(await _one(session, settings, directory, artifact))
    return MirrorResult(str(directory), tuple(files), tuple(_place_builds(directory, builds, builds_from)))


async def _one(session: HubSession, settings: Settings, directory: Path, a: MirrorArtifact) -> MirrorFile:
    if a.file is None:
        return await _snapshot(session, settings, directory, a)
    if a.revision is None:
        return MirrorFile(a, "skipped", reason="not mirrored: its revision is not pinned (hotfit registry lock)")
    try:
        status, fetched = await _bring(session, settings, directory, a.repo, a.revision, a.file,
                                       size_bytes=a.size_bytes, sha256=a.sha256, blob_id=None)
        return MirrorFile(a, status, str(resolve_path(directory, a.repo, a.revision, a.file)), fetched,
                          reason=_unpinned_note(a))
    except HotfitError as exc:
        _log.error("mirror.failed", repo=a.repo, file=a.file, error=exc.to_json())
        return MirrorFile(a, "failed", reason=exc.what, error=exc)


async def _bring(session: HubSession, settings: Settings, directory: Path, repo: str, revision: str, file: str, *,
                 size_bytes: int | None, sha256: str | None, blob_id: str | None,
                 static: StaticPins | None = None) -> tuple[str, int]:
    """One file into ``{repo}/resolve/{revision}/{file}``, checked against its pins (size; sha256, or
    the git blob id a verified snapshot listing gives a file kept in git). Returns (status, bytes fetched)."""
    final = resolve_path(directory, repo, revision, file)
    partial_dir = directory / PARTIAL_DIR
    if final.is_file() and (size_bytes is None or final.stat().st_size == size_bytes):
        if _holds(final, sha256, blob_id):
            return "present", 0
        _log.warning("mirror.replaced", file=str(final), reason="its hash differs from the pin")
    partial, sidecar, _lock = partial_paths(partial_dir, repo, file)
    partial_dir.mkdir(parents=True, exist_ok=True)
    if sha256 is not None or blob_id is not None:
        hit = take_into_partial(settings.hf_hub_cache, partial=partial, sidecar=sidecar, repo=repo, commit=revision,
                                file=file, size_bytes=size_bytes, sha256=sha256,
                                git_sha1=None if sha256 is not None else blob_id)
        if isinstance(hit, CacheHit):
            finalize_file(partial, final)
            return "hf-cache", 0
    outcome = await download_to_partial(
        session, repo=repo, revision=revision, path=file, expected_size=size_bytes, expected_sha256=sha256,
        partial_dir=partial_dir, git_sha1=sha256 is None, static=static)
    problem = _verify(size_bytes, sha256, blob_id, outcome.size_bytes, outcome.sha256, outcome.etag, outcome.git_sha1)
    if problem is not None:
        discard_partial(partial, sidecar)
        raise IntegrityError(f"{repo}/{file}: {problem}", hint="rerun; the file is fetched again", repo=repo, file=file)
    finalize_file(outcome.partial_path, final)
    sidecar.unlink(missing_ok=True)
    return "fetched", outcome.bytes_transferred


def _holds(path: Path, sha256: str | None, blob_id: str | None) -> bool:
    if sha256 is not None:
        return sha256_file(path) == sha256
    return blob_id is None or git_blob_sha1(path) == blob_id


async def _snapshot(session: HubSession, settings: Settings, directory: Path, a: MirrorArtifact) -> MirrorFile:
    """A whole-repository snapshot (OpenVINO): its listing at the pinned commit, checked against the
    registry's pin of it, every file it lists (each checked against the listing), then the listing
    itself where the Hub's tree API answers (``api/models/{repo}/tree/{commit}``), so a static server
    answers the listing request too — and a machine checks it against the same pin (docs/fleet.md,
    "OpenVINO snapshots")."""
    if a.revision is None or a.sha256 is None:
        return MirrorFile(a, "skipped", reason="not mirrored: the snapshot's revision and file list (artifact.sha256) "
                                               "are not pinned, so a static mirror could not vouch for it "
                                               "(hotfit registry lock pins them)")
    try:
        commit, listed = await list_snapshot(settings, a.repo, a.revision, session.options, listing_sha256=a.sha256)
        for f in listed:
            try:
                safe_relpath(f.path)
            except ValueError:
                raise IntegrityError(f"{a.repo}@{commit}: listed path {f.path!r} would leave the mirror",
                                     hint="refusing this snapshot; report the repository", repo=a.repo,
                                     path=f.path) from None
        fetched = 0
        statuses = set()
        for f in listed:
            status, n = await _bring(session, settings, directory, a.repo, commit, f.path, size_bytes=f.size_bytes,
                                     sha256=f.lfs_sha256, blob_id=None if f.lfs_sha256 else f.blob_id,
                                     static=snapshot_file_pins(f, listing_pinned=True))
            statuses.add(status)
            fetched += n
        listing = tree_listing_path(directory, a.repo, commit)
        listing.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(listing, json.dumps([_tree_item(f) for f in listed], indent=1))
    except HotfitError as exc:
        _log.error("mirror.failed", repo=a.repo, file=None, error=exc.to_json())
        return MirrorFile(a, "failed", reason=exc.what, error=exc)
    status = "fetched" if "fetched" in statuses else "hf-cache" if "hf-cache" in statuses else "present"
    return MirrorFile(a, status, str(directory / a.repo / "resolve" / commit), fetched)


def tree_listing_path(directory: Path, repo: str, commit: str) -> Path:
    """Where the Hub's tree API answers ``GET /api/models/{repo}/tree/{commit}`` (the query string,
    ``?recursive=...``, is not part of a static server's path)."""
    return directory / "api" / "models" / repo / "tree" / commit


def _tree_item(f: ListedFile) -> dict[str, Any]:
    """One file as the Hub's tree API lists it (what huggingface_hub's RepoFile reads)."""
    item: dict[str, Any] = {"type": "file", "oid": f.blob_id, "size": f.size_bytes, "path": f.path}
    if f.lfs_sha256 is not None:
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{f.lfs_sha256}\nsize {f.size_bytes}\n"
        item["lfs"] = {"oid": f.lfs_sha256, "size": f.size_bytes, "pointerSize": len(pointer.encode())}
    return item


def _verify(size_pin: int | None, sha_pin: str | None, blob_pin: str | None, size: int, sha256: str,
            etag: str | None, git_sha1: str | None) -> str | None:
    """Size and sha256 against the registry's pins; a file of a verified snapshot listing kept in git
    against its git blob id; a file pinned by commit only (a chat-template source) against the git
    blob id the Hub named it by, as fetch-template checks it."""
    if size_pin is not None and size != size_pin:
        return f"{size} bytes, the registry pins {size_pin}"
    if sha_pin is not None:
        return None if sha256 == sha_pin else f"sha256 {sha256}, the registry pins {sha_pin}"
    if blob_pin is not None:
        return None if git_sha1 == blob_pin else f"git blob id {git_sha1}, the pinned listing has {blob_pin}"
    if etag and git_sha1 and etag not in (git_sha1, sha256):
        return f"git blob id {git_sha1} differs from the Hub's {etag}"
    return None


def _unpinned_note(a: MirrorArtifact) -> str | None:
    return None if a.pinned else ("not pinned by size and sha256 in the registry: hotfit refuses it from a static "
                                  "mirror (it serves a Hub mirror)")


def _place_builds(directory: Path, builds: Sequence[dict[str, Any]], builds_from: Path | None) -> list[MirrorBuild]:
    """Each build's export archive (``llama-server-<flavour>.tar.gz`` in ``builds_from``) copied into
    ``DIR/builds/`` with its sha256 in ``DIR/builds/SHA256SUMS`` and beside it (``<archive>.sha256``,
    which ``install-llama-server --from URL`` reads); the ones not found are listed."""
    out = []
    target = directory / BUILDS_DIR
    sums: dict[str, str] = {}
    for b in builds:
        flavour = str(b["flavour"])
        name = _ARCHIVE.format(flavour=flavour)
        src = None if builds_from is None else builds_from / name
        dest = target / name
        if src is None or not src.is_file():
            if dest.is_file():
                sha = sha256_file(dest)
                sums[name] = sha
                out.append(MirrorBuild(flavour, "present", str(dest), sha, dest.stat().st_size))
            else:
                out.append(MirrorBuild(flavour, "missing", export_command=str(b.get("export_command") or "")))
            continue
        target.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.copyfile(src, tmp)
        sha = sha256_file(tmp)
        os.replace(tmp, dest)
        sums[name] = sha
        out.append(MirrorBuild(flavour, "placed", str(dest), sha, dest.stat().st_size))
    for name, sha in sums.items():  # what `install-llama-server --from URL` checks (URL.sha256)
        write_text_atomic(target / f"{name}.sha256", f"{sha}  {name}\n")
    if sums:
        existing = _read_sums(target / "SHA256SUMS")
        existing.update(sums)
        write_text_atomic(target / "SHA256SUMS", "".join(f"{sha}  {n}\n" for n, sha in sorted(existing.items())))
    return out


def _read_sums(path: Path) -> dict[str, str]:
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        sha, _, name = line.partition("  ")
        if len(sha) == 64 and name:
            out[name] = sha
    return out

