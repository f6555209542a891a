"""verify: the stage that makes fetched bytes trustworthy and puts them in place.

Input: what fetch-weights left (:class:`~core.model_files.FetchResult`: a complete partial per file,
hashed while streaming, or a file already verified in place) and fetch-template's result. For each
weights / projector file verify checks, in order:

1. **pin**: the partial is of the repository, commit and file the registry entry pins;
2. **size and sha256** (:func:`~core.model_files.check_integrity`): exact byte size; sha256 equal to
   the registry's when pinned *and* the Hub's LFS sha256. The sha256 fetch-weights computed while
   streaming is reused when the partial's identity (device, inode, size, mtime, ctime; see
   :class:`~core.model_files.FileIdentity`) is the one recorded then — the bytes cannot have changed
   unseen — otherwise (or with ``rehash``) the file is read again. A mismatch discards the partial,
   so a rerun fetches it again;
3. **GGUF header** (bounded reader, ``stages._gguf_header``; read once per run): architecture, block
   count, KV heads, key/value head dims, context length and sliding window against the registry
   entry (:func:`check_header_against_entry`); a mismatch fails closed naming the field and keeps
   the partial out of place;

then fsyncs and renames the file into place atomically and writes its receipt
(``state.receipts``). A file already in place is re-confirmed from its receipt (no re-read unless
``rehash``). The chat template must be the one fetch-template checked (its receipt's sha256). The
header's facts (:class:`~core.model_files.GGUFFacts`) travel forward in the :class:`VerifyResult`:
load takes "does the GGUF embed a template" from there instead of opening the file again.
OpenVINO snapshots go the same way (:func:`place_snapshot`: size and LFS sha256 or git blob id per
file, rename, receipt, stale files dropped, ``snapshot.json`` written) and are then re-confirmed
against ``snapshot.json`` (:func:`verify_snapshot_dir`); a template fetch-template read from a file
of the snapshot must be from the commit placed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from hotfit.core.entry import Artifact, Entry
from hotfit.core.errors import IntegrityError, TemplateError, UsageError
from hotfit.core.log import get_logger
from hotfit.core.model_files import (
    PARTIAL_DIRNAME,
    SNAPSHOT_DIRNAME,
    SNAPSHOT_MANIFEST,
    TEMPLATE_FILENAME,
    FetchedFile,
    FetchResult,
    FieldCheck,
    TemplateResult,
    VerifyResult,
    check_integrity,
)
from hotfit.stages._gguf_header import GGUFHeader, gguf, read_gguf_header, whole_number
from hotfit.stages._snapshot_verify import place_snapshot, snapshot_commit, verify_snapshot_dir
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.fetch_weights import FetchJob
from hotfit.download import discard_partial, partial_paths
from hotfit.state.files import finalize_file
from hotfit.state.locks import FileLock
from hotfit.state.receipts import (
    RECEIPTS_DIRNAME,
    Receipt,
    drop_receipt,
    file_identity,
    git_blob_sha1,
    read_receipt,
    receipt_matches,
    sha256_file,
    write_receipt,
)

log = get_logger()

__all__ = [
    "GGUFHeader",
    "FieldCheck",
    "VerifyResult",
    "read_gguf_header",
    "check_integrity",
    "check_header_against_entry",
    "ensure_header_matches",
    "place_snapshot",
    "verify_snapshot_dir",
    "verify",
    "InstalledFile",
    "recheck_installed",
    "recheck_models",
]


# --------------------------------------------------------------------------- header checks (pure)


def _as_values(value: Any) -> set[int] | None:
    """The distinct non-zero values of a scalar or per-layer array; an empty set (never equal to the
    registry's) when any item is not a whole number; None when the key is absent."""
    if value is None:
        return None
    items = value if isinstance(value, tuple) else (value,)
    ints = [whole_number(v) for v in items]
    if any(v is None for v in ints):
        return set()
    return {v for v in ints if v is not None and v != 0}  # 0 = a recurrent layer without KV


def check_header_against_entry(header: GGUFHeader, entry: Entry) -> tuple[FieldCheck, ...]:
    """Compare the registry's architecture facts with the GGUF header."""
    checks: list[FieldCheck] = []
    arch = header.architecture
    if entry.architecture is not None:
        checks.append(FieldCheck("architecture", entry.architecture, arch, arch == entry.architecture))
    if arch is None:
        checks.append(FieldCheck("architecture", entry.architecture, None, False, "general.architecture missing"))
        return tuple(checks)
    cfg = entry.config
    keys = gguf.Keys  # gguf is imported on first use (stages._gguf_header)

    block_count = header.arch_key(keys.LLM.BLOCK_COUNT)
    nextn_raw = header.arch_key(keys.LLM.NEXTN_PREDICT_LAYERS)
    nextn = 0 if nextn_raw is None else whole_number(nextn_raw)
    if nextn is None or nextn < 0:
        checks.append(FieldCheck("nextn_predict_layers", None, nextn_raw, False, "not a whole number of layers"))
        nextn = 0
    if cfg.n_layers is not None:
        ok = whole_number(block_count) in (cfg.n_layers, cfg.n_layers + nextn)
        checks.append(FieldCheck("block_count", cfg.n_layers, block_count, ok,
                                 f"{nextn} nextn layers allowed" if nextn else None))

    groups = cfg.layer_groups or ()
    if groups:
        reg_kv = {g.n_kv_heads for g in groups}
        gguf_kv = _as_values(header.arch_key(keys.Attention.HEAD_COUNT_KV))
        if gguf_kv is None:  # GGUF omits head_count_kv when it equals head_count
            gguf_kv = _as_values(header.arch_key(keys.Attention.HEAD_COUNT))
        checks.append(FieldCheck("head_count_kv", sorted(reg_kv), None if gguf_kv is None else sorted(gguf_kv),
                                 gguf_kv == reg_kv if gguf_kv is not None else False))
        if cfg.mla:
            checks.append(FieldCheck("key_length", None, header.arch_key(keys.Attention.KEY_LENGTH), None,
                                     "MLA: budgeted as dense, head dims not compared"))
        else:
            for name, reg_dims, key, key_swa in (
                ("key_length", {g.head_dim_k for g in groups}, keys.Attention.KEY_LENGTH, keys.Attention.KEY_LENGTH_SWA),
                ("value_length", {g.head_dim_v for g in groups}, keys.Attention.VALUE_LENGTH, keys.Attention.VALUE_LENGTH_SWA),
            ):
                dims = {header.arch_key(key), header.arch_key(key_swa)} - {None}
                if not dims:  # llama.cpp's default: embedding_length / head_count
                    embd = whole_number(header.arch_key(keys.LLM.EMBEDDING_LENGTH))
                    heads = _as_values(header.arch_key(keys.Attention.HEAD_COUNT))
                    if embd is not None and heads and len(heads) == 1 and next(iter(heads)) > 0:
                        dims = {embd // next(iter(heads))}
                dims_int = {whole_number(d) for d in dims}
                if None in dims_int:  # not a whole number: show what the header holds
                    checks.append(FieldCheck(name, sorted(reg_dims), sorted(map(repr, dims)), False,
                                             "not a whole number"))
                    continue
                checks.append(FieldCheck(name, sorted(reg_dims), sorted(dims_int) or None,
                                         dims_int == reg_dims if dims_int else False))
        windows = {g.window_tokens for g in groups if g.window_tokens}
        gguf_window = header.arch_key(keys.Attention.SLIDING_WINDOW)
        if windows:
            checks.append(FieldCheck("sliding_window", sorted(windows), gguf_window,
                                     {whole_number(gguf_window)} == windows))
        elif gguf_window:
            checks.append(FieldCheck("sliding_window", None, gguf_window, None,
                                     "registry budgets these layers as full attention (conservative)"))

    ctx = header.arch_key(keys.LLM.CONTEXT_LENGTH)
    if entry.context_limit is not None:
        checks.append(FieldCheck("context_length", entry.context_limit, ctx,
                                 (whole_number(ctx) or 0) >= entry.context_limit,
                                 "registry ceiling must not exceed the GGUF's"))
    return tuple(checks)


def ensure_header_matches(checks: tuple[FieldCheck, ...], *, file: str, entry_name: str) -> None:
    """Fail closed on the first mismatching field, naming it (and listing every mismatch)."""
    bad = [c for c in checks if c.ok is False]
    if not bad:
        return
    first = bad[0]
    raise IntegrityError(
        f"{file}: GGUF {first.field} is {first.gguf!r}, registry entry {entry_name} says {first.registry!r}",
        hint="the file does not match the registry's architecture facts; fix the entry (or its pin) after "
             "review — the file was not put in place",
        field=first.field, file=file, entry=entry_name,
        mismatches=[{"field": c.field, "registry": c.registry, "gguf": c.gguf} for c in bad])


# --------------------------------------------------------------------------- one file into place


@dataclass(frozen=True)
class _Placed:
    path: Path
    size_bytes: int
    sha256: str
    sha256_source: str
    verified_against: tuple[str, ...]
    header: GGUFHeader | None
    checks: tuple[FieldCheck, ...]


def _check_header(path: Path, entry: Entry, file: str) -> tuple[GGUFHeader, tuple[FieldCheck, ...]]:
    header = read_gguf_header(path, name=file)
    checks = check_header_against_entry(header, entry)
    ensure_header_matches(checks, file=file, entry_name=entry.name)
    return header, checks


def _verify_partial(entry: Entry, artifact: Artifact, dest_dir: Path, fetched: FetchedFile, partial: Path,
                    *, rehash: bool, gguf: bool) -> _Placed:
    """Check a hashed partial against the pin, rename it into place, write its receipt."""
    assert artifact.file is not None
    file = artifact.file
    if (fetched.repo, fetched.revision, fetched.file) != (artifact.repo, artifact.revision, file):
        raise IntegrityError(
            f"{partial} holds {fetched.repo}@{fetched.revision}/{fetched.file}, but entry {entry.name} pins "
            f"{artifact.repo}@{artifact.revision}/{file}",
            hint="rerun: fetch-weights fetches the pinned file", field="revision", file=file, entry=entry.name)
    now = file_identity(partial)
    if not rehash and fetched.identity == now:
        sha, source = fetched.sha256, "streamed"
    else:
        log.info("verify.rehash", file=file, reason="forced" if rehash else "the partial changed since it was hashed")
        sha, source = sha256_file(partial), "rehashed"
    _p, sidecar, _l = partial_paths(dest_dir / PARTIAL_DIRNAME, artifact.repo, file)
    try:
        matched = check_integrity(file=file, size_bytes=now.size_bytes, sha256=sha, expected_size=artifact.size_bytes,
                                  registry_sha256=artifact.sha256, hub_sha256=fetched.hub_lfs_sha256)
    except IntegrityError as exc:
        if not (exc.details.get("field") == "sha256" and "reference" not in exc.details):
            discard_partial(partial, sidecar)  # bad bytes must never be resumed from, nor put in place
            log.warning("verify.integrity_failed", file=file, field=exc.details.get("field"), discarded=True)
        raise
    header, checks = _check_header(partial, entry, file) if gguf else (None, ())
    final = dest_dir / file
    finalize_file(partial, final)
    write_receipt(dest_dir, Receipt(repo=artifact.repo, revision=artifact.revision, file=file, sha256=sha,
                                    size_bytes=now.size_bytes, hub_lfs_sha256=fetched.hub_lfs_sha256,
                                    verified_against=matched))
    discard_partial(partial, sidecar)  # the partial is renamed away; this drops its sidecar
    return _Placed(final, now.size_bytes, sha, source, matched, header, checks)


def _verify_in_place(entry: Entry, artifact: Artifact, dest_dir: Path, *, rehash: bool, gguf: bool) -> _Placed:
    """Re-confirm a file already in place from its receipt (no re-read unless ``rehash``)."""
    assert artifact.file is not None
    final = dest_dir / artifact.file
    receipt = read_receipt(dest_dir, artifact.file)
    if not final.is_file():
        raise IntegrityError(f"{final} is missing", hint="run `hotfit pull` for this entry", file=str(final),
                             field="file")
    if not receipt_matches(receipt, artifact, final):
        raise IntegrityError(f"{final} has no matching verification receipt (size, pin or sha256 differ)",
                             hint="delete it and rerun `hotfit pull` to fetch a verified copy",
                             file=str(final), field="receipt")
    assert receipt is not None and receipt.sha256 is not None
    sha, source = receipt.sha256, "streamed"
    if rehash:
        sha, source = sha256_file(final), "rehashed"
    size = final.stat().st_size
    matched = check_integrity(file=artifact.file, size_bytes=size, sha256=sha, expected_size=artifact.size_bytes,
                              registry_sha256=artifact.sha256, hub_sha256=receipt.hub_lfs_sha256)
    header, checks = _check_header(final, entry, artifact.file) if gguf else (None, ())
    return _Placed(final, size, sha, source, receipt.verified_against or matched, header, checks)


def _place(entry: Entry, artifact: Artifact, dest_dir: Path, fetched: FetchedFile | None, *, rehash: bool,
           gguf: bool) -> _Placed:
    partial = Path(fetched.partial_path) if fetched is not None and fetched.partial_path else None
    if fetched is not None and partial is not None and partial.is_file():
        return _verify_partial(entry, artifact, dest_dir, fetched, partial, rehash=rehash, gguf=gguf)
    # Nothing fetched this time, or a partial an earlier verify already renamed into place.
    return _verify_in_place(entry, artifact, dest_dir, rehash=rehash, gguf=gguf)


# --------------------------------------------------------------------------- template


def _check_template(entry: Entry, dest_dir: Path, template: TemplateResult | None) -> str | None:
    """The template fetch-template wrote and checked: present, and the text its receipt (or its
    result) hashed. Tool capability was checked there; here only that it is still that text."""
    if entry.chat_template is None:
        return None
    tpl = dest_dir / TEMPLATE_FILENAME
    if not tpl.is_file():
        raise TemplateError(f"{tpl} is missing but entry {entry.name} names a chat template",
                            hint="rerun `hotfit pull`; without it the model cannot call tools",
                            entry=entry.name, file=str(tpl))
    receipt = read_receipt(dest_dir, TEMPLATE_FILENAME)
    expected = template.sha256 if template is not None and template.sha256 else (receipt.sha256 if receipt else None)
    if expected is None or hashlib.sha256(tpl.read_bytes()).hexdigest() != expected:
        raise TemplateError(f"{tpl} is not the template fetch-template checked (no receipt, or its text changed)",
                            hint="rerun `hotfit pull` (or `hotfit auto`) to fetch and check it again",
                            entry=entry.name, file=str(tpl))
    return str(tpl)


def _check_snapshot_template(entry: Entry, dest_dir: Path, template: TemplateResult | None) -> None:
    """An OpenVINO entry's template: the one fetch-template checked, and — when it was read from a
    file of the snapshot — from the commit of the snapshot now in place, so the text checked for
    tools is the one GenAI renders from ``snapshot/``."""
    if entry.chat_template is None:
        return
    _check_template(entry, dest_dir, template)
    receipt = read_receipt(dest_dir, TEMPLATE_FILENAME)
    listed = receipt.commit_listed if receipt is not None else None
    commit = snapshot_commit(dest_dir)
    if listed is not None and listed != commit:
        raise TemplateError(f"{dest_dir / TEMPLATE_FILENAME} was taken from {entry.chat_template.file} of snapshot "
                            f"commit {listed}, but the snapshot in place is at {commit}",
                            hint="rerun `hotfit pull` (or `hotfit auto`): the template is read from the snapshot again",
                            entry=entry.name, file=entry.chat_template.file)


# --------------------------------------------------------------------------- stage


async def verify(entry: Entry, dest_dir: Path, *, fetched: FetchResult | None = None,
                 template: TemplateResult | None = None, rehash: bool = False) -> VerifyResult:
    """The pipeline's ``verify`` stage (see the module docstring).

    ``fetched`` is fetch-weights' result (None: re-confirm what is in place from its receipts);
    ``template`` fetch-template's. Raises IntegrityError (pin, size, sha256, header field) or
    TemplateError; reads no weights byte twice unless ``rehash`` or the partial changed.
    """
    return await anyio.to_thread.run_sync(_verify_sync, entry, Path(dest_dir), fetched, template, rehash)


def _verify_sync(entry: Entry, dest_dir: Path, fetched: FetchResult | None, template: TemplateResult | None,
                 rehash: bool) -> VerifyResult:
    artifact = entry.artifact
    if artifact is None:
        raise IntegrityError(f"registry entry {entry.name} has no artifact to verify",
                             hint="choose an entry with an artifact (hotfit registry list)", entry=entry.name)
    if entry.layout.snapshot or artifact.file is None:
        if fetched is not None and fetched.snapshot is not None:
            place_snapshot(dest_dir, fetched.snapshot, rehash=rehash)
        total, count = verify_snapshot_dir(dest_dir, rehash=rehash)
        _check_snapshot_template(entry, dest_dir, template)
        return VerifyResult(entry=entry.name, weights_path=str(dest_dir / SNAPSHOT_DIRNAME), size_bytes=total,
                            sha256=None, sha256_source="rehashed" if rehash else "streamed", header_checks=(),
                            gguf_embeds_chat_template=None, chat_template_path=None, vision=False,
                            files_checked=count, notes=(f"manifest {SNAPSHOT_MANIFEST}",))
    weights = _place(entry, artifact, dest_dir, fetched.weights if fetched else None, rehash=rehash,
                     gguf=artifact.file.endswith(".gguf"))
    notes: list[str] = []
    vision = False
    if entry.projector is not None and entry.projector.file:
        proj_fetched = fetched.projector if fetched else None
        if fetched is not None and proj_fetched is None:
            notes.append("projector missing: vision disabled")  # fetch-weights found none (logged there)
        else:
            try:
                _place(entry, entry.projector, dest_dir, proj_fetched, rehash=rehash, gguf=False)
                vision = True
            except IntegrityError as exc:
                if proj_fetched is not None and proj_fetched.partial_path:
                    raise  # fetched bytes that fail their checks: fail closed, as for the weights
                notes.append("projector missing: vision disabled")  # nothing fetched and nothing in place
                log.info("verify.projector_absent", entry=entry.name, reason=exc.what)
    template_path = _check_template(entry, dest_dir, template)
    header = weights.header
    log.info("verify.done", entry=entry.name, size_bytes=weights.size_bytes, sha256_source=weights.sha256_source,
             fields_checked=sum(1 for c in weights.checks if c.ok), vision=vision,
             gguf_embeds_chat_template=header.has_chat_template if header else None)
    return VerifyResult(entry=entry.name, weights_path=str(weights.path), size_bytes=weights.size_bytes,
                        sha256=weights.sha256, sha256_source=weights.sha256_source, header_checks=weights.checks,
                        gguf_embeds_chat_template=header.has_chat_template if header else None,
                        chat_template_path=template_path, vision=vision, notes=tuple(notes),
                        verified_against=weights.verified_against, gguf=header.facts() if header else None)


# --------------------------------------------------------------------------- installed models, on demand


@dataclass(frozen=True)
class InstalledFile:
    """One installed file re-hashed against its receipt (``hotfit verify``)."""

    model: str
    path: str
    algorithm: str  # "sha256", or "git-sha1" for a small non-LFS snapshot file
    expected: str
    actual: str | None  # None: the file is missing

    @property
    def ok(self) -> bool:
        return self.actual == self.expected

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "path": self.path, "algorithm": self.algorithm, "expected": self.expected,
                "actual": self.actual, "ok": self.ok}


def recheck_installed(model_dir: Path) -> list[InstalledFile]:
    """Re-hash every file a receipt in ``model_dir`` vouches for (weights, projector, template,
    snapshot files) and compare with the receipt. A file that no longer matches is damaged: its
    receipt and its bytes are removed (logged as ``verify.installed_damaged``), so nothing serves or
    trusts it and the next ``hotfit pull`` / ``auto`` fetches it again. The caller holds the model
    directory's lock."""
    out: list[InstalledFile] = []
    receipts_dir = model_dir / RECEIPTS_DIRNAME
    for receipt_file in sorted(receipts_dir.glob("*.json")) if receipts_dir.is_dir() else ():
        key = receipt_file.name[:-len(".json")].replace("%2F", "/")
        receipt = read_receipt(model_dir, key)
        if receipt is None:
            continue  # damaged receipt (logged): it vouches for nothing, the next fetch verifies again
        algorithm, expected = ("sha256", receipt.sha256) if receipt.sha256 else ("git-sha1", receipt.git_sha1)
        if expected is None:
            continue
        path = model_dir / key
        actual = None
        if path.is_file():
            actual = sha256_file(path) if algorithm == "sha256" else git_blob_sha1(path)
        checked = InstalledFile(model=model_dir.name, path=str(path), algorithm=algorithm, expected=expected,
                                actual=actual)
        if not checked.ok:
            log.warning("verify.installed_damaged", model=model_dir.name, file=str(path), algorithm=algorithm,
                        expected=expected, actual=actual)
            drop_receipt(model_dir, key)
            if path.is_file():
                path.unlink()
        out.append(checked)
    return out


def recheck_models(models_dir: Path, names: list[str] | None = None, *, wait: bool = False) -> list[InstalledFile]:
    """:func:`recheck_installed` for each named model directory (all of them when ``names`` is
    empty), each under the lock ``hotfit pull`` takes, so no download writes beside the check.
    A name with no directory is UsageError (exit 2)."""
    if names:
        dirs = [models_dir / n for n in names]
        missing = [d.name for d in dirs if not d.is_dir()]
        if missing:
            raise UsageError(f"no installed model named {', '.join(missing)} in {models_dir}",
                             hint="name a model `hotfit pull` or `hotfit auto` installed (ls the models directory), "
                                  "or give no name to verify them all", models=missing)
    else:
        dirs = sorted(d for d in models_dir.iterdir() if d.is_dir()) if models_dir.is_dir() else []
    out: list[InstalledFile] = []
    for d in dirs:
        with FileLock(d / PARTIAL_DIRNAME / "pull.lock", wait=wait, what=f"model directory {d}"):
            out.extend(recheck_installed(d))
    return out


# --------------------------------------------------------------------------- the stage


async def verify_work(ctx: StageContext) -> VerifyResult:
    job = ctx.job(FetchJob)
    entry = job.entry_of(ctx)
    return await job.locked(ctx, lambda: verify(entry, ctx.settings.model_dir(entry.name),
                                                fetched=ctx.result("fetch-weights", FetchResult),
                                                template=ctx.result("fetch-template", TemplateResult)))


def _inputs(ctx: StageContext) -> dict[str, Any]:
    job = ctx.job(FetchJob)
    entry = job.entry_of(ctx)
    # verify cross-checks the GGUF header against the entry's architecture facts too
    return {**job.pins(ctx), "architecture": entry.architecture, "config": dataclasses.asdict(entry.config),
            "context_limit": entry.context_limit}


def verified_still_there(verified: VerifyResult) -> bool:
    if verified.weights_path is None:
        return False
    p = Path(verified.weights_path)
    if p.is_dir():
        return True
    return p.is_file() and p.stat().st_size == verified.size_bytes


def verify_fingerprint(verified: VerifyResult) -> Any:
    return {"weights_path": verified.weights_path, "size_bytes": verified.size_bytes, "sha256": verified.sha256,
            "chat_template_path": verified.chat_template_path}


DECLARATION = StageDeclaration(
    "verify", verify_work, deps=("fetch-weights", "fetch-template"), inputs=_inputs, decode=VerifyResult.decode,
    still_valid=verified_still_there, fingerprint=verify_fingerprint, version=1, result_type=VerifyResult,
    job=FetchJob())
