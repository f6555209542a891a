"""End-to-end: the speed floors of ``hotfit auto`` (docs/usage.md, "Speed") on real GGUFs.

- On the real test GGUFs (tests/real_models.py: Qwen2.5-Coder-0.5B, Gemma 3 270M, SmolLM2-135M),
  served by the local Hub: a floor the largest misses by its *predicted* figure makes ``auto`` pick
  the next one, and a floor nothing meets exits 3 naming the fastest candidate and its predicted
  figures. Every floor is derived from ``hotfit plan --json``'s predictions at test time, so a
  re-fit of the speed model's constants (registry/speed.py) moves the floors with it.
- A measured shortfall (exit 5) and the rerun that moves on need a session that reaches
  measure-speed, which runs after the tool-call probe; none of the real test GGUFs passes that
  probe (tests/real_models.py says why), so this part runs the deterministic tool-call model of
  tests/gguf_fixtures.py in the real llama-server, in two sizes: one a few blocks wide enough
  that its prompt costs ~20 times the small one's.

These runs stop before load (a dry run, a refusal at plan) need no llama-server: the refusal runs
against the stand-in binary that only answers ``--version``, as tests/test_auto_e2e.py does.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import pytest

from hotfit.core.entry import Entry
from hotfit.planner.probe import Device, ProbeResult
from tests.e2e_support import GiB, World, fixture_entry, sha256_of, write_registry
from tests.gguf_fixtures import write_standin_llama_server, write_tool_call_model
from tests.hubserver import LocalHub
from tests.real_models import GEMMA3, QWEN_CODER, SMOLLM2, require_model
from tests.test_auto_e2e import AGENT_PROMPT_TOKENS, env_for, events

TIER = "e2e"

REPO = Path(__file__).resolve().parent.parent
FREE_BYTES = 8 * GiB  # every candidate here fits with its whole window
HOST_TOTAL_BYTES = 16 * GiB
DEVICE_NAME = "floors test host"


def write_probe(path: Path, *, bandwidth_bytes_per_s: int | None = None, threads: int | None = None) -> Path:
    """A saved probe of one CPU device; ``bandwidth_bytes_per_s`` and ``threads`` are the figures the
    speed model reads (None: the probe did not measure them, so the model assumes its defaults)."""
    device = Device(index=0, kind="cpu", name=DEVICE_NAME, total_bytes=HOST_TOTAL_BYTES, free_bytes=FREE_BYTES,
                    read_bandwidth_bytes_per_s=bandwidth_bytes_per_s,
                    bandwidth_basis=None if bandwidth_bytes_per_s is None else "set by the test",
                    compute_threads=threads)
    path.write_text(json.dumps(ProbeResult(devices=(device,)).to_json(), indent=2) + "\n", encoding="utf-8")
    return path


def hotfit(hub: LocalHub, home: Path, *args: str, server: Path | None = None,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "hotfit", "--home", str(home), "--log-format", "json", *args],
                          cwd=REPO, env=env_for(hub, server) | (env or {}), capture_output=True, text=True,
                          timeout=600)


def auto(hub: LocalHub, home: Path, registry: Path, probe: Path, *args: str, server: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return hotfit(hub, home, "auto", "--json", "--registry", str(registry), "--probe-file", str(probe),
                  "--agent-prompt-tokens", AGENT_PROMPT_TOKENS, *args, server=server, env=env)


def plan_candidates(hub: LocalHub, home: Path, registry: Path, probe: Path, *args: str) -> dict[str, dict[str, Any]]:
    """``hotfit plan --json``'s candidates by name (its verdict, reason and predicted speed)."""
    done = hotfit(hub, home, "plan", "--json", "--registry", str(registry), "--probe-file", str(probe),
                  "--agent-prompt-tokens", AGENT_PROMPT_TOKENS, *args)
    assert done.returncode == 0, done.stderr[-3000:]
    return {c["name"]: c for c in json.loads(done.stdout)["candidates"]}


def predicted(candidate: dict[str, Any]) -> dict[str, Any]:
    speed = candidate["speed"]["predicted"]
    assert speed is not None, candidate
    return dict(speed)


def between(slow: float, fast: float) -> float:
    """A floor strictly between two figures (their geometric mean: as far from each in ratio)."""
    assert slow < fast, (slow, fast)
    return float((slow * fast) ** 0.5)


# ---------------------------------------------------------------- the real test GGUFs, planned


@dataclass(frozen=True)
class RealRegistry:
    path: Path
    entries: dict[str, Entry]


