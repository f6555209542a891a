"""Disk, filesystem and path faults (docs/faults.md), on real filesystems: a tmpfs mounted for the
test is the small or full disk, a real GGUF (tests/real_models.py) the file where its size matters.

The full-disk matrix reads as a table: fault × where it strikes → exit code, what the message names,
what is on disk afterwards, and what the rerun does once space is free.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import anyio
import pytest
from huggingface_hub import hf_hub_download

from hotfit.core import log as core_log
from hotfit.core.entry import Artifact, TemplateSource
from hotfit.core.errors import DiskSpaceError, HotfitError, RegistryError
from hotfit.core.settings import Settings
from hotfit.download import DISK_MARGIN_BYTES, check_disk, partial_paths
from hotfit.download.sidecar import read_sidecar
from hotfit.pipeline.engine import Runner
from hotfit.pipeline.provision import FetchJob, fetch_stages
from hotfit.pipeline.pull import pull_entry
from hotfit.stages.fetch_template import fetch_template
from hotfit.stages.fetch_weights import fetch_weights
from hotfit.stages.verify import verify
from hotfit.state.store import SyncStateStore
from tests.conftest import REPO_ROOT
from tests.hubserver import LocalHub
from tests.real_models import SMOLLM2, require_model
from tests.test_fetch_weights import FAST, make_entry, make_gguf, settings_for, sha256_of
from tests.test_grade_model import cli_json
from tests.test_pull_cli import env_for, pull_cmd, write_registry
from tests.polling import wait_until

TIER = "e2e"

MiB = 1 << 20
SLACK_BYTES = 16 * MiB  # room for receipts, sidecars, the log and the state database beside the file
REQUIRE_TOOLS_ENV = "HOTFIT_REQUIRE_TOOLS"  # scripts/run-tests sets it: a refused mount fails, not skips


# --------------------------------------------------------------------------- a real small filesystem


def skip_unless_required(why: str) -> NoReturn:
    """Skip a fault test the machine cannot stage (no root, no loop device) — a failure under
    HOTFIT_REQUIRE_TOOLS, which scripts/run-tests sets."""
    if os.environ.get(REQUIRE_TOOLS_ENV):
        pytest.fail(f"{why}; {REQUIRE_TOOLS_ENV} is set, so this is a failure, not a skip")
    pytest.skip(why)


@contextlib.contextmanager
def tmpfs(where: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of ``size_bytes`` mounted at ``where`` (root only; skips where mount is refused)."""
    where.mkdir(parents=True, exist_ok=True)
    got = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(where)],
                         capture_output=True, text=True)
    if got.returncode != 0:
        skip_unless_required(f"cannot mount a tmpfs here ({got.stderr.strip()}): these faults need a real small "
                             "filesystem (root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def free_of(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


FILL_STEP_BYTES = 16 * 1024


def fill(fs: Path, leave_bytes: int = 0) -> Path:
    """Take every free byte of ``fs`` but ``leave_bytes`` (a real full disk); delete the file to free it."""
    filler = fs / "filler"
    with open(filler, "ab") as fh:
        while (want := free_of(fs) - leave_bytes) > 0:
            # In steps of FILL_STEP_BYTES: tmpfs undoes the whole of a fallocate that meets ENOSPC, so
            # one big step that a download beside it beats to the last page would free the disk again
            # just after the download failed for want of it (its error would then report the disk
            # nearly empty); a step's undo frees at most a step.
            try:  # a download writing beside it may take some of ``want`` first: read the free space again
                os.posix_fallocate(fh.fileno(), os.fstat(fh.fileno()).st_size, min(want, FILL_STEP_BYTES))
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
    return filler


def allocated(path: Path) -> int:
    return os.stat(path).st_blocks * 512


@pytest.fixture
def small_model(local_hub: LocalHub, tmp_path: Path) -> dict[str, Any]:
    src = tmp_path / "src"
    src.mkdir()
    weights = make_gguf(src / "model.gguf", pad_bytes=8 * MiB, seed=5)
    commit = local_hub.create_repo("org/model-GGUF", {"model.gguf": weights}, lfs=["model.gguf"])
    entry = make_entry("m", "org/model-GGUF", commit, "model.gguf", weights.stat().st_size, sha256_of(weights))
    return {"weights": weights, "entry": entry, "size": weights.stat().st_size}


def _partial(settings: Settings, entry: Any) -> tuple[Path, Path]:
    part, side, _lock = partial_paths(settings.model_dir(entry.name) / ".partial", entry.artifact.repo,
                                      entry.artifact.file)
    return part, side


async def _auto_fetch(entry: Any, settings: Settings) -> Any:
    """The fetch stages as ``hotfit auto`` runs them: with the entry-level disk check first."""
    job = FetchJob(entry=entry, progress=False, lock_each_stage=False)
    return (await Runner(fetch_stages(job), None, settings, handle_signals=False, plan_stage="").run()).results


async def _pull_fetch(entry: Any, settings: Settings) -> Any:
    """``hotfit pull``'s job (pipeline.pull.pull_entry): the same stages under one model lock."""
    pulled = await pull_entry(entry, settings, progress=False)
    return {"fetch-weights": pulled.fetch, "verify": pulled.verify}


# --------------------------------------------------------------------------- a tight disk resumes


def test_a_resume_on_a_disk_that_had_room_for_the_fresh_download_proceeds(local_hub: LocalHub,
                                                                          tmp_path: Path) -> None:
    """kill -9 during the download of a real GGUF on a tmpfs that held it plus the margin: the partial's
    whole size is reserved (fallocate) and already gone from the free space, so the entry check counts
    it as held, once; the rerun resumes instead of refusing."""
    real = require_model(SMOLLM2)
    size = real.size_bytes
    commit = local_hub.create_repo("real/smollm2-GGUF", {real.path.name: real.path}, lfs=True)
    entry = dataclasses.replace(real.entry(), chat_template=None, auto_eligible=False, ineligible_cause="tool-parser",
                                ineligible_reason="test: the embedded template is used",
                                artifact=Artifact("real/smollm2-GGUF", commit, real.path.name, size, real.spec.sha256))
    registry = write_registry(tmp_path / "registry.json", entry)
    with tmpfs(tmp_path / "fs", size + DISK_MARGIN_BYTES + SLACK_BYTES) as fs:
        home = fs / "home"
        settings = settings_for(local_hub, home)
        part, side = _partial(settings, entry)
        local_hub.inject(file=real.path.name, method="GET", throughput_bps=20 * MiB, times=None)
        proc = subprocess.Popen(pull_cmd(home, registry, entry.name, "--connections", "2"), env=env_for(local_hub),
                                cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_until(lambda: (s := read_sidecar(side)) and s.done_bytes >= 8 * MiB, "8 MiB claimed by the sidecar",
                       timeout_s=120, proc=proc)
        finally:
            proc.kill()  # SIGKILL: no handler, the reservation stays whole
        proc.wait()
        claimed = read_sidecar(side).done_bytes
        reserved = allocated(part)
        free = free_of(fs)
        # the figures of the fault: the whole file reserved, a part of it claimed, and less free than
        # the missing bytes plus the margin — the old check refused exactly here
        assert reserved >= size > claimed
        assert free < (size - claimed) + DISK_MARGIN_BYTES
        print(f"tmpfs {size + DISK_MARGIN_BYTES + SLACK_BYTES} B, file {size} B, reserved {reserved} B, "
              f"claimed {claimed} B, free {free} B")
        check_disk(entry, settings.model_dir(entry.name))  # the entry check: needs nothing more
        local_hub.clear_faults()
        results = anyio.run(_auto_fetch, entry, settings)
        weights = results["fetch-weights"].weights
        assert weights.resumed_from_bytes == claimed > 0 and weights.bytes_transferred == size - claimed
        assert results["verify"].sha256 == real.spec.sha256


@pytest.mark.anyio
async def test_a_failed_download_gives_its_reservation_back(local_hub: LocalHub, small_model: dict[str, Any],
                                                            tmp_path: Path) -> None:
    """A download that stops (interrupted once 2 MiB are claimed: Ctrl-C, SIGTERM, a give-up) keeps
    the partial and its claimed bytes but not the reservation of the rest: the .part holds on disk
    what its sidecar claims, not the whole file."""
    entry, size = small_model["entry"], small_model["size"]
    settings = settings_for(local_hub, tmp_path / "home")
    part, side = _partial(settings, entry)
    local_hub.inject(file="model.gguf", method="GET", throughput_bps=2 * MiB, times=None)
    async with anyio.create_task_group() as tg:
        async def watch() -> None:
            while not ((s := read_sidecar(side)) and s.done_bytes >= 2 * MiB):
                await anyio.sleep(0.01)
            tg.cancel_scope.cancel()
        tg.start_soon(watch)
        await fetch_weights(entry, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
        raise AssertionError("the download finished before it was interrupted")
    part, side = _partial(settings, entry)
    claimed = read_sidecar(side).done_bytes
    assert 0 < claimed < size and part.is_file()
    assert allocated(part) <= claimed + 64 * 1024 < size  # was: the whole size, whatever was claimed
    local_hub.clear_faults()
    fetched = await fetch_weights(entry, settings.model_dir("m"), settings=settings, options=FAST, progress=False)
    assert fetched.weights.resumed_from_bytes == claimed


def test_the_up_front_refusal_names_the_bytes_needed_and_free(local_hub: LocalHub, small_model: dict[str, Any],
                                                              tmp_path: Path) -> None:
    entry = small_model["entry"]
    with tmpfs(tmp_path / "fs", 64 * MiB) as fs:
        settings = settings_for(local_hub, fs / "home")
        with pytest.raises(DiskSpaceError) as err:
            anyio.run(_auto_fetch, entry, settings)
        needed, free = err.value.details["needed_bytes"], err.value.details["free_bytes"]
        assert needed == small_model["size"] + DISK_MARGIN_BYTES and 0 < free <= 64 * MiB
        assert f"need {needed} bytes" in err.value.what and f"{free} free" in err.value.what
        assert local_hub.requests_for(file="model.gguf", method="GET") == []  # nothing fetched, nothing written


# --------------------------------------------------------------------------- the Hugging Face cache's bytes


def _seeded(local_hub: LocalHub, cache: Path, entry: Any) -> None:
    """huggingface_hub's own hf_hub_download fills ``cache`` with the pinned file (a pre-seeded machine)."""
    hf_hub_download(entry.artifact.repo, entry.artifact.file, revision=entry.artifact.revision, cache_dir=cache,
                    endpoint=local_hub.endpoint, token=False)
    local_hub.reset_counters()


def test_a_file_the_hf_cache_hard_links_costs_no_disk_for_auto_and_pull(local_hub: LocalHub,
                                                                        small_model: dict[str, Any],
                                                                        tmp_path: Path) -> None:
    """A pre-seeded offline machine on a tight disk: the pinned file in the Hugging Face cache on the
    home's filesystem is hard-linked (0 bytes written), so neither auto's entry check nor pull asks
    for its size + the margin; both provision with nothing fetched."""
    entry, size = small_model["entry"], small_model["size"]
    with tmpfs(tmp_path / "fs", 4 * size) as fs:  # room for the cached file, far from size + 512 MiB
        cache = fs / "hf"
        _seeded(local_hub, cache, entry)
        for command, home in (("auto", fs / "auto-home"), ("pull", fs / "pull-home")):
            settings = dataclasses.replace(settings_for(local_hub, home, HF_HUB_OFFLINE="1"), hf_hub_cache=cache)
            fetched = anyio.run(_auto_fetch if command == "auto" else _pull_fetch, entry, settings)["fetch-weights"]
            assert fetched.weights.hf_cache == "hardlink", command
            assert fetched.weights.sha256 == entry.artifact.sha256
        assert local_hub.requests == []


def test_a_copy_from_a_cache_on_another_filesystem_costs_its_size_for_auto_and_pull(local_hub: LocalHub,
                                                                                    small_model: dict[str, Any],
                                                                                    tmp_path: Path) -> None:
    """The cache elsewhere: the file is copied, which writes its size, so both refuse alike (size + the
    margin), naming the figures, before a byte is copied or fetched; with the margin fitting, both copy."""
    entry, size = small_model["entry"], small_model["size"]
    cache = tmp_path / "hf"  # not on the tmpfs
    _seeded(local_hub, cache, entry)
    with tmpfs(tmp_path / "fs", 4 * size) as fs:
        for command, home in (("auto", fs / "auto-home"), ("pull", fs / "pull-home")):
            settings = dataclasses.replace(settings_for(local_hub, home, HF_HUB_OFFLINE="1"), hf_hub_cache=cache)
            with pytest.raises(DiskSpaceError) as err:
                anyio.run(_auto_fetch if command == "auto" else _pull_fetch, entry, settings)
            assert err.value.details["needed_bytes"] == size + DISK_MARGIN_BYTES, command
            assert not any(settings.model_dir(entry.name).rglob("*.gguf*")), command  # nothing copied
    with tmpfs(tmp_path / "roomy", size + DISK_MARGIN_BYTES + SLACK_BYTES) as fs:
        for command, home in (("auto", fs / "auto-home"), ("pull", fs / "pull-home")):
            settings = dataclasses.replace(settings_for(local_hub, home, HF_HUB_OFFLINE="1"), hf_hub_cache=cache)
            fetched = anyio.run(_auto_fetch if command == "auto" else _pull_fetch, entry, settings)["fetch-weights"]
            assert fetched.weights.hf_cache == "copy", command
    assert local_hub.requests == []


# --------------------------------------------------------------------------- a full disk, wherever it strikes


def _fill_when(predicate: Any, fs: Path, leave_bytes: int = 0) -> threading.Thread:
    """Fill ``fs`` from another thread as soon as ``predicate()`` holds (a disk filled by someone else)."""
    def run() -> None:
        deadline = time.monotonic() + 60
        while not predicate() and time.monotonic() < deadline:
            time.sleep(0.005)
        fill(fs, leave_bytes)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _full_at_sidecar(fs: Path, hub: LocalHub, model: dict[str, Any], settings: Settings) -> tuple[Any, Path]:
    entry = model["entry"]
    part, side = _partial(settings, entry)
    hub.inject(file="model.gguf", method="GET", throughput_bps=4 * MiB, times=None)
    # the whole file is reserved (fallocate) when the first byte lands: only the sidecar needs room now
    filler = _fill_when(lambda: (s := read_sidecar(side)) is not None and s.done_bytes >= 1 * MiB, fs)
    with pytest.raises(HotfitError) as err:
        anyio.run(lambda: fetch_weights(entry, settings.model_dir("m"), settings=settings, options=FAST,
                                        progress=False))
    filler.join()
    hub.clear_faults()
    return err.value, side


def _full_at_partial(fs: Path, hub: LocalHub, model: dict[str, Any], settings: Settings,
                     monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Path]:
    # A filesystem without fallocate (preallocation skipped): the bytes themselves meet the full disk.
    import hotfit.download.engine as engine
    monkeypatch.setattr(engine, "preallocate", lambda _fd, _size: None)
    entry = model["entry"]
    part, side = _partial(settings, entry)
    hub.inject(file="model.gguf", method="GET", throughput_bps=4 * MiB, times=None)
    # room left for the sidecar's checkpoints (a page each), not for the rest of the file
    filler = _fill_when(lambda: (s := read_sidecar(side)) is not None and s.done_bytes >= 1 * MiB, fs, 64 * 1024)
    with pytest.raises(HotfitError) as err:
        anyio.run(lambda: fetch_weights(entry, settings.model_dir("m"), settings=settings, options=FAST,
                                        progress=False))
    filler.join()
    hub.clear_faults()
    return err.value, part


def _full_at_receipt(fs: Path, hub: LocalHub, model: dict[str, Any], settings: Settings) -> tuple[Any, Path]:
    entry = model["entry"]
    dest = settings.model_dir("m")
    fetched = anyio.run(lambda: fetch_weights(entry, dest, settings=settings, options=FAST, progress=False))
    fill(fs)
    with pytest.raises(HotfitError) as err:
        anyio.run(lambda: verify(entry, dest, fetched=fetched))
    return err.value, dest / ".verified" / "model.gguf.json"


# where the disk fills → what the message names (the partial's bytes and its next checkpoint race for
# the last free page: either is the truth, and either names its file and the bytes)
@pytest.mark.parametrize("where, message_names", [
    ("partial", ("the partial download", "the resume sidecar")),
    ("sidecar", ("the resume sidecar",)),
    ("receipt", ("the receipt",)),
])
def test_full_disk_during_a_download_is_exit_4_and_the_rerun_resumes(
        where: str, message_names: tuple[str, ...], local_hub: LocalHub, small_model: dict[str, Any], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """fault × where → exit 4, the message names the file and the bytes needed and free, the partial
    (or the placed file) is kept, and the rerun with space freed completes with the pinned sha256."""
    with tmpfs(tmp_path / "fs", 32 * MiB) as fs:
        monkeypatch.setattr("hotfit.download.disk.DISK_MARGIN_BYTES", 0)  # the tmpfs is the small disk, not the margin
        settings = settings_for(local_hub, fs / "home")
        if where == "sidecar":
            err, path = _full_at_sidecar(fs, local_hub, small_model, settings)
        elif where == "partial":
            err, path = _full_at_partial(fs, local_hub, small_model, settings, monkeypatch)
        else:
            err, path = _full_at_receipt(fs, local_hub, small_model, settings)
        assert isinstance(err, DiskSpaceError) and err.exit_code == 4, repr(err)
        assert any(f"writing {name} " in err.what for name in message_names), err.what
        assert str(path) in err.what or where == "partial" and str(path.with_suffix(".json")) in err.what
        # the disk as the failing write met it: the 64 KiB left, and at most one filler step undone
        assert err.details["free_bytes"] < 64 * 1024 + FILL_STEP_BYTES and err.details["needed_bytes"] > 0
        assert f"need {err.details['needed_bytes']} bytes" in err.what
        entry = small_model["entry"]
        part, side = _partial(settings, entry)
        final = settings.model_dir("m") / "model.gguf"
        kept = read_sidecar(side).done_bytes if where != "receipt" else final.stat().st_size
        assert kept > 0 and (part.is_file() or final.is_file())
        (fs / "filler").unlink()
        fetched = anyio.run(lambda: fetch_weights(entry, settings.model_dir("m"), settings=settings, options=FAST,
                                                  progress=False))
        w = fetched.weights
        assert w is not None and w.sha256 == entry.artifact.sha256
        if where != "receipt":
            assert w.resumed_from_bytes >= kept > 0
        else:  # the verified file is re-hashed where it lies (moved to the partial slot), not fetched
            assert w.bytes_transferred == 0 and w.bytes_reread == small_model["size"]
        placed = anyio.run(lambda: verify(entry, settings.model_dir("m"), fetched=fetched))
        assert placed.sha256 == entry.artifact.sha256 and final.read_bytes() == small_model["weights"].read_bytes()


def test_full_disk_under_the_state_database_is_exit_4_not_a_rollback_error(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", 4 * MiB) as fs:
        store = SyncStateStore(fs / "state.db")
        run = store.create_run(["probe"], {"x": 1})
        filler = fill(fs)
        with pytest.raises(DiskSpaceError) as err:
            for i in range(64):  # the WAL grows until a page does not fit
                store.finish_run(run.run_id, "failed", {"why": "x" * 65536, "i": i})
        assert "the state database" in err.value.what and str(fs / "state.db") in err.value.what
        assert "database or disk is full" in err.value.details["sqlite_error"]
        filler.unlink()
        store.finish_run(run.run_id, "done")  # the connection is usable: nothing was left half-done
        assert store.get_run(run.run_id).status == "done"
        store.close()


def test_full_disk_under_the_event_log_is_exit_4_naming_it(tmp_path: Path) -> None:
    with tmpfs(tmp_path / "fs", 1 * MiB) as fs:
        log_file = fs / "logs" / "hotfit.jsonl"
        core_log.configure("json", 0, log_file, stream=open(os.devnull, "w"))
        try:
            fill(fs)
            with pytest.raises(DiskSpaceError) as err:
                for _ in range(64):
                    core_log.get_logger().info("test.event", padding="y" * 8192)
            assert "the event log" in err.value.what and str(log_file) in err.value.what
            core_log.get_logger().info("test.after")  # later events no longer retry the full file
        finally:
            core_log.configure("json", 0, None, stream=open(os.devnull, "w"))


def test_full_home_is_exit_4_from_the_cli(local_hub: LocalHub, small_model: dict[str, Any], tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The command end to end (`hotfit pull`) on a home whose disk is full: exit 4, one JSON error."""
    entry = dataclasses.replace(small_model["entry"], auto_eligible=False, ineligible_cause="tool-parser",
                                ineligible_reason="test: no template")
    registry = write_registry(tmp_path / "registry.json", entry)
    with tmpfs(tmp_path / "fs", 2 * MiB) as fs:
        home = fs / "home"
        (home / "logs").mkdir(parents=True)
        fill(fs)
        out = subprocess.run(pull_cmd(home, registry, "m"), env=env_for(local_hub), cwd=REPO_ROOT,
                             capture_output=True, timeout=120)
        assert out.returncode == 4, out.stderr.decode()[-2000:]
        error = json.loads(out.stdout)["error"]
        assert error["code"] == "disk_space" and "Traceback" not in out.stderr.decode()
        # the first write that meets the full disk names itself (here the model directory's lock file)
        assert error["details"]["path"].startswith(str(home)) and error["details"]["path"] in error["message"]
        assert f"{error['details']['free_bytes']} free" in error["message"]


# --------------------------------------------------------------------------- one path check


def test_a_template_file_that_escapes_is_refused_by_the_registry(tmp_path: Path, hotfit_home: Path) -> None:
    doc = json.loads((REPO_ROOT / "registry" / "data" / "curated.json").read_text())
    entry = next(e for e in doc["entries"] if e.get("chat_template"))
    entry["chat_template"]["file"] = "../../../x.jinja"
    path = tmp_path / "registry.json"
    path.write_text(json.dumps(doc))
    code, out = cli_json("pull", entry["name"], "--registry", str(path))
    assert code == 2 and "chat_template.file" in out["error"]["message"] and "../../../x.jinja" in out["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["../../../x.jinja", "/etc/x.jinja", "a/./b.jinja", "a\\b.jinja"])
async def test_a_template_file_that_escapes_is_refused_before_any_request(name: str, local_hub: LocalHub,
                                                                          tmp_path: Path) -> None:
    entry = make_entry("m", "org/model-GGUF", "a" * 40, "model.gguf", 1, None,
                       template=TemplateSource("org/tpl", "b" * 40, name))
    settings = settings_for(local_hub, tmp_path / "home", HF_TOKEN="hf_secret")
    with pytest.raises(RegistryError, match="escapes the model directory"):
        await fetch_template(entry, settings.model_dir("m"), settings=settings)
    assert local_hub.requests == []  # no request, so no token sent anywhere


# --------------------------------------------------------------------------- nothing through a symlink


TOOL_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}"


@pytest.fixture
def pulled(local_hub: LocalHub, small_model: dict[str, Any], tmp_path: Path, hotfit_home: Path,
           monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """An entry with weights and a template on the local Hub, pulled in-process into ``hotfit_home``."""
    for key, value in local_hub.env().items():
        monkeypatch.setenv(key, value)
    tpl_commit = local_hub.create_repo("org/tpl", {"chat_template.jinja": TOOL_TEMPLATE})
    entry = dataclasses.replace(small_model["entry"], auto_eligible=False, ineligible_cause="tool-parser",
                                ineligible_reason="test", chat_template=TemplateSource("org/tpl", tpl_commit,
                                                                                       "chat_template.jinja"))
    registry = write_registry(tmp_path / "registry.json", entry)
    dest = hotfit_home / "models" / "m"
    part, side, lock = partial_paths(dest / ".partial", "org/model-GGUF", "model.gguf")
    outside = tmp_path / "outside"
    outside.mkdir()
    return {"entry": entry, "registry": registry, "dest": dest, "part": part, "sidecar": side, "lock": lock,
            "outside": outside, "home": hotfit_home}


def _plant(kind: str, p: dict[str, Any]) -> Path:
    """Plant ``kind`` in the home before a pull; returns the path the error must name."""
    dest, outside = p["dest"], p["outside"]
    victim = outside / "victim"
    victim.write_bytes(b"not hotfit's")
    if kind == "partial dir symlink":
        dest.mkdir(parents=True)
        (dest / ".partial").symlink_to(outside, target_is_directory=True)
        return dest / ".partial"
    p["part"].parent.mkdir(parents=True)
    if kind == "part symlink":
        p["part"].symlink_to(victim)
        p["sidecar"].write_text(json.dumps({"schema": 1, "url": "", "repo": "org/model-GGUF", "revision":
                                            p["entry"].artifact.revision, "file": "model.gguf", "size_bytes":
                                            p["entry"].artifact.size_bytes, "expected_sha256": None, "etag": None,
                                            "ranges_supported": True, "blocks": [[0, p["entry"].artifact.size_bytes,
                                                                                  0]]}))
        return p["part"]
    if kind == "part is a directory":
        p["part"].mkdir()
        return p["part"]
    if kind == "sidecar is a directory":
        p["part"].write_bytes(b"")
        p["sidecar"].mkdir()
        return p["sidecar"]
    if kind == "lock symlink":
        p["lock"].symlink_to(victim)
        return p["lock"]
    if kind == "receipts dir symlink":
        (dest / ".verified").symlink_to(outside, target_is_directory=True)
        return dest / ".verified"
    if kind == "template symlink":
        (dest / "chat_template.jinja").symlink_to(victim)
        return dest / "chat_template.jinja"
    if kind in ("state.db-wal symlink", "state.db-shm symlink"):
        p["home"].mkdir(exist_ok=True)
        planted = p["home"] / kind.split()[0]
        planted.symlink_to(victim)
        return planted
    if kind == "manifest symlink":
        p["home"].mkdir(exist_ok=True)
        (p["home"] / "manifest.json").symlink_to(victim)
        return p["home"] / "manifest.json"
    raise AssertionError(kind)


# planted in the home → exit 2 naming it, nothing outside the home written, and the pull succeeds
# once the operator removes it
@pytest.mark.parametrize("kind", ["partial dir symlink", "part symlink", "part is a directory",
                                  "sidecar is a directory", "lock symlink", "receipts dir symlink",
                                  "template symlink", "manifest symlink", "state.db-wal symlink",
                                  "state.db-shm symlink"])
def test_nothing_is_written_through_a_symlink_or_onto_the_wrong_type(kind: str, pulled: dict[str, Any]) -> None:
    named = _plant(kind, pulled)
    before = {q.name: q.read_bytes() for q in pulled["outside"].iterdir()}
    code, out = cli_json("pull", "m", "--registry", str(pulled["registry"]))
    assert code == 2, out
    assert str(named) in out["error"]["message"], out["error"]["message"]
    assert out["error"]["details"]["path"] == str(named)
    assert {q.name: q.read_bytes() for q in pulled["outside"].iterdir()} == before  # nothing landed outside
    named.rmdir() if named.is_dir() and not named.is_symlink() else named.unlink()
    code, out = cli_json("pull", "m", "--registry", str(pulled["registry"]))
    assert code == 0, out
    assert out["fetch"]["weights"]["sha256"] == pulled["entry"].artifact.sha256


# --------------------------------------------------------------------------- damaged in place


def _flip_one_byte(path: Path) -> None:
    """One byte of the tensor data flipped in place: same size, same header, another sha256."""
    with open(path, "r+b") as fh:
        size = path.stat().st_size
        fh.seek(size - 1000 if size > 2000 else size // 2)  # a GGUF's tensor data, past its header
        b = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([b[0] ^ 0xFF]))


def _events(home: Path, name: str) -> list[dict[str, Any]]:
    lines = (home / "logs" / "hotfit.jsonl").read_text().splitlines()
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def test_pull_rehashes_an_installed_model_and_fetches_a_damaged_one_again(pulled: dict[str, Any],
                                                                          local_hub: LocalHub) -> None:
    reg = str(pulled["registry"])
    assert cli_json("pull", "m", "--registry", reg)[0] == 0
    final = pulled["dest"] / "model.gguf"
    good = final.read_bytes()
    code, out = cli_json("pull", "m", "--registry", reg)  # intact: re-hashed, trusted, nothing fetched
    assert code == 0 and out["fetch"]["weights"]["already_present"] is True
    _flip_one_byte(final)
    damaged_sha = sha256_of(final)
    local_hub.reset_counters()
    code, out = cli_json("pull", "m", "--registry", reg)
    assert code == 0, out
    w = out["fetch"]["weights"]
    assert w["already_present"] is False and w["bytes_transferred"] == len(good) and final.read_bytes() == good
    seen = _events(pulled["home"], "fetch.installed_damaged")
    assert [(e["expected_sha256"], e["actual_sha256"]) for e in seen] == [(pulled["entry"].artifact.sha256,
                                                                            damaged_sha)]


def test_offline_a_damaged_model_fails_naming_both_hashes(pulled: dict[str, Any],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    reg = str(pulled["registry"])
    assert cli_json("pull", "m", "--registry", reg)[0] == 0
    final = pulled["dest"] / "model.gguf"
    _flip_one_byte(final)
    damaged_sha = sha256_of(final)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = cli_json("pull", "m", "--registry", reg)
    assert code == 4
    msg = out["error"]["message"]
    assert damaged_sha in msg and pulled["entry"].artifact.sha256 in msg and str(final) in msg
    assert not final.exists()  # nothing may serve (or trust) the damaged bytes


def test_hotfit_verify_rehashes_every_installed_file_on_demand(pulled: dict[str, Any]) -> None:
    reg = str(pulled["registry"])
    assert cli_json("pull", "m", "--registry", reg)[0] == 0
    code, out = cli_json("verify")
    assert code == 0 and out["damaged"] == 0
    assert sorted(Path(f["path"]).name for f in out["files"]) == ["chat_template.jinja", "model.gguf"]
    final = pulled["dest"] / "model.gguf"
    _flip_one_byte(final)
    damaged_sha = sha256_of(final)
    code, out = cli_json("verify", "m")
    assert code == 4
    msg = out["error"]["message"]
    assert f"{final}: sha256 {damaged_sha}, receipt {pulled['entry'].artifact.sha256}" in msg
    assert "hotfit pull m" in out["error"]["hint"]
    assert not final.exists() and not (pulled["dest"] / ".verified" / "model.gguf.json").exists()
    assert cli_json("pull", "m", "--registry", reg)[0] == 0  # fetched again
    assert cli_json("verify")[0] == 0
    assert cli_json("verify", "nope")[0] == 2


def test_auto_recheck_rehashes_what_its_records_trust(local_hub: LocalHub, small_model: dict[str, Any],
                                                      tmp_path: Path) -> None:
    """`auto --recheck`'s fetch stages (FetchJob.rehash_installed) with a state store: the recorded
    fetch-weights result is reused while the installed file still hashes to it, and fetched again
    (not loaded) once a byte flipped in place."""
    from hotfit.state.store import StateStore

    entry = small_model["entry"]
    settings = settings_for(local_hub, tmp_path / "home")
    final = settings.model_dir("m") / "model.gguf"

    async def run(rehash: bool) -> Any:
        store = await StateStore.open(settings.state_db)
        try:
            job = FetchJob(entry=entry, progress=False, rehash_installed=rehash)
            return await Runner(fetch_stages(job), store, settings, handle_signals=False, plan_stage="").run()
        finally:
            await store.aclose()

    anyio.run(run, False)
    assert "fetch-weights" in anyio.run(run, True).skipped  # intact: the record stands
    _flip_one_byte(final)
    assert "fetch-weights" in anyio.run(run, False).skipped  # without --recheck: size-only, trusted
    again = anyio.run(run, True)
    assert "fetch-weights" not in again.skipped
    assert again.results["fetch-weights"].weights.bytes_transferred == small_model["size"]
    assert final.read_bytes() == small_model["weights"].read_bytes()


@pytest.mark.anyio
async def test_pull_rehashes_an_installed_openvino_snapshot(local_hub: LocalHub, tmp_path: Path) -> None:
    """The same for an OpenVINO snapshot: a flipped byte in a placed LFS file and in a small non-LFS
    file (checked by git blob id) are fetched again; the intact ones are not."""
    from tests.test_fetch_weights import _openvino_entry

    files: dict[str, str | bytes] = {"openvino_model.xml": "<net/>" * 100, "openvino_model.bin": os.urandom(1_200_000),
             "config.json": json.dumps({"max_position_embeddings": 40960})}
    local_hub.create_repo("OpenVINO/m-ov", files, lfs=["openvino_model.bin"])
    entry = _openvino_entry("OpenVINO/m-ov")
    settings = settings_for(local_hub, tmp_path / "home")
    dest = settings.model_dir("ov")
    await verify(entry, dest, fetched=await fetch_weights(entry, dest, settings=settings, options=FAST,
                                                          progress=False))
    for name in ("openvino_model.bin", "openvino_model.xml"):
        _flip_one_byte(dest / "snapshot" / name)
    again = await fetch_weights(entry, dest, settings=settings, options=FAST, progress=False, rehash_installed=True)
    assert again.snapshot is not None and again.snapshot.files_already_present == 1  # config.json only
    await verify(entry, dest, fetched=again)
    for name, content in files.items():
        assert (dest / "snapshot" / name).read_bytes() == (content.encode() if isinstance(content, str) else content)
