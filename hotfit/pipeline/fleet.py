"""``hotfit fleet plan``: every saved probe of a fleet planned by ``hotfit plan``'s own selection,
and what the fleet needs once — the artifacts a mirror must hold and the builds to make.

Each machine is planned by :func:`pipeline.provision.plan_probe`, the one function ``hotfit plan``
calls, with the options read and checked once (:func:`pipeline.provision.prepare_selection`), so
a machine gets in the fleet the plan it would get alone. A probe file that cannot be read (damaged,
foreign, another schema) or a manifest that cannot is that machine's error; the others are planned.
The summary, the artifact list and the build list are pure functions of the machines' plans
(docs/fleet.md).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotfit.backends.base import BuildNeed
from hotfit.backends.select import backend_for
from hotfit.core import log
from hotfit.core.entry import Entry
from hotfit.core.errors import HotfitError, UsageError
from hotfit.core.settings import Settings
from hotfit.pipeline.manifest import provisioned_device, read_manifest
from hotfit.pipeline.provision import PreparedSelection, SelectionOptions, plan_probe, prepare_selection
from hotfit.stages.plan import PlanOutcome, PreviousModel
from hotfit.stages.probe import load_saved_probe

__all__ = ["FleetPlan", "MachinePlan", "MirrorArtifact", "BuildToMake", "plan_fleet", "probe_files",
           "entry_artifacts"]

# A probe that does not say its CPU is taken for the common case, and the build list says so.
DEFAULT_ARCH = "x86_64"
_ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64"}


@dataclass(frozen=True)
class MachinePlan:
    """One machine: its plan (or refusal) — or, instead, why its probe could not be planned."""

    name: str
    probe_file: str
    arch: str | None  # from the probe (None: it did not say; DEFAULT_ARCH assumed for its build)
    outcome: PlanOutcome | None = None
    error: HotfitError | None = None
    build: BuildNeed | None = None
    previous_from: str | None = None  # the manifest the previous model came from

    @property
    def status(self) -> str:
        if self.error is not None:
            return "error"
        return "planned" if self.outcome is not None and self.outcome.plan is not None else "refused"

    @property
    def reason(self) -> str | None:
        """Why it has no plan: the refusal's first line, or the error (None when planned)."""
        if self.error is not None:
            return self.error.what
        assert self.outcome is not None
        refusal = self.outcome.selection.refusal
        return None if refusal is None else refusal.message.splitlines()[0]

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "probe_file": self.probe_file, "arch": self.arch,
                               "status": self.status, "reason": self.reason}
        plan = None if self.outcome is None else self.outcome.plan
        device = None if self.outcome is None else self.outcome.placement.device
        out |= {
            "model": None if plan is None else plan.entry.name,
            "backend": None if plan is None else plan.backend,
            "device": None if device is None else {"index": device.index, "kind": device.kind, "name": device.name,
                                                    "compute_capability": device.compute_capability},
            "hot_context_tokens": None if plan is None else plan.hot_context_tokens,
            # registry/speed.py's prediction for the pick on its device (None: none made)
            "speed_predicted": None if plan is None or plan.speed_predicted is None else dict(plan.speed_predicted),
            "kv_cache_type": None if self.outcome is None else self.outcome.kv_cache_type,
            "reused_previous": bool(plan is not None and plan.reused_previous),
            "previous_from": self.previous_from,
            "plan_id": None if plan is None else plan.plan_id,
            "build": None if self.build is None else self.build.flavour,
            "error": None if self.error is None else self.error.to_json(),
            "refusal": (None if self.outcome is None or self.outcome.selection.refusal is None
                        else self.outcome.selection.refusal.to_json()),
        }
        return out


@dataclass(frozen=True)
class MirrorArtifact:
    """One pinned file the fleet's mirror holds once, however many machines need it (its
    ``{repo}/resolve/{revision}/{file}`` path). ``file`` None: a whole repository snapshot."""

    role: str  # weights | projector | template | snapshot
    repo: str
    revision: str | None
    file: str | None
    size_bytes: int | None
    sha256: str | None
    entries: tuple[str, ...]
    machines: int

    @property
    def key(self) -> tuple[str, str | None, str | None]:
        return (self.repo, self.revision, self.file)

    @property
    def pinned(self) -> bool:
        """Pinned by revision, size and sha256: what a static mirror can be trusted for (docs/fleet.md)."""
        return self.revision is not None and self.size_bytes is not None and self.sha256 is not None

    def to_json(self) -> dict[str, Any]:
        return {"role": self.role, "repo": self.repo, "revision": self.revision, "file": self.file,
                "size_bytes": self.size_bytes, "sha256": self.sha256, "pinned": self.pinned,
                "entries": list(self.entries), "machines": self.machines}