@pytest.fixture(scope="module")
def real_registry(hub: LocalHub, plain_world: World, tmp_path_factory: pytest.TempPathFactory) -> RealRegistry:
    """The three real GGUFs on the module's Hub and a registry pinning them. What the registry asks
    the planner to assume, not read from the files: each is an auto-eligible agentic entry under a
    permissive licence, with the fixtures' pinned chat template (nothing here loads them)."""
    template = next(iter(plain_world.entries.values())).chat_template
    entries = {}
    for name in (QWEN_CODER, GEMMA3, SMOLLM2):
        model = require_model(name)
        entry = model.entry()
        assert entry.artifact is not None
        repo = f"hotfit-real/{name}-GGUF"
        commit = hub.create_repo(repo, {model.path.name: model.path}, lfs=True)
        entries[name] = dataclasses.replace(
            entry, agentic_tier="agentic", license="Apache-2.0", release_date="2026-01-01", chat_template=template,
            artifact=dataclasses.replace(entry.artifact, repo=repo, revision=commit))
    path = tmp_path_factory.mktemp("real-registry") / "registry.json"
    write_registry(path, entries.values())
    return RealRegistry(path, entries)


@pytest.fixture(scope="module")
def standin_server(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_standin_llama_server(tmp_path_factory.mktemp("standin") / "llama-server")


@pytest.fixture()
def probe(tmp_path: Path) -> Path:
    return write_probe(tmp_path / "probe.json", bandwidth_bytes_per_s=10 * 10**9, threads=2)


@pytest.mark.parametrize(("flag", "figure", "env"), [
    ("--min-decode-tokens-per-s", "decode_tokens_per_s", None),
    ("--max-first-token-s", "first_token_s", None),
    ("--min-decode-tokens-per-s", "decode_tokens_per_s", "HOTFIT_MIN_DECODE_TOKENS_PER_S"),
])
def test_a_floor_the_largest_real_model_misses_makes_auto_pick_the_next(
        hub: LocalHub, real_registry: RealRegistry, probe: Path, tmp_path: Path, flag: str, figure: str,
        env: str | None) -> None:
    home = tmp_path / "home"
    hub.reset_counters()
    cands = plan_candidates(hub, home, real_registry.path, probe)
    # without a floor the spec's order picks the largest; SmolLM2's 8192-token ceiling is below 32768
    assert cands[QWEN_CODER]["verdict"] == "selected" and cands[GEMMA3]["verdict"] == "qualifies"
    assert cands[SMOLLM2]["reason_code"] == "context_floor"
    big, next_one = predicted(cands[QWEN_CODER])[figure], predicted(cands[GEMMA3])[figure]
    # a floor between the two predictions: the largest misses it, the next meets it
    floor = between(big, next_one) if figure == "decode_tokens_per_s" else between(next_one, big)
    floor_arg = f"{floor:.6g}"
    if env is None:
        done = auto(hub, home, real_registry.path, probe, "--dry-run", flag, floor_arg)
    else:  # the same floor from the environment (recipes and fleets set it there)
        done = auto(hub, home, real_registry.path, probe, "--dry-run", env={env: floor_arg})
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout)
    assert out["model"] == GEMMA3 and out["would"] == "provision"
    verdicts = {c["name"]: c for c in out["selection"]["candidates"]}
    missed = verdicts[QWEN_CODER]
    assert (missed["verdict"], missed["reason_code"]) == ("excluded", "speed")
    assert f"< {floor:g}" in missed["reason"] or f"> {floor:g} s" in missed["reason"], missed["reason"]
    assert out["plan"]["speed_predicted"][figure] == next_one
    assert hub.requests == []  # a plan reads no byte from the Hub


@pytest.mark.parametrize(("flag", "figure"), [("--min-decode-tokens-per-s", "decode_tokens_per_s"),
                                              ("--max-first-token-s", "first_token_s")])
def test_an_impossible_floor_exits_3_naming_the_fastest_and_its_predicted_figures(
        hub: LocalHub, real_registry: RealRegistry, probe: Path, standin_server: Path, tmp_path: Path,
        flag: str, figure: str) -> None:
    home = tmp_path / "home"
    hub.reset_counters()
    cands = plan_candidates(hub, home, real_registry.path, probe)
    speeds = {name: predicted(c) for name, c in cands.items() if c["reason_code"] == "ok"}
    if figure == "decode_tokens_per_s":
        fastest = max(speeds, key=lambda n: speeds[n][figure])
        floor = speeds[fastest][figure] * 10
    else:
        fastest = min(speeds, key=lambda n: speeds[n][figure])
        floor = speeds[fastest][figure] / 10
    done = auto(hub, home, real_registry.path, probe, flag, f"{floor:.6g}", server=standin_server)
    assert done.returncode == 3, done.stderr[-3000:]
    error = json.loads(done.stdout)["error"]
    assert error["code"] == "no_model_qualifies"
    fig = speeds[fastest]
    # the fastest and its predicted figures, as the speed model prints them (SpeedPrediction.text)
    assert f"The fastest is {fastest}: prefill {fig['prefill_tokens_per_s']:.0f} tok/s" in error["message"]
    assert f"generation {fig['decode_tokens_per_s']:.1f} tok/s" in error["message"]
    assert f"{flag} {floor:.6g}" in error["message"]
    assert hub.requests == [] and not (home / "models").exists()  # refused before any download
