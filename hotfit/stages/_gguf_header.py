"""The bounded GGUF header reader verify uses (read once per run; its facts travel in the verify result).

A parser of the GGUF key/value header (format and key names from the ``gguf`` package), safe on
hostile input: every count and length is checked against the bytes actually left in the file and
against fixed caps *before* anything is read or allocated, unwanted strings and arrays are skipped
with ``seek``, nesting is bounded — garbage gives :class:`IntegrityError` quickly (fuzzed in
``tests/test_fuzz_inputs.py``). ``gguf.GGUFReader`` is not used because it memory-maps the whole
file and builds arrays for every tensor and token (14 s and 561 MiB on a 200k-token vocabulary;
this reader 0.4 s / 40 MiB).
"""

from __future__ import annotations

import functools
import hashlib
import io
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from hotfit.core.errors import IntegrityError
from hotfit.core.lazy_import import lazy_module
from hotfit.core.model_files import GGUFFacts

__all__ = ["GGUFHeader", "gguf", "read_gguf_header", "whole_number"]

MAX_KV_COUNT = 1 << 16  # real files: ~30–80 keys
MAX_TENSOR_COUNT = 1 << 20  # real files: ≤ ~3 000 tensors
MAX_KEY_BYTES = 1 << 16
MAX_KEPT_STRING_BYTES = 1 << 12  # scalar strings kept in metadata (names, architecture)
MAX_TEMPLATE_BYTES = 1 << 22  # tokenizer.chat_template kept up to 4 MiB
MAX_KEPT_ARRAY_ITEMS = 1 << 12  # small numeric arrays (per-layer head counts) kept
MAX_ARRAY_ITEMS_WALKED = 1 << 23  # string arrays are walked item by item; vocabularies are ≤ ~300k
MAX_ARRAY_DEPTH = 2
MAX_HEADER_BYTES = 1 << 30  # a header that would need more than this is not a header

# The format's constants and key names (GGUF_MAGIC, GGUFValueType, Keys) come from ``gguf``, imported on
# first use (core.lazy_import): it imports numpy (~0.1 s), which every CLI start would otherwise pay
# though only a header read needs it.
if TYPE_CHECKING:  # the type checker reads the real module; at run time it loads on first use
    import gguf
else:
    gguf = lazy_module("gguf")

_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"  # gguf.Keys.Tokenizer.CHAT_TEMPLATE (a test holds them equal)


@functools.cache
def _scalar_formats() -> dict[int, str]:
    t = gguf.GGUFValueType
    return {t.UINT8: "<B", t.INT8: "<b", t.UINT16: "<H", t.INT16: "<h", t.UINT32: "<I", t.INT32: "<i",
            t.FLOAT32: "<f", t.BOOL: "<?", t.UINT64: "<Q", t.INT64: "<q", t.FLOAT64: "<d"}


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
        value = self.metadata.get(gguf.Keys.General.ARCHITECTURE)
        return value if isinstance(value, str) else None

    def arch_key(self, template: str) -> Any:
        """Value of an ``{arch}.…`` key from ``gguf.Keys`` (None if absent)."""
        return self.metadata.get(template.format(arch=self.architecture)) if self.architecture else None

    def facts(self) -> GGUFFacts:
        """The header's facts for later stages (whole numbers only; see :class:`GGUFFacts`)."""

        def per_layer(key: str) -> int | tuple[int, ...] | None:
            value = self.arch_key(key)
            if isinstance(value, tuple):
                items = tuple(whole_number(v) for v in value)
                whole = tuple(v for v in items if v is not None)
                return whole if len(whole) == len(items) else None
            return whole_number(value)

        def one(key: str) -> int | None:
            return whole_number(self.arch_key(key))

        tpl = self.chat_template
        llm, attn = gguf.Keys.LLM, gguf.Keys.Attention
        return GGUFFacts(
            version=self.version, tensor_count=self.tensor_count, architecture=self.architecture,
            context_length=one(llm.CONTEXT_LENGTH), block_count=one(llm.BLOCK_COUNT),
            embedding_length=one(llm.EMBEDDING_LENGTH), head_count=per_layer(attn.HEAD_COUNT),
            head_count_kv=per_layer(attn.HEAD_COUNT_KV), key_length=one(attn.KEY_LENGTH),
            value_length=one(attn.VALUE_LENGTH), sliding_window=one(attn.SLIDING_WINDOW),
            has_chat_template=self.has_chat_template,
            chat_template_sha256=hashlib.sha256(tpl.encode()).hexdigest() if tpl is not None else None,
            header_bytes=self.header_bytes)


def whole_number(value: Any) -> int | None:
    """A header value as a whole number, or None when it is not one (a string, an array, a bool, a
    NaN/inf or fractional float): a hostile header then fails its check instead of crashing it."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    return None


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
        return gguf.GGUFValueType(raw)
    except ValueError:
        raise r.fail(f"{what} has unknown value type {raw}") from None


def _read_value(r: _Reader, vtype: int, key: str, depth: int, budget: list[int]) -> tuple[Any, bool]:
    """(value or None, kept?) — skips what the checks do not need."""
    scalars, types = _scalar_formats(), gguf.GGUFValueType
    if vtype in scalars:
        return r.unpack(scalars[vtype], key), True
    if vtype == types.STRING:
        n = r.string_len(key)
        keep_cap = MAX_TEMPLATE_BYTES if key == _CHAT_TEMPLATE_KEY else MAX_KEPT_STRING_BYTES
        if n > keep_cap:
            r.skip(n, key)
            return None, False
        return r.read(n, key).decode("utf-8", "replace"), True
    if vtype == types.ARRAY:
        if depth >= MAX_ARRAY_DEPTH:
            raise r.fail(f"{key}: arrays nested deeper than {MAX_ARRAY_DEPTH}")
        item_type = _value_type(r, r.unpack("<I", f"{key} item type"), key)
        count = r.unpack("<Q", f"{key} item count")
        if item_type in scalars:
            item_size = struct.calcsize(scalars[item_type])
            r.need(count * item_size, f"{key} ({count} items)")
            if count <= MAX_KEPT_ARRAY_ITEMS:
                raw = r.read(count * item_size, key)
                fmt = "<" + scalars[item_type][1] * count
                return tuple(struct.unpack(fmt, raw)), True
            r.skip(count * item_size, key)
            return None, False
        # strings / nested arrays: each item is ≥ 8 bytes, so the count is bounded by what is left
        r.need(count * 8 if item_type == types.STRING else count * 12, f"{key} ({count} items)")
        budget[0] -= count
        if budget[0] < 0:
            raise r.fail(f"{key}: more than {MAX_ARRAY_ITEMS_WALKED} array items in the header")
        for _ in range(count):
            if item_type == types.STRING:
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
    if struct.unpack("<I", magic)[0] != gguf.GGUF_MAGIC:
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
        if key == _CHAT_TEMPLATE_KEY:
            has_template = True
        value, kept = _read_value(r, vtype, key, 0, budget)
        if kept:
            metadata[key] = value
    template = metadata.pop(_CHAT_TEMPLATE_KEY, None)
    return GGUFHeader(version=version, tensor_count=tensor_count, kv_count=kv_count, metadata=metadata,
                      chat_template=template if isinstance(template, str) else None,
                      has_chat_template=has_template, header_bytes=r.pos)

