"""fetch-template: the tool-capable chat template, written as ``chat_template.jinja`` beside the weights.

Why (spec, "Most community GGUF quants … carry no tokenizer.chat_template"): without the publisher's
template llama.cpp falls back to ChatML, which declares no tool-call markers, and the model's calls
come back as prose. So where the registry entry names a template source it is mandatory:

- a ``.jinja`` file is taken as is; a ``tokenizer_config.json`` gives ``chat_template`` as a string,
  or as a list of ``{"name", "template"}`` — ``tool_use`` when present, else ``default``;
- the template must be able to express tool calls: it references the ``tools`` variable or a
  tool-call marker (:func:`check_tool_capable`), else :class:`TemplateError`;
- the file is written atomically (temp + fsync + rename), with a receipt (``state.receipts``) holding
  its sha256, which verify checks before load uses the file.

Whether the GGUF embeds ``tokenizer.chat_template`` is verify's to say: it reads the header once.

**A template inside the OpenVINO snapshot** (every bundled OpenVINO entry: its ``tokenizer_config.json``
or ``chat_template.jinja``, in the repository fetch-weights lists) is read from the file fetch-weights
brought — its hashed partial, or the snapshot's copy once verify has placed it — after checking its
bytes against the listing's git blob id (or LFS sha256); it is never downloaded a second time, and the
template is recorded at the snapshot's commit. That file stays where it is: verify puts it into
``snapshot/`` with the rest. Only a template from elsewhere (another repository, or a pinned commit the
snapshot is not at) is downloaded here, into fetch-template's own partial directory
(:data:`~core.model_files.TEMPLATE_PARTIAL_DIRNAME`), so no partial, sidecar or lock of this stage is
ever one fetch-weights uses.

A template failure fails this stage but keeps the verified weights: nothing already downloaded is
lost, and a rerun fetches only the template. Parsing is bounded and fuzzed
(``tests/test_fuzz_inputs.py``): oversized or garbage input gives TemplateError quickly.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import anyio

from hotfit.core.entry import Entry, TemplateSource, template_json
from hotfit.core.errors import HubError, IntegrityError, RegistryError, TemplateError
from hotfit.core.log import get_logger
from hotfit.core.model_files import (
    SNAPSHOT_DIRNAME,
    TEMPLATE_FILENAME,
    TEMPLATE_PARTIAL_DIRNAME,
    FetchResult,
    SnapshotFile,
    SnapshotResult,
    TemplateResult,
)
from hotfit.core.settings import Settings
from hotfit.download import (
    CacheMiss,
    HubSession,
    TransferOptions,
    discard_partial,
    download_to_partial,
    head_retrying,
    is_commit,
    partial_paths,
    safe_relpath,
    snapshot_path,
    take_from_cache,
    write_text_atomic,
)
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.fetch_weights import FetchJob
from hotfit.state.locks import FileLock
from hotfit.state.receipts import Receipt, read_receipt, write_receipt

log = get_logger()

__all__ = ["TemplateResult", "fetch_template", "extract_template", "check_tool_capable", "in_snapshot",
           "TEMPLATE_FILENAME"]

MAX_TEMPLATE_SOURCE_BYTES = 8 << 20  # real tokenizer_config.json files are ≤ ~1 MiB (with added tokens)
MAX_TEMPLATE_BYTES = 1 << 20  # real templates are ≤ ~50 KiB
_FIX_SOURCE = ("point the registry entry's chat_template at the publisher's tool-capable template "
               "(a .jinja file, or a tokenizer_config.json with a tool_use or default template)")

# A template can express tool calls when it renders the ``tools`` variable or emits a call marker.
# (Markers from llama.cpp's common/chat.cpp dialects: Hermes/Qwen, Mistral, Llama 3.x, functionary,
# DeepSeek, Command-R, gpt-oss harmony, Gemma 4, GLM, MiniCPM…)
_TOOLS_WORD_RE = re.compile(r"\btools\b")
_TOOL_MARKERS = (
    "<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<|tool_call", "<tool_calls>", "tool_calls",
    "<|action_start|>", "<function=", "<｜tool▁calls▁begin｜>", "<|start_header_id|>ipython",
    "<start_function_call>", "<|tool_calls_section_begin|>", "to=functions.", "<|tool_call_start|>",
)


# --------------------------------------------------------------------------- pure core


def extract_template(filename: str, data: bytes) -> tuple[str, str]:
    """(template text, variant) from a ``.jinja`` file or a ``tokenizer_config.json``; TemplateError."""
    if len(data) > MAX_TEMPLATE_SOURCE_BYTES:
        raise TemplateError(f"{filename}: {len(data)} bytes is too large for a template source",
                            hint="point the entry at the template file itself", file=filename)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise TemplateError(f"{filename}: not UTF-8 ({exc.reason} at byte {exc.start})",
                            hint="the template source is corrupt or binary", file=filename) from None
    if not filename.endswith(".json"):
        return _bounded(text, filename), "jinja"
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise TemplateError(f"{filename}: not valid JSON ({str(exc)[:120]})",
                            hint="the template source is corrupt", file=filename) from None
    if not isinstance(config, dict):
        raise TemplateError(f"{filename}: top level is {type(config).__name__}, not an object",
                            hint=_FIX_SOURCE, file=filename)
    value = config.get("chat_template")
    if value is None:
        raise TemplateError(f"{filename} has no chat_template",
                            hint="name a source that carries the tool-capable template (a .jinja file)",
                            file=filename)
    if isinstance(value, str):
        return _bounded(value, filename), "tokenizer_config:string"
    if isinstance(value, list):
        named: dict[str, str] = {}
        for item in value:
            if (isinstance(item, dict) and isinstance(item.get("name"), str)
                    and isinstance(item.get("template"), str)):
                named.setdefault(item["name"], item["template"])
        for name in ("tool_use", "default"):
            if name in named:
                return _bounded(named[name], filename), f"tokenizer_config:{name}"
        raise TemplateError(f"{filename}: chat_template list has neither 'tool_use' nor 'default' "
                            f"(names: {sorted(named)[:8]})", hint=_FIX_SOURCE, file=filename)
    raise TemplateError(f"{filename}: chat_template is {type(value).__name__}, not a string or list",
                        hint=_FIX_SOURCE, file=filename)


def _bounded(text: str, filename: str) -> str:
    if not text.strip():
        raise TemplateError(f"{filename}: the chat template is empty", hint=_FIX_SOURCE, file=filename)
    if len(text) > MAX_TEMPLATE_BYTES:
        raise TemplateError(f"{filename}: chat template of {len(text)} characters exceeds {MAX_TEMPLATE_BYTES}",
                            hint=_FIX_SOURCE, file=filename)
    return text


def _references_tools(text: str) -> bool:
    """``tools`` inside a ``{{ … }}`` / ``{% … %}`` tag. A linear scan, not a backtracking regex over
    the whole text, so a hostile template cannot make it quadratic."""
    pos, n = 0, len(text)
    while True:
        i = text.find("{", pos)
        if i < 0 or i + 1 >= n:
            return False
        if text[i + 1] not in "{%":
            pos = i + 1
            continue
        j = text.find("}", i + 2)
        if j < 0:
            return False
        if _TOOLS_WORD_RE.search(text, i + 2, j):
            return True
        pos = j + 1


def check_tool_capable(text: str, *, source: str) -> tuple[str, ...]:
    """The tool-call evidence found in a template, or TemplateError when there is none."""
    found: list[str] = []
    if _references_tools(text):
        found.append("tools")
    found.extend(m for m in _TOOL_MARKERS if m in text)
    if not found:
        raise TemplateError(
            f"{source}: the chat template cannot express tool calls (no 'tools' variable, no tool-call marker)",
            hint="name the publisher's tool-capable template in the registry entry (a .jinja file or the "
                 "tokenizer_config.json with the tool_use template)", source=source)
    return tuple(found)


# --------------------------------------------------------------------------- stage


def _present(entry: Entry, dest_dir: Path, settings: Settings, *, commit: str | None = None) -> TemplateResult | None:
    """The template already written for this pin (its receipt and text agree), or None.

    ``commit``: the snapshot commit a template inside the snapshot must come from. Otherwise an
    unpinned source is re-resolved when online (main may have moved) and taken from disk offline.
    """
    src = entry.chat_template
    assert src is not None
    final = dest_dir / TEMPLATE_FILENAME
    receipt = read_receipt(dest_dir, TEMPLATE_FILENAME)
    if receipt is None or not final.is_file() or (receipt.repo, receipt.file) != (src.repo, src.file):
        return None
    if commit is not None:
        if receipt.revision != commit or receipt.commit_listed != commit:
            return None
    elif src.revision is not None and receipt.revision != src.revision:
        return None
    elif src.revision is None and not settings.hf_offline:
        return None
    data = final.read_bytes()
    if hashlib.sha256(data).hexdigest() != receipt.sha256:
        return None
    log.info("template.already_present", entry=entry.name, path=str(final))
    return TemplateResult(entry=entry.name, path=str(final), source=f"{src.repo}@{receipt.revision}/{src.file}",
                          variant=receipt.variant, sha256=receipt.sha256, tool_markers=receipt.tool_markers,
                          size_bytes=len(data))


def in_snapshot(src: TemplateSource, snapshot: SnapshotResult | None) -> SnapshotFile | None:
    """Pure: the snapshot file the template source names — same repository, a file the commit lists,
    and no pin to another commit — or None (the source is fetched on its own)."""
    if snapshot is None or src.repo != snapshot.repo:
        return None
    if src.revision is not None and src.revision != snapshot.commit:
        return None
    return next((f for f in snapshot.listed if f.path == src.file), None)


def _read_snapshot_source(entry: Entry, dest_dir: Path, snapshot: SnapshotResult, sf: SnapshotFile) -> bytes:
    """The bytes fetch-weights brought for ``sf``: its hashed partial, or the snapshot's placed copy
    (verify already ran), checked against the listing (git blob id, or LFS sha256) — the same check
    verify makes, so the template is only ever taken from the file verify puts in place."""
    where = f"{snapshot.repo}@{snapshot.commit}/{sf.path}"
    if sf.size_bytes > MAX_TEMPLATE_SOURCE_BYTES:
        raise TemplateError(f"{where}: {sf.size_bytes} bytes is too large for a template source",
                            hint="point the entry at the template file itself", entry=entry.name, file=sf.path)
    partial = Path(sf.partial_path) if sf.partial_path else None
    path = partial if partial is not None and partial.is_file() else dest_dir / SNAPSHOT_DIRNAME / sf.path
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TemplateError(f"{where}: the snapshot's copy is not on disk ({exc.strerror or exc})",
                            hint="rerun; fetch-weights fetches the snapshot again", entry=entry.name,
                            file=str(path)) from None
    if sf.lfs_sha256 is not None:
        ok = hashlib.sha256(data).hexdigest() == sf.lfs_sha256
    else:
        ok = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == sf.blob_id
    if len(data) != sf.size_bytes or not ok:
        raise TemplateError(f"{path}: not the bytes {where} lists (size or hash differ)",
                            hint="rerun; the snapshot's file changed since it was fetched and is fetched again",
                            entry=entry.name, file=str(path))
    return data


def _write(entry: Entry, dest_dir: Path, src: TemplateSource, revision: str, data: bytes, *,
           commit_listed: str | None) -> TemplateResult:
    """Extract and check the template, write ``chat_template.jinja`` and its receipt."""
    text, variant = extract_template(src.file, data)
    markers = check_tool_capable(text, source=f"{src.repo}/{src.file}")
    final = dest_dir / TEMPLATE_FILENAME
    write_text_atomic(final, text, what="the chat template")
    digest = hashlib.sha256(text.encode()).hexdigest()
    # keyed by the file written (chat_template.jinja), recording the source file it came from (and,
    # for a file of the snapshot, the commit it was listed at: verify checks it is the snapshot's)
    write_receipt(dest_dir, Receipt(repo=src.repo, revision=revision, file=src.file, sha256=digest,
                                    variant=variant, tool_markers=markers, commit_listed=commit_listed),
                  key=TEMPLATE_FILENAME)
    log.info("template.written", entry=entry.name, variant=variant, markers=list(markers),
             size_bytes=len(text.encode()), source=f"{src.repo}@{revision}/{src.file}",
             from_snapshot=commit_listed is not None)
    return TemplateResult(entry=entry.name, path=str(final), source=f"{src.repo}@{revision}/{src.file}",
                          variant=variant, sha256=digest, tool_markers=markers, size_bytes=len(text.encode()))


async def _from_hf_cache(entry: Entry, settings: Settings, partial_dir: Path) -> bytes | None:
    """The pinned template source from the Hugging Face cache (download.hf_cache): the file at the
    pinned commit whose bytes hash to the id the cache names its blob by (the Hub's ETag: git blob id,
    or sha256 for an LFS file). None when absent or damaged (then it is downloaded)."""
    src = entry.chat_template
    assert src is not None
    if src.revision is None or settings.hf_hub_cache is None:
        return None
    if not snapshot_path(settings.hf_hub_cache, src.repo, src.revision, src.file).exists():
        return None
    partial, sidecar, _lock = partial_paths(partial_dir, src.repo, src.file)
    discard_partial(partial, sidecar)
    found = await anyio.to_thread.run_sync(lambda: take_from_cache(
        settings.hf_hub_cache, repo=src.repo, commit=src.revision or "", file=src.file, dest=partial,
        size_bytes=src.size_bytes, sha256=src.sha256, max_size_bytes=MAX_TEMPLATE_SOURCE_BYTES))
    if isinstance(found, CacheMiss):
        if found.damaged:
            log.warning("fetch.hf_cache_rejected", entry=entry.name, file=src.file, path=found.source,
                        reason=found.reason, detail=found.detail,
                        action="ignored" if settings.hf_offline else "ignored; downloading")
        return None
    try:
        data = partial.read_bytes()
    finally:
        discard_partial(partial, sidecar)
    log.info("fetch.hf_cache_used", entry=entry.name, role="template", file=src.file, path=found.source,
             how=found.how, size_bytes=found.size_bytes)
    return data


async def _download(entry: Entry, settings: Settings, options: TransferOptions | None,
                    partial_dir: Path) -> tuple[bytes, str]:
    """The pinned template source from the Hub: (its bytes, the commit)."""
    src = entry.chat_template
    assert src is not None
    _partial, sidecar, _lock = partial_paths(partial_dir, src.repo, src.file)
    async with HubSession(settings, options) as session:
        try:
            revision = src.revision
            if revision is None:  # not yet pinned: take main's current commit, and record it
                revision = (await head_retrying(session, src.repo, "main", src.file)).commit
                log.warning("template.unpinned", entry=entry.name, repo=src.repo, commit=revision,
                            hint="pin it with `hotfit registry lock`")
            outcome = await download_to_partial(
                session, repo=src.repo, revision=revision, path=src.file, expected_size=src.size_bytes,
                expected_sha256=src.sha256, partial_dir=partial_dir, connections=1, git_sha1=True,
                max_size_bytes=MAX_TEMPLATE_SOURCE_BYTES)
        except (HubError, IntegrityError) as exc:
            raise TemplateError(f"entry {entry.name}: chat template {src.repo}/{src.file} could not be "
                                f"fetched: {exc.what}", hint=exc.hint or "rerun; the weights are kept",
                                entry=entry.name, **exc.details) from exc
    try:
        if src.sha256 is not None and outcome.sha256 != src.sha256:  # the registry's pin, where it has one
            raise TemplateError(f"{src.file}: sha256 {outcome.sha256} differs from the registry's {src.sha256}",
                                hint="the server holds another file under this name; rerun, or fill the mirror "
                                     "again", entry=entry.name)
        if outcome.etag and outcome.git_sha1 and outcome.hub_lfs_sha256 is None and outcome.etag != outcome.git_sha1:
            raise TemplateError(f"{src.file}: git blob id {outcome.git_sha1} differs from the Hub's {outcome.etag}",
                                hint="the download is corrupt; rerun", entry=entry.name)
        if outcome.hub_lfs_sha256 and outcome.sha256 != outcome.hub_lfs_sha256:
            raise TemplateError(f"{src.file}: sha256 differs from the Hub's LFS sha256",
                                hint="the download is corrupt; rerun", entry=entry.name)
        data = outcome.partial_path.read_bytes()
    finally:
        discard_partial(outcome.partial_path, sidecar)
    return data, revision


async def fetch_template(entry: Entry, dest_dir: Path, *, settings: Settings, wait: bool = False,
                         options: TransferOptions | None = None,
                         snapshot: SnapshotResult | None = None) -> TemplateResult:
    """Fetch the entry's pinned template source, check it, and write ``<dest_dir>/chat_template.jinja``.

    ``snapshot``: fetch-weights' OpenVINO snapshot; a template that is one of its files is read from
    what fetch-weights brought (see the module docstring). Raises TemplateError / HubError /
    PinMismatch; never touches weights, nor any file of the snapshot.
    """
    dest_dir = Path(dest_dir)
    src = entry.chat_template
    if src is None:
        log.info("template.none", entry=entry.name)
        return TemplateResult(entry=entry.name, path=None, source=None, variant=None, sha256=None, tool_markers=())
    if src.revision is not None and not is_commit(src.revision):
        raise TemplateError(f"entry {entry.name}: chat template source {src.repo}/{src.file} names "
                            f"{src.revision!r}, not a 40-hex commit", hint="pin it (hotfit registry lock)",
                            entry=entry.name)
    try:  # the one path check every file name from the registry or the Hub passes, before any request
        safe_relpath(src.file)
    except ValueError:
        raise RegistryError(f"entry {entry.name}: chat template file {src.file!r} escapes the model directory",
                            hint="use the file's path inside its repository (no '..', not absolute)",
                            entry=entry.name, file=src.file) from None
    partial_dir = dest_dir / TEMPLATE_PARTIAL_DIRNAME
    _partial, _sidecar, lock_path = partial_paths(partial_dir, src.repo, src.file)
    own = in_snapshot(src, snapshot)
    async with FileLock(lock_path, wait=wait, what=f"chat template of {entry.name}").async_held():
        if own is not None:
            assert snapshot is not None
            present = _present(entry, dest_dir, settings, commit=snapshot.commit)
            if present is not None:
                return present
            data = _read_snapshot_source(entry, dest_dir, snapshot, own)
            return _write(entry, dest_dir, src, snapshot.commit, data, commit_listed=snapshot.commit)
        present = _present(entry, dest_dir, settings)
        if present is not None:
            return present
        cached = await _from_hf_cache(entry, settings, partial_dir)
        revision = src.revision
        if cached is None:
            data, revision = await _download(entry, settings, options, partial_dir)
        else:
            data = cached
        assert revision is not None
        return _write(entry, dest_dir, src, revision, data, commit_listed=None)


# --------------------------------------------------------------------------- the stage


async def fetch_template_work(ctx: StageContext) -> TemplateResult:
    job = ctx.job(FetchJob)
    entry = job.entry_of(ctx)
    # a template that is a file of the OpenVINO snapshot is read from what fetch-weights brought
    snapshot = ctx.result("fetch-weights", FetchResult).snapshot
    return await job.locked(ctx, lambda: fetch_template(entry, ctx.settings.model_dir(entry.name),
                                                        settings=ctx.settings, wait=job.wait, snapshot=snapshot))


def _inputs(ctx: StageContext) -> dict[str, Any]:
    entry = ctx.job(FetchJob).entry_of(ctx)
    return {"entry": entry.name,
            "chat_template": template_json(entry.chat_template),
            "models_dir": str(ctx.settings.models_dir)}


def template_still_there(template: TemplateResult) -> bool:
    """The template is a few KiB: hash it, so text edited behind our back is fetched again
    instead of being trusted by verify and load through a skipped record."""
    if template.path is None:
        return True
    try:
        data = Path(template.path).read_bytes()
    except OSError:
        return False
    return hashlib.sha256(data).hexdigest() == template.sha256


def template_fingerprint(template: TemplateResult) -> Any:
    return {"path": template.path, "sha256": template.sha256, "source": template.source}


DECLARATION = StageDeclaration(
    "fetch-template", fetch_template_work, deps=("fetch-weights",), inputs=_inputs, decode=TemplateResult.decode,
    still_valid=template_still_there, fingerprint=template_fingerprint, version=1, result_type=TemplateResult,
    job=FetchJob())
