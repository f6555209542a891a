"""verify: what makes a downloaded file trustworthy, and the stage that re-confirms it.

Three layers (issue 4 §2):

1. **Integrity** (:func:`check_integrity`, pure): exact byte size; sha256 — computed while streaming
   by ``download`` — equal to the Hub's LFS sha256 *and* the registry's when pinned; for a
   non-LFS file the git blob sha1 equal to the Hub's ETag.
2. **GGUF header** (:func:`read_gguf_header`): a bounded parser of the GGUF key/value header (format
   and key names from the ``gguf`` package). Safe on hostile input: every count and length is checked
   against the bytes actually left in the file and against fixed caps *before* anything is read or
   allocated, unwanted strings and arrays are skipped with ``seek``, nesting is bounded — garbage gives
   :class:`IntegrityError` quickly (fuzzed in ``tests/test_fuzz_inputs.py``). ``gguf.GGUFReader`` is
   not used because it memory-maps the whole file and builds arrays for every tensor and token.
3. **Registry facts** (:func:`check_header_against_entry`, pure): architecture, block count, KV heads,
   key/value head dims, context length and sliding window compared with the registry entry; a
   mismatch fails closed naming the field (:func:`ensure_header_matches`).

Only a file that passed all three is renamed into place (``stages.fetch_weights``); a receipt
(``<model dir>/.verified/<file>.json``: size, sha256, commit) records that it did. The ``verify``
stage re-confirms a model directory from those receipts without re-reading the weights (sha256 was
computed while streaming; ``rehash=True`` forces a full re-read), re-parses the header, and checks the
chat template and projector.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import anyio
from gguf import GGUF_MAGIC, GGUFValueType, Keys

from core.errors import IntegrityError, TemplateError
from core.log import get_logger
from core.entry import Artifact, Entry
from state.files import write_text_atomic

log = get_logger()

__all__ = [
    "GGUFHeader",
    "FieldCheck",
    "VerifyResult",
    "read_gguf_header",
    "check_integrity",
    "check_header_against_entry",
    "ensure_header_matches",
    "receipt_path",
    "read_receipt",
    "write_receipt",
    "verify",
]

# Caps for the header parser: far above any real GGUF, far below anything that hurts.
MAX_KV_COUNT = 1 << 16  # real files: ~30–80 keys
MAX_TENSOR_COUNT = 1 << 20  # real files: ≤ ~3 000 tensors
MAX_KEY_BYTES = 1 << 16
MAX_KEPT_STRING_BYTES = 1 << 12  # scalar strings kept in metadata (names, architecture)
MAX_TEMPLATE_BYTES = 1 << 22  # tokenizer.chat_template kept up to 4 MiB
MAX_KEPT_ARRAY_ITEMS = 1 << 12  # small numeric arrays (per-layer head counts) kept
MAX_ARRAY_ITEMS_WALKED = 1 << 23  # string arrays are walked item by item; vocabularies are ≤ ~300k
MAX_ARRAY_DEPTH = 2
MAX_HEADER_BYTES = 1 << 30  # a header that would need more than this is not a header

_SCALAR_FORMATS: dict[int, str] = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}


@dataclass(frozen=True)
class GGUFHeader:
    version: int
    tensor_count: int
    kv_count: int
    metadata: dict[str, Any]  # scalars, short strings and small numeric arrays (as tuples)
    chat_template: str | None  # tokenizer.chat_template when embedded (None if absent or too large)
    has_chat_template: bool
    header_bytes: int  # bytes of key/value header read or skipped

    @property
    def architecture(self) -> str | None:
        value = self.metadata.get(Keys.General.ARCHITECTURE)
        return value if isinstance(value, str) else None

    def arch_key(self, template: str) -> Any:
        """Value of an ``{arch}.…`` key from ``gguf.Keys`` (None if absent)."""
        return self.metadata.get(template.format(arch=self.architecture)) if self.architecture else None


class _Reader:
    """Sequential reads with every length checked against what is left (no over-allocation)."""

    def __init__(self, fh: BinaryIO, size: int, source: str) -> None:
        self.fh = fh
        self.size = size
        self.pos = 0
        self.source = source

    def fail(self, why: str) -> IntegrityError:
        return IntegrityError(f"{self.source} is not a valid GGUF file: {why} (at byte {self.pos})",
                              hint="the file is corrupt or not a GGUF; delete it and rerun the download",
                              file=self.source, offset_bytes=self.pos, field="gguf_header")

    def need(self, n: int, what: str) -> None:
        if n < 0 or n > self.size - self.pos:
            raise self.fail(f"{what} needs {n} bytes, {self.size - self.pos} left")
        if self.pos + n > MAX_HEADER_BYTES:
            raise self.fail(f"{what} runs past the {MAX_HEADER_BYTES}-byte header cap")

    def read(self, n: int, what: str) -> bytes:
        self.need(n, what)
        data = self.fh.read(n)
        if len(data) != n:
            raise self.fail(f"{what}: short read")
        self.pos += n
        return data

    def skip(self, n: int, what: str) -> None:
        self.need(n, what)
        self.fh.seek(n, io.SEEK_CUR)
        self.pos += n

    def unpack(self, fmt: str, what: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt), what))[0]

    def string_len(self, what: str, cap: int | None = None) -> int:
        n = self.unpack("<Q", f"{what} length")
        if cap is not None and n > cap:
            raise self.fail(f"{what} length {n} exceeds the {cap}-byte cap")
        self.need(n, what)
        return n


def _value_type(r: _Reader, raw: int, what: str) -> int:
    try:
        return GGUFValueType(raw)
    except ValueError:
        raise r.fail(f"{what} has unknown value type {raw}") from None


def _read_value(r: _Reader, vtype: int, key: str, depth: int, budget: list[int]) -> tuple[Any, bool]:
    """(value or None, kept?) — skips what the checks do not need."""
    if vtype in _SCALAR_FORMATS:
        return r.unpack(_SCALAR_FORMATS[vtype], key), True
    if vtype == GGUFValueType.STRING:
        n = r.string_len(key)
        keep_cap = MAX_TEMPLATE_BYTES if key == Keys.Tokenizer.CHAT_TEMPLATE else MAX_KEPT_STRING_BYTES
        if n > keep_cap:
            r.skip(n, key)
            return None, False
        return r.read(n, key).decode("utf-8", "replace"), True
    if vtype == GGUFValueType.ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise r.fail(f"{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item_type = _value_type(r, r.unpack("<I", f"{key} item type"), key)
        count = r.unpack("<Q", f"{key} item count")
        if item_type in _SCALAR_FORMATS:
            item_size = struct.calcsize(_SCALAR_FORMATS[item_type])
            r.need(count * item_size, f"{key} ({count} items)")
            if count <= MAX_KEPT_ARRAY_ITEMS:
                raw = r.read(count * item_size, key)
                fmt = "<" + _SCALAR_FORMATS[item_type][1] * count
                return tuple(struct.unpack(fmt, raw)), True
            r.skip(count * item_size, key)
            return None, False
        # strings / nested arrays: each item is ≥ 8 bytes, so the count is bounded by what is left
        r.need(count * 8 if item_type == GGUFValueType.STRING else count * 12, f"{key} ({count} items)")
        budget[0] -= count
        if budget[0] < 0:
            raise r.fail(f"{key}: more than {MAX_ARRAY_ITEMS_WALKED} array items in the header")
        for _ in range(count):
            if item_type == GGUFValueType.STRING:
                r.skip(r.string_len(key), key)
            else:
                _read_value(r, item_type, key, depth + 1, budget)
        return None, False
    raise r.fail(f"{key}: unsupported value type {vtype}")  # pragma: no cover (enum is exhaustive)


def read_gguf_header(source: Path | str | BinaryIO, *, size_bytes: int | None = None,
                     name: str | None = None) -> GGUFHeader:
    """Parse the GGUF key/value header, bounded (see the module docstring). Raises IntegrityError."""
    if isinstance(source, (str, Path)):
        path = Path(source)
        with open(path, "rb", buffering=1 << 20) as fh:
            return read_gguf_header(fh, size_bytes=path.stat().st_size, name=name or path.name)
    fh = source
    if size_bytes is None:
        here = fh.tell()
        size_bytes = fh.seek(0, io.SEEK_END) - here
        fh.seek(here)
    r = _Reader(fh, size_bytes, name or "file")
    magic = r.read(4, "magic")
    if struct.unpack("<I", magic)[0] != GGUF_MAGIC:
        raise r.fail(f"magic is {magic!r}, not b'GGUF'")
    version = r.unpack("<I", "version")
    if version not in (2, 3):
        hint = " (big-endian file?)" if version > 0xFFFF else ""
        raise r.fail(f"unsupported GGUF version {version}{hint}")
    tensor_count = r.unpack("<Q", "tensor count")
    kv_count = r.unpack("<Q", "key/value count")
    if tensor_count > MAX_TENSOR_COUNT:
        raise r.fail(f"tensor count {tensor_count} exceeds {MAX_TENSOR_COUNT}")
    if kv_count > MAX_KV_COUNT:
        raise r.fail(f"key/value count {kv_count} exceeds {MAX_KV_COUNT}")
    metadata: dict[str, Any] = {}
    has_template = False
    budget = [MAX_ARRAY_ITEMS_WALKED]
    for i in range(kv_count):
        key_raw = r.read(r.string_len(f"key #{i}", MAX_KEY_BYTES), f"key #{i}")
        try:
            key = key_raw.decode("utf-8")
        except UnicodeDecodeError:
            raise r.fail(f"key #{i} is not UTF-8") from None
        vtype = _value_type(r, r.unpack("<I", f"{key} type"), key)
        if key == Keys.Tokenizer.CHAT_TEMPLATE:
            has_template = True
        value, kept = _read_value(r, vtype, key, 0, budget)
        if kept:
            metadata[key] = value
    template = metadata.pop(Keys.Tokenizer.CHAT_TEMPLATE, None)
    return GGUFHeader(version=version, tensor_count=tensor_count, kv_count=kv_count, metadata=metadata,
                      chat_template=template if isinstance(template, str) else None,
                      has_chat_template=has_template, header_bytes=r.pos)


# --------------------------------------------------------------------------- checks (pure)


@dataclass(frozen=True)
class FieldCheck:
    """One registry fact against the GGUF. ``ok`` None = not checkable (fact unknown on one side)."""

    field: str
    registry: Any
    gguf: Any
    ok: bool | None
    note: str | None = None


def _int_value(value: Any) -> int | None:
    """A header value as a whole number, or None when it is not one (a string, an array, a bool, a
    NaN/inf or fractional float): a hostile header then fails its check instead of crashing it."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


