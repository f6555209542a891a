"""stages.load: the command line leaves nothing the plan depends on to llama.cpp's defaults, the
child really starts with it, failures quote the log, and the process never outlives the stage.

Tests marked ``llama`` start the real pinned llama-server on tiny GGUF fixtures (well under a
second each)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from hotfit.backends.llama_server.discovery import BuildInfo, build_info_from_json
from hotfit.core.errors import LoadError
from hotfit.core.isa import MACRO_TO_CPUINFO, cpuinfo_flags
from hotfit.planner.plan import BudgetBreakdown, Placement, Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.registry.kv import KV_CACHE_TYPES, kv_bytes, layer_profile
from hotfit.core.entry import Entry, LayerGroup, SourceConfig
from hotfit.backends.llama_server.crash import SIGNAL_LOG_TAIL_LINES, compare_isa, diagnose_signal_death
from hotfit.backends.llama_server.flags import (
    API_KEY_ENV,
    LLAMA_UBATCH_TOKENS,
    ServerFeatures,
    device_env,
    llama_server_argv,
    new_api_key,
    parse_server_features,
    server_env,
    template_used,
)
from hotfit.backends.llama_server.logs import LogLine, diagnose_load_failure, parse_log_lines, relevant_log_lines
from hotfit.backends.llama_server.process import open_server
from tests.gguf_fixtures import (
    FixtureInfo,
    require_llama_server,
    write_garbage_file,
    write_llama_model,
    write_truncated_copy,
    write_unsupported_arch_model,
)
from tests.polling import wait_until

TIER = "unit"

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
        probe=ProbeResult(devices=(device,)),
        placement=Placement.single(device),
        kv_cache_type=kv_type,
        kv_cache_type_source="flag",
        hot_context_tokens=tokens,
        estimated_kv_bytes=estimate,
        budget=budget,
        origin=None,
    )


def write_crashing_stand_in(directory: Path, sig: str = "SEGV", build_info: dict[str, object] | None = None) -> Path:
    """A stand-in llama-server that dies by signal ``sig`` as soon as it is asked to load a model.

    A stand-in because no binary here really crashes: the issue's crash (ggml's AMX kernels,
    llama.cpp#20824) needs an Intel CPU with AMX and a build that still has the kernels, and the
    pinned CPU build compiles them out. ``--version`` and ``--help`` run the real pinned
    llama-server, so hotfit finds, checks and probes it like the real one; any other command line
    (a load) writes one line to stderr and sends itself ``SIGsig`` (``kill -s``), so the process
    really dies by that signal. ``build_info`` is written beside it as its ``build-info.json``."""
    directory.mkdir(parents=True, exist_ok=True)
    script = directory / "llama-server"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        # hotfit test stand-in (tests/test_load.py write_crashing_stand_in): dies by SIG{sig} on a load
        case "$1" in
            --version|--help) exec {require_llama_server()} "$@" ;;
        esac
        ulimit -c 0  # no core file
        echo "stand-in llama-server: dying by SIG{sig} (not a real crash)" >&2
        kill -s {sig} $$
        """))
    script.chmod(0o755)
    if build_info is not None:
        (directory / "build-info.json").write_text(json.dumps(build_info), encoding="utf-8")
    return script


def real_build_info() -> dict[str, Any]:
    """The pinned build's build-info.json (its backend and ISA record)."""
    return json.loads((require_llama_server().parent / "build-info.json").read_text(encoding="utf-8"))


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


