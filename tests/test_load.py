"""stages.load: the command line leaves nothing the plan depends on to llama.cpp's defaults, the
child really starts with it, failures quote the log, and the process never outlives the stage.

Tests marked ``llama`` start the real pinned llama-server on tiny GGUF fixtures (well under a
second each)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import anyio
import httpx
import pytest

from pipeline.errors import LoadError
from pipeline.plan import BudgetBreakdown, Device, Plan, ProbeResult
from registry.kv import KV_CACHE_TYPES, kv_bytes, layer_profile
from registry.model import Entry, LayerGroup, SourceConfig
from stages.load import (
    API_KEY_ENV,
    LLAMA_UBATCH_TOKENS,
    LogLine,
    ServerFeatures,
    device_env,
    diagnose_load_failure,
    llama_server_argv,
    new_api_key,
    open_server,
    parse_log_lines,
    parse_server_features,
    relevant_log_lines,
    server_env,
    template_used,
)
from tests.gguf_fixtures import (
    FixtureInfo,
    require_llama_server,
    write_garbage_file,
    write_llama_model,
    write_truncated_copy,
    write_unsupported_arch_model,
)

REPO = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------- plan helpers (shared by
# tests/test_probe_tool_call.py and tests/test_recheck.py)


def fixture_entry(info: FixtureInfo) -> Entry:
    """A registry entry describing a fixture the way the registry describes a real model."""
    if info.sliding_window_tokens:
        groups: tuple[LayerGroup, ...] = (
            LayerGroup(info.n_full_layers, info.n_kv_heads, info.head_dim_k, info.head_dim_v),
            LayerGroup(info.n_swa_layers, info.n_kv_heads, info.head_dim_k, info.head_dim_v, info.sliding_window_tokens),
        )
    else:
        groups = (LayerGroup(info.n_layers, info.n_kv_heads, info.head_dim_k, info.head_dim_v),)
    return Entry(
        name=f"fixture-{info.kind}",
        display_name=info.path.name,
        backend="llama",
        origin="us",
        license="MIT",
        params_total_b=0.001,
        params_active_b=None,
        release_date=None,
        architecture=info.architecture,
        agentic_tier="agentic",
        evidence=(),
        auto_eligible=True,
        ineligible_reason=None,
        artifact=None,
        projector=None,
        chat_template=None,
        config=SourceConfig(n_layers=info.n_layers, layer_groups=groups, source="tests/gguf_fixtures.py"),
        context_limit=info.n_ctx_train,
    )


def estimate_kv_bytes(info: FixtureInfo, tokens: int, kv_type: str) -> int:
    profile = layer_profile(fixture_entry(info))
    assert not hasattr(profile, "reason"), profile
    return kv_bytes(profile, tokens, KV_CACHE_TYPES[kv_type])


def fixture_plan(
    info: FixtureInfo,
    tokens: int,
    kv_type: str = "f16",
    *,
    device_kind: str = "cpu",
    estimated_kv_bytes: int | None = None,
) -> Plan:
    """A plan for ``info`` as the planner would make it (estimate from registry.kv)."""
    estimate = estimate_kv_bytes(info, tokens, kv_type) if estimated_kv_bytes is None else estimated_kv_bytes
    device = Device(index=0, kind=device_kind, name="test device", total_bytes=16 << 30, free_bytes=12 << 30)  # type: ignore[arg-type]
    budget = BudgetBreakdown(
        free_bytes=12 << 30, reserve_bytes=0, headroom_bytes=0, usable_bytes=12 << 30,
        weights_bytes=info.size_bytes, allowance_bytes=256 << 20, kv_budget_bytes=estimate,
        hot_context_tokens=tokens,
    )  # fmt: skip
    return Plan(
        entry=fixture_entry(info),
        probe=ProbeResult(devices=(device,), selected=0),
        kv_cache_type=kv_type,
        kv_cache_type_source="flag",
        hot_context_tokens=tokens,
        estimated_kv_bytes=estimate,
        budget=budget,
        origin=None,
    )


def process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (absent, or a zombie nobody reaped yet)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")


def children_of(pid: int) -> list[int]:
    """Live child processes of ``pid`` (from /proc; no psutil)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(entry.name))
    return out


