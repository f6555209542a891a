"""Receipts: the small files that vouch for verified bytes, with their one decoder.

A receipt (``<model dir>/.verified/<file>.json``, ``schema`` 1) says which pinned file is in place
and what it hashed to. verify writes one for each weights file it renames into place, fetch-template
for ``chat_template.jinja``, the OpenVINO snapshot fetch for each snapshot file. Stages trust a file
only while its receipt matches the pin (:func:`receipt_matches`).

:func:`decode_receipt` is the only parser of the format: a damaged receipt is an IntegrityError
naming the file; :func:`read_receipt` logs that (``receipt.damaged``) and treats the file as having
no receipt, so it is verified again — never trusted, never a traceback. Decoded with the
``core.records`` readers, so the error names the receipt, the field and what is wrong with it.
Also here: :func:`file_identity` and :func:`sha256_file`, the two ways a stage knows bytes on disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotfit.core.entry import Artifact
from hotfit.core.errors import IntegrityError
from hotfit.core.log import get_logger
from hotfit.core.records import parse_own_file
from hotfit.core.model_files import FileIdentity
from hotfit.state.files import checked_write_path, write_text_atomic

log = get_logger()

__all__ = ["Receipt", "RECEIPT_SCHEMA", "receipt_path", "decode_receipt", "read_receipt", "write_receipt",
           "drop_receipt", "receipt_matches", "file_identity", "git_blob_sha1", "sha256_file"]

RECEIPT_SCHEMA = 1
RECEIPTS_DIRNAME = ".verified"
MAX_RECEIPT_BYTES = 1 << 20  # real receipts are a few hundred bytes

_STR_FIELDS = ("repo", "revision", "file", "sha256", "hub_lfs_sha256", "variant", "git_sha1", "commit_listed")
_STR_LIST_FIELDS = ("verified_against", "tool_markers")
_REQUIRED = ("repo", "file")


@dataclass(frozen=True)
class Receipt:
    repo: str
    revision: str | None
    file: str
    sha256: str | None
    size_bytes: int | None = None  # absent for a template (its text is hashed instead)
    hub_lfs_sha256: str | None = None
    verified_against: tuple[str, ...] = ()
    variant: str | None = None  # template only
    tool_markers: tuple[str, ...] = ()  # template only
    git_sha1: str | None = None  # snapshot files
    commit_listed: str | None = None  # snapshot files

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": RECEIPT_SCHEMA}
        for key, value in self.__dict__.items():
            if value is None or value == ():
                continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out


def receipt_path(dest_dir: Path, file: str) -> Path:
    return dest_dir / RECEIPTS_DIRNAME / (file.replace("/", "%2F") + ".json")


def _damaged(path: Path | str, why: str) -> IntegrityError:
    return IntegrityError(f"receipt {path} is damaged: {why}",
                          hint="it is ignored: the file it vouched for is verified again (or fetched again)",
                          file=str(path), field="receipt")


def decode_receipt(text: str, *, path: Path | str) -> Receipt:
    """Parse one receipt; IntegrityError naming ``path`` and what is wrong when it is not one."""
    if len(text) > MAX_RECEIPT_BYTES:
        raise _damaged(path, f"{len(text)} characters, more than a receipt holds")
    doc, f = parse_own_file(text, lambda why: _damaged(path, why), kind="a receipt", noun="receipt")
    # unknown keys are ignored: a receipt only vouches, and a newer field must not void it
    raw = f.object(doc, "", ("schema", *_REQUIRED), extra=True)
    f.equal(raw["schema"], "schema", RECEIPT_SCHEMA, "it is verified again and rewritten")
    # the keyword arguments of Receipt by name: the checker cannot match a dict's keys to parameters
    strings: dict[str, Any] = {key: f.string(raw.get(key), key, nullable=key not in _REQUIRED, blank=key not in _REQUIRED)
               for key in _STR_FIELDS}
    lists: dict[str, Any] = {key: f.strings(raw.get(key) or [], key) for key in _STR_LIST_FIELDS}
    return Receipt(**strings, size_bytes=f.integer(raw.get("size_bytes"), "size_bytes", minimum=0, nullable=True),
                   **lists)


def read_receipt(dest_dir: Path, file: str) -> Receipt | None:
    """The receipt for ``file``, or None when there is none or it is damaged (logged, then ignored:
    the file is verified again rather than trusted)."""
    path = receipt_path(dest_dir, file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        text = None
        err = _damaged(path, f"unreadable ({exc})")
    if text is not None:
        try:
            return decode_receipt(text, path=path)
        except IntegrityError as exc:
            err = exc
    log.warning("receipt.damaged", file=str(path), error=err.to_json())
    return None


def write_receipt(dest_dir: Path, receipt: Receipt, *, key: str | None = None) -> None:
    """Write ``receipt`` durably; ``key`` names it when it is not ``receipt.file`` (a snapshot file's
    receipt is kept under ``snapshot/<path>`` and records the path inside the repository)."""
    write_text_atomic(receipt_path(dest_dir, key or receipt.file), json.dumps(receipt.to_json(), sort_keys=True),
                      what="the receipt")


def drop_receipt(dest_dir: Path, key: str) -> None:
    """Remove the receipt of ``key`` (the file it vouched for no longer hashes to it)."""
    path = receipt_path(dest_dir, key)
    checked_write_path(path)
    path.unlink(missing_ok=True)


def receipt_matches(receipt: Receipt | None, artifact: Artifact, final: Path) -> bool:
    """True when ``final`` is the file a receipt vouches for (same pin, size, sha256)."""
    if receipt is None or not final.is_file():
        return False
    if receipt.revision != artifact.revision or receipt.repo != artifact.repo:
        return False
    if final.stat().st_size != receipt.size_bytes:
        return False
    if artifact.size_bytes is not None and receipt.size_bytes != artifact.size_bytes:
        return False
    if receipt.sha256 is None:  # a receipt vouches for a hash, or for nothing
        return False
    return artifact.sha256 is None or receipt.sha256 == artifact.sha256


def file_identity(path: Path) -> FileIdentity:
    st = os.stat(path)
    return FileIdentity(device=st.st_dev, inode=st.st_ino, size_bytes=st.st_size, mtime_ns=st.st_mtime_ns,
                        ctime_ns=st.st_ctime_ns)


def git_blob_sha1(path: Path) -> str:
    """The git blob id of a file (what the Hub lists for a small non-LFS file)."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode(), usedforsecurity=False)
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()
