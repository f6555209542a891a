"""The download engine's pure parts: ordered hashing, header parsing, path safety, block plans, retry waits,
progress throttling."""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import pytest
import structlog
from tenacity import RetryCallState

from hotfit.core.errors import DiskSpaceError, HubError, IntegrityError, PinMismatch, TransferError, UsageError
from hotfit.core.settings import Settings, load_settings
from hotfit.download import (
    HubSession,
    OrderedHasher,
    ProgressReporter,
    TransferOptions,
    disk,
    download_to_partial,
    head_retrying,
    hub_call_retrying,
    partial_paths,
    safe_relpath,
)
from hotfit.download.disk import bytes_held, preallocate
from hotfit.download.engine import DownloadOutcome, plan_blocks
from hotfit.download.hub_errors import (
    NOT_A_HUB,
    Retryable,
    hub_error_from_hf_exception,
    hub_error_from_response,
    is_not_a_hub,
    parse_retry_after,
)
from hotfit.download.options import MAX_BLOCKS
from hotfit.download.retry import StopPolicy, wait_policy
from hotfit.download.sidecar import Block, decode_sidecar, read_sidecar
from hotfit.download.stream import _Writer, parse_content_range
from tests.hubserver import LocalHub


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

    opts = TransferOptions(max_attempts_without_progress=100, max_total_retry_s=3600, min_progress_bytes=10)
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


def _failed_attempt(n: int) -> RetryCallState:
    rs = RetryCallState(None, None, (), {})  # type: ignore[arg-type]
    rs.attempt_number = n
    rs.set_exception((Retryable, Retryable("connection closed"), None))
    return rs


def test_bytes_reset_the_backoff_and_a_trickle_is_no_progress() -> None:
    opts = TransferOptions(backoff_initial_s=0.5, backoff_max_s=30, max_attempts_without_progress=6,
                           min_progress_bytes=1 << 20)
    done = [0]
    stop = StopPolicy(opts, lambda: done[0], deadline=time.monotonic() + 900)
    wait = wait_policy(opts, stop)
    # (tenacity asks the wait before the stop after each failed attempt; both see the same count)
    # a link cut every 2 MiB: each attempt brought bytes, so the next one goes at once, forever
    for n in range(1, 50):
        done[0] += 2 << 20
        assert wait(_failed_attempt(n)) == 0 and stop(_failed_attempt(n)) is False
    # then nothing: the backoff starts again from its first step, and grows
    waits = []
    for n in range(50, 55):
        waits.append(wait(_failed_attempt(n)))
        assert stop(_failed_attempt(n)) is False
    assert 0.5 <= waits[0] <= 1.0 and all(b > a for a, b in zip(waits, waits[1:]))
    # one byte per connection is no progress: given up after the bounded attempts, the bound named
    trickle = StopPolicy(opts, lambda: done[0], deadline=time.monotonic() + 900)
    stops = []
    for n in range(1, 7):
        done[0] += 1
        stops.append(trickle(_failed_attempt(n)))
    assert stops == [False] * 5 + [True]
    assert trickle.reason == f"6 attempts in a row brought less than {1 << 20} bytes"
    # several short attempts that add up to the threshold are progress
    short = StopPolicy(opts, lambda: done[0], deadline=time.monotonic() + 900)
    results = []
    for n in range(1, 9):
        done[0] += 512 << 10
        results.append((short(_failed_attempt(n)), short.without_progress))
    assert results == [(False, 1), (False, 0)] * 4


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
    with pytest.raises(UsageError) as exc:  # where the settings are read, before any session
        load_settings({"HOTFIT_HOME": str(tmp_path), "HF_ENDPOINT": endpoint})
    assert "HF_ENDPOINT" in str(exc.value) and exc.value.exit_code == 2 and exc.value.hint


@pytest.mark.parametrize("endpoint", ["https://huggingface.co", "http://127.0.0.1:8080/", "https://mirror.example/hf"])
def test_http_endpoints_with_or_without_a_path_are_accepted(endpoint: str, tmp_path: Path) -> None:
    settings = load_settings({"HOTFIT_HOME": str(tmp_path), "HF_ENDPOINT": endpoint})
    session = HubSession(settings, token=False)
    assert session.resolve_url("o/r", "a" * 40, "f.gguf") == f"{endpoint.rstrip('/')}/o/r/resolve/{'a' * 40}/f.gguf"


# --------------------------------------------------------------------------- shared by every caller now