def wait_gone(pid: int, timeout_s: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process_gone(pid):
            return True
        time.sleep(0.05)
    return process_gone(pid)


FULL_FEATURES = ServerFeatures(
    log_jsonl=True, fit=True, ngl_all=True, api_key_env=True, api_key_file=True, cache_ram=True,
    offline=True, verbosity=True, flash_attn_values=True,
)  # fmt: skip


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory: pytest.TempPathFactory) -> FixtureInfo:
    return write_llama_model(tmp_path_factory.mktemp("models") / "llama.gguf", n_ctx_train=65536)


def _flag(argv: list[str], name: str) -> str:
    assert argv.count(name) == 1, f"{name} must appear exactly once in {argv}"
    return argv[argv.index(name) + 1]


# ---------------------------------------------------------------- pure core


def test_argv_passes_every_plan_parameter(llama_model: FixtureInfo, tmp_path: Path) -> None:
    plan = fixture_plan(llama_model, 40960, "f16")
    tpl = tmp_path / "chat_template.jinja"
    argv = llama_server_argv(plan, llama_model.path, tpl, 4321, binary=Path("/bin/llama-server"), features=FULL_FEATURES)
    assert argv[0] == "/bin/llama-server"
    assert _flag(argv, "-m") == str(llama_model.path)
    assert "--jinja" in argv
    assert _flag(argv, "--chat-template-file") == str(tpl)
    assert _flag(argv, "-c") == "40960"
    assert _flag(argv, "-ctk") == "f16" and _flag(argv, "-ctv") == "f16"
    assert _flag(argv, "-np") == "1"
    assert _flag(argv, "--fit") == "off"
    assert _flag(argv, "--host") == "127.0.0.1"
    assert _flag(argv, "--port") == "4321"
    assert _flag(argv, "-ub") == str(LLAMA_UBATCH_TOKENS)
    assert _flag(argv, "-ngl") == "0" and _flag(argv, "-dev") == "none"  # CPU plan
    assert "--log-jsonl" in argv
    assert _flag(argv, "-lv") == "4"  # libllama's KV records are printed at trace level
    assert not any("key" in a.lower() for a in argv)  # the API key travels in the environment


def test_argv_flash_attention_follows_v_cache_type(llama_model: FixtureInfo) -> None:
    def fa(kv: str) -> str:
        plan = fixture_plan(llama_model, 32768, kv)
        return _flag(llama_server_argv(plan, llama_model.path, None, 1, binary=Path("x"), features=FULL_FEATURES), "-fa")

    assert fa("q8_0") == "on"  # a quantized V cache needs flash attention
    assert fa("q4_0") == "on"
    assert fa("f16") == "auto"


def test_argv_accelerator_plan_offloads_every_layer(llama_model: FixtureInfo) -> None:
    plan = fixture_plan(llama_model, 32768, device_kind="nvidia")
    argv = llama_server_argv(plan, llama_model.path, None, 1, binary=Path("x"), features=FULL_FEATURES)
    assert _flag(argv, "-ngl") == "all"
    assert "-dev" not in argv
    assert "--chat-template-file" not in argv
    old = FULL_FEATURES.__class__(**{**FULL_FEATURES.__dict__, "ngl_all": False, "log_jsonl": False})
    argv_old = llama_server_argv(plan, llama_model.path, None, 1, binary=Path("x"), features=old)
    assert _flag(argv_old, "-ngl") == "999"
    assert "--log-jsonl" not in argv_old


def test_server_env_strips_llama_arg_overrides_and_carries_the_key() -> None:
    base = {"PATH": "/bin", "LLAMA_ARG_CTX_SIZE": "4096", "LLAMA_ARG_FIT": "on", "LLAMA_API_KEY": "stale"}
    key = new_api_key()
    env = server_env(key, base)
    assert env == {"PATH": "/bin", API_KEY_ENV: key}
    assert new_api_key() != key and len(key) > 40


