"""Unattended operation (docs/operations.md): every failure in the log with its exit code, the
Prometheus textfile, `status` as an alerting check, `-q`, `--version`, `--json` usage errors."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from hotfit.planner.probe import Device, ProbeResult
from hotfit.pipeline.cli import main
from hotfit.pipeline.manifest import Manifest
from hotfit.core.settings import load_settings
from hotfit.pipeline.metrics import last_run, render, shared_textfile_name
from hotfit.pipeline.status import last_run_failed
from hotfit.state.store import RunRecord
from tests.hubserver import LocalHub
from tests.polling import wait_until
from tests.test_pull_cli import env_for, model  # noqa: F401 - the pull fixture (a pinned model on the local Hub)

TIER = "unit"

REPO = Path(__file__).resolve().parent.parent


def events(home: Path) -> list[dict[str, Any]]:
    path = home / "logs" / "hotfit.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def last_command_event(home: Path) -> dict[str, Any]:
    found = [e for e in events(home) if e["event"] in ("command.done", "command.failed")]
    assert found, "no command event in the log"
    return found[-1]


def promtool_check(text: str, tmp_path: Path) -> None:
    """`promtool check metrics` (Debian's prometheus package) on ``text``: no error, no lint problem."""
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.fail("promtool is missing: install Debian's prometheus package (scripts/bootstrap --test does)")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and not done.stdout.strip() and not done.stderr.strip(), done.stdout + done.stderr


def write_probe(path: Path) -> Path:
    path.write_text(json.dumps(ProbeResult(devices=(Device(index=0, kind="cpu", name="host", total_bytes=64 << 30,
                                                           free_bytes=48 << 30),)).to_json()))
    return path


_HOLDER = textwrap.dedent("""
    import sys, time
    from hotfit.state.locks import FileLock
    with FileLock(sys.argv[1]):
        print("held", flush=True)
        time.sleep(60)
""")


@pytest.fixture
def locked_home(tmp_path: Path) -> Any:
    """A home whose pipeline lock another process holds (as a running `hotfit auto` does)."""
    home = tmp_path / "home"
    home.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(home / "pipeline.lock")], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        yield home, holder.pid
    finally:
        holder.kill()
        holder.wait()


# -- a log that misses no failure --------------------------------------------------------------------


@pytest.mark.parametrize("argv, command", [(["frobnicate"], None), (["auto", "--bogus"], "auto"),
                                           (["auto", "--grade-tier", "huge"], "auto"), (["pull"], "pull")])
