"""The resume sidecar: one schema, one decoder, one encoder.

``<dir>/.partial/<name>.json`` beside ``<name>.part``: URL, repo, commit, file, size, expected sha256,
etag, whether the server honours ranges, and per-block ``[start, end, done]``. It only ever claims
bytes written before an ``fdatasync`` that completed (``download.engine`` checkpoints), so it is true
after ``kill -9`` and after a power loss. A damaged one is never trusted: :func:`decode_sidecar` (on
the ``core.records`` readers) names the file and what is wrong; :func:`read_sidecar` logs that and
answers None, and the download starts that file over (its bytes are not claimed by anything
trustworthy).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from hotfit.core.errors import IntegrityError
from hotfit.core.log import get_logger
from hotfit.core.records import parse_own_file
from hotfit.download.options import MAX_BLOCKS
from hotfit.state.files import write_text_atomic

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


def decode_sidecar(path: Path, text: str) -> Sidecar:
    """The sidecar in ``text`` (read from ``path``), or IntegrityError naming ``path`` and the fault:
    not JSON, another schema, a field missing or mistyped, blocks that do not tile ``[0, size)``."""
    doc, f = parse_own_file(text, lambda why: _damaged(path, why), kind="a sidecar", noun="sidecar")
    if not isinstance(doc, dict):
        raise _damaged(path, "not a JSON object")
    if doc.get("schema") != SIDECAR_SCHEMA:  # another version's sidecar: its fields mean other things
        raise _damaged(path, f"schema {doc.get('schema')!r}, this hotfit writes {SIDECAR_SCHEMA}")
    raw = f.object(doc, "", ("url", "repo", "revision", "file", "size_bytes", "blocks"), extra=True)
    strings = {key: f.string(raw.get(key), key, nullable=key in ("expected_sha256", "etag"), blank=True)
               for key in ("url", "repo", "revision", "file", "expected_sha256", "etag")}
    size = f.integer(raw["size_bytes"], "size_bytes")
    blocks_raw = f.items(raw["blocks"], "blocks", non_empty=True, what="[start, end, done] blocks")
    if len(blocks_raw) > MAX_BLOCKS:
        raise _damaged(path, f"{len(blocks_raw)} blocks, more than {MAX_BLOCKS}")
    blocks: list[list[int]] = []
    pos = 0
    for i, b in enumerate(blocks_raw):
        start, end, done = (f.integer(v, f"blocks[{i}][{j}]", minimum=0)
                            for j, v in enumerate(f.items(b, f"blocks[{i}]", length=3)))
        # The blocks must tile [0, size) exactly with sane counters.
        if start != pos or end <= start or not 0 <= done <= end - start:
            raise _damaged(path, f"block {b!r} does not continue at byte {pos} with 0 ≤ done ≤ its length")
        blocks.append([start, end, done])
        pos = end
    if pos != size:
        raise _damaged(path, f"blocks end at byte {pos}, the file has {size}")
    return Sidecar(**strings, size_bytes=size, ranges_supported=bool(raw.get("ranges_supported", True)),
                   blocks=blocks)


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
    write_text_atomic(path, text, durable=durable, what="the resume sidecar")
