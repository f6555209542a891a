"""``hotfit registry lock``: pin what the registry leaves open, from the Hub API (online).

For every entry whose artifact, projector or chat-template source has a null revision (or an artifact
with a null size or sha256), ask the Hub (``HfApi.model_info(..., files_metadata=True)``: commit sha,
file sizes, LFS sha256) and fill the nulls. Rules:

* a value already recorded is never overwritten; if the Hub disagrees the disagreement is reported
  (``mismatch``) and nothing of that artifact is written — a revision resolved from ``main`` must not
  be paired with bytes recorded from another snapshot;
* an unpinned revision resolves to the repository's current ``main`` commit;
* a whole-repository snapshot (OpenVINO: an artifact without a file) gets the commit, its total size
  and, as its ``sha256``, the pin of its file list (core.model_files.snapshot_listing_sha256): what a
  static mirror serving the snapshot is trusted for (docs/fleet.md, "OpenVINO snapshots");
* a template inside an OpenVINO snapshot (same repository, an artifact without a file) takes the
  snapshot's revision, and stays unpinned while the snapshot does: pinned alone, it would name a commit
  the snapshot's fetch no longer loads;
* a chat template is pinned by size and sha256 too — the only pins a static mirror is trusted for
  (docs/fleet.md, "Serving the mirror"). The Hub names only a git blob id for a file kept in git, so
  its bytes are read once at the pinned commit, checked against that blob id and size, and hashed;
* a file missing at the revision, an unknown repository or revision, a gated repository are reported
  (``error``) and leave the entry as it was;
* an endpoint that does not answer like a Hub (a 404 without X-Error-Code, an HTML page where the
  API answers JSON) stops the lock at its first answer with one HubError naming the URL: its
  answers say nothing about the entries, so none is reported as missing;
* the result is re-checked against the schema, then written atomically (temp file in the same
  directory, fsync, rename, fsync of the directory): a crash leaves the old file or the new one.

The pure part (``apply_hub_facts``) decides from already-fetched ``HubFacts``; ``lock_registry`` does
the I/O. The registry is a JSON document, edited as such so unknown top-level keys survive.
"""

from __future__ import annotations

import copy
import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from hotfit.core.errors import HubError, PinMismatch, UsageError
from hotfit.core.log import get_logger
from hotfit.core.model_files import snapshot_listing_sha256
from hotfit.core.records import JsonRecord
from hotfit.pipeline.registry_file import bundled_registry_path
from hotfit.registry.catalog import parse_registry, parse_registry_text
from hotfit.download import Proxy, hub_error_from_hf_exception, is_not_a_hub, proxy_config
from hotfit.stages.fetch_template import MAX_TEMPLATE_SOURCE_BYTES
from hotfit.state.files import write_text_atomic
from hotfit.state.receipts import git_blob_sha1, sha256_file

log = get_logger()

ARTIFACT_KEYS = ("artifact", "projector")
TEMPLATE_KEY = "chat_template"


@dataclass(frozen=True)
class FileFacts:
    size_bytes: int
    sha256: str | None  # the LFS oid; None for a file kept in git (the Hub gives only its git blob id)
    blob_id: str | None = None  # the git blob id the Hub lists (of the LFS pointer, for an LFS file)


@dataclass(frozen=True)
class HubFacts:
    """What the Hub says about one repository at one revision."""

    repo: str
    commit: str
    files: Mapping[str, FileFacts]


@dataclass(frozen=True)
class LockChange(JsonRecord):
    entry: str
    field: str
    new: Any


@dataclass(frozen=True)
class LockProblem(JsonRecord):
    entry: str
    field: str
    kind: str  # "mismatch" (a recorded value disagrees with the Hub) | "error" (the Hub could not answer)
    message: str


@dataclass(frozen=True)
class LockReport:
    source: str
    output: str | None  # where the registry was written; None = nothing to write
    checked: tuple[str, ...]
    changes: tuple[LockChange, ...] = ()
    problems: tuple[LockProblem, ...] = ()

    @property
    def all_failed(self) -> bool:
        """Every lookup failed: nothing was pinned or compared."""
        return bool(self.checked) and not self.changes and bool(self.problems) and all(
            p.kind == "error" for p in self.problems) and {p.entry for p in self.problems} >= set(self.checked)

    @property
    def exit_code(self) -> int:
        if any(p.kind == "mismatch" for p in self.problems):
            return PinMismatch.exit_code
        if self.problems:
            return HubError.exit_code
        return 0

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "output": self.output,
            "checked": list(self.checked),
            "changes": [c.to_json() for c in self.changes],
            "problems": [p.to_json() for p in self.problems],
        }


# --------------------------------------------------------------------------- pure core