@dataclass(frozen=True)
class BuildToMake:
    """One build the build server makes once and exports (``install-llama-server --export``);
    a CUDA build's ``cuda_architectures`` is the union over every GPU it serves."""

    flavour: str
    arch: str
    install_flags: str
    machines: int
    cuda_architectures: tuple[str, ...] = ()
    unknown_capability_machines: int = 0  # CUDA machines whose probe recorded no compute capability

    @property
    def export_command(self) -> str:
        env = f'HOTFIT_CUDA_ARCHS="{";".join(self.cuda_architectures)}" ' if self.cuda_architectures else ""
        return f"{env}scripts/install-llama-server {self.install_flags} --export llama-server-{self.flavour}.tar.gz"

    def to_json(self) -> dict[str, Any]:
        return {"flavour": self.flavour, "arch": self.arch, "machines": self.machines,
                "cuda_architectures": list(self.cuda_architectures),
                "unknown_capability_machines": self.unknown_capability_machines,
                "export_command": self.export_command}


@dataclass(frozen=True)
class FleetPlan:
    selection: PreparedSelection
    machines: tuple[MachinePlan, ...]
    artifacts: tuple[MirrorArtifact, ...]
    builds: tuple[BuildToMake, ...]

    @property
    def mirror_bytes(self) -> int:
        """The mirror's size: every artifact once (unknown sizes count 0; ``unsized`` says how many)."""
        return sum(a.size_bytes or 0 for a in self.artifacts)

    def summary(self) -> dict[str, Any]:
        planned = [m for m in self.machines if m.status == "planned"]
        count = Counter(m.status for m in self.machines)

        def tally(values: Iterable[str]) -> dict[str, int]:
            return dict(sorted(Counter(values).items(), key=lambda kv: (-kv[1], kv[0])))

        return {
            "machines": len(self.machines),
            "planned": count["planned"],
            "refused": count["refused"],
            "errors": count["error"],
            "per_model": tally(m.outcome.plan.entry.name for m in planned
                               if m.outcome is not None and m.outcome.plan is not None),
            "per_backend": tally(m.outcome.plan.backend for m in planned
                                 if m.outcome is not None and m.outcome.plan is not None),
            "per_build": tally(m.build.flavour for m in planned if m.build is not None),
            "mirror_bytes": self.mirror_bytes,
            "unsized_artifacts": sum(a.size_bytes is None for a in self.artifacts),
        }

    def to_json(self) -> dict[str, Any]:
        sel = self.selection
        return {
            "kv_cache_type": sel.cache_type.name,
            "kv_cache_type_source": sel.kv_cache_type_source,
            "origin": sel.origin or "auto",
            "backend": sel.options.backend,
            "registry": str(sel.options.registry_file) if sel.options.registry_file else None,
            "summary": self.summary(),
            "machines": [m.to_json() for m in self.machines],
            "artifacts": [a.to_json() for a in self.artifacts],
            "builds": [b.to_json() for b in self.builds],
        }

    @property
    def exit_code(self) -> int:
        """0 every machine planned; else the code of the first error, else of the refusals (3)."""
        errors = [m.error.exit_code for m in self.machines if m.error is not None]
        if errors:
            return errors[0]
        refused = [m for m in self.machines if m.status == "refused"]
        if refused:
            assert refused[0].outcome is not None and refused[0].outcome.selection.refusal is not None
            return refused[0].outcome.selection.refusal.error().exit_code
        return 0


# ------------------------------------------------------------------------ reading the inventory


def probe_files(paths: Sequence[str | Path]) -> list[Path]:
    """The probe files named: each file as given, each directory's ``*.json`` (sorted, not recursive).
    A path that does not exist is a UsageError: a typo in an inventory is not an empty fleet."""
    out: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            out += sorted(q for q in p.glob("*.json") if q.is_file() or q.is_symlink())
        elif p.exists() or p.is_symlink():
            out.append(p)
        else:
            raise UsageError(f"fleet plan: {p} does not exist",
                             hint="pass probe files saved with 'hotfit probe --save FILE', or directories of them",
                             file=str(p))
    if not out:
        raise UsageError("fleet plan: no probe files found in " + ", ".join(str(p) for p in paths),
                         hint="each machine saves one with 'hotfit probe --save NAME.json'")
    return out


def _arch(raw: str | None) -> str | None:
    if raw is None:
        return None
    key = raw.strip().lower()
    return _ARCH_ALIASES.get(key, key) or None


def _previous(manifests: Path | None, name: str) -> tuple[PreviousModel | None, str | None]:
    """The previous model of machine ``name`` from ``<manifests>/<name>.json`` (a copy of its
    home's manifest.json), kept on its device while it qualifies; a damaged one is its error."""
    if manifests is None:
        return None, None
    path = manifests / f"{name}.json"
    manifest = read_manifest(path, strict=True)
    if manifest is None:
        return None, None
    return PreviousModel(manifest.entry_name, device=provisioned_device(manifest)), str(path)


