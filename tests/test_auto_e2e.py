"""End-to-end: `hotfit auto` as an operator runs it.

Real parts only: the local Hub (tests/hubserver.py) serving two deterministic tool-call fixture
models and the pinned Qwen3 chat template, the real llama-server, `hotfit` run as a subprocess
with its own --home. A saved probe (--probe-file) gives the planner a chosen budget.

Tests that stop before load (plan, dry run, refusals, an interrupted download and its resume) need
no llama-server: they take ``plain_world`` and run against a stand-in binary that only answers
``--version`` (tests/gguf_fixtures.py), so they run — not skip — on a machine without the build.
Tests marked ``llama`` take ``world`` and the real server.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.e2e_support import LARGE, SMALL, GiB, World, sha256_of, write_probe
from tests.gguf_fixtures import pinned_template, require_llama_server, write_standin_llama_server
from tests.hubserver import LocalHub
from tests.polling import wait_until

TIER = "e2e"

REPO = Path(__file__).resolve().parent.parent
STAGES = ["probe", "plan", "fetch-weights", "fetch-template", "verify", "load", "probe-tool-call", "re-check",
          "measure-speed"]
ROOMY_FREE_BYTES = 8 * GiB  # both fixtures fit with their whole 65536-token window
# Pace the model downloads so that a fetch lasts long enough to be interrupted part-way.
THROTTLE_BPS = 64_000


@pytest.fixture(scope="module")
def standin_server(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_standin_llama_server(tmp_path_factory.mktemp("standin") / "llama-server")


@pytest.fixture(autouse=True)
def _clean_hub(hub: LocalHub) -> Any:
    hub.clear_faults()
    hub.reset_counters()
    yield
    hub.clear_faults()


def env_for(hub: LocalHub, server: Path | None = None) -> dict[str, str]:
    """The environment of a hotfit subprocess; ``server`` pins the llama-server it uses."""
    env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_TOKEN", "CONTENOX_LLAMA_KV_CACHE_TYPE")}
    env.update(hub.env())
    if server is not None:
        env["HOTFIT_LLAMA_SERVER"] = str(server)
    return env


# measure-speed's agent prompt for the fixtures: long enough to time, short enough for ~20 runs a test
AGENT_PROMPT_TOKENS = "2048"


def cmd(home: Path, world: World, probe: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", "auto",
            "--registry", str(world.registry_path), "--probe-file", str(probe),
            "--agent-prompt-tokens", AGENT_PROMPT_TOKENS, *args]


def auto(hub: LocalHub, home: Path, world: World, probe: Path, *args: str, timeout: float = 240,
         server: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd(home, world, probe, *args), cwd=REPO, env=env_for(hub, server), capture_output=True,
                          text=True, timeout=timeout)


def auto_json(hub: LocalHub, home: Path, world: World, probe: Path, *args: str,
              server: Path | None = None) -> dict[str, Any]:
    """``hotfit auto --json ARGS`` that must succeed (its stderr tail if not): its JSON answer."""
    done = auto(hub, home, world, probe, "--json", *args, server=server)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def start(hub: LocalHub, home: Path, world: World, probe: Path, *args: str,
          server: Path | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(cmd(home, world, probe, *args), cwd=REPO, env=env_for(hub, server),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def events(home: Path) -> list[dict[str, Any]]:
    """Every line of the JSON log, parsed (a line that does not parse fails the test)."""
    path = home / "logs" / "hotfit.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def log_lines(home: Path) -> int:
    path = home / "logs" / "hotfit.jsonl"
    try:
        return path.read_bytes().count(b"\n")
    except FileNotFoundError:
        return 0


def sidecar_done_bytes(model_dir: Path) -> int:
    """Bytes the download sidecars of ``model_dir`` record as written (0 when none)."""
    done = 0
    for side in (model_dir / ".partial").glob("*.json"):
        try:
            done += int(json.loads(side.read_text()).get("done_bytes", 0))
        except (OSError, ValueError):
            pass
    return done


def stage_story(evs: list[dict[str, Any]], run_id: str) -> list[tuple[str, str]]:
    return [(e["event"], e["stage"]) for e in evs
            if e.get("run_id") == run_id and e["event"] in ("stage.start", "stage.done", "stage.skip")]


@pytest.mark.llama
def test_fresh_home_provisions_a_verified_probed_rechecked_model(hub: LocalHub, world: World,
                                                                  tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    done = auto(hub, home, world, probe, "--json")
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads(done.stdout)  # not auto_json: stderr is checked below
    large = world.entry(LARGE)
    # the automatic pick: both fit, the larger model wins
    assert manifest["entry_name"] == LARGE and manifest["kv_cache_type"] == "f16"
    model = Path(manifest["model_path"])
    assert model.is_file() and sha256_of(model) == large.artifact.sha256 == manifest["model_sha256"]
    assert Path(manifest["template_path"]).read_text() == pinned_template().read_text()
    assert manifest["probe_verdict"]["passed"] is True and manifest["probe_verdict"]["tool"] == "hotfit_probe"
    assert manifest["measured"]["verdict"] == "pass"
    assert manifest["measured"]["opened_context_tokens"] >= manifest["planned_hot_context_tokens"] >= 32768
    assert manifest["measured"]["actual_kv_bytes"] > 0
    assert manifest["backend_build"]["commit"]
    # the KV hint: the type was left unset; part of the output, never a message on stderr (cron)
    assert "CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0 halves what the window costs" in manifest["kv_cache_type_hint"]
    assert "halves what the window costs" not in done.stderr
    assert json.loads((home / "manifest.json").read_text())["run_id"] == manifest["run_id"]

    # the JSON log parses line by line and tells the whole story, every stage event bound
    evs = events(home)
    run_id = manifest["run_id"]
    names = [e["event"] for e in evs]
    assert names[0] == "run.start" and "manifest.written" in names
    story = stage_story(evs, run_id)
    assert story == [(ev, s) for s in STAGES for ev in ("stage.start", "stage.done")]
    for e in evs:
        if e["event"].startswith("stage.") or e["event"] in ("run.start", "run.done"):
            assert e["run_id"] == run_id
    plan_id = manifest["plan_id"]
    after_plan = [e for e in evs if e["event"].startswith("stage.") and e["stage"] not in ("probe", "plan")]
    assert after_plan and all(e["plan_id"] == plan_id for e in after_plan)
    selected = next(e for e in evs if e["event"] == "plan.selected")
    assert selected["model"] == LARGE and selected["kv_cache_type"] == "f16"
    assert any(e["event"] == "download.progress" for e in evs)
    assert next(e for e in evs if e["event"] == "run.done")["status"] == "done"
    # llama-server is resolved once per run: the plan stage's preflight result is what load starts
    found = [e for e in evs if e["event"] == "backend.found" and e.get("run_id") == run_id]
    assert len(found) == 1, found
    load_start = next(e for e in evs if e["event"] == "load.start" and e.get("run_id") == run_id)
    assert load_start["argv"][0] == found[0]["path"]
    # no secret reaches the log or the state: llama-server's API key ends in "-hfk"
    blob = (home / "logs" / "hotfit.jsonl").read_text() + (home / "state.db").read_bytes().decode("latin-1")
    assert "-hfk" not in blob and "Bearer" not in blob

    # a completed, still-valid provisioning: a fast no-op, nothing downloaded again
    hub.reset_counters()
    assert auto_json(hub, home, world, probe)["noop"] is True
    assert hub.bytes_sent() == 0
    assert "run.noop" in [e["event"] for e in events(home)]
    # what cron runs: with -q a no-op prints nothing at all, and the metrics say it was one
    quiet = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "-q", *cmd(home, world, probe)[5:]],
                           cwd=REPO, env=env_for(hub), capture_output=True, text=True, timeout=240)
    assert (quiet.returncode, quiet.stdout, quiet.stderr) == (0, "", "")
    assert f'hotfit_last_run_info{{home="{os.path.realpath(home)}",outcome="noop",error_code="",model="{LARGE}"}} 1' \
        in (home / "metrics" / "hotfit.prom").read_text()

    # --recheck re-opens the session; downloads are reused (stage.skip), not repeated
    hub.reset_counters()
    new_run = auto_json(hub, home, world, probe, "--recheck")["run_id"]
    assert new_run != run_id and hub.bytes_sent() == 0
    assert stage_story(events(home), new_run) == [
        ("stage.start", "probe"), ("stage.done", "probe"), ("stage.start", "plan"), ("stage.done", "plan"),
        ("stage.skip", "fetch-weights"), ("stage.skip", "fetch-template"), ("stage.skip", "verify"),
        ("stage.start", "load"), ("stage.done", "load"), ("stage.start", "probe-tool-call"),
        ("stage.done", "probe-tool-call"), ("stage.start", "re-check"), ("stage.done", "re-check"),
        ("stage.start", "measure-speed"), ("stage.done", "measure-speed"),
    ]

    status = subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "status", "--json"],
                            cwd=REPO, env=env_for(hub), capture_output=True, text=True, timeout=60)
    data = json.loads(status.stdout)
    assert data["run"]["run_id"] == new_run and data["provisioned"]["entry_name"] == LARGE
    assert [s["status"] for s in data["stages"]] == ["done", "done", "skipped", "skipped", "skipped",
                                                     "done", "done", "done", "done"]
    # measure-speed: the fixture's agent-sized prompt and follow-up, timed by llama-server, beside the prediction
    speed = data["provisioned"]["speed"]
    assert speed["measured"]["prompt_tokens"] > 500 and speed["measured"]["first_token_s"] > 0
    assert speed["measured"]["follow_up_first_token_s"] > 0 and speed["predicted"]["prompt_tokens"] == int(AGENT_PROMPT_TOKENS)


def test_dry_run_prints_probe_plan_and_reuse_and_changes_nothing(hub: LocalHub, plain_world: World,
                                                                standin_server: Path, tmp_path: Path) -> None:
    world = plain_world
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    dry = auto(hub, home, world, probe, "--dry-run", "us", server=standin_server)
    assert dry.returncode == 0, dry.stderr[-2000:]
    data = json.loads(dry.stdout)
    assert data["probe"]["devices"][0]["free_bytes"] == ROOMY_FREE_BYTES
    assert data["model"] == LARGE and data["reused"] is False and data["previous_model"] is None
    assert data["plan"]["origin"] == "us" and data["estimated_hot_context_tokens"] >= 32768
    assert not (home / "state.db").exists() and not (home / "manifest.json").exists()
    assert not (home / "models").exists() and hub.bytes_sent() == 0


@pytest.mark.llama
def test_budget_change_keeps_previous_model_while_it_qualifies(hub: LocalHub, world: World,
                                                               tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert auto_json(hub, home, world, write_probe(tmp_path / "roomy.json", ROOMY_FREE_BYTES))["entry_name"] == LARGE

    # less memory, but the large model still holds the floor: kept (a fast no-op)
    tight = write_probe(tmp_path / "tight.json", world.floor_free_bytes(LARGE))
    dry = json.loads(auto(hub, home, world, tight, "--dry-run").stdout)
    assert dry["model"] == LARGE and dry["reused"] is True and dry["previous_model"] == LARGE
    assert auto_json(hub, home, world, tight)["noop"] is True

    # one byte less: the large model no longer qualifies; re-plan to the small one and provision it
    too_tight = write_probe(tmp_path / "too-tight.json", world.floor_free_bytes(LARGE) - 1)
    assert world.floor_free_bytes(SMALL) <= world.floor_free_bytes(LARGE) - 1
    manifest = auto_json(hub, home, world, too_tight)
    assert manifest["entry_name"] == SMALL and manifest["measured"]["verdict"] == "pass"
    assert manifest["planned_hot_context_tokens"] >= 32768
    selected = [e for e in events(home) if e["event"] == "plan.selected"]
    assert selected[-1]["model"] == SMALL and selected[-1]["reused_previous"] is False
    notes = [e["note"] for e in events(home) if e["event"] == "plan.note"]
    assert any(f"previous model {LARGE} no longer qualifies" in n for n in notes)

    # with room again, the small model is kept (a working pick is not swapped for a marginal gain) ...
    roomy = write_probe(tmp_path / "roomy.json", ROOMY_FREE_BYTES)
    assert json.loads(auto(hub, home, world, roomy, "--dry-run").stdout)["model"] == SMALL
    # ... unless --refresh selects afresh
    assert json.loads(auto(hub, home, world, roomy, "--dry-run", "--refresh").stdout)["model"] == LARGE


def test_nothing_qualifies_fails_closed_with_exit_3(hub: LocalHub, plain_world: World, standin_server: Path,
                                                    tmp_path: Path) -> None:
    world = plain_world
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "small.json", world.floor_free_bytes(SMALL) - 1)
    failed = auto(hub, home, world, probe, "--json", server=standin_server)
    assert failed.returncode == 3, failed.stderr[-2000:]
    error = json.loads(failed.stdout)["error"]
    assert error["code"] == "no_model_qualifies"
    message = error["message"]
    # spec: the smallest agentic model, the memory it needs, and the alternatives
    assert SMALL in message and "32768" in message
    assert str(world.floor_free_bytes(SMALL)) in json.dumps(error)
    for alternative in ("raise", "origin", "hosted backend"):
        assert alternative in message + error.get("hint", "")
    assert not (home / "models").exists() and not (home / "manifest.json").exists()
    rejected = [e for e in events(home) if e["event"] == "plan.rejected"]
    assert rejected and rejected[0]["error"]["code"] == "no_model_qualifies"
    assert [e for e in events(home) if e["event"] == "stage.fail"][0]["stage"] == "plan"
    # an origin with no agentic model: same fail-closed exit code
    assert auto(hub, home, world, probe, "gus", server=standin_server).returncode == 3


@pytest.mark.llama
def test_explicit_model_is_provisioned_without_fallback(hub: LocalHub, world: World, tmp_path: Path) -> None:
    home = tmp_path / "home"
    roomy = write_probe(tmp_path / "roomy.json", ROOMY_FREE_BYTES)
    manifest = auto_json(hub, home, world, roomy, "--model", SMALL)
    assert manifest["entry_name"] == SMALL and manifest["plan"]["explicit_model"] is True
    # a named model that cannot open its window fails closed; no other model is fetched
    tight = write_probe(tmp_path / "tight.json", world.floor_free_bytes(LARGE) - 1)
    refused = auto(hub, home, world, tight, "--model", LARGE)
    assert refused.returncode == 3 and LARGE in refused.stderr
    assert not (home / "models" / LARGE).exists()
    unknown = auto(hub, home, world, roomy, "--model", "no-such-model")
    assert unknown.returncode == 2 and "no-such-model" in unknown.stderr


@pytest.mark.llama
def test_two_concurrent_runs_one_waits_or_exits_naming_the_holder(hub: LocalHub, world: World,
                                                                  tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    hub.inject(file="*.gguf", throughput_bps=THROTTLE_BPS, times=None)
    first = start(hub, home, world, probe)
    try:
        wait_until(lambda: (home / "pipeline.lock").exists()
                   and (home / "pipeline.lock").read_text().startswith(f"{first.pid} "), "the first run's lock")
        second = auto(hub, home, world, probe, "--json")
        assert second.returncode == 6
        assert f"PID {first.pid}" in second.stderr
        assert json.loads(second.stdout)["error"]["details"]["holder_pid"] == first.pid
        waiter = start(hub, home, world, probe, "--wait", "--json")
        out, err = first.communicate(timeout=240)
        assert first.returncode == 0, err[-2000:]
        w_out, w_err = waiter.communicate(timeout=240)
        assert waiter.returncode == 0, w_err[-2000:]
        assert json.loads(w_out)["noop"] is True  # it ran after the first and found it provisioned
    finally:
        for p in (first,):
            if p.poll() is None:
                p.kill()
                p.wait()
    size = world.entry(LARGE).artifact.size_bytes
    assert hub.bytes_sent(world.entry(LARGE).artifact.file) <= size + THROTTLE_BPS * 2


def _interrupt_mid_download(hub: LocalHub, home: Path, world: World, probe: Path,
                            server: Path | None) -> dict[str, Any]:
    """Start `hotfit auto`, SIGTERM it while the large fixture's bytes are arriving, check what an
    interrupted run leaves behind, and return `hotfit status --json`."""
    large = world.entry(LARGE)
    slow_bps = 24_000  # about 9 s for the large fixture: SIGTERM lands mid-body
    hub.inject(file="*.gguf", throughput_bps=slow_bps, times=None)
    proc = start(hub, home, world, probe, "--json", server=server)
    # SIGTERM once a checkpoint claims bytes (state, not a sleep: a loaded machine starts late), while
    # most of the body is still to come (at 24 kB/s the rest takes seconds)
    wait_until(lambda: sidecar_done_bytes(home / "models" / LARGE) > 0, "a checkpoint to claim downloaded bytes")
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err[-2000:]
    assert json.loads(out)["error"]["code"] == "interrupted"
    wait_until(hub.idle, "the Hub to log the interrupted run's last response")
    first_bytes = hub.bytes_sent(large.artifact.file)
    assert 0 < first_bytes < large.artifact.size_bytes
    status = json.loads(subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "status", "--json"],
                                       cwd=REPO, capture_output=True, text=True, timeout=60).stdout)
    assert status["run"]["status"] == "interrupted"
    assert {s["stage"]: s["status"] for s in status["stages"]}["fetch-weights"] == "interrupted"
    assert not (home / "models" / LARGE / large.artifact.file).exists()  # never a partial final file
    hub.clear_faults()
    hub.reset_counters()
    return status


def _assert_the_rerun_fetched_only_the_rest(hub: LocalHub, home: Path, world: World) -> None:
    large = world.entry(LARGE)
    assert sha256_of(home / "models" / LARGE / large.artifact.file) == large.artifact.sha256
    assert hub.bytes_sent(large.artifact.file) < large.artifact.size_bytes  # the rest, not the whole file
    fetched = [e for e in events(home) if e["event"] == "stage.done" and e["stage"] == "fetch-weights"]
    assert fetched[-1]["resumed_from_bytes"] > 0


def test_sigterm_mid_download_then_rerun_resumes_the_bytes(hub: LocalHub, plain_world: World,
                                                           standin_server: Path, tmp_path: Path) -> None:
    # No model is served here: the stand-in binary passes the pre-download check and refuses at load.
    world = plain_world
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    status = _interrupt_mid_download(hub, home, world, probe, standin_server)
    resumed = auto(hub, home, world, probe, "--json", server=standin_server)
    assert resumed.returncode == 5, resumed.stderr[-2000:]  # the stand-in cannot serve: load fails
    _assert_the_rerun_fetched_only_the_rest(hub, home, world)
    run_id = status["run"]["run_id"]
    done = {e["stage"] for e in events(home) if e["event"] == "stage.done" and e.get("run_id") == run_id}
    assert {"fetch-weights", "fetch-template", "verify"} <= done  # the same run continued through verify
    failed = [e for e in events(home) if e["event"] == "stage.fail"]
    assert failed and failed[-1]["stage"] == "load" and failed[-1]["run_id"] == run_id


@pytest.mark.llama
def test_sigterm_mid_download_then_rerun_provisions_with_the_real_server(hub: LocalHub, world: World,
                                                                        tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    status = _interrupt_mid_download(hub, home, world, probe, None)
    manifest = auto_json(hub, home, world, probe)
    assert manifest["run_id"] == status["run"]["run_id"]  # the same run continued
    assert Path(manifest["model_path"]) == home / "models" / LARGE / world.entry(LARGE).artifact.file
    _assert_the_rerun_fetched_only_the_rest(hub, home, world)


@pytest.mark.slow
@pytest.mark.llama
def test_kill_9_at_many_points_then_rerun_completes(hub: LocalHub, world: World, tmp_path: Path) -> None:
    """SIGKILL at ≥ 20 distinct points spread over every stage — after the N-th log event of a
    run, or part-way through the (paced) download; each time the next run completes, a completed
    file is never fetched again and no final file is ever corrupt."""
    large = world.entry(LARGE)
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    # one reference run: how many events a whole run writes, and at which one each stage starts
    ref_home = tmp_path / "reference"
    hub.inject(file="*.gguf", throughput_bps=THROTTLE_BPS, times=None)
    assert auto(hub, ref_home, world, probe).returncode == 0
    ref = events(ref_home)
    total = len(ref)
    starts = {e["stage"]: i + 1 for i, e in enumerate(ref) if e["event"] == "stage.start"}
    assert set(starts) == set(STAGES) and total >= 25
    rng = random.Random(6)
    others = sorted(set(range(1, total)) - set(starts.values()))
    after_events = set(starts.values()) | set(rng.sample(others, k=min(9, len(others))))
    fetch_line = next(i + 1 for i, e in enumerate(ref) if e["event"] == "fetch.disk_check")
    # (kill once the log has this many lines, then after this many more seconds)
    points = sorted({(n, 0.0) for n in after_events} | {(fetch_line, d) for d in (0.6, 1.4, 2.4)})
    assert len(points) >= 20
    final = Path("models") / LARGE / large.artifact.file
    stages_hit: set[str] = set()
    resumed_total = 0
    for n, (lines, delay_s) in enumerate(points):
        home = tmp_path / f"kill-{n}"
        hub.clear_faults()
        hub.inject(file="*.gguf", throughput_bps=THROTTLE_BPS, times=None)
        hub.reset_counters()
        proc = start(hub, home, world, probe)
        wait_until(lambda: log_lines(home) >= lines or proc.poll() is not None, f"event {lines}")
        time.sleep(delay_s)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        killed_events = events(home)  # parses: a kill never leaves half a line
        last = next((e["stage"] for e in reversed(killed_events) if e.get("stage")), None)
        if last:
            stages_hit.add(last)
        fetched_before = any(e["event"] == "stage.done" and e.get("stage") == "fetch-weights"
                             for e in killed_events)
        if (home / final).exists():  # a final path never holds a partial or unverified file
            assert sha256_of(home / final) == large.artifact.sha256, (lines, delay_s)
        wait_until(hub.idle, "the Hub to log the killed client's last response")
        checkpointed = sidecar_done_bytes(home / "models" / LARGE)
        hub.clear_faults()
        hub.reset_counters()
        rerun = auto(hub, home, world, probe, "--json")
        assert rerun.returncode == 0, f"kill point {(lines, delay_s)}: {rerun.stderr[-2000:]}"
        manifest = json.loads(rerun.stdout)
        assert manifest["measured"]["verdict"] == "pass" and manifest["probe_verdict"]["passed"]
        assert sha256_of(home / final) == large.artifact.sha256
        again = hub.bytes_sent(large.artifact.file)
        if fetched_before:
            assert again == 0, f"kill point {(lines, delay_s)}: a completed file was fetched again"
        else:
            # the rerun continues from the checkpointed bytes: it never fetches what the sidecar
            # says is on disk (how often the engine checkpoints is the download stage's business)
            assert again <= large.artifact.size_bytes - checkpointed, (lines, delay_s, checkpointed)
            resumed_total += checkpointed
    # every stage's start is a kill point by construction; probe, plan and verify finish within
    # milliseconds, so the kill lands in them only by luck — the stages that take time must all
    # have been hit part-way
    assert stages_hit >= {"fetch-weights", "fetch-template", "load", "probe-tool-call", "re-check"}, stages_hit


@pytest.mark.llama
def test_provision_demo_runs_every_stage_offline(tmp_path: Path) -> None:
    require_llama_server()
    env = {k: v for k, v in os.environ.items() if k not in ("HOTFIT_HOME", "HF_ENDPOINT")}
    env["TMPDIR"] = str(tmp_path)
    done = subprocess.run([str(REPO / "scripts" / "provision-demo")], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    out = done.stdout + done.stderr
    for stage in STAGES:
        assert f"stage={stage}" in out  # the console renderer shows each stage's events
    assert "provisioned: fx-agent-large" in out and "already provisioned (nothing to do)" in out
    assert "llama-server" in out and "-c 65536" in out
    assert list(tmp_path.iterdir()) == []  # the demo cleans up after itself


@pytest.mark.llama
def test_new_kv_type_replans_and_reopens_without_downloading_again(hub: LocalHub, world: World,
                                                                   tmp_path: Path) -> None:
    home = tmp_path / "home"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    f16 = auto_json(hub, home, world, probe)
    hub.reset_counters()
    env = env_for(hub) | {"CONTENOX_LLAMA_KV_CACHE_TYPE": "q8_0"}
    second = subprocess.run(cmd(home, world, probe, "--json"), cwd=REPO, env=env, capture_output=True, text=True,
                            timeout=240)
    assert second.returncode == 0, second.stderr[-2000:]
    q8 = json.loads(second.stdout)
    assert q8["kv_cache_type"] == "q8_0" and q8["plan_id"] != f16["plan_id"]
    assert "kv_cache_type_hint" not in q8  # the type was set: no hint
    assert hub.bytes_sent() == 0  # the weights did not change
    story = dict((s, ev) for ev, s in stage_story(events(home), q8["run_id"]) if ev != "stage.start")
    assert story["fetch-weights"] == "stage.skip" and story["verify"] == "stage.skip"
    assert story["load"] == story["re-check"] == "stage.done"
    # the re-check verified the q8_0 allocation: 34/64 of f16's bytes at the same window
    assert q8["measured"]["actual_kv_bytes"] * 64 == f16["measured"]["actual_kv_bytes"] * 34
    assert q8["measured"]["opened_context_tokens"] == f16["measured"]["opened_context_tokens"]


def test_origin_given_twice_differently_is_a_usage_error(hub: LocalHub, plain_world: World, standin_server: Path,
                                                         tmp_path: Path) -> None:
    world = plain_world
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    clash = auto(hub, tmp_path / "home", world, probe, "us", "--origin", "eu", server=standin_server)
    assert clash.returncode == 2 and "two origins" in clash.stderr
    same = auto(hub, tmp_path / "home", world, probe, "us", "--origin", "us", "--dry-run", server=standin_server)
    assert same.returncode == 0 and json.loads(same.stdout)["plan"]["origin"] == "us"


def test_openvino_dry_run_downloads_nothing(tmp_path: Path) -> None:
    """An OpenVINO pick is planned by a dry run and nothing is fetched (the full OpenVINO pipeline:
    tests/test_auto_openvino_e2e.py)."""
    home = tmp_path / "home"
    env = {**os.environ, "HOTFIT_HOME": str(home), "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "hotfit", "--json", "auto", "--backend", "openvino", "--dry-run"]
    dry = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert dry.returncode in (0, 3), dry.stderr  # planned (or refused by memory), never downloaded
    assert not (home / "models").exists()


# A hotfit run with gguf.GGUFReader made to raise and every bounded header read of a file recorded.
_HEADER_WATCH = """
import os, sys
import gguf, gguf.gguf_reader
def _boom(*a, **k):
    raise AssertionError("gguf.GGUFReader constructed")