def test_a_damaged_sidecar_names_its_file_and_the_fault(tmp_path: Path) -> None:
    good = {"schema": 1, "url": "u", "repo": "r", "revision": "c" * 40, "file": "f", "size_bytes": 10,
            "blocks": [[0, 5, 5], [5, 10, 2]]}
    p = tmp_path / "m.gguf.abc.json"
    assert decode_sidecar(p, json.dumps(good)).done_bytes == 7
    for text, fault in (("{not json", "not JSON"), ("[1]", "not a JSON object"),
                        (json.dumps({**good, "schema": 9}), "schema 9"),
                        (json.dumps({**good, "size_bytes": "10"}), "size_bytes"),
                        (json.dumps({**good, "repo": 5}), "repo"),
                        (json.dumps({**good, "blocks": [[0, 5, 6], [5, 10, 0]]}), "block [0, 5, 6]"),
                        (json.dumps({**good, "blocks": [[0, 5, 0]]}), "blocks end at byte 5")):
        with pytest.raises(IntegrityError) as exc:
            decode_sidecar(p, text)
        assert str(p) in exc.value.what and fault in exc.value.what, exc.value.what
        assert exc.value.details["path"] == str(p) and exc.value.hint


def test_reading_a_damaged_sidecar_says_which_file_it_discards(tmp_path: Path) -> None:
    import structlog

    p = tmp_path / "s.json"
    p.write_text('{"schema": 1}')
    with structlog.testing.capture_logs() as logs:
        assert read_sidecar(p) is None
        assert read_sidecar(tmp_path / "absent.json") is None  # no sidecar: nothing to say
    assert [e["event"] for e in logs] == ["download.partial_discarded"]
    assert logs[0]["file"] == str(p) and "damaged" in logs[0]["reason"]


@contextmanager
def _hub_with(tmp_path: Path, path: str, data: bytes, **repo_kw: Any) -> Iterator[tuple[LocalHub, str, Settings]]:
    """A local Hub whose repository ``o/r`` holds ``path`` = ``data``: the hub, the commit, a client's settings."""
    src = tmp_path / path
    src.write_bytes(data)
    with LocalHub(tmp_path / "hub") as hub:
        commit = hub.create_repo("o/r", {path: src}, **repo_kw)
        yield hub, commit, load_settings({"HOTFIT_HOME": str(tmp_path / "home"), "HF_ENDPOINT": hub.endpoint})


async def _download_model(session: HubSession, commit: str, data: bytes, partial_dir: Path) -> DownloadOutcome:
    """``o/r``'s model.gguf (``data``, no pinned hash) into ``partial_dir``."""
    return await download_to_partial(session, repo="o/r", revision=commit, path="model.gguf",
                                     expected_size=len(data), expected_sha256=None, partial_dir=partial_dir)


@pytest.mark.anyio
async def test_a_damaged_sidecar_restarts_the_file_from_byte_0(tmp_path: Path) -> None:
    """End to end on the local Hub: a partial whose sidecar is garbage is not trusted — the whole file
    is fetched again and the result is the pinned bytes (the behaviour before the decoder was one)."""
    data = random.Random(7).randbytes(3 << 20)
    with _hub_with(tmp_path, "model.gguf", data, lfs=["model.gguf"]) as (_hub, commit, settings):
        partial_dir = tmp_path / ".partial"
        partial_dir.mkdir()
        part, sidecar, _lock = partial_paths(partial_dir, "o/r", "model.gguf")
        part.write_bytes(b"\xff" * (1 << 20))  # wrong bytes a trusted sidecar would have kept
        sidecar.write_text('{"schema": 1, "blocks": "garbage"}')
        async with HubSession(settings, TransferOptions(connections=2, block_bytes=1 << 20), token=False) as s:
            out = await _download_model(s, commit, data, partial_dir)
    assert out.resumed_from_bytes == 0 and out.bytes_transferred == len(data)
    assert out.sha256 == hashlib.sha256(data).hexdigest() and part.read_bytes() == data