def test_device_env_pins_an_nvidia_card_by_uuid(llama_model: FixtureInfo) -> None:
    import dataclasses

    plan = fixture_plan(llama_model, 32768, device_kind="nvidia")
    if not any(f.name == "uuid" for f in dataclasses.fields(plan.probe.device)):
        assert device_env(plan) == {}
        return
    dev = dataclasses.replace(plan.probe.device, uuid="GPU-1234")  # type: ignore[call-arg]
    pinned = dataclasses.replace(plan, probe=ProbeResult(devices=(dev,), selected=0))
    assert device_env(pinned) == {"CUDA_VISIBLE_DEVICES": "GPU-1234"}
    cpu = fixture_plan(llama_model, 32768)
    assert device_env(cpu) == {}


def test_parse_log_lines_reads_jsonl_and_plain_text() -> None:
    text = "\n".join(
        [
            '{"type":"log","time":1,"level":"error","msg":"llama_model_load: error loading model: x\\n\\n"}',
            '{"type":"fit_memory_breakdown","data":[]}',
            "warning: no usable GPU found",
            "",
        ]
    )
    lines = parse_log_lines(text)
    assert lines[0] == LogLine("error", "llama_model_load: error loading model: x")
    assert lines[1].level == "fit_memory_breakdown"
    assert lines[2] == LogLine("", "warning: no usable GPU found")
    assert len(lines) == 3


def test_diagnosis_names_the_cause() -> None:
    def cause(msg: str) -> str:
        return diagnose_load_failure([LogLine("info", "loading"), LogLine("error", msg)])[0]

    assert cause("llama_model_load: error loading model: unknown model architecture: 'xyz'") == "unsupported_architecture"
    assert cause("ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9000 MiB on device 0: cudaMalloc failed: out of memory") == "out_of_memory"
    assert cause("gguf_init_from_file_impl: failed to read magic") == "bad_model_file"
    assert cause("something else entirely") == "unknown"
    # the errors are quoted, the noise is not
    quoted = relevant_log_lines([LogLine("info", "a"), LogLine("error", "boom"), LogLine("warn", "careful")])
    assert quoted == ["boom", "careful"]


def test_template_used_names_the_source(tmp_path: Path) -> None:
    assert template_used(tmp_path / "t.jinja", True).describe() == str(tmp_path / "t.jinja")
    assert "embedded" in template_used(None, True).describe()
    assert "ChatML fallback" in template_used(None, False).describe()
    assert template_used(None, None).kind == "unknown"  # unreadable header: say so, do not guess


# ---------------------------------------------------------------- real llama-server