def needs_lock(entry: Mapping[str, Any]) -> bool:
    """True when the entry leaves a revision (or an artifact's size/sha256) to be resolved."""
    for key in ARTIFACT_KEYS:
        art = entry.get(key)
        if art and (art.get("revision") is None or art.get("size_bytes") is None
                    or art.get("sha256") is None):
            return True
    tpl = entry.get(TEMPLATE_KEY)
    return bool(tpl and _template_open(tpl))


def _template_open(tpl: Mapping[str, Any]) -> bool:
    return any(tpl.get(k) is None for k in ("revision", "size_bytes", "sha256"))


def queries_for(entry: Mapping[str, Any], *, verify_pinned: bool = False) -> list[tuple[str, str | None]]:
    """The (repo, revision-or-None) pairs the Hub must answer for this entry."""
    out: list[tuple[str, str | None]] = []
    for key in (*ARTIFACT_KEYS, TEMPLATE_KEY):
        comp = entry.get(key)
        if not comp:
            continue
        if key == TEMPLATE_KEY:
            open_ = _template_open(comp)
        else:
            open_ = (comp.get("revision") is None or comp.get("size_bytes") is None
                     or comp.get("sha256") is None)
        if open_ or verify_pinned:
            pair = (comp["repo"], comp.get("revision"))
            if pair not in out:
                out.append(pair)
    return out


ContentLookup = Callable[[str, str, str, FileFacts], "FileFacts | str"]


def apply_hub_facts(
    entry: dict[str, Any],
    lookup: Callable[[str, str | None], HubFacts | str],
    *,
    verify_pinned: bool = False,
    content: ContentLookup | None = None,
) -> tuple[list[LockChange], list[LockProblem]]:
    """Fill ``entry``'s open values from ``lookup`` (repo, revision) → facts or an error text.
    ``content`` (repo, commit, file, listed facts) → the facts of the bytes read there (size and
    sha256), or an error text: how a template kept in git gets its sha256 (None: left unpinned).

    Mutates ``entry`` in place; returns what changed and what disagreed or failed (pure: no I/O).
    """
    name = entry.get("name", "?")
    changes: list[LockChange] = []
    problems: list[LockProblem] = []
    for key in ARTIFACT_KEYS:
        art = entry.get(key)
        if not art:
            continue
        is_open = (art.get("revision") is None or art.get("size_bytes") is None
                   or art.get("sha256") is None)
        if not (is_open or verify_pinned):
            continue
        facts = lookup(art["repo"], art.get("revision"))
        if isinstance(facts, str):
            problems.append(LockProblem(name, key, "error", facts))
            continue
        updates, comp_problems = _artifact_updates(name, key, art, facts)
        problems.extend(comp_problems)
        if any(p.kind == "mismatch" for p in comp_problems):
            continue  # never pair recorded bytes with another snapshot's commit
        for fld, value in updates.items():
            art[fld] = value
            changes.append(LockChange(name, f"{key}.{fld}", value))
    tpl = entry.get(TEMPLATE_KEY)
    if not tpl:
        return changes, problems
    art = entry.get("artifact")
    ask_at = tpl.get("revision")
    if ask_at is None and art and art.get("file") is None and tpl["repo"] == art["repo"]:
        # A template inside the snapshot goes with the snapshot's commit (registry/schema.py): pinned
        # alone, while the snapshot follows main, it would name a commit the fetch no longer loads.
        if art.get("revision") is None:
            problems.append(LockProblem(
                name, f"{TEMPLATE_KEY}.revision", "error",
                f"left unpinned: it is a file of the {art['repo']} snapshot, whose revision was not pinned "
                "(see the artifact's problem); both are pinned together once it is"))
            return changes, problems
        ask_at = art["revision"]
    if _template_open(tpl) or verify_pinned:
        facts = lookup(tpl["repo"], ask_at)
        if isinstance(facts, str):
            problems.append(LockProblem(name, TEMPLATE_KEY, "error", facts))
        elif tpl["file"] not in facts.files:
            problems.append(LockProblem(
                name, f"{TEMPLATE_KEY}.file", "error",
                f"{tpl['file']} is not in {tpl['repo']} at {facts.commit}; correct the template source"))
        else:
            c, p = _template_updates(name, tpl, facts, content, verify_pinned=verify_pinned)
            changes.extend(c)
            problems.extend(p)
    return changes, problems