def _as_values(value: Any) -> set[int] | None:
    """The distinct non-zero values of a scalar or per-layer array; an empty set (never equal to the
    registry's) when any item is not a whole number; None when the key is absent."""
    if value is None:
        return None
    items = value if isinstance(value, tuple) else (value,)
    ints = [_int_value(v) for v in items]
    if any(v is None for v in ints):
        return set()
    return {v for v in ints if v != 0}  # 0 = a recurrent layer without KV


def check_header_against_entry(header: GGUFHeader, entry: Entry) -> tuple[FieldCheck, ...]:
    """Compare the registry's architecture facts with the GGUF header (issue 4 §2)."""
    checks: list[FieldCheck] = []
    arch = header.architecture
    if entry.architecture is not None:
        checks.append(FieldCheck("architecture", entry.architecture, arch, arch == entry.architecture))
    if arch is None:
        checks.append(FieldCheck("architecture", entry.architecture, None, False, "general.architecture missing"))
        return tuple(checks)
    cfg = entry.config

    block_count = header.arch_key(Keys.LLM.BLOCK_COUNT)
    nextn_raw = header.arch_key(Keys.LLM.NEXTN_PREDICT_LAYERS)
    nextn = 0 if nextn_raw is None else _int_value(nextn_raw)
    if nextn is None or nextn < 0:
        checks.append(FieldCheck("nextn_predict_layers", None, nextn_raw, False, "not a whole number of layers"))
        nextn = 0
    if cfg.n_layers is not None:
        ok = _int_value(block_count) in (cfg.n_layers, cfg.n_layers + nextn)
        checks.append(FieldCheck("block_count", cfg.n_layers, block_count, ok,
                                 f"{nextn} nextn layers allowed" if nextn else None))

    groups = cfg.layer_groups or ()
    if groups:
        reg_kv = {g.n_kv_heads for g in groups}
        gguf_kv = _as_values(header.arch_key(Keys.Attention.HEAD_COUNT_KV))
        if gguf_kv is None:  # GGUF omits head_count_kv when it equals head_count
            gguf_kv = _as_values(header.arch_key(Keys.Attention.HEAD_COUNT))
        checks.append(FieldCheck("head_count_kv", sorted(reg_kv), None if gguf_kv is None else sorted(gguf_kv),
                                 gguf_kv == reg_kv if gguf_kv is not None else False))
        if cfg.mla:
            checks.append(FieldCheck("key_length", None, header.arch_key(Keys.Attention.KEY_LENGTH), None,
                                     "MLA: budgeted as dense, head dims not compared"))
        else:
            for name, reg_dims, key, key_swa in (
                ("key_length", {g.head_dim_k for g in groups}, Keys.Attention.KEY_LENGTH, Keys.Attention.KEY_LENGTH_SWA),
                ("value_length", {g.head_dim_v for g in groups}, Keys.Attention.VALUE_LENGTH, Keys.Attention.VALUE_LENGTH_SWA),
            ):
                dims = {header.arch_key(key), header.arch_key(key_swa)} - {None}
                if not dims:  # llama.cpp's default: embedding_length / head_count
                    embd = _int_value(header.arch_key(Keys.LLM.EMBEDDING_LENGTH))
                    heads = _as_values(header.arch_key(Keys.Attention.HEAD_COUNT))
                    if embd is not None and heads and len(heads) == 1 and next(iter(heads)) > 0:
                        dims = {embd // next(iter(heads))}
                dims_int = {_int_value(d) for d in dims}
                if None in dims_int:  # not a whole number: show what the header holds
                    checks.append(FieldCheck(name, sorted(reg_dims), sorted(map(repr, dims)), False,
                                             "not a whole number"))
                    continue
                checks.append(FieldCheck(name, sorted(reg_dims), sorted(dims_int) or None,  # type: ignore[type-var]
                                         dims_int == reg_dims if dims_int else False))
        windows = {g.window_tokens for g in groups if g.window_tokens}
        gguf_window = header.arch_key(Keys.Attention.SLIDING_WINDOW)
        if windows:
            checks.append(FieldCheck("sliding_window", sorted(windows), gguf_window,
                                     {_int_value(gguf_window)} == windows))
        elif gguf_window:
            checks.append(FieldCheck("sliding_window", None, gguf_window, None,
                                     "registry budgets these layers as full attention (conservative)"))

    ctx = header.arch_key(Keys.LLM.CONTEXT_LENGTH)
    if entry.context_limit is not None:
        checks.append(FieldCheck("context_length", entry.context_limit, ctx,
                                 (_int_value(ctx) or 0) >= entry.context_limit,
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


def check_integrity(*, file: str, size_bytes: int, sha256: str | None, expected_size: int | None,
                    registry_sha256: str | None, hub_sha256: str | None, git_sha1: str | None = None,
                    hub_git_sha1: str | None = None) -> tuple[str, ...]:
    """Size and hashes; returns which references matched (``("registry", "hub")``…) or raises."""
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


# --------------------------------------------------------------------------- receipts


def receipt_path(dest_dir: Path, file: str) -> Path:
    return dest_dir / ".verified" / (file.replace("/", "%2F") + ".json")


def write_receipt(dest_dir: Path, file: str, data: dict[str, Any]) -> None:
    write_text_atomic(receipt_path(dest_dir, file), json.dumps({"schema": 1, **data}, sort_keys=True))


def read_receipt(dest_dir: Path, file: str) -> dict[str, Any] | None:
    try:
        data = json.loads(receipt_path(dest_dir, file).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):  # damaged: no receipt, so the file is verified again
        return None
    return data if isinstance(data, dict) and data.get("schema") == 1 else None


def receipt_matches(receipt: dict[str, Any] | None, artifact: Artifact, final: Path) -> bool:
    """True when ``final`` is the file a receipt vouches for (same pin, size, sha256)."""
    if receipt is None or not final.is_file():
        return False
    if receipt.get("revision") != artifact.revision or receipt.get("repo") != artifact.repo:
        return False
    if final.stat().st_size != receipt.get("size_bytes"):
        return False
    if artifact.size_bytes is not None and receipt.get("size_bytes") != artifact.size_bytes:
        return False
    if not isinstance(receipt.get("sha256"), str):  # a receipt vouches for a hash, or for nothing
        return False
    return artifact.sha256 is None or receipt.get("sha256") == artifact.sha256


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------- stage


@dataclass(frozen=True)
class VerifyResult:
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

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["header_checks"] = [asdict(c) for c in self.header_checks]
        return out


async def verify(entry: Entry, dest_dir: Path, *, rehash: bool = False) -> VerifyResult:
    """Re-confirm a fetched model directory (the pipeline's ``verify`` stage).

    Inputs are what fetch-weights / fetch-template left on disk: the weights renamed into place with
    their receipts, ``chat_template.jinja`` when the entry names a template. Raises IntegrityError
    (size, sha256, header field) or TemplateError; reads no weights byte twice unless ``rehash``.
    """
    return await anyio.to_thread.run_sync(_verify_sync, entry, Path(dest_dir), rehash)


def _verify_sync(entry: Entry, dest_dir: Path, rehash: bool) -> VerifyResult:
    from stages.fetch_template import TEMPLATE_FILENAME, check_tool_capable
    from stages.fetch_weights import SNAPSHOT_DIRNAME, SNAPSHOT_MANIFEST, verify_snapshot_dir

    artifact = entry.artifact
    if artifact is None:
        raise IntegrityError(f"registry entry {entry.name} has no artifact to verify",
                             hint="choose an entry with an artifact (hotfit registry list)", entry=entry.name)
    notes: list[str] = []
    if entry.backend == "openvino" or artifact.file is None:
        total, count = verify_snapshot_dir(dest_dir, rehash=rehash)
        return VerifyResult(entry=entry.name, weights_path=str(dest_dir / SNAPSHOT_DIRNAME), size_bytes=total,
                            sha256=None, sha256_source="rehashed" if rehash else "streamed", header_checks=(),
                            gguf_embeds_chat_template=None, chat_template_path=None, vision=False,
                            files_checked=count, notes=(f"manifest {SNAPSHOT_MANIFEST}",))
    final = dest_dir / artifact.file
    receipt = read_receipt(dest_dir, artifact.file)
    if not final.is_file():
        raise IntegrityError(f"{final} is missing", hint="run `hotfit pull` for this entry", file=str(final),
                             field="file")
    if not receipt_matches(receipt, artifact, final):
        raise IntegrityError(f"{final} has no matching verification receipt (size, pin or sha256 differ)",
                             hint="delete it and rerun `hotfit pull` to fetch a verified copy",
                             file=str(final), field="receipt")
    assert receipt is not None
    sha = receipt["sha256"]
    source = "streamed"
    if rehash:
        sha, source = sha256_file(final), "rehashed"
    check_integrity(file=artifact.file, size_bytes=final.stat().st_size, sha256=sha,
                    expected_size=artifact.size_bytes, registry_sha256=artifact.sha256,
                    hub_sha256=receipt.get("hub_lfs_sha256"))
    header = read_gguf_header(final)
    checks = check_header_against_entry(header, entry)
    ensure_header_matches(checks, file=artifact.file, entry_name=entry.name)

    vision = False
    if entry.projector is not None and entry.projector.file:
        proj = dest_dir / entry.projector.file
        vision = receipt_matches(read_receipt(dest_dir, entry.projector.file), entry.projector, proj)
        if not vision:
            notes.append("projector missing: vision disabled")
    template_path = None
    if entry.chat_template is not None:
        tpl = dest_dir / TEMPLATE_FILENAME
        if not tpl.is_file():
            raise TemplateError(f"{tpl} is missing but entry {entry.name} names a chat template",
                                hint="rerun `hotfit pull`; without it the model cannot call tools",
                                entry=entry.name, file=str(tpl))
        text = tpl.read_text(encoding="utf-8", errors="replace")
        check_tool_capable(text, source=str(tpl))
        template_path = str(tpl)
    log.info("verify.done", entry=entry.name, size_bytes=final.stat().st_size, sha256_source=source,
             fields_checked=sum(1 for c in checks if c.ok), vision=vision)
    return VerifyResult(entry=entry.name, weights_path=str(final), size_bytes=final.stat().st_size, sha256=sha,
                        sha256_source=source, header_checks=checks,
                        gguf_embeds_chat_template=header.has_chat_template, chat_template_path=template_path,
                        vision=vision, notes=tuple(notes))
