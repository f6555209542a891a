"""The resume sidecar: one schema, one decoder, one encoder.

``<dir>/.partial/<name>.json`` beside ``<name>.part``: URL, repo, commit, file, size, expected sha256,
etag, whether the server honours ranges, and per-block ``[start, end, done]``. It only ever claims
bytes written before an ``fdatasync`` that completed (``download.engine`` checkpoints), so it is true
after ``kill -9`` and after a power loss. A damaged one is never trusted: :func:`decode_sidecar` names
the file and what is wrong; :func:`read_sidecar` logs that and answers None, and the download starts
that file over (its bytes are not claimed by anything trustworthy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from core.errors import IntegrityError
from core.log import get_logger
from download.options import MAX_BLOCKS
from state.files import write_text_atomic

log = get_logger()

SIDECAR_SCHEMA = 1


@dataclass
class Block:
    """One byte range of the file; ``done`` bytes from ``start`` are on disk."""

    start: int
    end: int  # exclusive
    done: int = 0

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def complete(self) -> bool:
        return self.done >= self.length


@dataclass
class Sidecar:
    url: str
    repo: str
    revision: str
    file: str
    size_bytes: int
    expected_sha256: str | None
    etag: str | None
    ranges_supported: bool
    blocks: list[list[int]] = field(default_factory=list)  # [start, end, done]

    @property
    def done_bytes(self) -> int:
        return sum(b[2] for b in self.blocks)

    def matches(self, other: "Sidecar") -> bool:
        # Not the URL: a mirror (another HF_ENDPOINT) serves the same pinned bytes, and the sha256
        # check catches one that does not. An expected sha256 recorded on one side only (pinned
        # since) is no conflict: the commit fixes the bytes, and the check after the download
        # compares them with the sha256 known now.
        shas_agree = (self.expected_sha256 is None or other.expected_sha256 is None
                      or self.expected_sha256 == other.expected_sha256)
        return shas_agree and (self.repo, self.revision, self.file, self.size_bytes) == (
            other.repo, other.revision, other.file, other.size_bytes)


def _damaged(path: Path, why: str) -> IntegrityError:
    return IntegrityError(f"download sidecar {path} is damaged: {why}",
                          hint="nothing to do: its partial file is not trusted and is fetched again",
                          field="sidecar", path=str(path))


def _int(raw: Any, key: str, path: Path) -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise _damaged(path, f"{key} is {value!r}, not an integer")
    return value


def decode_sidecar(path: Path, text: str) -> Sidecar:
    """The sidecar in ``text`` (read from ``path``), or IntegrityError naming ``path`` and the fault:
    not JSON, another schema, a field missing or mistyped, blocks that do not tile ``[0, size)``."""
    try:
        raw = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise _damaged(path, f"not JSON ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise _damaged(path, "not a JSON object")
    if raw.get("schema") != SIDECAR_SCHEMA:
        raise _damaged(path, f"schema {raw.get('schema')!r}, this hotfit writes {SIDECAR_SCHEMA}")
    strings = {}
    for key, optional in (("url", False), ("repo", False), ("revision", False), ("file", False),
                          ("expected_sha256", True), ("etag", True)):
        value = raw.get(key)
        if not (isinstance(value, str) or (optional and value is None)):
            raise _damaged(path, f"{key} is {value!r}, not a string")
        strings[key] = value
    size = _int(raw, "size_bytes", path)
    blocks_raw = raw.get("blocks")
    if not isinstance(blocks_raw, list) or not blocks_raw:
        raise _damaged(path, "blocks is not a non-empty list")
    if len(blocks_raw) > MAX_BLOCKS:
        raise _damaged(path, f"{len(blocks_raw)} blocks, more than {MAX_BLOCKS}")
    blocks: list[list[int]] = []
    pos = 0
    for b in blocks_raw:
        if not (isinstance(b, list) and len(b) == 3 and all(isinstance(v, int) and not isinstance(v, bool) for v in b)):
            raise _damaged(path, f"block {b!r} is not [start, end, done]")
        start, end, done = b
        # The blocks must tile [0, size) exactly with sane counters.
        if start != pos or end <= start or not 0 <= done <= end - start:
            raise _damaged(path, f"block {b!r} does not continue at byte {pos} with 0 ≤ done ≤ its length")
        blocks.append([start, end, done])
        pos = end
    if size <= 0 or pos != size:
        raise _damaged(path, f"blocks end at byte {pos}, the file has {size}")
    return Sidecar(url=strings["url"], repo=strings["repo"], revision=strings["revision"], file=strings["file"],
                   size_bytes=size, expected_sha256=strings["expected_sha256"], etag=strings["etag"],
                   ranges_supported=bool(raw.get("ranges_supported", True)), blocks=blocks)


def read_sidecar(path: Path) -> Sidecar | None:
    """The sidecar at ``path``; None when there is none or it is damaged (logged, naming the file)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        log.info("download.partial_discarded", file=str(path), reason=f"sidecar unreadable: {exc}")
        return None
    try:
        return decode_sidecar(path, text)
    except IntegrityError as exc:
        log.info("download.partial_discarded", file=str(path), reason=exc.what)
        return None


def encode_sidecar(side: Sidecar, blocks: list[Block]) -> str:
    return json.dumps({"schema": SIDECAR_SCHEMA, "url": side.url, "repo": side.repo, "revision": side.revision,
                       "file": side.file, "size_bytes": side.size_bytes, "expected_sha256": side.expected_sha256,
                       "etag": side.etag, "ranges_supported": side.ranges_supported,
                       "blocks": [[b.start, b.end, b.done] for b in blocks],
                       "done_bytes": sum(b.done for b in blocks)})


def write_sidecar(path: Path, text: str, *, durable: bool = False) -> None:
    # Not fsynced by default: the sidecar only ever claims bytes already fdatasync'd, so losing its
    # newest version to a power cut costs redone bytes, never a wrong claim.
    write_text_atomic(path, text, durable=durable)