def _template_updates(name: str, tpl: dict[str, Any], facts: HubFacts, content: ContentLookup | None, *,
                      verify_pinned: bool) -> tuple[list[LockChange], list[LockProblem]]:
    """The template's revision, size and sha256 from the Hub at ``facts.commit``; the sha256 of a
    file kept in git from its bytes (``content``). A recorded value that disagrees writes nothing."""
    listed = facts.files[tpl["file"]]
    read: FileFacts | str = listed
    # read the bytes where a sha256 is to be pinned, or a recorded one checked against a commit
    # being pinned now (never pair recorded bytes with another commit)
    if listed.sha256 is None and content is not None and (
            tpl.get("sha256") is None or tpl.get("revision") is None or verify_pinned):
        read = content(tpl["repo"], facts.commit, tpl["file"], listed)
    if isinstance(read, str):
        return [], [LockProblem(name, f"{TEMPLATE_KEY}.sha256", "error",
                                f"{tpl['file']} at {tpl['repo']}@{facts.commit}: {read}")]
    where = f"{tpl['repo']}@{facts.commit}"
    updates: dict[str, Any] = {}
    problems: list[LockProblem] = []
    for fld, value in (("size_bytes", read.size_bytes), ("sha256", read.sha256)):
        if value is None:
            continue
        if tpl.get(fld) is None:
            updates[fld] = value
        elif tpl[fld] != value:
            problems.append(LockProblem(name, f"{TEMPLATE_KEY}.{fld}", "mismatch",
                                        f"recorded {fld} {tpl[fld]}, the Hub has {value} at {where}"))
    if problems:
        return [], problems  # never pair recorded bytes with another commit
    if tpl.get("revision") is None:
        updates = {"revision": facts.commit, **updates}
    for fld, value in updates.items():
        tpl[fld] = value
    return [LockChange(name, f"{TEMPLATE_KEY}.{fld}", value) for fld, value in updates.items()], []


def _artifact_updates(name: str, key: str, art: Mapping[str, Any],
                      facts: HubFacts) -> tuple[dict[str, Any], list[LockProblem]]:
    updates: dict[str, Any] = {}
    problems: list[LockProblem] = []
    where = f"{art['repo']}@{facts.commit}"
    sha: str | None
    if art.get("file") is None:  # a whole-repository snapshot (OpenVINO): its file list is pinned
        size = sum(f.size_bytes for f in facts.files.values())
        sha = snapshot_listing_sha256((path, f.size_bytes, f.sha256, f.blob_id) for path, f in facts.files.items())
    else:
        found = facts.files.get(art["file"])
        if found is None:
            return {}, [LockProblem(name, f"{key}.file", "error",
                                    f"{art['file']} is not in {where}; correct the file name or the revision")]
        size, sha = found.size_bytes, found.sha256
    if art.get("size_bytes") is None:
        updates["size_bytes"] = size
    elif art["size_bytes"] != size:
        problems.append(LockProblem(name, f"{key}.size_bytes", "mismatch",
                                    f"recorded {art['size_bytes']} bytes, the Hub has {size} at {where}"))
    if sha is not None:
        if art.get("sha256") is None:
            updates["sha256"] = sha
        elif art["sha256"] != sha:
            problems.append(LockProblem(name, f"{key}.sha256", "mismatch",
                                        f"recorded sha256 {art['sha256']}, the Hub has {sha} at {where}"))
    if art.get("revision") is None:
        updates["revision"] = facts.commit
    return updates, problems


# --------------------------------------------------------------------------- effectful shell


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never half."""
    write_text_atomic(path, text)


def render_registry(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, indent=2, ensure_ascii=False) + "\n"


def hub_facts(api: Any, repo: str, revision: str | None, proxy: Proxy | None = None) -> HubFacts | str:
    """Ask the Hub for one repository at one revision (None = main); an error comes back as text.
    An endpoint that is not a Hub raises HubError (see the module doc)."""
    endpoint = str(getattr(api, "endpoint", "") or "")
    try:
        info = api.model_info(repo, revision=revision, files_metadata=True)
    except Exception as exc:
        url = f"{endpoint}/api/models/{repo}" + (f"/revision/{revision}" if revision else "")
        mapped = hub_error_from_hf_exception(exc, repo=repo, revision=revision, endpoint=endpoint, url=url,
                                             proxy=proxy)
        if mapped is None:  # no Hub answer at all: a bug, not a lock problem
            raise
        if is_not_a_hub(mapped):
            raise mapped from exc
        return f"{mapped.what}; {mapped.hint}" if mapped.hint else mapped.what
    files: dict[str, FileFacts] = {}
    for sib in info.siblings or ():
        lfs = getattr(sib, "lfs", None)
        size = lfs.size if lfs is not None else sib.size
        if size is None:
            return f"the Hub gave no size for {repo}/{sib.rfilename}; retry later"
        files[sib.rfilename] = FileFacts(size_bytes=int(size), sha256=lfs.sha256 if lfs is not None else None,
                                         blob_id=getattr(sib, "blob_id", None))
    return HubFacts(repo=repo, commit=info.sha, files=files)


def file_content_facts(api: Any, repo: str, commit: str, file: str, listed: FileFacts,
                       proxy: Proxy | None = None) -> FileFacts | str:
    """Read a file kept in git at ``commit`` (into a temporary directory) and hash it: its size and
    git blob id must be the ones the Hub listed, else the bytes are not the commit's file."""
    if listed.size_bytes > MAX_TEMPLATE_SOURCE_BYTES:
        return f"{listed.size_bytes} bytes is too large for a template source"
    endpoint = str(getattr(api, "endpoint", "") or "")
    with tempfile.TemporaryDirectory(prefix="hotfit-lock-") as tmp:
        try:
            path = Path(api.hf_hub_download(repo_id=repo, filename=file, revision=commit, local_dir=tmp))
        except Exception as exc:
            mapped = hub_error_from_hf_exception(exc, repo=repo, revision=commit, endpoint=endpoint,
                                                 url=f"{endpoint}/{repo}/resolve/{commit}/{file}", proxy=proxy)
            if mapped is None:
                raise
            return f"reading it failed: {mapped.what}"
        size = path.stat().st_size
        if size != listed.size_bytes or (listed.blob_id is not None and git_blob_sha1(path) != listed.blob_id):
            return (f"the bytes read ({size}) are not the file the Hub lists ({listed.size_bytes} bytes, "
                    f"git blob {listed.blob_id}); retry, or check HF_ENDPOINT")
        return FileFacts(size_bytes=size, sha256=sha256_file(path), blob_id=listed.blob_id)


