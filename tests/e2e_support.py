"""A complete offline world for ``hotfit auto``: fixture models on a local Hub, a registry that
pins them, and saved probes with a chosen budget. Used by the end-to-end tests and by
``scripts/provision-demo`` (``python -m tests.e2e_support``).

Two deterministic tool-call models (tests/gguf_fixtures.py) with the same KV geometry:

- ``fx-agent-large`` — f32 tensors, more parameters on record: the automatic pick when both fit;
- ``fx-agent-small`` — f16 tensors, a smaller file: fits a budget the large one no longer does.

Both name the pinned llama.cpp Qwen3 chat template (uploaded to the Hub as
``chat_template.jinja`` in its own repository), which is what makes their tool calls parse.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotfit.planner.plan import Plan
from hotfit.planner.probe import Device, ProbeResult
from hotfit.registry.kv import parse_kv_cache_type
from hotfit.core.entry import Artifact, Entry, Evidence, LayerGroup, SourceConfig, TemplateSource
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT, device_budget, model_fit, required_free_bytes
from tests.gguf_fixtures import FixtureInfo, pinned_template, shipped_qwen3_template_text, write_tool_call_model
from tests.hubserver import LocalHub
from hotfit.pipeline.manifest import Manifest, write_manifest
from hotfit.stages.plan import build_plan

GiB = 1 << 30
TEMPLATE_REPO = "hotfit-fixtures/qwen3-chat-template"
LARGE = "fx-agent-large"
SMALL = "fx-agent-small"
HOST_TOTAL_BYTES = 16 * GiB  # the saved probes describe a 16 GiB host ("cpu" device)


def sha256_of(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def fixture_entry(name: str, info: FixtureInfo, *, repo: str, revision: str, sha256: str, params_b: float,
                  template: TemplateSource | None, tier: str = "agentic") -> Entry:
    """A registry entry whose facts are the fixture's (verify cross-checks them with the header)."""
    return Entry(
        name=name, display_name=f"Fixture {name}", backend="llama", origin="us", license="Apache-2.0",
        params_total_b=params_b, params_active_b=None, release_date="2026-01-01", architecture=info.architecture,
        agentic_tier=tier,  # type: ignore[arg-type]
        evidence=(Evidence("measured", "deterministic fixture: one parsed tool call by construction",
                           "tests/gguf_fixtures.py write_tool_call_model"),),
        auto_eligible=True, ineligible_reason=None,
        artifact=Artifact(repo=repo, revision=revision, file=info.path.name, size_bytes=info.size_bytes,
                          sha256=sha256),
        projector=None, chat_template=template,
        config=SourceConfig(n_layers=info.n_layers,
                            layer_groups=(LayerGroup(info.n_layers, info.n_kv_heads, info.head_dim_k,
                                                     info.head_dim_v, None),),
                            source="tests/gguf_fixtures.py"),
        context_limit=info.n_ctx_train, tool_parser="hermes (Qwen3 <tool_call>)", notes="test fixture",
    )


@dataclass(frozen=True)
class World:
    root: Path
    registry_path: Path
    entries: dict[str, Entry]
    repos: dict[str, str]  # entry name -> Hub repo

    def entry(self, name: str) -> Entry:
        return self.entries[name]

    def floor_free_bytes(self, name: str, kv_cache_type: str = "f16") -> int:
        """The least free memory of the 16 GiB host device at which ``name`` holds the floor."""
        entry = self.entries[name]
        ct = parse_kv_cache_type(kv_cache_type)
        fit = model_fit(entry, 0, ct)
        need_usable = fit.floor_need_bytes(ct)
        free = required_free_bytes(need_usable, "cpu", HOST_TOTAL_BYTES)
        assert model_fit(entry, device_budget("cpu", HOST_TOTAL_BYTES, free).usable_bytes,
                         ct).hot_context_tokens >= MIN_AGENTIC_HOT_CONTEXT
        return free


