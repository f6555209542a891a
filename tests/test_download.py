"""The download engine's pure parts: ordered hashing, header parsing, path safety, block plans, retry waits,
progress throttling."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
from dataclasses import replace
from pathlib import Path

import pytest
from tenacity import RetryCallState

from download import OrderedHasher, ProgressReporter, TransferOptions, safe_relpath
from download.disk import bytes_held, preallocate
from download.engine import plan_blocks
from download.hub_errors import Retryable, parse_retry_after
from download.options import MAX_BLOCKS
from download.retry import StopPolicy, wait_policy
from download.sidecar import read_sidecar
from download.stream import parse_content_range


@pytest.mark.parametrize("buffer_bytes", [1 << 30, 3000, 0])
def test_ordered_hasher_out_of_order_with_spills(tmp_path: Path, buffer_bytes: int) -> None:
    data = random.Random(1).randbytes(50_000)
    path = tmp_path / "f"
    path.write_bytes(data)  # on disk, as the engine guarantees before feeding
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = [(o, data[o:o + 1000]) for o in range(0, len(data), 1000)]
        random.Random(2).shuffle(chunks)
        hasher = OrderedHasher(fd, len(data), buffer_bytes=buffer_bytes, git_sha1=True)
        hasher.mark_on_disk(0, 0)
        for offset, chunk in chunks:
            hasher.feed(offset, [chunk[:300], chunk[300:]] if offset % 2000 else chunk)
        sha256, sha1 = hasher.finish()
    finally:
        os.close(fd)
    assert sha256 == hashlib.sha256(data).hexdigest()
    assert sha1 == hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    if buffer_bytes >= len(data):
        assert hasher.reread_bytes == 0  # everything hashed from memory, in stream
    if buffer_bytes == 0:
        assert hasher.reread_bytes == len(data)  # no memory allowed: every byte read back once, still right


def test_ordered_hasher_resume_prefix_is_read_back_once(tmp_path: Path) -> None:
    data = os.urandom(10_000)
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        hasher = OrderedHasher(fd, len(data), buffer_bytes=1 << 20)
        hasher.mark_on_disk(0, 4000)
        hasher.feed(4000, data[4000:])
        assert hasher.finish()[0] == hashlib.sha256(data).hexdigest()
        assert hasher.reread_bytes == 4000
    finally:
        os.close(fd)


def test_content_range_and_retry_after() -> None:
    assert parse_content_range("bytes 10-19/100") == (10, 19, 100)
    assert parse_content_range("bytes 0-0/*") == (0, 0, None)
    assert parse_content_range("bytes */100") is None and parse_content_range(None) is None
    assert parse_retry_after("7") == 7.0
    assert parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT", now=1445412470.0) == 10.0
    assert parse_retry_after("soon") is None


def testwait_policy_prefers_retry_after_and_caps_it() -> None:
    opts = TransferOptions(backoff_initial_s=0.5, backoff_max_s=4, retry_after_cap_s=60)
    wait = wait_policy(opts)

    def state(exc: BaseException, attempt: int) -> RetryCallState:
        rs = RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        rs.attempt_number = attempt
        rs.set_exception((type(exc), exc, None))
        return rs

    assert wait(state(Retryable("429", retry_after_s=7), 1)) == 7
    assert wait(state(Retryable("503", retry_after_s=600), 1)) == 60
    backoffs = [wait(state(Retryable("500"), n)) for n in range(1, 8)]
    assert all(0 < b <= 4 + 0.5 for b in backoffs) and backoffs[-1] >= backoffs[0]


@pytest.mark.parametrize("path", ["../x", "/x", "a/../../x", "a//b", "a\\b", "", "./a", "a/\x00"])
def test_unsafe_paths(path: str) -> None:
    with pytest.raises(ValueError):
        safe_relpath(path)


def test_safe_paths() -> None:
    assert safe_relpath("sub/dir/openvino_model.bin") == "sub/dir/openvino_model.bin"


def test_block_plans() -> None:
    opts = TransferOptions()
    blocks = plan_blocks(1 << 30, 4, opts, ranges=True)
    assert [b.start for b in blocks[:2]] == [0, 64 << 20] and blocks[-1].end == 1 << 30
    assert len(plan_blocks(1 << 20, 4, opts, ranges=True)) == 1  # small: one stream
    assert len(plan_blocks(1 << 30, 4, opts, ranges=False)) == 1
    huge = plan_blocks(1 << 50, 4, TransferOptions(block_bytes=1 << 20), ranges=True)
    assert len(huge) <= MAX_BLOCKS  # bounded whatever the size


def test_a_retry_loop_started_late_still_gets_its_window_and_progress_extends_it() -> None:
    import time


    def failed() -> RetryCallState:
        rs = RetryCallState(None, None, (), {})  # type: ignore[arg-type]
        rs.set_exception((Retryable, Retryable("503"), None))
        return rs

    opts = TransferOptions(max_attempts_without_progress=100, max_total_retry_s=3600)
    # a block whose first request fails long after the file's own deadline passed: retried
    stop = StopPolicy(opts, lambda: 0, deadline=time.monotonic() - 1)
    assert stop(failed()) is False
    # no window left and no progress: stop; new bytes arrived: retried again
    done = [0]
    stop = StopPolicy(replace(opts, max_total_retry_s=0), lambda: done[0], deadline=time.monotonic() - 1)
    assert stop(failed()) is True
    stop = StopPolicy(opts, lambda: done[0], deadline=time.monotonic() - 1)
    done[0] = 10
    assert stop(failed()) is False


def test_sidecar_that_does_not_tile_the_file_is_not_trusted(tmp_path: Path) -> None:
    good = {"schema": 1, "url": "u", "repo": "r", "revision": "c" * 40, "file": "f", "size_bytes": 10,
            "blocks": [[0, 5, 5], [5, 10, 2]]}
    p = tmp_path / "s.json"
    p.write_text(json.dumps(good))
    assert read_sidecar(p) is not None
    for blocks in ([[0, 5, 6], [5, 10, 0]], [[0, 4, 0], [5, 10, 0]], [[0, 5, 0]]):
        p.write_text(json.dumps({**good, "blocks": blocks}))
        assert read_sidecar(p) is None
    p.write_text("{not json")
    assert read_sidecar(p) is None


@pytest.mark.parametrize("text", ["[1, 2]", "\"x\"", "null", "[" * 100_000 + "]" * 100_000,
                                  '{"schema": 1, "url": "u", "repo": "r", "revision": "r", "file": "f", '
                                  '"size_bytes": 10, "blocks": [1, 2]}',
                                  '{"schema": 1, "url": "u", "repo": "r", "revision": "r", "file": "f", '
                                  '"size_bytes": 10, "blocks": {"a": 1}}'])
def test_a_damaged_sidecar_is_not_trusted_and_never_crashes(tmp_path: Path, text: str) -> None:
    p = tmp_path / "s.json"
    p.write_text(text)
    assert read_sidecar(p) is None


def test_progress_events_are_throttled(capsys: pytest.CaptureFixture[str]) -> None:
    out = io.StringIO()
    bar = ProgressReporter("f", 1000, tty=True, stream=out, min_interval_s=3600)
    events = ProgressReporter("f", 100_000, tty=False, min_interval_s=0.0)
    for _ in range(999):
        bar.advance(1)
        events.advance(1)  # 0.001 % per call: no event per call
    bar.advance(1)
    bar.close()
    assert out.getvalue().count("\r") <= 3 and "100.0%" in out.getvalue()
    assert events.events == 0  # 999 bytes of 100000: under 1 %
    events.advance(1)
    assert events.events == 1  # 1 %
    events.advance(500)
    assert events.events == 1
    events.close()
    assert events.events == 2  # and one at the end


def test_reserved_blocks_of_a_partial_count_as_already_held(tmp_path: Path) -> None:
    """A resume must not be refused for space the partial reserved itself (fallocate KEEP_SIZE)."""

    partial = tmp_path / "m.gguf.part"
    size = 4 << 20
    fd = os.open(partial, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        preallocate(fd, size)
    finally:
        os.close(fd)
    if partial.stat().st_blocks == 0:
        pytest.skip("this filesystem does not reserve blocks with fallocate")
    assert partial.stat().st_size == 0  # KEEP_SIZE: the visible size only grows with real bytes
    assert bytes_held(tmp_path / "missing.json", partial) >= size


@pytest.mark.parametrize("endpoint", ["localhost:8080", "ftp://mirror.example", "http://", "hf-mirror.com/hf"])
def test_an_hf_endpoint_that_is_not_an_http_url_is_a_usage_error_at_once(endpoint: str, tmp_path: Path) -> None:
    from core.errors import UsageError
    from core.settings import load_settings
    from download import HubSession

    settings = load_settings({"HOTFIT_HOME": str(tmp_path), "HF_ENDPOINT": endpoint})
    with pytest.raises(UsageError) as exc:
        HubSession(settings, token=False)
    assert "HF_ENDPOINT" in str(exc.value) and exc.value.exit_code == 2 and exc.value.hint


@pytest.mark.parametrize("endpoint", ["https://huggingface.co", "http://127.0.0.1:8080/", "https://mirror.example/hf"])
def test_http_endpoints_with_or_without_a_path_are_accepted(endpoint: str, tmp_path: Path) -> None:
    from core.settings import load_settings
    from download import HubSession

    settings = load_settings({"HOTFIT_HOME": str(tmp_path), "HF_ENDPOINT": endpoint})
    session = HubSession(settings, token=False)
    assert session.resolve_url("o/r", "a" * 40, "f.gguf") == f"{endpoint.rstrip('/')}/o/r/resolve/{'a' * 40}/f.gguf"