@dataclass
class _Cache:
    api: Any
    proxy: Proxy | None = None
    seen: dict[tuple[str, str | None], HubFacts | str] = field(default_factory=dict)
    read: dict[tuple[str, str, str], FileFacts | str] = field(default_factory=dict)

    def __call__(self, repo: str, revision: str | None) -> HubFacts | str:
        key = (repo, revision)
        if key not in self.seen:
            log.info("registry.lock.query", repo=repo, revision=revision or "main")
            self.seen[key] = hub_facts(self.api, repo, revision, self.proxy)
        return self.seen[key]

    def content(self, repo: str, commit: str, file: str, listed: FileFacts) -> FileFacts | str:
        key = (repo, commit, file)
        if key not in self.read:
            log.info("registry.lock.read", repo=repo, revision=commit, file=file, size_bytes=listed.size_bytes)
            self.read[key] = file_content_facts(self.api, repo, commit, file, listed, self.proxy)
        return self.read[key]


def lock_registry(
    source: Path | None,
    output: Path | None,
    *,
    endpoint: str,
    offline: bool = False,
    verify_pinned: bool = False,
    api: Any = None,
    proxy_env: Mapping[str, str] | None = None,
) -> LockReport:
    """Resolve open revisions/sizes/sha256 of ``source`` (None = bundled) and write ``output``
    (None = in place). Writes only when something changed or ``output`` differs from ``source``.
    ``proxy_env``: the proxy variables (download.proxy); huggingface_hub's client reads the same
    variables with the same rules, so this checks them (exit 2 when malformed) and names the proxy
    in errors."""
    if offline:
        raise UsageError("'hotfit registry lock' asks the Hub and HF_HUB_OFFLINE is set",
                         hint="unset HF_HUB_OFFLINE (or set HF_ENDPOINT to a reachable mirror) and rerun")
    src_path = Path(source) if source is not None else bundled_registry_path()
    label = str(src_path)
    try:
        text = src_path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"{label}: cannot be read ({exc.strerror or exc})",
                         hint="pass an existing registry file with --registry") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = None
    parse_registry_text(text, label)  # a broken file fails here, before any request
    assert isinstance(doc, dict)
    proxy = proxy_config(proxy_env or {}).for_url(endpoint)
    if api is None:
        from huggingface_hub import HfApi

        api = HfApi(endpoint=endpoint)
    lookup = _Cache(api, proxy)

    new_doc = copy.deepcopy(doc)
    changes: list[LockChange] = []
    problems: list[LockProblem] = []
    checked: list[str] = []
    for entry in new_doc["entries"]:
        if not (needs_lock(entry) or verify_pinned):
            continue
        checked.append(entry["name"])
        c, p = apply_hub_facts(entry, lookup, verify_pinned=verify_pinned, content=lookup.content)
        changes.extend(c)
        problems.extend(p)

    dest = Path(output) if output is not None else src_path
    written: str | None = None
    if changes or dest != src_path:
        parse_registry(new_doc, f"{label} (locked)")  # the result must still pass the schema
        write_atomic(dest, render_registry(new_doc))
        written = str(dest)
    for change in changes:
        log.info("registry.lock.pinned", entry=change.entry, field=change.field, value=change.new)
    for problem in problems:
        log.warning("registry.lock.problem", entry=problem.entry, field=problem.field, kind=problem.kind,
                    message=problem.message)
    return LockReport(source=label, output=written, checked=tuple(checked),
                      changes=tuple(changes), problems=tuple(problems))
