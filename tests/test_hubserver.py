"""The local Hub speaks the protocol the real huggingface_hub client and plain httpx expect
(as huggingface_hub's file_download.py calls it), and its faults and counters are observable."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from tests.conftest import REPO_ROOT
from tests.hubserver import LocalHub, git_blob_sha1, lfs_pointer, parse_range

TIER = "integration"

CONFIG = b'{"architectures": ["LlamaForCausalLM"]}\n'
WEIGHTS = bytes(range(256)) * 40  # 10240 bytes, forced LFS below


@pytest.fixture
def repo(local_hub: LocalHub) -> tuple[LocalHub, str]:
    commit = local_hub.create_repo(
        "org/tiny", {"config.json": CONFIG, "model.gguf": WEIGHTS, "sub/dir/notes.txt": "hi"}, lfs=["model.gguf"]
    )
    return local_hub, commit


def _no_xet(headers: httpx.Headers) -> None:
    assert not [k for k in headers if k.lower().startswith("x-xet")]
    assert "xet" not in headers.get("link", "")


# --------------------------------------------------------------------------- pure parts


def test_git_blob_sha1_matches_git() -> None:
    # `printf 'hello\n' | git hash-object --stdin` and the empty blob, as git prints them.
    assert git_blob_sha1(b"hello\n") == "ce013625030ba8dba906f756967f9e9ca394464a"
    assert git_blob_sha1(b"") == "e69de29bb2d1d6434b8b29ae775ad8c2e48c5391"


@pytest.mark.parametrize(
    ("header", "size", "expected"),
    [
        (None, 10, None),
        ("bytes=0-", 10, (0, 9)),
        ("bytes=2-4", 10, (2, 4)),
        ("bytes=2-100", 10, (2, 9)),
        ("bytes=-3", 10, (7, 9)),
        ("bytes=-30", 10, (0, 9)),
        ("bytes=10-", 10, "unsatisfiable"),
        ("bytes=0-", 0, "unsatisfiable"),
        ("bytes=5-2", 10, None),  # malformed: ignored, whole body
        ("bytes=0-1,4-5", 10, None),  # multi-range: ignored, whole body
        ("items=0-1", 10, None),
    ],
)
def test_parse_range(header: str | None, size: int, expected: object) -> None:
    assert parse_range(header, size) == expected


# --------------------------------------------------------------------------- plain httpx


def test_small_file_head_and_get(repo: tuple[LocalHub, str]) -> None:
    hub, commit = repo
    head = httpx.head(hub.url("org/tiny", "config.json"))
    assert head.status_code == 200
    assert head.headers["X-Repo-Commit"] == commit
    assert head.headers["ETag"] == f'"{git_blob_sha1(CONFIG)}"'
    assert int(head.headers["Content-Length"]) == len(CONFIG)
    assert head.headers["Accept-Ranges"] == "bytes"
    assert "X-Linked-Etag" not in head.headers
    _no_xet(head.headers)
    get = httpx.get(hub.url("org/tiny", "config.json"))
    assert get.status_code == 200 and get.content == CONFIG
    assert hub.file_entry("org/tiny", "config.json").blob_id == git_blob_sha1(CONFIG)


def test_lfs_file_redirects_to_cdn_host_with_metadata_on_the_302(repo: tuple[LocalHub, str]) -> None:
    hub, commit = repo
    sha256 = hashlib.sha256(WEIGHTS).hexdigest()
    head = httpx.head(hub.url("org/tiny", "model.gguf"))
    assert head.status_code == 302
    assert head.headers["X-Linked-Etag"] == f'"{sha256}"'
    assert int(head.headers["X-Linked-Size"]) == len(WEIGHTS)
    assert head.headers["X-Repo-Commit"] == commit
    location = httpx.URL(head.headers["Location"])
    assert location.host == "localhost" != httpx.URL(hub.endpoint).host
    _no_xet(head.headers)

    get = httpx.get(hub.url("org/tiny", "model.gguf"), follow_redirects=True)
    assert get.status_code == 200 and get.content == WEIGHTS
    assert [r.where for r in hub.requests_for(file="model.gguf", method="GET")] == ["hub", "cdn"]
    # The tree/model_info etags agree with what the resolve says.
    entry = hub.file_entry("org/tiny", "model.gguf")
    assert entry.lfs and entry.sha256 == sha256
    assert entry.blob_id == git_blob_sha1(lfs_pointer(sha256, len(WEIGHTS)))


def test_lfs_served_directly_when_redirects_are_off(tmp_path: Path) -> None:
    with LocalHub(tmp_path / "hub", redirect_lfs=False) as hub:
        hub.create_repo("m", {"w.bin": WEIGHTS}, lfs=True)
        head = httpx.head(hub.url("m", "w.bin"))
        assert head.status_code == 200
        assert head.headers["ETag"] == head.headers["X-Linked-Etag"] == f'"{hashlib.sha256(WEIGHTS).hexdigest()}"'
        assert int(head.headers["Content-Length"]) == int(head.headers["X-Linked-Size"]) == len(WEIGHTS)


def test_lfs_threshold_decides_by_default(tmp_path: Path) -> None:
    with LocalHub(tmp_path / "hub", lfs_threshold_bytes=100) as hub:
        hub.create_repo("m", {"small": b"a" * 100, "big": b"b" * 101})
        assert not hub.file_entry("m", "small").lfs
        assert hub.file_entry("m", "big").lfs


def test_range_206_and_416(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    with httpx.Client(follow_redirects=True) as client:
        part = client.get(hub.url("org/tiny", "model.gguf"), headers={"Range": "bytes=100-199"})
        assert part.status_code == 206
        assert part.headers["Content-Range"] == f"bytes 100-199/{len(WEIGHTS)}"
        assert part.content == WEIGHTS[100:200]
        tail = client.get(hub.url("org/tiny", "model.gguf"), headers={"Range": f"bytes={len(WEIGHTS) - 5}-"})
        assert tail.status_code == 206 and tail.content == WEIGHTS[-5:]
        past = client.get(hub.url("org/tiny", "model.gguf"), headers={"Range": f"bytes={len(WEIGHTS)}-"})
        assert past.status_code == 416
        assert past.headers["Content-Range"] == f"bytes */{len(WEIGHTS)}"
        small = client.get(hub.url("org/tiny", "config.json"), headers={"Range": "bytes=1-3"})
        assert small.status_code == 206 and small.content == CONFIG[1:4]
    ranges = [r.range for r in hub.requests_for(file="model.gguf", where="cdn")]
    assert ranges == ["bytes=100-199", f"bytes={len(WEIGHTS) - 5}-", f"bytes={len(WEIGHTS)}-"]


def test_keep_alive_reuses_one_connection(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    with httpx.Client() as client:
        for _ in range(3):
            assert client.get(hub.url("org/tiny", "config.json")).status_code == 200
    assert len({r.client_port for r in hub.requests}) == 1


def test_big_file_from_disk_is_linked_not_copied(local_hub: LocalHub, tmp_path: Path) -> None:
    big = tmp_path / "big.gguf"
    big.write_bytes(os.urandom(300_000))
    local_hub.create_repo("m", {"big.gguf": big}, lfs=True)
    entry = local_hub.file_entry("m", "big.gguf")
    stored = local_hub.store.object_path(entry.sha256)
    assert os.path.samefile(stored, big)
    body = httpx.get(local_hub.url("m", "big.gguf"), follow_redirects=True).content
    assert body == big.read_bytes() and hashlib.sha256(body).hexdigest() == entry.sha256


# --------------------------------------------------------------------------- the real client


def test_hf_hub_download_small_and_lfs_at_pinned_revision(repo: tuple[LocalHub, str], tmp_path: Path) -> None:
    hub, commit = repo
    cache = tmp_path / "hf-cache"
    small = hf_hub_download("org/tiny", "config.json", revision=commit, cache_dir=cache, endpoint=hub.endpoint)
    big = hf_hub_download("org/tiny", "model.gguf", revision=commit, cache_dir=cache, endpoint=hub.endpoint)
    nested = hf_hub_download("org/tiny", "sub/dir/notes.txt", revision=commit, cache_dir=cache, endpoint=hub.endpoint)
    assert Path(small).read_bytes() == CONFIG
    assert Path(big).read_bytes() == WEIGHTS
    assert Path(nested).read_text() == "hi"
    assert f"snapshots/{commit}/" in big
    # The client names blobs by etag: sha256 for LFS, git blob sha1 otherwise.
    assert os.path.basename(os.path.realpath(big)) == hashlib.sha256(WEIGHTS).hexdigest()
    assert os.path.basename(os.path.realpath(small)) == git_blob_sha1(CONFIG)
    # The LFS body came from the CDN host; the client never asked for Xet.
    assert [r.where for r in hub.requests_for(file="model.gguf", method="GET")] == ["cdn"]
    assert not [r for r in hub.requests if "xet" in r.url_path]


def test_hf_hub_download_through_resolve_cache_307(tmp_path: Path) -> None:
    with LocalHub(tmp_path / "hub", redirect_small=True) as hub:
        commit = hub.create_repo("m", {"config.json": CONFIG})
        head = httpx.head(hub.url("m", "config.json"))
        assert head.status_code == 307 and head.headers["Location"].startswith("/api/resolve-cache/models/m/")
        path = hf_hub_download("m", "config.json", cache_dir=tmp_path / "c", endpoint=hub.endpoint)
        assert Path(path).read_bytes() == CONFIG and commit in path
        assert {r.status for r in hub.requests if r.url_path.startswith("/api/resolve-cache/")} == {200}


def test_model_info_and_list_repo_tree(repo: tuple[LocalHub, str]) -> None:
    hub, commit = repo
    api = HfApi(endpoint=hub.endpoint)
    info = api.model_info("org/tiny", revision=commit, files_metadata=True)
    assert info.id == "org/tiny" and info.sha == commit
    siblings = {s.rfilename: s for s in info.siblings or []}
    assert set(siblings) == {"config.json", "model.gguf", "sub/dir/notes.txt"}
    assert siblings["model.gguf"].size == len(WEIGHTS)
    assert siblings["model.gguf"].lfs is not None
    assert siblings["model.gguf"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert siblings["config.json"].lfs is None and siblings["config.json"].blob_id == git_blob_sha1(CONFIG)
    assert api.model_info("org/tiny").sha == commit  # no revision → main

    tree = {e.path: e for e in api.list_repo_tree("org/tiny", revision=commit, recursive=True)}
    assert set(tree) == {"config.json", "model.gguf", "sub", "sub/dir", "sub/dir/notes.txt"}
    assert tree["model.gguf"].lfs.sha256 == hashlib.sha256(WEIGHTS).hexdigest()
    assert tree["config.json"].blob_id == git_blob_sha1(CONFIG)
    top = {e.path for e in api.list_repo_tree("org/tiny", revision=commit)}
    assert top == {"config.json", "model.gguf", "sub"}
    assert {e.path for e in api.list_repo_tree("org/tiny", path_in_repo="sub/dir")} == {"sub/dir/notes.txt"}
    assert sorted(api.list_repo_files("org/tiny")) == ["config.json", "model.gguf", "sub/dir/notes.txt"]


def test_tree_pagination_follows_link_header(tmp_path: Path) -> None:
    with LocalHub(tmp_path / "hub", tree_page_size=2) as hub:
        hub.create_repo("m", {f"f{i}.txt": str(i) for i in range(5)})
        first = httpx.get(f"{hub.endpoint}/api/models/m/tree/main")
        assert len(first.json()) == 2 and first.links["next"]["url"].startswith(hub.endpoint)
        files = {e.path for e in HfApi(endpoint=hub.endpoint).list_repo_tree("m")}
        assert files == {f"f{i}.txt" for i in range(5)}


def test_error_codes_map_to_huggingface_hub_errors(repo: tuple[LocalHub, str], tmp_path: Path) -> None:
    hub, commit = repo
    api = HfApi(endpoint=hub.endpoint)
    with pytest.raises(RepositoryNotFoundError):
        api.model_info("org/missing")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("org/missing", "x", cache_dir=tmp_path, endpoint=hub.endpoint)
    with pytest.raises(RevisionNotFoundError):
        api.model_info("org/tiny", revision="nope")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download("org/tiny", "config.json", revision="0" * 40, cache_dir=tmp_path, endpoint=hub.endpoint)
    with pytest.raises(RemoteEntryNotFoundError) as exc:
        hf_hub_download("org/tiny", "absent.bin", revision=commit, cache_dir=tmp_path, endpoint=hub.endpoint)
    assert isinstance(exc.value, EntryNotFoundError)
    with pytest.raises(EntryNotFoundError):
        list(api.list_repo_tree("org/tiny", path_in_repo="nowhere"))
    # What the real Hub sends on the wire: anonymous → 401, authenticated → 404; JSON error body.
    anon = httpx.head(hub.url("org/missing", "x"))
    authed = httpx.get(hub.url("org/missing", "x"), headers={"Authorization": "Bearer t"})
    assert (anon.status_code, authed.status_code) == (401, 404)
    assert anon.headers["X-Error-Code"] == authed.headers["X-Error-Code"] == "RepoNotFound"
    assert "error" in authed.json()
    entry = httpx.head(hub.url("org/tiny", "absent.bin"))
    assert entry.headers["X-Error-Code"] == "EntryNotFound" and entry.headers["X-Repo-Commit"] == commit


def test_gated_repo_needs_its_token(local_hub: LocalHub, tmp_path: Path) -> None:
    local_hub.create_repo("org/gated", {"w.gguf": WEIGHTS}, lfs=True, gated_token="hf_secret")
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "w.gguf", cache_dir=tmp_path / "a", endpoint=local_hub.endpoint, token=False)
    with pytest.raises(GatedRepoError):
        hf_hub_download("org/gated", "w.gguf", cache_dir=tmp_path / "b", endpoint=local_hub.endpoint, token="hf_wrong")
    assert httpx.head(local_hub.url("org/gated", "w.gguf")).status_code == 401
    wrong = httpx.head(local_hub.url("org/gated", "w.gguf"), headers={"Authorization": "Bearer hf_wrong"})
    assert wrong.status_code == 403 and wrong.headers["X-Error-Code"] == "GatedRepo"
    path = hf_hub_download("org/gated", "w.gguf", cache_dir=tmp_path / "c", endpoint=local_hub.endpoint,
                           token="hf_secret")
    assert Path(path).read_bytes() == WEIGHTS
    # The bearer token stays on the Hub origin; the CDN GET does not get it.
    assert [r.authorization for r in local_hub.requests if r.status in (200, 302)] == [True, False]
    # model_info stays public for gated repos, as on the Hub, and says it is gated.
    assert HfApi(endpoint=local_hub.endpoint).model_info("org/gated").gated == "manual"
    local_hub.set_gated("org/gated", None)
    assert httpx.head(local_hub.url("org/gated", "w.gguf")).status_code == 302


def test_moving_main_keeps_old_commits_resolvable(repo: tuple[LocalHub, str], tmp_path: Path) -> None:
    hub, first = repo
    second = hub.commit("org/tiny", {"config.json": b"{}", "sub/dir/notes.txt": None})
    assert len(second) == 40 and second != first and hub.head("org/tiny") == second
    assert httpx.head(hub.url("org/tiny", "config.json")).headers["X-Repo-Commit"] == second
    assert httpx.get(hub.url("org/tiny", "config.json")).content == b"{}"
    assert httpx.get(hub.url("org/tiny", "config.json", revision=first)).content == CONFIG
    assert httpx.head(hub.url("org/tiny", "sub/dir/notes.txt")).status_code == 404
    api = HfApi(endpoint=hub.endpoint)
    assert api.model_info("org/tiny").sha == second
    assert api.model_info("org/tiny", revision=first).sha == first
    hub.set_ref("org/tiny", "main", first)  # move it back
    assert api.model_info("org/tiny").sha == first
    side = hub.commit("org/tiny", {"extra.txt": "x"}, branch="dev")
    assert hub.head("org/tiny", "dev") == side and hub.head("org/tiny") == first
    assert httpx.get(hub.url("org/tiny", "config.json", revision="dev")).content == CONFIG


# --------------------------------------------------------------------------- faults


def test_close_after_bytes_cuts_the_body(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    fault = hub.inject(file="model.gguf", where="cdn", close_after_bytes=1000)
    with pytest.raises(httpx.RemoteProtocolError):
        httpx.get(hub.url("org/tiny", "model.gguf"), follow_redirects=True)
    assert fault.hits == 1 and fault.spent
    assert hub.bytes_sent("model.gguf") == 1000
    again = httpx.get(hub.url("org/tiny", "model.gguf"), follow_redirects=True)  # spent: next one is whole
    assert again.content == WEIGHTS


def test_hf_hub_download_resumes_after_a_cut(repo: tuple[LocalHub, str], tmp_path: Path) -> None:
    hub, commit = repo
    hub.inject(file="model.gguf", method="GET", close_after_bytes=4096)
    path = hf_hub_download("org/tiny", "model.gguf", revision=commit, cache_dir=tmp_path, endpoint=hub.endpoint)
    assert Path(path).read_bytes() == WEIGHTS
    gets = hub.requests_for(file="model.gguf", method="GET")
    assert [r.body_bytes for r in gets] == [4096, len(WEIGHTS)]
    # A cut inside the client's first 10 MiB chunk restarts from 0: no Range re-sent.
    assert [r.range for r in gets] == [None, None]


def test_status_bursts_and_retry_after(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    hub.inject(file="config.json", status=503, times=2, retry_after=7)
    statuses = []
    for _ in range(3):
        r = httpx.get(hub.url("org/tiny", "config.json"))
        statuses.append((r.status_code, r.headers.get("Retry-After")))
    assert statuses == [(503, "7"), (503, "7"), (200, None)]
    hub.inject(status=500, times=None, url="/api/*")  # always, every API call
    for _ in range(2):
        assert httpx.get(f"{hub.endpoint}/api/models/org/tiny").status_code == 500
    assert httpx.get(hub.url("org/tiny", "config.json")).status_code == 200  # resolve unaffected
    hub.clear_faults()
    assert httpx.get(f"{hub.endpoint}/api/models/org/tiny").status_code == 200


def test_429_is_retried_by_huggingface_hub(repo: tuple[LocalHub, str], tmp_path: Path) -> None:
    hub, commit = repo
    fault = hub.inject(file="config.json", method="GET", status=429, retry_after=0)
    path = hf_hub_download("org/tiny", "config.json", revision=commit, cache_dir=tmp_path, endpoint=hub.endpoint)
    assert Path(path).read_bytes() == CONFIG and fault.hits == 1
    assert [r.status for r in hub.requests_for(file="config.json", method="GET")] == [429, 200]


def test_500_is_a_typed_error_from_model_info(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    hub.inject(url="/api/models/*", status=500)
    with pytest.raises(HfHubHTTPError) as exc:
        HfApi(endpoint=hub.endpoint).model_info("org/tiny")
    assert exc.value.response.status_code == 500


def test_ignore_range_answers_200_with_everything(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    hub.inject(file="model.gguf", ignore_range=True)
    r = httpx.get(hub.url("org/tiny", "model.gguf"), headers={"Range": "bytes=100-"}, follow_redirects=True)
    assert r.status_code == 200 and r.content == WEIGHTS and "Content-Range" not in r.headers


def test_wrong_size_advertised(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    hub.inject(file="model.gguf", method="HEAD", advertise_size=100)
    head = httpx.head(hub.url("org/tiny", "model.gguf"))
    assert head.status_code == 302 and head.headers["X-Linked-Size"] == "100"
    assert httpx.head(hub.url("org/tiny", "model.gguf")).headers["X-Linked-Size"] == str(len(WEIGHTS))
    hub.inject(file="model.gguf", where="cdn", advertise_size=100)
    assert httpx.get(hub.url("org/tiny", "model.gguf"), follow_redirects=True).content == WEIGHTS[:100]
    hub.inject(file="model.gguf", where="cdn", advertise_size=len(WEIGHTS) + 50)
    with pytest.raises(httpx.RemoteProtocolError):  # promises more than exists: connection dropped
        httpx.get(hub.url("org/tiny", "model.gguf"), follow_redirects=True)


def test_corrupt_flips_a_byte_but_keeps_the_size(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    hub.inject(file="model.gguf", corrupt=True)
    body = httpx.get(hub.url("org/tiny", "model.gguf"), follow_redirects=True).content
    assert len(body) == len(WEIGHTS) and body != WEIGHTS and body[1:] == WEIGHTS[1:]


def test_redirect_to_cdn_for_a_small_file(repo: tuple[LocalHub, str], tmp_path: Path) -> None:
    hub, commit = repo
    hub.inject(file="config.json", redirect_to_cdn=True, times=None)
    head = httpx.head(hub.url("org/tiny", "config.json"))
    assert head.status_code == 302 and httpx.URL(head.headers["Location"]).host == "localhost"
    assert head.headers["X-Linked-Etag"] == f'"{git_blob_sha1(CONFIG)}"'
    path = hf_hub_download("org/tiny", "config.json", revision=commit, cache_dir=tmp_path, endpoint=hub.endpoint)
    assert Path(path).read_bytes() == CONFIG


def test_throughput_cap_paces_the_body(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    bps = 40_000
    fault = hub.inject(file="model.gguf", where="cdn", throughput_bps=bps)
    t0 = time.monotonic()
    body = httpx.get(hub.url("org/tiny", "model.gguf"), follow_redirects=True).content
    elapsed_s = time.monotonic() - t0
    assert body == WEIGHTS and fault.hits == 1
    # A lower bound only (the server sleeps at least this long); a slow machine cannot make it fail.
    assert elapsed_s >= 0.8 * len(WEIGHTS) / bps


def test_faults_match_only_where_they_can_act(repo: tuple[LocalHub, str]) -> None:
    hub, _ = repo
    cut = hub.inject(file="*.gguf", close_after_bytes=10)
    httpx.head(hub.url("org/tiny", "model.gguf"))  # a HEAD has no body to cut
    httpx.get(f"{hub.endpoint}/api/models/org/tiny")  # not a file request
    assert cut.hits == 0
    status = hub.inject(file="config.json", method="HEAD", status=500)
    assert httpx.get(hub.url("org/tiny", "config.json")).status_code == 200
    assert httpx.head(hub.url("org/tiny", "config.json")).status_code == 500
    assert status.spent and [r.faults for r in hub.requests][-1] == 1


# --------------------------------------------------------------------------- as its own process


def test_runs_as_a_process_sharing_the_store(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    seed = LocalHub(root)  # not started: only the store is used
    first = seed.create_repo("org/m", {"a.txt": "one"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.hubserver", "--root", str(root), "--port", "0"],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        assert info["endpoint"].startswith("http://127.0.0.1:")
        url = f"{info['endpoint']}/org/m/resolve/main/a.txt"
        r = httpx.get(url)
        assert r.content == b"one" and r.headers["X-Repo-Commit"] == first
        second = seed.commit("org/m", {"a.txt": "two"})  # moved here, seen there
        r = httpx.get(url)
        assert r.content == b"two" and r.headers["X-Repo-Commit"] == second
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0


# The demo (scripts/provision-demo) runs after `./scripts/bootstrap`, which installs no test
# dependencies: its Hub and world must import and start with pytest unimportable.
_WITHOUT_PYTEST = "import runpy, sys; sys.modules['pytest'] = None; sys.argv[0] = {module!r}; " \
                  "runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"


def test_the_hub_server_runs_without_pytest(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", _WITHOUT_PYTEST.format(module="tests.hubserver"), "--root", str(tmp_path / "hub"),
         "--port", "0"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        assert json.loads(line)["endpoint"].startswith("http://127.0.0.1:")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_demo_world_starts_without_pytest(tmp_path: Path) -> None:
    from tests.gguf_fixtures import pinned_template

    pinned_template()  # the world uploads the pinned llama.cpp template: skip (or fail) like the server
    proc = subprocess.Popen(
        [sys.executable, "-c", _WITHOUT_PYTEST.format(module="tests.e2e_support"), str(tmp_path / "world"),
         "--free-gib", "8"], cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line, proc.stderr.read() if proc.stderr else ""
        world = json.loads(line)
        assert world["models"] == ["fx-agent-large", "fx-agent-small"]
        r = httpx.head(f"{world['endpoint']}/hotfit-fixtures/qwen3-chat-template/resolve/main/chat_template.jinja")
        assert r.status_code == 200 and r.headers["X-Repo-Commit"]
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_parallel_ranges_on_separate_connections(repo: tuple[LocalHub, str]) -> None:
    hub, commit = repo
    url = f"{hub.cdn_endpoint}/cdn/org%2Ftiny/{commit}/model.gguf"
    parts = [(i * 2048, i * 2048 + 2047) for i in range(5)]

    def fetch(rng: tuple[int, int]) -> bytes:
        r = httpx.get(url, headers={"Range": f"bytes={rng[0]}-{rng[1]}"})
        assert r.status_code == 206
        return r.content

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(5) as pool:
        body = b"".join(pool.map(fetch, parts))
    assert body == WEIGHTS
    assert len({r.client_port for r in hub.requests}) == 5
    assert hub.bytes_sent("model.gguf") == len(WEIGHTS)


def test_bad_configuration_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        LocalHub(tmp_path, cdn_host="127.0.0.1")
    hub = LocalHub(tmp_path)
    with pytest.raises(ValueError):
        hub.inject(where="elsewhere", status=500)
    with pytest.raises(TypeError):
        hub.inject(close_after=3)  # a misspelt effect must not silently do nothing
    with pytest.raises(TypeError):
        hub.create_repo("m", {"x": 3})  # type: ignore[dict-item]


def test_hf_endpoint_env_in_a_fresh_client_process(repo: tuple[LocalHub, str], tmp_path: Path) -> None:
    # huggingface_hub reads HF_ENDPOINT once at import: a new interpreter is the honest way to use it.
    hub, commit = repo
    script = (
        "import sys; from huggingface_hub import hf_hub_download, HfApi\n"
        "print(HfApi().model_info('org/tiny').sha)\n"
        "print(hf_hub_download('org/tiny', 'model.gguf', cache_dir=sys.argv[1]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("HF_")} | hub.env()
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "cache")], env=env, capture_output=True, text=True,
        timeout=60, check=True,
    ).stdout.split()
    assert out[0] == commit
    assert Path(out[1]).read_bytes() == WEIGHTS
    assert [r.where for r in hub.requests_for(file="model.gguf")] == ["hub", "cdn"]


@pytest.mark.anyio
async def test_async_client_resumes_with_one_range(repo: tuple[LocalHub, str]) -> None:
    # The pattern hotfit's downloader follows: HEAD without redirects, GET the CDN URL, resume by Range.
    hub, commit = repo
    hub.inject(file="model.gguf", where="cdn", close_after_bytes=3000)
    got = bytearray()
    async with httpx.AsyncClient(headers={"Accept-Encoding": "identity"}) as client:
        head = await client.head(hub.url("org/tiny", "model.gguf", revision=commit))
        location, size = head.headers["Location"], int(head.headers["X-Linked-Size"])
        while len(got) < size:
            headers = {"Range": f"bytes={len(got)}-"} if got else {}
            try:
                async with client.stream("GET", location, headers=headers) as r:
                    assert r.status_code == (206 if got else 200)
                    async for chunk in r.aiter_raw():
                        got += chunk
            except httpx.RemoteProtocolError:
                continue
    assert bytes(got) == WEIGHTS
    cdn_gets = hub.requests_for(file="model.gguf", where="cdn")
    assert [r.range for r in cdn_gets] == [None, "bytes=3000-"]
    assert hub.bytes_sent("model.gguf") == len(WEIGHTS)