def test_a_usage_error_from_argparse_is_logged_with_its_exit_code(argv: list[str], command: str | None,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    home.mkdir()
    assert main(["--home", str(home), *argv]) == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "error:" in err  # what argparse printed before, still printed
    event = last_command_event(home)
    assert event["event"] == "command.failed" and event["exit_code"] == 2 and event["level"] == "error"
    assert event["command"] == command and event["error"]["code"] == "usage"


def test_a_usage_error_does_not_create_a_home(tmp_path: Path) -> None:
    assert main(["--home", str(tmp_path / "typo"), "frobnicate"]) == 2
    assert not (tmp_path / "typo").exists()


def test_json_usage_error_is_json_on_stdout_with_the_exit_code(tmp_path: Path) -> None:
    out = io.StringIO()
    assert main(["--home", str(tmp_path), "auto", "--json", "--grade-tier", "huge"], out=out) == 2
    error = json.loads(out.getvalue())["error"]
    assert error["exit_code"] == 2 and error["code"] == "usage"
    assert "--grade-tier" in error["message"] and "hotfit auto --help" in error["hint"]


def test_a_bad_environment_variable_is_logged_in_an_existing_home(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTFIT_DOWNLOAD_CONNECTIONS", "many")
    home = tmp_path / "home"
    home.mkdir()
    assert main(["--home", str(home), "status"]) == 2
    event = last_command_event(home)
    assert event["exit_code"] == 2 and "HOTFIT_DOWNLOAD_CONNECTIONS" in event["error"]["message"]


@pytest.mark.integration
def test_a_locked_home_is_logged_with_exit_6_and_fails_the_metrics(locked_home: Any, tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    home, holder_pid = locked_home
    textfile_dir = tmp_path / "node-exporter"
    textfile_dir.mkdir()
    monkeypatch.setenv("HOTFIT_TEXTFILE_DIR", str(textfile_dir))
    out = io.StringIO()
    rc = main(["--home", str(home), "--log-format", "json", "--json", "auto", "--probe-file",
               str(write_probe(tmp_path / "probe.json"))], out=out)
    assert rc == 6
    assert json.loads(out.getvalue())["error"]["code"] == "locked"
    event = last_command_event(home)
    assert event["event"] == "command.failed" and event["command"] == "auto" and event["exit_code"] == 6
    assert str(holder_pid) in event["error"]["message"]

    prom = (home / "metrics" / "hotfit.prom").read_text()
    copies = list(textfile_dir.iterdir())  # node_exporter's copy, under this home's name; no temp file left
    assert [p.name for p in copies] == [shared_textfile_name(load_settings(home=home))]
    assert copies[0].read_text() == prom
    at = f'home="{os.path.realpath(home)}"'
    assert f"hotfit_last_run_exit_code{{{at}}} 6\n" in prom and f"hotfit_last_run_success{{{at}}} 0\n" in prom
    assert f'hotfit_last_run_info{{{at},outcome="failed",error_code="locked",model=""}} 1' in prom
    assert f"hotfit_provisioned{{{at}}} 0\n" in prom
    promtool_check(prom, tmp_path)

    # status: the alerting check's answer is 10 while the last auto failed
    out = io.StringIO()
    assert main(["--home", str(home), "--json", "status"], out=out) == 10
    data = json.loads(out.getvalue())
    assert data["last_auto_failed"] is True and data["last_auto"]["exit_code"] == 6
    assert data["last_auto"]["error"]["code"] == "locked"


def _refused_auto(home: Path, tmp_path: Path) -> int:
    """A quick real `hotfit auto` that ends with a refusal (exit 3: a 1 GiB host holds no agentic model)."""
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps(ProbeResult(devices=(Device(index=0, kind="cpu", name="host", total_bytes=1 << 30,
                                                           free_bytes=1 << 29),)).to_json()))
    return main(["--home", str(home), "--log-format", "json", "-q", "auto", "--probe-file", str(tiny)],
                out=io.StringIO())


def scrape_node_exporter(textfile_dir: Path, tmp_path: Path) -> str:
    """What node_exporter's textfile collector (Debian's prometheus-node-exporter) serves from ``textfile_dir``."""
    exporter = shutil.which("prometheus-node-exporter")
    if exporter is None:
        pytest.fail("prometheus-node-exporter is missing: install Debian's package (scripts/bootstrap --test does)")
    with socket.socket() as probe:  # a free loopback port
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path / "node-exporter.log").open("w")
    server = subprocess.Popen([exporter, "--collector.disable-defaults", "--collector.textfile",
                               f"--collector.textfile.directory={textfile_dir}",
                               f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
    scraped: list[str] = []

    def answers() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                scraped.append(answer.read().decode())
                return True
        except OSError:
            return False

    try:
        wait_until(answers, "node_exporter to answer on its port", timeout_s=30, proc=server)
        return scraped[0]
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def served_samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], str]:
    """Samples of a scrape as (name, label set) -> value (the label values here hold no quote or comma)."""
    found: dict[tuple[str, frozenset[tuple[str, str]]], str] = {}
    for line in text.splitlines():
        sample = re.fullmatch(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)", line)
        if sample:
            labels = frozenset(re.findall(r'([a-zA-Z_][a-zA-Z0-9_]*)="([^"]*)"', sample.group(2) or ""))
            found[(sample.group(1), labels)] = sample.group(3)
    return found


@pytest.mark.integration  # node_exporter and promtool run
def test_two_homes_sharing_a_textfile_dir_are_told_apart(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two homes, one HOTFIT_TEXTFILE_DIR: two files, two label sets, both served by node_exporter."""
    textfile_dir = tmp_path / "node-exporter"
    textfile_dir.mkdir()
    monkeypatch.setenv("HOTFIT_TEXTFILE_DIR", str(textfile_dir))
    homes = [tmp_path / "a" / "hotfit", tmp_path / "b" / "hotfit"]
    assert [_refused_auto(home, tmp_path) for home in homes] == [3, 3]
    files = sorted(p.name for p in textfile_dir.iterdir())
    assert len(files) == 2 and all(name.startswith("hotfit-") and name.endswith(".prom") for name in files)
    for path in textfile_dir.iterdir():
        promtool_check(path.read_text(), tmp_path)
    served = served_samples(scrape_node_exporter(textfile_dir, tmp_path))
    assert served[("node_textfile_scrape_error", frozenset())] == "0"
    for home in homes:
        at = ("home", os.path.realpath(home))
        assert served[("hotfit_last_run_exit_code", frozenset({at}))] == "3"
        info = {at, ("outcome", "failed"), ("error_code", "no_model_qualifies"), ("model", "")}
        assert served[("hotfit_last_run_info", frozenset(info))] == "1"


def test_a_mistyped_textfile_dir_is_not_created_and_is_reported(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "node-exporter").mkdir()
    typo = tmp_path / "node-exportr"
    monkeypatch.setenv("HOTFIT_TEXTFILE_DIR", str(typo))
    home = tmp_path / "home"
    assert _refused_auto(home, tmp_path) == 3  # the run's own exit code is kept
    assert not typo.exists()
    warned = [e for e in events(home) if e["event"] == "metrics.unwritable"]
    assert len(warned) == 1 and warned[0]["path"].startswith(str(typo))
    assert f"HOTFIT_TEXTFILE_DIR={typo} does not exist" in warned[0]["error"]
    assert "metrics.unwritable" in capsys.readouterr().err  # on the operator's screen too, even with -q
    assert (home / "metrics" / "hotfit.prom").exists()  # the home's own copy is written


def test_a_dry_run_writes_no_metrics(tmp_path: Path) -> None:
    home = tmp_path / "home"
    main(["--home", str(home), "--json", "auto", "--dry-run", "--probe-file", str(write_probe(tmp_path / "p.json"))],
         out=io.StringIO())
    assert not (home / "metrics").exists()
    assert last_command_event(home)["command"] == "auto"


def test_a_serve_failure_is_logged_with_its_exit_code(tmp_path: Path) -> None:
    home = tmp_path / "home"
    assert main(["--home", str(home), "serve"]) == 2  # nothing provisioned
    event = last_command_event(home)
    assert event["event"] == "command.failed" and event["command"] == "serve" and event["exit_code"] == 2
    assert "nothing is provisioned" in event["error"]["message"]


def test_a_refusal_returned_as_an_exit_code_is_logged(tmp_path: Path) -> None:
    home = tmp_path / "home"
    tiny = tmp_path / "tiny.json"
    tiny.write_text(json.dumps(ProbeResult(devices=(Device(index=0, kind="cpu", name="host", total_bytes=1 << 30,
                                                           free_bytes=1 << 29),)).to_json()))
    assert main(["--home", str(home), "plan", "--probe-file", str(tiny)], out=io.StringIO()) == 3
    event = last_command_event(home)
    assert event["event"] == "command.failed" and event["exit_code"] == 3 and event["command"] == "plan"


def test_success_is_logged_once_and_kept_off_the_stream(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    home = tmp_path / "home"
    assert main(["--home", str(home), "--log-format", "json", "status"], out=io.StringIO()) == 0
    assert "command.done" not in capsys.readouterr().err
    done = [e for e in events(home) if e["event"].startswith("command.")]
    assert [(e["event"], e["command"], e["exit_code"]) for e in done] == [("command.done", "status", 0)]


# -- metrics --------------------------------------------------------------------------------------------


def _manifest(**grade: Any) -> Manifest:
    return Manifest(
        run_id="r1", plan_id="p1", written_at="2026-11-29T00:00:00Z", entry_name='qwen"3', model_path="/m.gguf",
        model_size_bytes=10, model_sha256=None, template_path=None, projector_path=None, kv_cache_type="q8_0",
        planned_hot_context_tokens=40000,
        measured={"opened_context_tokens": 40192, "estimated_kv_bytes": 2_000_000, "actual_kv_bytes": 1_900_000},
        probe_verdict={"passed": True}, backend_build={}, device={"kind": "cuda"},
        plan={"speed_predicted": {"prompt_tokens": 16384, "prefill_tokens_per_s": 812.5, "decode_tokens_per_s": 41.25,
                                  "first_token_s": 20.17, "basis": {}}},
        speed={"measured": {"prompt_tokens": 16000, "prefill_tokens_per_s": 800.0, "decode_tokens_per_s": 40.0,
                            "first_token_s": 20.0, "follow_up_first_token_s": 2.5}, "ratio": {"decode_tokens_per_s": 1.031}},
        grade=grade or None)


@pytest.mark.integration
def test_a_provisioning_run_renders_every_figure_and_passes_promtool(tmp_path: Path) -> None:
    seen: list[dict[str, object]] = [
        {"event": "run.start", "run_id": "r9"},
        {"event": "stage.done", "stage": "probe", "duration_s": 0.1, "run_id": "r9"},
        {"event": "stage.done", "stage": "plan", "duration_s": 0.2, "model": 'qwen"3', "run_id": "r9"},
        {"event": "fetch.done", "bytes_transferred": 1000, "stage": "fetch-weights"},
        {"event": "fetch.done", "bytes_transferred": 24, "stage": "fetch-weights"},
        {"event": "stage.done", "stage": "fetch-weights", "duration_s": 3.5, "bytes_transferred": 1000},
        {"event": "stage.skip", "stage": "fetch-template"},
        {"event": "stage.done", "stage": "re-check", "duration_s": 1.25},
        {"event": "manifest.written", "model": 'qwen"3'},
    ]
    run = last_run(0, None, seen, started_at=1000.0, finished_at=1010.5)
    assert run.outcome == "provisioned" and run.run_id == "r9" and run.downloaded_bytes == 1024
    text = render(run, _manifest(verdict="pass", tier="full", fraction=0.9375, passed=15, total=16))
    for line in ("hotfit_last_run_success 1", "hotfit_last_run_exit_code 0", "hotfit_last_run_timestamp_seconds 1010.5",
                 "hotfit_last_run_duration_seconds 10.5", "hotfit_last_run_downloaded_bytes 1024",
                 'hotfit_last_run_stage_duration_seconds{stage="fetch-weights"} 3.5',
                 'hotfit_last_run_stage_duration_seconds{stage="fetch-template"} 0.0',
                 'hotfit_last_run_info{outcome="provisioned",error_code="",model="qwen\\"3"} 1',
                 'hotfit_provisioned_info{model="qwen\\"3",backend="llama",kv_cache_type="q8_0",device_kind="cuda"} 1',
                 "hotfit_provisioned_planned_context_tokens 40000", "hotfit_provisioned_opened_context_tokens 40192",
                 "hotfit_provisioned_kv_estimated_bytes 2000000", "hotfit_provisioned_kv_actual_bytes 1900000",
                 'hotfit_grade_info{verdict="pass",tier="full"} 1', "hotfit_grade_score_ratio 0.9375",
                 'hotfit_provisioned_speed_predicted{figure="prefill_tokens_per_s",prompt_tokens="16384"} 812.5',
                 'hotfit_provisioned_speed_predicted{figure="decode_tokens_per_s",prompt_tokens="16384"} 41.25',
                 'hotfit_provisioned_speed_predicted{figure="first_token_s",prompt_tokens="16384"} 20.17',
                 'hotfit_provisioned_speed_measured{figure="follow_up_first_token_s",prompt_tokens="16000"} 2.5',
                 'hotfit_provisioned_speed_ratio{figure="decode_tokens_per_s"} 1.031',
                 "hotfit_grade_passed_scenarios 15", "hotfit_grade_scenarios 16"):
        assert line + "\n" in text, line
    promtool_check(text, tmp_path)


def test_a_noop_and_an_interrupted_run_are_told_apart() -> None:
    noop = last_run(0, None, [{"event": "run.noop", "model": "m"}], started_at=1.0, finished_at=2.0)
    assert (noop.outcome, noop.model, noop.downloaded_bytes) == ("noop", "m", 0)
    stopped = last_run(130, {"code": "interrupted"}, [], started_at=1.0, finished_at=2.0)
    assert stopped.outcome == "interrupted"
    text = render(noop, None)
    assert "hotfit_provisioned 0\n" in text and "hotfit_grade" not in text and "stage_duration" not in text


def test_status_fails_on_a_run_killed_after_the_last_recorded_one() -> None:
    ok = {"exit_code": 0, "finished_at": 100.0}
    killed = RunRecord(run_id="r", seq=1, status="running", started_at=200.0, finished_at=None, plan_id=None,
                       args={}, error=None)
    older = RunRecord(run_id="r", seq=1, status="failed", started_at=50.0, finished_at=60.0, plan_id=None,
                      args={}, error=None)
    assert last_run_failed(ok, killed, "interrupted") is True
    assert last_run_failed(ok, older, "failed") is False  # a later auto (a no-op) succeeded
    assert last_run_failed({"exit_code": 4, "finished_at": 100.0}, None, None) is True
    assert last_run_failed(None, None, None) is False


# -- cron etiquette --------------------------------------------------------------------------------------


@pytest.mark.integration
def test_version() -> None:
    done = subprocess.run([sys.executable, "-m", "hotfit", "--version"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and done.stdout.startswith("hotfit ") and done.stdout.split()[1][0].isdigit()


@pytest.mark.integration
def test_quiet_pull_prints_nothing_on_success_and_the_error_on_failure(local_hub: LocalHub,
                                                                      model: dict[str, Any]) -> None:  # noqa: F811
    base = [sys.executable, "-m", "hotfit", "--home", str(model["home"]), "-q", "pull"]
    for _ in range(2):  # the download, then the already-present rerun cron would make
        done = subprocess.run([*base, "test-model", "--registry", str(model["registry"])], env=env_for(local_hub),
                              cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stdout == "" and done.stderr == "", done.stderr[-2000:]
    done = subprocess.run([*base, "test-modle", "--registry", str(model["registry"])], env=env_for(local_hub),
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "test-modle" in done.stderr
    assert [e["event"] for e in events(model["home"]) if e["event"].startswith("command.")] == [
        "command.done", "command.done", "command.failed"]


def test_the_log_rotates_by_size_and_keeps_k_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTFIT_LOG_MAX_BYTES", "4096")
    monkeypatch.setenv("HOTFIT_LOG_KEEP", "2")
    home = tmp_path / "home"
    for _ in range(120):  # about 130 bytes each: three rotations' worth
        main(["--home", str(home), "--json", "status"], out=io.StringIO())
    logs = sorted(p.name for p in (home / "logs").iterdir() if not p.name.startswith("."))
    assert logs == ["hotfit.jsonl", "hotfit.jsonl.1", "hotfit.jsonl.2"]
    assert all((home / "logs" / name).stat().st_size < 4096 + 2048 for name in logs)
    assert last_command_event(home)["event"] == "command.done"  # the live file has the newest events


@pytest.mark.anyio
async def test_a_provisioning_run_prunes_old_runs_and_their_directories(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from hotfit.core.settings import load_settings
    from hotfit.pipeline.auto import prune_runs
    from hotfit.state.store import StateStore

    monkeypatch.setenv("HOTFIT_KEEP_RUNS", "3")
    settings = load_settings(home=tmp_path / "home")
    store = await StateStore.open(settings.state_db)
    ids = []
    for _ in range(6):
        run = await store.create_run(["probe"])
        await store.finish_run(run.run_id, "failed")
        (settings.runs_dir / run.run_id).mkdir(parents=True)
        ids.append(run.run_id)
    try:
        assert await prune_runs(store, settings, protect=(ids[0],)) == ids[1:3]
    finally:
        await store.aclose()
    assert sorted(p.name for p in settings.runs_dir.iterdir()) == sorted([ids[0], *ids[3:]])


@pytest.mark.integration
def test_serve_whose_exec_fails_is_exit_5_in_the_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.e2e_support import write_probe as write_host_probe
    from tests.gguf_fixtures import write_standin_llama_server

    server = write_standin_llama_server(tmp_path / "llama-server")
    monkeypatch.setenv("HOTFIT_LLAMA_SERVER", str(server))
    home = _provisioned_home(tmp_path)

    def gone(*_args: Any) -> None:
        raise FileNotFoundError(2, "No such file or directory")

    monkeypatch.setattr(os, "execve", gone)
    code = main(["--home", str(home), "--log-format", "json", "serve", "--probe-file",
                 str(write_host_probe(tmp_path / "p.json", 8 << 30))], out=io.StringIO())
    assert code == 5
    event = last_command_event(home)
    assert event["command"] == "serve" and event["exit_code"] == 5 and event["error"]["code"] == "load"
    assert str(server) in event["error"]["message"]
    assert "serve.exec" in [e["event"] for e in events(home)]


def _provisioned_home(tmp_path: Path) -> Path:
    """A home as `hotfit auto` leaves it (tests/test_serve.py's fixture, built here per test)."""
    from tests.e2e_support import write_provisioned_home
    from tests.gguf_fixtures import tool_template_text
    from tests.test_serve import probe_with

    return write_provisioned_home(tmp_path / "home", probe_with(8 << 30), template_text=tool_template_text()).home


def test_quiet_keeps_what_was_asked_for(tmp_path: Path) -> None:
    """-q silences the report of an action, not a query's answer (scripts/provision-demo reads the dry run)."""
    probe = str(write_probe(tmp_path / "p.json"))
    for argv in (["auto", "--dry-run", "--probe-file", probe], ["plan", "--probe-file", probe], ["status"]):
        out = io.StringIO()
        assert main(["--home", str(tmp_path / "home"), "-q", *argv], out=out) == 0
        assert out.getvalue().strip(), argv
    out = io.StringIO()
    main(["--home", str(tmp_path / "home"), "-q", "auto", "--dry-run", "--probe-file", probe], out=out)
    assert json.loads(out.getvalue())["dry_run"] is True