gguf.GGUFReader = gguf.gguf_reader.GGUFReader = _boom
import hotfit.stages._gguf_header as h
_read = h.read_gguf_header
def _counted(source, *a, **k):
    if isinstance(source, (str, os.PathLike)):  # (the reader calls itself again on the open file)
        with open(os.environ["HEADER_READS"], "a") as out:
            out.write(str(source) + "\\n")
    return _read(source, *a, **k)
h.read_gguf_header = _counted
from hotfit.pipeline.cli import main
sys.argv[0] = "hotfit"
sys.exit(main())
"""


@pytest.mark.llama
def test_a_run_reads_the_gguf_header_once_and_load_never_opens_a_gguf_reader(
        hub: LocalHub, world: World, tmp_path: Path) -> None:
    home = tmp_path / "home"
    reads = tmp_path / "header-reads.txt"
    probe = write_probe(tmp_path / "probe.json", ROOMY_FREE_BYTES)
    env = {**env_for(hub), "HEADER_READS": str(reads)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-c", _HEADER_WATCH, *cmd(home, world, probe, *args)[3:]]
        return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)

    done = run("--json")
    assert done.returncode == 0, done.stderr[-3000:]
    manifest = json.loads(done.stdout)
    assert manifest["probe_verdict"]["passed"] is True
    lines = reads.read_text().splitlines()
    # once, by verify, on the hashed partial (before it was renamed into place)
    assert len(lines) == 1 and "/.partial/" in lines[0], lines
    load = next(e for e in events(home) if e["event"] == "stage.done" and e.get("stage") == "load")
    assert "chat_template.jinja" in load["template"]
    # --recheck loads again from the recorded verify result: no header read at all
    reads.unlink()
    again = run("--json", "--recheck")
    assert again.returncode == 0, again.stderr[-3000:]
    assert not reads.exists()