def test_one_disk_margin_for_the_entry_check_and_the_per_file_check(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    assert disk.DISK_MARGIN_BYTES == 512 << 20  # the spec's artifact + projector + 512 MiB
    monkeypatch.setattr(disk, "free_bytes", lambda _d: 1000 + disk.DISK_MARGIN_BYTES)
    disk.check_disk_space(tmp_path, 1000, "f")  # exactly what is needed plus the margin: fits
    with pytest.raises(DiskSpaceError) as exc:
        disk.check_disk_space(tmp_path / "not" / "yet", 1001, "o/r/model.gguf")
    assert exc.value.details["needed_bytes"] == 1001 + disk.DISK_MARGIN_BYTES
    assert exc.value.details["margin_bytes"] == disk.DISK_MARGIN_BYTES and "o/r/model.gguf" in exc.value.what
    assert exc.value.exit_code == 4 and "HOTFIT_HOME" in (exc.value.hint or "")


def test_free_bytes_of_a_directory_not_created_yet_is_its_filesystems(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # Which filesystem is asked, not two readings of a free-space figure other writers move.
    asked: list[Path] = []
    real = os.statvfs

    def recorded(path: Any) -> Any:
        asked.append(Path(path))
        return real(path)

    monkeypatch.setattr(disk.os, "statvfs", recorded)
    assert disk.free_bytes(tmp_path / "a" / "b") > 0
    assert asked == [tmp_path]  # the nearest directory that exists


def _hf_error(cls_name: str, status: int, headers: dict[str, str] | None = None) -> Exception:
    import httpx2
    from huggingface_hub import errors as hf

    url = "http://hub.example/api/models/o/r"
    resp = httpx2.Response(status, headers=headers or {"x-error-code": "x"}, request=httpx2.Request("GET", url))
    return getattr(hf, cls_name)(f"{status} for {url}", response=resp)


def _response(status: int, code: str) -> Any:
    import httpx

    url = "http://hub.example/o/r/resolve/" + "c" * 40 + "/f.gguf"
    return httpx.Response(status, headers={"x-error-code": code, "x-repo-commit": "c" * 40},
                          request=httpx.Request("HEAD", url))


@pytest.mark.parametrize("cls_name,status,code,words", [
    ("GatedRepoError", 403, "GatedRepo", ("is gated", "licence", "HF_TOKEN")),
    ("RepositoryNotFoundError", 404, "RepoNotFound", ("repository o/r not found",)),
    ("RevisionNotFoundError", 404, "RevisionNotFound", ("revision " + "c" * 40 + " not found in o/r",)),
])
def test_the_hub_api_and_the_resolve_endpoint_give_one_message_per_cause(cls_name: str, status: int, code: str,
                                                                         words: tuple[str, ...]) -> None:
    api = hub_error_from_hf_exception(_hf_error(cls_name, status, {"x-error-code": code}), repo="o/r",
                                      revision="c" * 40, endpoint="http://hub.example", url="http://hub.example/api")
    resolve = hub_error_from_response(_response(status, code), repo="o/r", revision="c" * 40, path="f.gguf",
                                      endpoint="http://hub.example")
    assert isinstance(api, HubError) and isinstance(resolve, HubError)
    for word in words:
        assert word in str(api) and word in str(resolve)
    assert api.hint == resolve.hint and api.exit_code == resolve.exit_code == 4


def test_the_hf_mapping_names_not_a_hub_unreachable_and_leaves_bugs_alone() -> None:
    kw: dict[str, Any] = {"repo": "o/r", "revision": None, "endpoint": "http://web.example",
                          "url": "http://web.example/api"}
    plain_404 = hub_error_from_hf_exception(_hf_error("HfHubHTTPError", 404, {"content-type": "text/html"}), **kw)
    assert plain_404 is not None and is_not_a_hub(plain_404) and NOT_A_HUB in plain_404.what
    html = hub_error_from_hf_exception(json.JSONDecodeError("x", "<html>", 0), **kw)
    assert html is not None and is_not_a_hub(html)
    server = hub_error_from_hf_exception(_hf_error("HfHubHTTPError", 500), **kw)
    assert server is not None and not is_not_a_hub(server) and "o/r@main" in server.what
    down = hub_error_from_hf_exception(ConnectionRefusedError(111, "refused"), **kw)
    assert down is not None and down.what.startswith("cannot reach the Hub for o/r")
    assert down.exit_code == server.exit_code == 11 and isinstance(down, HubError)  # passing faults: exit 11
    missing = hub_error_from_hf_exception(_hf_error("HfHubHTTPError", 403), **kw)
    assert missing is not None and missing.exit_code == 4
    assert hub_error_from_hf_exception(KeyError("bug"), **kw) is None


@pytest.mark.anyio
async def test_one_retry_policy_for_heads_and_hub_api_calls(tmp_path: Path) -> None:
    opts = TransferOptions(backoff_initial_s=0.001, backoff_max_s=0.002, max_attempts_without_progress=3)
    with _hub_with(tmp_path, "f.bin", b"x" * 100) as (hub, commit, settings):
        async with HubSession(settings, opts, token=False) as session:
            hub.inject(method="HEAD", file="f.bin", status=503, retry_after=0, times=2)
            counters = {"attempts": 0}
            remote = await head_retrying(session, "o/r", commit, "f.bin", expected_size=100, pinned=True,
                                         counters=counters)
            assert remote.commit == commit and counters["attempts"] == 3  # two 503s, then the answer
            with pytest.raises(PinMismatch):  # not retried: a wrong size is no passing fault
                await head_retrying(session, "o/r", commit, "f.bin", expected_size=99, pinned=True)
            hub.inject(method="HEAD", file="f.bin", status=503, retry_after=0, times=None)
            with pytest.raises(TransferError, match="gave up .3 attempts in a row brought less than") as exc:
                await head_retrying(session, "o/r", commit, "f.bin", done_bytes=lambda: 42)
            assert "42 bytes already on disk" in (exc.value.hint or "")
    calls: list[int] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise _hf_error("HfHubHTTPError", 503)
        return "listed"

    assert await hub_call_retrying(flaky, options=opts, repo="o/r", url="http://h/api") == "listed"
    assert len(calls) == 3
    calls.clear()

    def missing() -> str:
        calls.append(1)
        raise _hf_error("RepositoryNotFoundError", 404, {"x-error-code": "RepoNotFound"})

    with pytest.raises(Exception, match="404"):
        await hub_call_retrying(missing, options=opts, repo="o/r", url="http://h/api")
    assert len(calls) == 1  # a missing repository is not retried


def test_the_write_behind_thread_writes_counts_and_hashes_in_order(tmp_path: Path) -> None:
    data = random.Random(3).randbytes(200_000)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        w = OrderedHasher(fd, len(data), buffer_bytes=10_000)
        blocks = [Block(s, min(len(data), s + 50_000)) for s in range(0, len(data), 50_000)]
        for b in reversed(blocks):  # out of order, in 7000-byte writes of two parts each
            for o in range(b.start, b.end, 7000):
                chunk = data[o:min(o + 7000, b.end)]
                w.write(o, [chunk[:100], chunk[100:]], len(chunk), b)
        w.wait_written()
        assert w.write_queued_bytes == 0 and all(b.complete for b in blocks) and w.write_error is None
        assert w.finish()[0] == hashlib.sha256(data).hexdigest()
    finally:
        os.close(fd)
    assert path.read_bytes() == data


def test_a_failed_write_is_kept_for_the_loop_and_later_writes_are_dropped(tmp_path: Path) -> None:
    path = tmp_path / "f"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)  # every write fails (EBADF)
    try:
        w = OrderedHasher(fd, 20, buffer_bytes=100)
        b = Block(0, 20)
        w.write(0, [b"a" * 10], 10, b)
        w.write(10, [b"b" * 10], 10, b)
        w.wait_written()
        assert w.write_error is not None and w.write_error[1] == 0 and b.done == 0
        w.abort()
    finally:
        os.close(fd)


def test_a_thread_that_died_is_raised_by_the_next_write_not_retried_in_silence(tmp_path: Path) -> None:
    import anyio


    path = tmp_path / "f"
    path.write_bytes(b"")
    # write-only: the resume read-back of bytes 0-10 fails whenever it runs (an empty file would not
    # do: the block's own write at byte 10 may land first, and the hole then reads back as zeros)
    fd = os.open(path, os.O_WRONLY)
    try:
        w = OrderedHasher(fd, 20, buffer_bytes=100)
        w.mark_on_disk(0, 10)
        b = Block(10, 20)
        writer = _Writer(path, b, 10, w, None, {"transferred": 0})
        writer.add(b"x" * 10)

        async def go() -> None:
            await writer.flush()
            await writer.drain()

        with pytest.raises(OSError, match="Bad file descriptor"):
            anyio.run(go)
        w.abort()
    finally:
        os.close(fd)


@pytest.mark.anyio
async def test_a_cancelled_stream_stops_at_once_keeps_its_bytes_and_resumes(tmp_path: Path) -> None:
    # The body is read in a worker thread (download.wire): cancelling (Ctrl-C) must unblock its recv,
    # leave every received byte written and claimed, and the rerun must resume there, not at 0.
    import anyio


    data = random.Random(11).randbytes(8 << 20)
    with _hub_with(tmp_path, "model.gguf", data, lfs=["model.gguf"]) as (hub, commit, settings):
        partial_dir = tmp_path / ".partial"
        part, sidecar, _lock = partial_paths(partial_dir, "o/r", "model.gguf")
        opts = TransferOptions(connections=1, read_timeout_s=600)  # only the cancel can end the wait
        hub.inject(file="model.gguf", method="GET", throughput_bps=2 << 20, times=None)
        async with HubSession(settings, opts, token=False) as s:
            with anyio.move_on_after(1.0) as scope:
                await _download_model(s, commit, data, partial_dir)
        assert scope.cancelled_caught
        side = read_sidecar(sidecar)
        assert side is not None and 0 < side.done_bytes < len(data)
        assert part.read_bytes()[:side.done_bytes] == data[:side.done_bytes]
        hub.clear_faults()
        async with HubSession(settings, TransferOptions(connections=1), token=False) as s:
            out = await _download_model(s, commit, data, partial_dir)
    assert out.resumed_from_bytes == side.done_bytes and out.bytes_transferred == len(data) - side.done_bytes
    assert out.sha256 == hashlib.sha256(data).hexdigest()


@pytest.mark.anyio
async def test_ranged_gets_reuse_their_keep_alive_connections_between_blocks(tmp_path: Path) -> None:
    data = random.Random(12).randbytes(6 << 20)
    with _hub_with(tmp_path, "model.gguf", data, lfs=["model.gguf"]) as (hub, commit, settings):
        async with HubSession(settings, TransferOptions(connections=2, block_bytes=1 << 20), token=False) as s:
            out = await _download_model(s, commit, data, tmp_path / ".partial")
        gets = hub.requests_for(file="model.gguf", method="GET", where="cdn")
    assert out.sha256 == hashlib.sha256(data).hexdigest()
    assert len(gets) == 6 and all(r.status == 206 for r in gets)
    assert len({r.client_port for r in gets}) <= 2  # six blocks, two connections opened


@pytest.mark.anyio
async def test_a_link_cut_every_2_mib_on_one_connection_is_retried_at_once_each_time(tmp_path: Path) -> None:
    data = random.Random(5).randbytes(9 << 20)
    with _hub_with(tmp_path, "model.gguf", data, lfs=["model.gguf"]) as (hub, commit, settings):
        hub.inject(method="GET", file="model.gguf", close_after_bytes=2 << 20, times=None)
        opts = TransferOptions(connections=1)  # the default backoff: 0.5 s, doubling
        with structlog.testing.capture_logs() as events:
            async with HubSession(settings, opts, token=False) as s:
                with anyio.fail_after(60):
                    out = await _download_model(s, commit, data, tmp_path / ".partial")
        heads = [r for r in hub.requests if r.method == "HEAD" and r.file == "model.gguf"]
    assert out.sha256 == hashlib.sha256(data).hexdigest() and out.bytes_transferred == len(data)
    assert len(heads) == 1  # a cut that followed progress is resumed on the same link, without a re-HEAD
    retries = [e for e in events if e["event"] == "download.retry"]
    assert len(retries) == 4  # cut at 2, 4, 6 and 8 MiB
    assert [e["wait_s"] for e in retries] == [0] * 4  # before: 0.5, 1, 2, 4 s (+ jitter), growing with each cut
    assert [e["attempts_without_progress"] for e in retries] == [0] * 4


@pytest.mark.anyio
async def test_a_server_sending_one_byte_per_connection_is_given_up_on_with_exit_11(tmp_path: Path) -> None:
    data = random.Random(6).randbytes(3 << 20)
    with _hub_with(tmp_path, "model.gguf", data, lfs=["model.gguf"]) as (hub, commit, settings):
        hub.inject(method="GET", file="model.gguf", close_after_bytes=1, times=None)
        opts = TransferOptions(connections=1, backoff_initial_s=0.001, backoff_max_s=0.002)
        async with HubSession(settings, opts, token=False) as s:
            with anyio.fail_after(60), pytest.raises(TransferError) as exc:  # before: retried forever
                await _download_model(s, commit, data, tmp_path / ".partial")
        gets = [r for r in hub.requests if r.method == "GET" and r.file == "model.gguf"]
    assert exc.value.exit_code == 11  # a passing fault, not a bad file (core.errors)
    assert f"gave up ({opts.max_attempts_without_progress} attempts in a row brought less than" in exc.value.what
    assert exc.value.details["gave_up"].startswith(f"{opts.max_attempts_without_progress} attempts")
    assert len(gets) == opts.max_attempts_without_progress and exc.value.details["done_bytes"] <= len(gets)
