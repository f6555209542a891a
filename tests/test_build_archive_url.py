"""`install-llama-server --from URL` (docs/builds.md "Build once, install on many machines"): the
archive comes from an http(s) mirror, is checked against `--sha256` or the `URL.sha256` beside it,
resumes from its `.part` after a cut connection, and is then installed as `--from FILE` installs.
The mirror is a real HTTP server on 127.0.0.1 (http.server, with byte ranges and a way to cut a
transfer short, which no stock server does on demand)."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from hotfit.core.settings import LLAMA_SDIST_VERSION
from tests.test_build_archive import _script, exported  # noqa: F401 - a fixture
from tests.test_build_archive_faults import _export

TIER = "integration"


@dataclass
class Mirror:
    root: Path
    url: str
    cut_after_bytes: int | None = None  # the next archive transfer stops after this many bytes
    ranges: list[str] = field(default_factory=list)  # the Range header of each archive request


@pytest.fixture
def mirror(tmp_path: Path) -> Iterator[Mirror]:
    root = tmp_path / "mirror"
    root.mkdir()
    state = Mirror(root, "")

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = root / self.path.lstrip("/")
            if not path.is_file():
                self.send_error(404)
                return
            data = path.read_bytes()
            start = 0
            asked = self.headers.get("Range")
            if not path.name.endswith(".sha256"):
                state.ranges.append(asked or "")
            if asked:
                start = int(asked.removeprefix("bytes=").split("-")[0])
                if start >= len(data):
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{len(data)}")
                    self.end_headers()
                    return
                self.send_response(206)
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            else:
                self.send_response(200)
            body = data[start:]
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if state.cut_after_bytes is not None and not path.name.endswith(".sha256"):
                body, state.cut_after_bytes = body[: state.cut_after_bytes], None
                self.close_connection = True
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        server.shutdown()
        server.server_close()


def _publish(mirror: Mirror, archive: Path, with_sum: bool = True) -> str:
    data = archive.read_bytes()
    (mirror.root / archive.name).write_bytes(data)
    digest = hashlib.sha256(data).hexdigest()
    if with_sum:
        (mirror.root / f"{archive.name}.sha256").write_text(f"{digest}  {archive.name}\n")
    return digest


def test_from_url_with_the_sum_beside_it_installs_after_a_cut_transfer_resumes(exported: Path, mirror: Mirror,
                                                                              tmp_path: Path) -> None:
    _publish(mirror, exported)
    cache = tmp_path / "cache"
    url = f"{mirror.url}/{exported.name}"
    mirror.cut_after_bytes = exported.stat().st_size // 3
    cut = _script("--from", url, cache=cache)
    assert cut.returncode == 1 and "Traceback" not in cut.stderr, cut.stderr
    assert "could not download" in cut.stderr and "partial download is resumed" in cut.stderr
    assert not (cache / LLAMA_SDIST_VERSION / "cpu").exists()
    parts = list((cache / "downloads").glob("*.part"))
    assert [p.stat().st_size for p in parts] == [exported.stat().st_size // 3]
    done = _script("--from", url, cache=cache)
    assert done.returncode == 0, done.stderr
    assert mirror.ranges == ["", f"bytes={exported.stat().st_size // 3}-"]  # the rerun asked for the rest only
    assert done.stdout.strip() == str(cache / LLAMA_SDIST_VERSION / "cpu" / "bin" / "llama-server")
    assert list((cache / "downloads").iterdir()) == []  # installed: the download is not kept


def test_from_url_with_sha256_given_needs_no_sum_file(exported: Path, mirror: Mirror, tmp_path: Path) -> None:
    digest = _publish(mirror, exported, with_sum=False)
    proc = _script("--from", f"{mirror.url}/{exported.name}", "--sha256", digest, cache=tmp_path / "cache")
    assert proc.returncode == 0, proc.stderr


def _refused_url(args: list[str], tmp_path: Path, *says: str) -> None:
    cache = tmp_path / "cache"
    proc = _script(*args, cache=cache)
    assert proc.returncode in (1, 2) and "Traceback" not in proc.stderr, proc.stderr
    for text in says:
        assert text in proc.stderr, proc.stderr
    version_dir = cache / LLAMA_SDIST_VERSION
    assert not version_dir.exists() or list(version_dir.iterdir()) == []
    assert not (cache / "downloads").exists() or not any((cache / "downloads").glob("*.part"))


def test_a_download_that_does_not_match_its_sum_is_refused_and_not_kept(mirror: Mirror, tmp_path: Path) -> None:
    archive = _export(tmp_path)
    _publish(mirror, archive)
    _refused_url(["--from", f"{mirror.url}/{archive.name}", "--sha256", "0" * 64], tmp_path,
                 "expected " + "0" * 64 + " (--sha256)", "nothing was installed")


def test_without_a_sum_the_download_is_refused_saying_how_to_publish_one(mirror: Mirror, tmp_path: Path) -> None:
    archive = _export(tmp_path)
    _publish(mirror, archive, with_sum=False)
    _refused_url(["--from", f"{mirror.url}/{archive.name}"], tmp_path, "no checksum beside",
                 "sha256sum FILE > FILE.sha256", "--sha256 HEX")


def test_a_missing_archive_and_a_closed_port_are_refused_naming_the_url(mirror: Mirror, tmp_path: Path) -> None:
    _refused_url(["--from", f"{mirror.url}/absent.tar.gz", "--sha256", "a" * 64], tmp_path,
                 f"could not download {mirror.url}/absent.tar.gz: HTTP 404")
    _refused_url(["--from", "http://127.0.0.1:9/x.tar.gz", "--sha256", "a" * 64], tmp_path,
                 "could not download http://127.0.0.1:9/x.tar.gz", "Connection refused")


@pytest.mark.parametrize(("args", "says"), [(["--sha256", "a" * 64], "--sha256 goes with --from"),
                                            (["--from", "x.tar.gz", "--sha256", "ABC"], "64 lowercase hex digits")])
def test_sha256_argument_errors(tmp_path: Path, args: list[str], says: str) -> None:
    _refused_url(args, tmp_path, says)