def build_world(root: Path, hub: Any, template_text: str | None = None, *, pin_template: bool = False) -> World:
    """Write the fixture models and template into ``hub`` and a registry file under ``root``.

    ``template_text`` None: the pinned llama.cpp Qwen3 template (what makes the fixtures' tool calls
    parse in the real llama-server); tests that stop before load may pass a stand-in."""
    root.mkdir(parents=True, exist_ok=True)
    models = root / "fixture-models"
    models.mkdir(exist_ok=True)
    if template_text is None:
        template_text = pinned_template().read_text(encoding="utf-8")
    template_commit = hub.create_repo(TEMPLATE_REPO, {"chat_template.jinja": template_text})
    raw = template_text.encode("utf-8")
    # pin_template: its size and sha256 too, as a static mirror requires (docs/fleet.md)
    template = TemplateSource(repo=TEMPLATE_REPO, revision=template_commit, file="chat_template.jinja",
                              size_bytes=len(raw) if pin_template else None,
                              sha256=hashlib.sha256(raw).hexdigest() if pin_template else None)
    entries: dict[str, Entry] = {}
    repos: dict[str, str] = {}
    for name, tensor_type, params_b in ((LARGE, "f32", 0.02), (SMALL, "f16", 0.01)):
        info = write_tool_call_model(models / f"{name}.gguf", tensor_type=tensor_type)
        repo = f"hotfit-fixtures/{name}-GGUF"
        commit = hub.create_repo(repo, {info.path.name: info.path}, lfs=True)
        entries[name] = fixture_entry(name, info, repo=repo, revision=commit, sha256=sha256_of(info.path),
                                      params_b=params_b, template=template)
        repos[name] = repo
    registry_path = root / "registry.json"
    write_registry(registry_path, entries.values())
    return World(root=root, registry_path=registry_path, entries=entries, repos=repos)


@dataclass(frozen=True)
class ProvisionedHome:
    """A home as `hotfit auto` leaves it: the fixture model (and template) in place, a manifest."""

    home: Path
    entry: Entry
    plan: Plan
    manifest: Manifest
    model: Path
    template: Path


def write_provisioned_home(home: Path, probe: ProbeResult, *, name: str = "fx-agent", kv_cache_type: str = "f16",
                           template_text: str | None = None, opened_context_tokens: int | None = None,
                           device: dict[str, Any] | None = None) -> ProvisionedHome:
    """Write the tool-call fixture model under ``home`` and the manifest of its plan on ``probe``.
    ``template_text`` None leaves the template path unwritten (a test writes the one it needs);
    ``opened_context_tokens`` defaults to the planned window."""
    model_dir = home / "models" / name
    model_dir.mkdir(parents=True)
    info = write_tool_call_model(model_dir / f"{name}.gguf")
    template = model_dir / "chat_template.jinja"
    if template_text is not None:
        template.write_text(template_text)
    entry = fixture_entry(name, info, repo=f"hotfit-fixtures/{name}-GGUF", revision="a" * 40,
                          sha256=sha256_of(info.path), params_b=0.02, template=None)
    plan = build_plan(probe, [entry], parse_kv_cache_type(kv_cache_type)).plan
    assert plan is not None
    manifest = Manifest(
        run_id="r1", plan_id=plan.plan_id, written_at="2026-11-29T00:00:00Z", entry_name=entry.name,
        model_path=str(info.path), model_size_bytes=info.size_bytes, model_sha256=sha256_of(info.path),
        template_path=str(template), projector_path=None, kv_cache_type=kv_cache_type,
        planned_hot_context_tokens=plan.hot_context_tokens,
        measured={"opened_context_tokens": opened_context_tokens or plan.hot_context_tokens},
        probe_verdict={"passed": True}, backend_build={}, device=device or {}, plan=plan.to_json(),
    )
    write_manifest(home / "manifest.json", manifest)
    return ProvisionedHome(home, entry, plan, manifest, info.path, template)


def write_registry(path: Path, entries: Any) -> None:
    from hotfit.registry.catalog import SCHEMA_VERSION

    doc = {"schema": SCHEMA_VERSION, "entries": [dataclasses.asdict(e) for e in entries]}
    path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")


def write_probe(path: Path, free_bytes: int, total_bytes: int = HOST_TOTAL_BYTES) -> Path:
    probe = ProbeResult(devices=(Device(index=0, kind="cpu", name="fixture host", total_bytes=total_bytes,
                                        free_bytes=free_bytes),))
    path.write_text(json.dumps(probe.to_json(), indent=2) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    """Set up a world under ROOT with a running local Hub; print its endpoint and files as JSON,
    then serve until SIGINT/SIGTERM (scripts/provision-demo drives this)."""
    ap = argparse.ArgumentParser(prog="python -m tests.e2e_support")
    ap.add_argument("root", type=Path)
    ap.add_argument("--free-gib", type=float, default=8.0, help="free memory the saved probe reports")
    args = ap.parse_args(argv)
    try:  # the shipped copy of the pinned template: the demo needs no llama.cpp source tree
        template_text = shipped_qwen3_template_text()
    except (OSError, ValueError) as exc:
        print(f"e2e_support: error: {exc}", file=sys.stderr)
        return 1
    with LocalHub(args.root / "hub") as hub:
        world = build_world(args.root, hub, template_text)
        probe = write_probe(args.root / "probe.json", int(args.free_gib * GiB))
        print(json.dumps({"endpoint": hub.endpoint, "registry": str(world.registry_path), "probe": str(probe),
                          "models": sorted(world.entries)}), flush=True)
        hub.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