def _plan_one(settings: Settings, prepared: PreparedSelection, path: Path, taken: set[str],
              manifests: Path | None) -> MachinePlan:
    name = path.stem
    try:
        saved = load_saved_probe(path)
    except HotfitError as exc:
        return MachinePlan(_unique(name, path, taken), str(path), None, error=exc)
    name = _unique(saved.machine.name or name, path, taken)
    arch = _arch(saved.machine.arch)
    log.bind(machine=name)  # the plan's events (plan.device, plan.selected, ...) name their machine
    try:
        previous, previous_from = _previous(manifests, name)
        outcome = plan_probe(settings, prepared, saved.result, previous=previous)
    except HotfitError as exc:
        return MachinePlan(name, str(path), arch, error=exc)
    finally:
        log.unbind("machine")
    build = None
    if outcome.plan is not None:
        build = backend_for(outcome.plan.backend).build_for(outcome.placement.device, arch or DEFAULT_ARCH)
    return MachinePlan(name, str(path), arch, outcome=outcome, build=build, previous_from=previous_from)


def _unique(name: str, path: Path, taken: set[str]) -> str:
    """Two probes naming the same host (a cloned image) stay two machines: the second is named by its file."""
    if name in taken:
        name = f"{name} ({path.name})"
    taken.add(name)
    return name


def plan_fleet(settings: Settings, opts: SelectionOptions, paths: Sequence[str | Path], *,
               manifests: Path | None = None) -> FleetPlan:
    """Plan every probe in ``paths`` (files or directories) with ``hotfit plan``'s selection."""
    prepared = prepare_selection(settings, opts)  # a bad option fails the whole run, once, before any probe
    files = probe_files(paths)
    taken: set[str] = set()
    machines = tuple(_plan_one(settings, prepared, p, taken, manifests) for p in files)
    return FleetPlan(prepared, machines, mirror_artifacts(machines), builds_to_make(machines))


# ------------------------------------------------------------------------ what the fleet needs once (pure)


def entry_artifacts(entry: Entry) -> list[tuple[str, str, str | None, str | None, int | None, str | None]]:
    """(role, repo, revision, file, size_bytes, sha256) of every file an entry's provisioning
    fetches: weights (or the whole snapshot), projector, chat-template source (unless the snapshot
    holds it)."""
    out = []
    a = entry.artifact
    if a is not None:
        out.append(("snapshot" if a.file is None else "weights", a.repo, a.revision, a.file, a.size_bytes, a.sha256))
    if entry.projector is not None:
        p = entry.projector
        out.append(("projector", p.repo, p.revision, p.file, p.size_bytes, p.sha256))
    t = entry.chat_template
    # a template that is a file of the entry's snapshot is in the snapshot (fetch-template reads it
    # there): mirrored, and counted, once with it
    if t is not None and not (a is not None and a.file is None and t.repo == a.repo
                              and t.revision in (None, a.revision)):
        out.append(("template", t.repo, t.revision, t.file, t.size_bytes, t.sha256))
    return out


def artifacts_of(entries: Iterable[tuple[Entry, int]]) -> tuple[MirrorArtifact, ...]:
    """Each distinct (repo, revision, file) once, with the entries and machines that need it."""
    found: dict[tuple[str, str | None, str | None], MirrorArtifact] = {}
    for entry, machines in entries:
        for role, repo, revision, file, size, sha in entry_artifacts(entry):
            key = (repo, revision, file)
            seen = found.get(key)
            if seen is None:
                found[key] = MirrorArtifact(role, repo, revision, file, size, sha, (entry.name,), machines)
            else:
                names = seen.entries if entry.name in seen.entries else (*seen.entries, entry.name)
                found[key] = dataclasses.replace(seen, entries=names, machines=seen.machines + machines,
                                                 size_bytes=seen.size_bytes if seen.size_bytes is not None else size,
                                                 sha256=seen.sha256 or sha)
    return tuple(sorted(found.values(), key=lambda a: (a.repo, a.revision or "", a.file or "")))


def mirror_artifacts(machines: Iterable[MachinePlan]) -> tuple[MirrorArtifact, ...]:
    entries: dict[str, Entry] = {}
    count = Counter[str]()
    for m in machines:
        if m.outcome is not None and m.outcome.plan is not None:
            entries[m.outcome.plan.entry.name] = m.outcome.plan.entry
            count[m.outcome.plan.entry.name] += 1
    return artifacts_of((entries[name], count[name]) for name in sorted(entries))


def builds_to_make(machines: Iterable[MachinePlan]) -> tuple[BuildToMake, ...]:
    """One build per flavour; a CUDA build for the union of the GPUs' compute capabilities."""
    groups: dict[str, list[BuildNeed]] = {}
    for m in machines:
        if m.status == "planned" and m.build is not None:
            groups.setdefault(m.build.flavour, []).append(m.build)
    out = []
    for flavour in sorted(groups):
        needs = groups[flavour]
        caps = sorted({n.cuda_capability for n in needs if n.cuda_capability is not None})
        unknown = sum(n.cuda_capability is None for n in needs) if needs[0].per_gpu_code else 0
        out.append(BuildToMake(flavour, needs[0].arch, needs[0].install_flags, len(needs),
                               tuple(str(c) for c in caps), unknown))
    return tuple(out)

