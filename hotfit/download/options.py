"""The engine's knobs and the pure naming rules: what a pin looks like, where a partial lives."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from hotfit.core.entry import safe_relpath  # the one path check, re-exported for the stages

MiB = 1024 * 1024
MAX_BLOCKS = 1 << 16  # bounds the sidecar and the block plan whatever the size and block setting
_COMMIT_RE = re.compile(r"^[0-9a-f]{40}$")


def is_commit(revision: str | None) -> bool:
    return bool(revision) and bool(_COMMIT_RE.match(revision or ""))


@dataclass(frozen=True)
class TransferOptions:
    """Knobs of the engine; defaults suit 1–20 GB files over a WAN link."""

    connections: int = 4
    block_bytes: int | None = None  # None: size / (connections × 4), clamped to [1, 64] MiB
    min_parallel_bytes: int = 2 * MiB  # below this one stream beats the per-request overhead
    max_attempts_without_progress: int = 6
    max_total_retry_s: float = 900.0  # one file gives up after this much time spent failing
    # Less than this since the last progress is none (download.retry): a server that sends a trickle
    # per connection is given up on, not retried forever; while failing, the floor is this much per
    # max_total_retry_s.
    min_progress_bytes: int = 1 * MiB
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    retry_after_cap_s: float = 120.0  # a Retry-After beyond this is treated as "give up"
    checkpoint_interval_s: float = 0.25  # what a kill -9 can cost per connection: this long of bytes
    hash_buffer_bytes: int = 64 * MiB  # out-of-order bytes held for in-stream hashing
    connect_timeout_s: float = 15.0
    read_timeout_s: float = 60.0  # a stalled stream is retried after this
    chunk_bytes: int = 1 * MiB
    # False only for scripts/bench-download's "download alone" baseline: the outcome then has no
    # sha256 and nothing downstream can verify it.
    hash_while_streaming: bool = True

    def block_size_for(self, size_bytes: int, connections: int) -> int:
        if self.block_bytes:
            return self.block_bytes
        return max(1 * MiB, min(64 * MiB, size_bytes // max(1, connections * 4) or 1))


def _partial_stem(repo: str, path: str) -> str:
    # Unique per (repo, path), readable, one path component.
    digest = hashlib.sha1(f"{repo}\0{path}".encode()).hexdigest()[:10]
    base = re.sub(r"[^A-Za-z0-9._-]", "_", path.rsplit("/", 1)[-1])[:120]
    return f"{base}.{digest}"


def partial_paths(partial_dir: Path, repo: str, path: str) -> tuple[Path, Path, Path]:
    """(partial data file, sidecar JSON, lock file) for one target."""
    stem = _partial_stem(repo, path)
    return partial_dir / f"{stem}.part", partial_dir / f"{stem}.json", partial_dir / f"{stem}.lock"
