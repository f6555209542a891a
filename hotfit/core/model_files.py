"""What fetch-weights, fetch-template and verify hand forward: frozen results, the on-disk names they
share, and the pure integrity rule.

- fetch-weights ends with :class:`FetchResult`: each file a :class:`FetchedFile` — a complete partial
  with the sha256 computed while streaming and the partial's :class:`FileIdentity`, or a file already
  verified in place (its receipt matched the pin).
- fetch-template ends with :class:`TemplateResult` (``chat_template.jinja`` written and checked).
- verify ends with :class:`VerifyResult`: the file renamed into place and the GGUF header's facts
  (:class:`GGUFFacts`, read once per run) that load and later stages use instead of re-reading it.

Every result has ``to_json`` and a ``decode`` (:class:`core.records.JsonRecord`: one decoder for
every stage record, a StageRecordError naming the field), so a stage reused from ``state.db`` hands
downstream the same type a fresh one does. Nothing here touches the disk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from hotfit.core.errors import IntegrityError
from hotfit.core.records import JsonRecord

__all__ = [
    "TEMPLATE_FILENAME", "SNAPSHOT_DIRNAME", "SNAPSHOT_MANIFEST", "PARTIAL_DIRNAME", "TEMPLATE_PARTIAL_DIRNAME",
    "FileIdentity", "FetchedFile", "SnapshotFile", "SnapshotResult", "FetchResult", "TemplateResult",
    "FieldCheck", "GGUFFacts", "VerifyResult", "check_integrity", "snapshot_listing_sha256",
]

# The model directory's layout (``<home>/models/<entry>/``), named once for every stage.
TEMPLATE_FILENAME = "chat_template.jinja"
SNAPSHOT_DIRNAME = "snapshot"  # an OpenVINO repository snapshot
SNAPSHOT_MANIFEST = "snapshot.json"  # what the snapshot fetch verified
PARTIAL_DIRNAME = ".partial"  # downloads in progress, hashed partials, locks
# fetch-template's own downloads and lock: a partial is named by (repo, path), and a template may be a
# file of the very repository fetch-weights fetches, so the two stages' partials must never share a name
TEMPLATE_PARTIAL_DIRNAME = f"{PARTIAL_DIRNAME}/template"


@dataclass(frozen=True)
class FileIdentity:
    """Which bytes a recorded sha256 belongs to, without reading them again.

    Device + inode say it is the same file (not a copy or a replacement renamed over it); size and
    mtime say it was not rewritten in place; ctime too, because unlike mtime no program can set it
    back (``touch -r``), and anything that writes the file moves it. A false "changed" (a chmod,
    a copied home) only costs one re-hash; a false "same" would need the kernel to lie.
    """

    device: int
    inode: int
    size_bytes: int
    mtime_ns: int
    ctime_ns: int



@dataclass(frozen=True)
class FetchedFile(JsonRecord):
    """One pinned file fetch-weights brought to disk, not yet put in place by it.

    ``partial_path`` set: a complete partial whose bytes hashed to ``sha256`` while streaming, with
    the partial's identity at that moment. ``partial_path`` None: ``path`` already held this pin's
    verified bytes (its receipt matched), so nothing was fetched. ``path`` is where verify puts it.
    """

    repo: str
    revision: str
    file: str
    path: str  # the final place (<dest>/<file>)
    partial_path: str | None
    size_bytes: int
    sha256: str
    hub_lfs_sha256: str | None
    identity: FileIdentity | None  # of the partial, when one was hashed
    bytes_transferred: int  # this run
    bytes_reread: int  # read back for hashing: resume prefix + spills (0 on a clean single run)
    resumed_from_bytes: int
    connections: int
    attempts: int
    already_present: bool
    integrity_retries: int = 0
    verified_against: tuple[str, ...] = ()  # from the receipt when already present
    hf_cache: str | None = None  # "hardlink" | "copy": taken from the Hugging Face cache (docs/network.md)



@dataclass(frozen=True)
class SnapshotFile:
    """One file of an OpenVINO snapshot as listed at the commit, and what fetch-weights left for it:
    a hashed partial (``partial_path``), or nothing when its receipt already matched (in place)."""

    path: str  # inside the repository (and under <dest>/snapshot/)
    size_bytes: int
    lfs_sha256: str | None
    blob_id: str | None  # git blob sha1, checked for non-LFS files
    partial_path: str | None = None
    sha256: str | None = None  # computed while streaming
    git_sha1: str | None = None
    identity: FileIdentity | None = None



def snapshot_listing_sha256(files: Iterable[tuple[str, int, str | None, str | None]]) -> str:
    """The pin of an OpenVINO snapshot's file list (the registry's ``artifact.sha256`` for an
    artifact without a file): the sha256 of its files as ``[path, size, LFS sha256, git blob id]``,
    sorted by path, as compact JSON. An LFS file is named by its sha256 (its blob id is the pointer's),
    a file kept in git by its git blob id: the hashes each file is checked against when fetched, so a
    listing that hashes to the pin fixes every byte of the snapshot (docs/fleet.md, "OpenVINO
    snapshots"). ``files``: (path, size_bytes, lfs_sha256, blob_id)."""
    rows = sorted([path, size, lfs, None if lfs else blob] for path, size, lfs, blob in files)
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


@dataclass(frozen=True)
class SnapshotResult(JsonRecord):
    repo: str
    revision_requested: str
    commit: str
    directory: str
    files: int
    size_bytes: int
    bytes_transferred: int
    bytes_reread: int
    files_already_present: int
    listed: tuple[SnapshotFile, ...] = ()  # every file of the commit (verify puts the partials in place)



@dataclass(frozen=True)
class FetchResult(JsonRecord):
    entry: str
    backend: str
    weights: FetchedFile | None
    projector: FetchedFile | None
    vision: bool  # a projector was fetched (verify confirms it)
    snapshot: SnapshotResult | None = None
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def files(self) -> tuple[FetchedFile, ...]:
        return tuple(f for f in (self.weights, self.projector) if f is not None)


@dataclass(frozen=True)
class TemplateResult(JsonRecord):
    entry: str
    path: str | None  # chat_template.jinja written (None when the entry names no template)
    source: str | None  # "<repo>@<revision>/<file>"
    variant: str | None  # "jinja", "tokenizer_config:string", "tokenizer_config:tool_use", …
    sha256: str | None  # of the written template text
    tool_markers: tuple[str, ...]
    size_bytes: int = 0


@dataclass(frozen=True)
class FieldCheck:
    """One registry fact against the GGUF. ``ok`` None = not checkable (fact unknown on one side)."""

    field: str
    registry: Any
    gguf: Any
    ok: bool | None
    note: str | None = None



PerLayer = int | tuple[int, ...] | None  # one value, or one per layer (GGUF arrays)


@dataclass(frozen=True)
class GGUFFacts(JsonRecord):
    """What the GGUF header says, read once by verify (bounded reader) for every later stage.

    Whole numbers only: a header value that is not one is None here (verify has already failed
    closed on every fact the registry names)."""

    version: int
    tensor_count: int
    architecture: str | None
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    head_count: PerLayer
    head_count_kv: PerLayer
    key_length: int | None
    value_length: int | None
    sliding_window: int | None
    has_chat_template: bool
    chat_template_sha256: str | None  # of the embedded template (None if absent or over the kept cap)
    header_bytes: int



@dataclass(frozen=True)
class VerifyResult(JsonRecord):
    entry: str
    weights_path: str | None  # a file (GGUF) or a directory (OpenVINO snapshot)
    size_bytes: int
    sha256: str | None
    sha256_source: str  # "streamed" (recorded at download) or "rehashed"
    header_checks: tuple[FieldCheck, ...]
    gguf_embeds_chat_template: bool | None
    chat_template_path: str | None
    vision: bool
    files_checked: int = 1
    notes: tuple[str, ...] = field(default_factory=tuple)
    verified_against: tuple[str, ...] = ()  # "registry", "hub_lfs", "hub_git_blob"
    gguf: GGUFFacts | None = None


def check_integrity(*, file: str, size_bytes: int, sha256: str | None, expected_size: int | None,
                    registry_sha256: str | None, hub_sha256: str | None, git_sha1: str | None = None,
                    hub_git_sha1: str | None = None) -> tuple[str, ...]:
    """Size and hashes; returns which references matched (``("registry", "hub_lfs")``…) or raises."""
    if expected_size is not None and size_bytes != expected_size:
        raise IntegrityError(f"{file}: {size_bytes} bytes on disk, {expected_size} expected",
                             hint="the partial is discarded; rerun to fetch it again",
                             field="size_bytes", file=file, size_bytes=size_bytes, expected_size_bytes=expected_size)
    matched: list[str] = []
    for ref_name, ref in (("registry", registry_sha256), ("hub_lfs", hub_sha256)):
        if ref is None:
            continue
        if sha256 != ref:
            raise IntegrityError(f"{file}: sha256 {sha256} does not match the {ref_name} sha256 {ref}",
                                 hint="the download is corrupt or not the pinned file; it is discarded and "
                                      "fetched again (bounded); if it persists, review the registry entry",
                                 field="sha256", file=file, sha256=sha256, expected_sha256=ref, reference=ref_name)
        matched.append(ref_name)
    if hub_git_sha1 is not None and git_sha1 is not None:
        if git_sha1 != hub_git_sha1:
            raise IntegrityError(f"{file}: git blob id {git_sha1} does not match the Hub's {hub_git_sha1}",
                                 hint="the download is corrupt; it is discarded and fetched again",
                                 field="git_blob_sha1", file=file)
        matched.append("hub_git_blob")
    if not matched:
        raise IntegrityError(f"{file}: no sha256 (registry or Hub LFS) or git blob id to check it against",
                             hint="pin the entry's sha256 in the registry", field="sha256", file=file)
    return tuple(matched)