FULL_FEATURES = ServerFeatures(
    log_jsonl=True, fit=True, ngl_all=True, api_key_env=True, api_key_file=True, cache_ram=True,
    offline=True, verbosity=True, flash_attn_values=True, alias=True, metrics=True,
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
    if not any(f.name == "uuid" for f in dataclasses.fields(plan.placement.device)):
        assert device_env(plan) == {}
        return
    dev = dataclasses.replace(plan.placement.device, uuid="GPU-1234")
    pinned = dataclasses.replace(plan, probe=ProbeResult(devices=(dev,)), placement=Placement.single(dev))
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


NATIVE_CPU = BuildInfo("build-info.json", "0.5.0-dev", 1, "0c1e570", sdist_version="0.3.36", backend="cpu",
                       variant="native", cpu_features=("avx", "avx2", "avx512f", "fma", "sse4_2"))
OLD_AMX_CPU = BuildInfo("build-info.json", "0.5.0-dev", 1, "0c1e570", backend="cpu", variant="native",
                        cpu_features=("amx_int8", "amx_tile", "avx", "avx2", "avx512f", "fma"))
VULKAN = BuildInfo("build-info.json", "0.5.0-dev", 1, "0c1e570", backend="vulkan", variant="native",
                   cpu_features=("avx", "avx2", "fma"))
XEON_AMX = frozenset("fpu vmx avx avx2 avx512f fma sse4_2 amx_int8 amx_tile amx_bf16".split())
EPYC = frozenset("fpu svm avx avx2 avx512f fma sse4_2 sse4a".split())
OLD_CPU = frozenset("fpu avx avx2 fma sse4_2".split())


@pytest.mark.parametrize(
    ("sig", "build", "flags", "in_message", "not_in_message", "in_hint"),
    [
        pytest.param(signal.SIGSEGV, NATIVE_CPU, XEON_AMX,
                     ["killed by SIGSEGV (segmentation fault)", "/opt/ls/llama-server", "cpu backend", "native build",
                      "this CPU has all of them", "ISA features the build does not use: amx_bf16, amx_int8, amx_tile",
                      "compiled ggml's AMX kernels out, so they are not the cause", "llama.cpp bug"],
                     ["llama.cpp#20824", "GPU driver"],
                     ["`scripts/install-llama-server --backend cpu --force`", "gdb -batch -ex run -ex bt --args"],
                     id="segv-amx-cpu-amx-compiled-out"),
        pytest.param(signal.SIGSEGV, OLD_AMX_CPU, XEON_AMX,
                     ["llama.cpp#20824", "the build uses amx_int8, amx_tile", "AMX: this CPU has"],
                     ["compiled ggml's AMX kernels out", "GPU driver"],
                     ["AMX compiled out", "--backend cpu --force"], id="segv-build-with-amx"),
        pytest.param(signal.SIGSEGV, None, XEON_AMX,
                     ["no build record", "records no ISA features", "llama.cpp#20824", "may use them", "GPU driver",
                      "this CPU's ISA features: amx_bf16, amx_int8, amx_tile, avx, avx2, avx512f, fma, sse4_2"],
                     [], ["AMX compiled out"], id="segv-unknown-build"),
        pytest.param(signal.SIGSEGV, VULKAN, EPYC,
                     ["vulkan backend", "GPU driver", "this CPU has all of them"],
                     ["AMX", "#20824"], ["--backend vulkan --force", "vulkaninfo", "--backend cpu`"],
                     id="segv-vulkan-no-amx"),
        pytest.param(signal.SIGILL, NATIVE_CPU, OLD_CPU,
                     ["killed by SIGILL (illegal instruction)", "this CPU lacks avx512f",
                      "executes instructions this CPU lacks: avx512f"],
                     ["this CPU has all of them"], ["on this machine", "--backend cpu --force"], id="sigill-missing"),
        pytest.param(signal.SIGILL, NATIVE_CPU, frozenset(),
                     ["flags are unknown", "which this CPU may lack"], ["this CPU lacks"], ["on this machine"],
                     id="sigill-no-cpuinfo"),
        pytest.param(signal.SIGILL, None, EPYC, ["records no ISA features to compare"], [], ["--backend cpu --force"],
                     id="sigill-no-record"),
        pytest.param(signal.SIGBUS, NATIVE_CPU, EPYC, ["killed by SIGBUS (bus error)", "memory-mapped", "I/O error"],
                     ["#20824"], ["re-verify it (`hotfit pull fx-model`)"], id="sigbus"),
        pytest.param(signal.SIGKILL, NATIVE_CPU, EPYC, ["OOM killer"], [], ["`hotfit plan`"], id="sigkill"),
        pytest.param(signal.SIGABRT, NATIVE_CPU, EPYC, ["GGML_ASSERT"], ["GPU runtime"], ["--force"], id="sigabrt"),
        pytest.param(signal.SIGUSR1, NATIVE_CPU, EPYC, ["SIGUSR1 came from outside"], [], ["--force"], id="other"),
    ],
)
def test_signal_death_names_binary_isa_and_known_causes(
    sig: signal.Signals, build: BuildInfo | None, flags: frozenset[str], in_message: list[str],
    not_in_message: list[str], in_hint: list[str],
) -> None:
    argv = ["/opt/ls/llama-server", "-m", "/models/m.gguf", "-c", "32768"]
    message, hint = diagnose_signal_death(int(sig), build, flags, ["load_tensors: done", "warming up the model"],
                                          binary=Path(argv[0]), argv=argv, model_name="fx-model")
    for text in in_message:
        assert text in message, (text, message)
    for text in not_in_message:
        assert text not in message, (text, message)
    for text in in_hint:
        assert text in hint, (text, hint)
    assert "warming up the model" in message  # the log tail is quoted
    assert "gdb -batch -ex run -ex bt --args /opt/ls/llama-server -m /models/m.gguf -c 32768" in hint
    assert "files are kept" in hint


def test_signal_death_quotes_the_log_tail_and_says_when_there_is_none() -> None:
    lines = [f"line {i}" for i in range(40)]
    message, _ = diagnose_signal_death(int(signal.SIGSEGV), NATIVE_CPU, EPYC, lines, binary=Path("/b"))
    assert "line 39" in message and f"line {40 - SIGNAL_LOG_TAIL_LINES}" in message
    assert f"line {39 - SIGNAL_LOG_TAIL_LINES}\n" not in message + "\n"
    empty, _ = diagnose_signal_death(int(signal.SIGSEGV), NATIVE_CPU, EPYC, [], binary=Path("/b"))
    assert "wrote no log lines" in empty


@pytest.mark.parametrize(
    ("build", "flags", "missing", "amx_on_cpu", "amx_in_build", "compiled_out"),
    [
        (NATIVE_CPU, XEON_AMX, (), ("amx_bf16", "amx_int8", "amx_tile"), (), True),
        (OLD_AMX_CPU, XEON_AMX, (), ("amx_bf16", "amx_int8", "amx_tile"), ("amx_int8", "amx_tile"), False),
        (OLD_AMX_CPU, EPYC, ("amx_int8", "amx_tile"), (), ("amx_int8", "amx_tile"), False),
        (NATIVE_CPU, OLD_CPU, ("avx512f",), (), (), False),
        (NATIVE_CPU, frozenset(), (), (), (), False),  # no flags: nothing can be said missing
        (None, XEON_AMX, (), ("amx_bf16", "amx_int8", "amx_tile"), None, False),
    ],
)
def test_compare_isa(build: BuildInfo | None, flags: frozenset[str], missing: tuple[str, ...],
                     amx_on_cpu: tuple[str, ...], amx_in_build: tuple[str, ...] | None, compiled_out: bool) -> None:
    isa = compare_isa(build, flags)
    assert isa.missing == missing
    assert isa.amx_on_cpu == amx_on_cpu
    assert isa.amx_in_build == amx_in_build
    assert isa.amx_compiled_out is compiled_out
    assert "fpu" not in isa.cpu_isa and "vmx" not in isa.cpu_isa  # only ISA names a compiler targets


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

    from hotfit.backends.llama_server.flags import child_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    plan = fixture_plan(llama_model, 32768, device_kind="nvidia")
    dev = dataclasses.replace(plan.placement.device, uuid="GPU-5e1f-pinned")
    plan = dataclasses.replace(plan, probe=ProbeResult(devices=(dev,)), placement=Placement.single(dev))
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


def _absent_cpu_feature() -> str:
    """An ISA feature the pinned build does not use and this CPU lacks (for a SIGILL record)."""
    have = cpuinfo_flags(Path("/proc/cpuinfo").read_text())
    for name in sorted(set(MACRO_TO_CPUINFO.values())):
        if name not in have and not name.startswith("amx"):
            return name
    pytest.skip("this CPU has every ISA feature hotfit knows")


@pytest.mark.llama
@pytest.mark.anyio
@pytest.mark.parametrize("sig", ["SEGV", "ILL", "BUS"])
async def test_death_by_signal_during_load_names_the_binary_its_isa_build_and_the_causes(
    llama_model: FixtureInfo, tmp_path: Path, sig: str
) -> None:
    """Through a real process that really dies by the signal (a stand-in: write_crashing_stand_in
    says why). The build record is the real pinned build's; for SIGILL it also claims a feature
    this CPU lacks, which the message must name."""
    record = real_build_info()
    if sig == "ILL":
        absent = _absent_cpu_feature()
        record = {**record, "cpu_features": [*record["cpu_features"], absent]}
    binary = write_crashing_stand_in(tmp_path / "bin", sig, record)
    build = build_info_from_json(record)
    with pytest.raises(LoadError) as caught:
        async with open_server(fixture_plan(llama_model, 32768), llama_model.path, binary=binary,
                               run_dir=tmp_path / "run", threads=1, build=build):
            pytest.fail("the stand-in must die before it is healthy")
    err = caught.value
    d = err.details
    assert d["cause"] == "killed_by_signal" and d["signal"] == f"SIG{sig}"
    assert d["returncode"] == -int(getattr(signal, f"SIG{sig}"))
    assert d["backend"] == "cpu" and d["variant"] == record["variant"]  # the default build: portable
    assert d["build_cpu_features"] == sorted(record["cpu_features"])
    assert d["known_causes"] and all(c in str(err) for c in d["known_causes"])
    assert f"killed by SIG{sig}" in str(err) and str(binary) in str(err)
    assert f"cpu backend, {record['variant']} build" in str(err)
    assert f"dying by SIG{sig}" in str(err)  # the log tail (the stand-in's one stderr line)
    assert "gdb -batch -ex run -ex bt --args" in (err.hint or "") and str(binary) in (err.hint or "")
    fix = "hotfit pull fixture-llama" if sig == "BUS" else "--backend cpu --force"  # a file fault is no rebuild
    assert fix in (err.hint or "")
    if sig == "ILL":
        assert d["missing_cpu_features"] == [absent]
        assert f"this CPU lacks {absent}" in str(err)
    else:
        assert d["missing_cpu_features"] == []
        assert "this CPU has all of them" in str(err)
    if d["amx_on_cpu"]:  # an AMX CPU: the real build compiled AMX out and the message says so
        assert d["amx_compiled_out"] is True and "compiled ggml's AMX kernels out" in str(err)
    assert children_of(os.getpid()) == []


@pytest.mark.llama
@pytest.mark.anyio
async def test_death_by_signal_without_a_build_passed_reads_the_record_beside_the_binary(
    llama_model: FixtureInfo, tmp_path: Path
) -> None:
    binary = write_crashing_stand_in(tmp_path / "bin", "SEGV", real_build_info())
    with pytest.raises(LoadError) as caught:
        async with open_server(fixture_plan(llama_model, 32768), llama_model.path, binary=binary,
                               run_dir=tmp_path / "run", threads=1):
            pytest.fail("unreachable")
    variant = real_build_info()["variant"]
    assert caught.value.details["backend"] == "cpu" and f"cpu backend, {variant} build" in str(caught.value)
    bare = write_crashing_stand_in(tmp_path / "bare", "SEGV")  # no record at all
    with pytest.raises(LoadError) as caught:
        async with open_server(fixture_plan(llama_model, 32768), llama_model.path, binary=bare,
                               run_dir=tmp_path / "run2", threads=1):
            pytest.fail("unreachable")
    assert caught.value.details["backend"] is None and "no build record" in str(caught.value)
    assert "records no ISA features" in str(caught.value)


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
    import signal, sys, anyio
    from pathlib import Path
    # Ctrl-C reaches a foreground process whose SIGINT is Python's default; a runner that started
    # this test in the background (SIGINT ignored, inherited) must not make the holder deaf to it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.path.insert(0, {repo!r})
    from tests.test_load import fixture_plan
    from tests.gguf_fixtures import write_llama_model
    from hotfit.backends.llama_server.process import open_server

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
        wait_until(lambda: process_gone(server_pid), f"llama-server {server_pid} to end with hotfit after {sig.name}",
                   timeout_s=15)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        if server_pid and not process_gone(server_pid):  # never leave an orphan behind a failure
            os.kill(server_pid, signal.SIGKILL)
