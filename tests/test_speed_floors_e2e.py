"""End-to-end: the speed floors of ``hotfit auto`` (docs/usage.md, "Speed") on real GGUFs.

- On the real test GGUFs (tests/real_models.py: Qwen2.5-Coder-0.5B, Gemma 3 270M, SmolLM2-135M),
  served by the local Hub: a floor the largest misses by its *predicted* figure makes ``auto`` pick
  the next one, and a floor nothing meets exits 3 naming the fastest candidate and its predicted
  figures. Every floor is derived from ``hotfit plan --json``'s predictions at test time, so a
  re-fit of the speed model's constants (registry/speed.py) moves the floors with it.
- A measured shortfall (exit 5) and the rerun that moves on need a session that reaches
  measure-speed, which runs after the tool-call probe; none of the real test GGUFs passes that
  probe (tests/real_models.py says why), so this part runs the deterministic tool-call model of
  tests/gguf_fixtures.py in the real llama-server, in two sizes: one with blocks wide enough that
  its agent prompt costs 8-100 times the small one's (more on an idle machine).

The runs that stop before load (a dry run, a refusal at plan) need no llama-server: the refusal runs
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
from hotfit.stages.measure_speed import FOLLOW_UP_TOKENS, SPEED_STAGE
from tests.e2e_support import GiB, World, fixture_entry, sha256_of, write_registry
from tests.gguf_fixtures import write_standin_llama_server, write_tool_call_model
from tests.hubserver import LocalHub
from tests.real_models import GEMMA3, QWEN_CODER, SMOLLM2, require_model
from tests.test_auto_e2e import AGENT_PROMPT_TOKENS, env_for, events, stage_story

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


# ---------------------------------------------------------------- a measured shortfall, and the rerun


SLOW, QUICK = "fx-speed-slow", "fx-speed-quick"
# More and wider zeroed blocks (the same answers): a 100 MB file whose 2.5k-token agent prompt took
# 12-16 s on 2 loaded cores, against 0.2-1.9 s for the one-block model (110 kB) on the same machine.
SLOW_SHAPE: dict[str, Any] = {"n_layers": 4, "n_ff": 65536, "tensor_type": "f16"}
QUICK_SHAPE: dict[str, Any] = {"tensor_type": "f16"}


def parameters(path: Path) -> int:
    """The parameters a GGUF holds (its tensors' elements): the registry's params_total_b, so that
    the speed model weighs the two fixtures by the work they really do."""
    return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)


@dataclass(frozen=True)
class SpeedWorld:
    registry: Path
    entries: dict[str, Entry]

    def file(self, name: str) -> str:
        artifact = self.entries[name].artifact
        assert artifact is not None and artifact.file is not None
        return artifact.file


@pytest.fixture(scope="module")
def speed_world(hub: LocalHub, plain_world: World, tmp_path_factory: pytest.TempPathFactory) -> SpeedWorld:
    """The slow and the quick tool-call model on the module's Hub, with the pinned template."""
    root = tmp_path_factory.mktemp("speed-world")
    template = next(iter(plain_world.entries.values())).chat_template
    entries = {}
    for name, shape in ((SLOW, SLOW_SHAPE), (QUICK, QUICK_SHAPE)):
        info = write_tool_call_model(root / f"{name}.gguf", **shape)
        repo = f"hotfit-fixtures/{name}-GGUF"
        commit = hub.create_repo(repo, {info.path.name: info.path}, lfs=True)
        entries[name] = fixture_entry(name, info, repo=repo, revision=commit, sha256=sha256_of(info.path),
                                      params_b=parameters(info.path) / 1e9, template=template)
    registry = root / "registry.json"
    write_registry(registry, entries.values())
    return SpeedWorld(registry, entries)


def file_identity(path: Path) -> tuple[int, int]:
    st = path.stat()
    return st.st_ino, st.st_mtime_ns


def failed_run(home: Path) -> str:
    """The last run of ``home`` that did not end done (from the JSON log)."""
    ends = [e for e in events(home) if e["event"] == "run.done" and e.get("status") != "done"]
    assert ends, "no failed run in the log"
    return str(ends[-1]["run_id"])


@pytest.mark.llama
def test_a_measured_shortfall_exits_5_and_the_rerun_moves_on_without_downloading_again(
        hub: LocalHub, world: World, speed_world: SpeedWorld, tmp_path: Path) -> None:
    home = tmp_path / "home"
    registry = speed_world.registry
    plain = write_probe(tmp_path / "probe.json")

    # The home holds both models, verified (provisioned by name). The floor lies between two anchors
    # measured on this machine, as loaded as it is now: the first token the quick model's own speed
    # check measured (the figure the floor is checked against) and the one the slow model's tool-call
    # probe implies for the agent prompt (its prompt rate; its own speed check skipped: 25 s saved).
    hub.reset_counters()
    manifests, paths = {}, {}
    for name, skip in ((SLOW, ("--skip-speed-check",)), (QUICK, ())):
        done = auto(hub, home, registry, plain, "--model", name, *skip)
        assert done.returncode == 0, done.stderr[-3000:]
        manifests[name] = json.loads(done.stdout)
        paths[name] = Path(manifests[name]["model_path"])
        assert hub.bytes_sent(speed_world.file(name)) == paths[name].stat().st_size  # downloaded once
    identities = {name: file_identity(path) for name, path in paths.items()}
    quick_measured = manifests[QUICK]["speed"]["measured"]
    slow_implied_s = quick_measured["prompt_tokens"] / manifests[SLOW]["probe_verdict"]["prompt_tokens_per_s"]
    floor = float(f"{between(quick_measured['first_token_s'], slow_implied_s):.3g}")
    floor_args = ("--refresh", "--max-first-token-s", f"{floor:g}")

    # Prediction must pass and measurement miss, whatever the speed model's constants: a saved probe
    # of the same device with its bandwidth and threads raised 1000-fold predicts the slow model's
    # first token far under the floor; the session then measures what the machine really does. (The
    # figures are the planner's alone: llama-server's threads do not come from the probe file.)
    optimistic = write_probe(tmp_path / "optimistic.json", bandwidth_bytes_per_s=10**13, threads=2000)
    cands = plan_candidates(hub, home, registry, optimistic, "--max-first-token-s", f"{floor:g}")
    assert cands[SLOW]["verdict"] == "selected" and predicted(cands[SLOW])["first_token_s"] < floor

    hub.reset_counters()
    missed = auto(hub, home, registry, optimistic, *floor_args)
    assert missed.returncode == 5, missed.stderr[-3000:]
    error = json.loads(missed.stdout)["error"]
    assert error["code"] == "speed_floor"
    measured, said = error["details"]["measured"], error["details"]["predicted"]
    assert measured["first_token_s"] > floor
    assert (f"measured first token after {measured['first_token_s']:.0f} s > {floor:g} s for "
            f"{measured['prompt_tokens']} prompt tokens (predicted {said['first_token_s']} s for "
            f"{said['prompt_tokens']})") in error["message"]
    assert hub.bytes_sent() == 0  # the slow model was verified in this home: nothing downloaded again

    # The measurement is kept: the next plan on this device weighs the slow model by it.
    cands = plan_candidates(hub, home, registry, optimistic, "--max-first-token-s", f"{floor:g}")
    assert (cands[SLOW]["verdict"], cands[SLOW]["reason_code"]) == ("excluded", "speed")
    assert f"> {floor:g} s" in cands[SLOW]["reason"]
    assert "calibrated" in predicted(cands[SLOW])["basis"]["compute"] and cands[QUICK]["verdict"] == "selected"

    # The operator's rerun moves on to the quick model, verified here already: nothing downloaded,
    # both verified files where they were.
    hub.reset_counters()
    rerun = auto(hub, home, registry, optimistic, *floor_args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    manifest = json.loads(rerun.stdout)
    # ... and measures it under the floor: the record its provisioning by name left (no floor then)
    # is no measurement against this one
    evs = events(home)
    rerun_start = max(i for i, e in enumerate(evs) if e["event"] == "run.start")  # it resumes the failed run
    story = {stage: ev for ev, stage in stage_story(evs[rerun_start:], manifest["run_id"])}
    assert story["fetch-weights"] == story["verify"] == "stage.skip" and story[SPEED_STAGE] == "stage.done", story
    assert manifest["entry_name"] == QUICK and Path(manifest["model_path"]) == paths[QUICK]
    assert hub.bytes_sent() == 0, [(r.method, r.file) for r in hub.requests if r.body_bytes]
    assert {name: file_identity(path) for name, path in paths.items()} == identities
    speed = manifest["speed"]
    assert speed["measured"]["first_token_s"] <= floor
    assert f"by run {failed_run(home)} ({SLOW}" in speed["predicted"]["basis"]["compute"]
    # the follow-up turn adds about FOLLOW_UP_TOKENS in this model's own characters per token (this
    # byte vocabulary holds ~1 character a token: at 4 characters a token the turn was ~6k tokens)
    assert speed["measured"]["follow_up_prompt_tokens"] < 1.5 * FOLLOW_UP_TOKENS