@pytest.mark.llama
@pytest.mark.anyio
async def test_the_started_server_runs_pinned_to_the_planned_nvidia_card(
    llama_model: FixtureInfo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the child really got (its /proc environ), not what we meant to pass: the uuid of the
    planned card, whatever CUDA_VISIBLE_DEVICES hotfit itself ran under. (On this CPU-only build
    the nvidia plan's -ngl all offloads nothing; the pin is the point.)"""
    import dataclasses

    from stages.load import child_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    plan = fixture_plan(llama_model, 32768, device_kind="nvidia")
    dev = dataclasses.replace(plan.probe.device, uuid="GPU-5e1f-pinned")
    plan = dataclasses.replace(plan, probe=ProbeResult(devices=(dev,), selected=0))
    async with open_server(plan, llama_model.path, binary=require_llama_server(), run_dir=tmp_path / "run",
                           threads=1, warmup=False) as srv:
        raw = Path(f"/proc/{srv.pid}/environ").read_bytes().split(b"\0")
        environ = dict(item.decode().split("=", 1) for item in raw if b"=" in item)
    assert environ["CUDA_VISIBLE_DEVICES"] == "GPU-5e1f-pinned"
    assert child_env(plan, None, {}) == {"CUDA_VISIBLE_DEVICES": "GPU-5e1f-pinned"}  # what serve prints


@pytest.mark.llama
def test_help_of_the_pinned_build_has_every_flag_we_rely_on() -> None:
    help_text = subprocess.run([str(require_llama_server()), "--help"], capture_output=True, text=True).stdout
    f = parse_server_features(help_text)
    assert f == FULL_FEATURES


@pytest.mark.llama
@pytest.mark.anyio
async def test_opens_the_planned_window_with_a_key_that_is_nowhere_on_disk(
    llama_model: FixtureInfo, tmp_path: Path
) -> None:
    binary = require_llama_server()
    plan = fixture_plan(llama_model, 40960, "q8_0")
    async with open_server(plan, llama_model.path, binary=binary, run_dir=tmp_path / "run", threads=1, warmup=False) as srv:
        pid = srv.pid
        async with srv.client(10) as client:
            slots = (await client.get("/slots")).json()
            assert [s["n_ctx"] for s in slots] == [40960]
        async with httpx.AsyncClient(base_url=srv.base_url, trust_env=False) as anon:
            assert (await anon.get("/health")).status_code == 200  # public
            assert (await anon.get("/slots")).status_code == 401  # the random key is enforced
        key = srv.auth_headers["Authorization"].removeprefix("Bearer ")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert key not in cmdline
        assert "--fit\x00off" in cmdline and "-np\x001" in cmdline
        assert key not in repr(srv) and key not in str(srv.to_json())
    assert process_gone(pid)
    for f in (tmp_path / "run").iterdir():
        assert key not in f.read_text(errors="replace"), f"API key leaked into {f}"
    assert (tmp_path / "run" / "llama-server.jsonl").stat().st_size > 0


@pytest.mark.llama
@pytest.mark.anyio
async def test_unsupported_architecture_is_a_load_error_quoting_the_log(tmp_path: Path) -> None:
    info = write_unsupported_arch_model(tmp_path / "alien.gguf")
    plan = fixture_plan(write_llama_model(tmp_path / "shape.gguf"), 32768)
    with pytest.raises(LoadError) as caught:
        async with open_server(plan, info.path, binary=require_llama_server(), run_dir=tmp_path / "run", threads=1):
            pytest.fail("an unknown architecture must not load")
    err = caught.value
    assert err.details["cause"] == "unsupported_architecture"
    assert "unknown model architecture" in str(err)
    assert info.architecture in str(err)
    assert "architecture" in (err.hint or "")
    assert err.details["returncode"] not in (None, 0)
    assert children_of(os.getpid()) == []


@pytest.mark.llama
@pytest.mark.anyio
@pytest.mark.parametrize("broken", ["truncated", "garbage"])
async def test_broken_file_is_a_load_error(llama_model: FixtureInfo, tmp_path: Path, broken: str) -> None:
    bad = tmp_path / "bad.gguf"
    if broken == "truncated":
        write_truncated_copy(llama_model.path, bad)
    else:
        write_garbage_file(bad, gguf_magic=True)
    with pytest.raises(LoadError) as caught:
        async with open_server(
            fixture_plan(llama_model, 32768), bad, binary=require_llama_server(), run_dir=tmp_path / "run", threads=1
        ):
            pytest.fail("a broken file must not load")
    assert caught.value.details["cause"] == "bad_model_file"
    assert caught.value.details["log_lines"], "the error must quote the server's log"
    assert children_of(os.getpid()) == []


@pytest.mark.llama
@pytest.mark.anyio
async def test_memory_cap_is_an_out_of_memory_load_error(tmp_path: Path) -> None:
    """A 4 GiB KV cache under a 1 GB address-space cap (RLIMIT_AS): the allocation really fails."""
    capped = tmp_path / "llama-server-capped"
    capped.write_text(f'#!/bin/sh\nulimit -v 1000000\nexec {require_llama_server()} "$@"\n')
    capped.chmod(0o755)
    info = write_llama_model(tmp_path / "wide.gguf", n_layers=4, n_heads=8, n_kv_heads=8, head_dim=128, n_ctx_train=262144)
    plan = fixture_plan(info, 262144, "f16")
    assert plan.estimated_kv_bytes == 4 << 30
    with pytest.raises(LoadError) as caught:
        async with open_server(plan, info.path, binary=capped, run_dir=tmp_path / "run", threads=1, warmup=False):
            pytest.fail("a KV cache larger than the cap must not load")
    err = caught.value
    assert err.details["cause"] == "out_of_memory"
    assert any("failed to allocate buffer for kv cache" in line for line in err.details["log_lines"])
    assert "memory" in (err.hint or "")
    assert children_of(os.getpid()) == []


@pytest.mark.llama
@pytest.mark.anyio
async def test_not_healthy_in_time_is_a_load_error_and_the_process_is_reaped(
    llama_model: FixtureInfo, tmp_path: Path
) -> None:
    with pytest.raises(LoadError, match="not healthy after"):
        async with open_server(
            fixture_plan(llama_model, 32768), llama_model.path, binary=require_llama_server(),
            run_dir=tmp_path / "run", threads=1, health_timeout_s=0.0,
        ):  # fmt: skip
            pytest.fail("unreachable")
    assert children_of(os.getpid()) == []


@pytest.mark.llama
@pytest.mark.anyio
async def test_cancellation_reaps_the_server(llama_model: FixtureInfo, tmp_path: Path) -> None:
    seen: list[int] = []
    with anyio.move_on_after(30) as scope:
        async with open_server(
            fixture_plan(llama_model, 32768), llama_model.path, binary=require_llama_server(),
            run_dir=tmp_path / "run", threads=1, warmup=False,
        ) as srv:  # fmt: skip
            seen.append(srv.pid)
            scope.cancel()
            await anyio.sleep(30)
    assert scope.cancelled_caught and seen
    assert process_gone(seen[0])
    assert children_of(os.getpid()) == []


@pytest.mark.llama
@pytest.mark.anyio
async def test_error_in_the_body_reaps_the_server(llama_model: FixtureInfo, tmp_path: Path) -> None:
    seen: list[int] = []
    with pytest.raises(RuntimeError, match="stage failed"):
        async with open_server(
            fixture_plan(llama_model, 32768), llama_model.path, binary=require_llama_server(),
            run_dir=tmp_path / "run", threads=1, warmup=False,
        ) as srv:  # fmt: skip
            seen.append(srv.pid)
            raise RuntimeError("stage failed")
    assert process_gone(seen[0])


_HOLDER = textwrap.dedent(
    """
    import sys, anyio
    from pathlib import Path
    sys.path.insert(0, {repo!r})
    from tests.test_load import fixture_plan
    from tests.gguf_fixtures import write_llama_model
    from stages.load import open_server

    async def main():
        info = write_llama_model({model!r})
        async with open_server(fixture_plan(info, 32768), info.path, binary=Path({binary!r}),
                               run_dir=Path({run!r}), threads=1, warmup=False) as srv:
            print("SERVER_PID", srv.pid, flush=True)
            await anyio.sleep(120)

    anyio.run(main)
    """
)


@pytest.mark.llama
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_signal_to_hotfit_takes_the_server_down(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C (SIGINT) unwinds the context; SIGTERM and SIGKILL kill the Python process outright
    (unless a runner handles them) and PR_SET_PDEATHSIG takes the server with it."""
    script = _HOLDER.format(
        repo=str(REPO), model=str(tmp_path / "m.gguf"), binary=str(require_llama_server()), run=str(tmp_path / "run")
    )
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    server_pid = 0
    try:
        assert holder.stdout is not None
        for line in holder.stdout:  # structlog's console lines come first
            if line.startswith("SERVER_PID "):
                server_pid = int(line.split()[1])
                break
        assert server_pid, holder.stderr.read() if holder.stderr else "holder exited early"
        assert not process_gone(server_pid)
        holder.send_signal(sig)
        holder.wait(timeout=30)
        assert wait_gone(server_pid), f"llama-server {server_pid} outlived hotfit after {sig.name}"
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if server_pid and not process_gone(server_pid):  # never leave an orphan behind a failure
            os.kill(server_pid, signal.SIGKILL)
