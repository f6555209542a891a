"""The ``hotfit pull NAME`` job: fetch-weights → fetch-template → verify for one named entry.

The same three stages ``hotfit auto`` runs (pipeline.provision.fetch_stages), through the same
engine, ephemerally: pull writes no stage state (it may run beside an ``auto`` of this home), and
holds one lock per model directory around all three stages, so a second pull of the same entry
exits 6 naming the holder, or queues behind it with ``--wait``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hotfit.core.entry import Entry
from hotfit.core.errors import UsageError
from hotfit.core.settings import Settings
from hotfit.pipeline.engine import Runner
from hotfit.pipeline.provision import FetchJob, fetch_stages
from hotfit.pipeline.registry_file import load_registry
from hotfit.core.model_files import FetchResult, TemplateResult, VerifyResult
from hotfit.state.locks import FileLock


@dataclass(frozen=True)
class PullResult:
    entry: str
    directory: str
    fetch: FetchResult
    template: TemplateResult
    verify: VerifyResult

    def to_json(self) -> dict[str, Any]:
        return {"entry": self.entry, "directory": self.directory, "fetch": self.fetch.to_json(),
                "template": self.template.to_json(), "verify": self.verify.to_json()}


def find_entry(name: str, registry_file: str | None) -> Entry:
    """The registry entry named ``name``; never another one."""
    registry = load_registry(Path(registry_file) if registry_file else None)
    try:
        entry = registry.get(name)
    except KeyError:
        entry = None
    if entry is None:
        raise UsageError(f"no registry entry named {name!r}",
                         hint="list the names with `hotfit registry list` (pull never substitutes another model)",
                         name=name)
    return entry


async def pull_entry(entry: Entry, settings: Settings, *, connections: int | None = None, wait: bool = False,
                     progress: bool = True) -> PullResult:
    """fetch-weights → fetch-template → verify, under one lock per model directory."""
    dest = settings.model_dir(entry.name)
    job = FetchJob(entry=entry, wait=wait, connections=connections, progress=progress, lock_each_stage=False,
                   rehash_installed=True)
    async with FileLock(dest / ".partial" / "pull.lock", wait=wait, what=f"model directory {dest}").async_held():
        outcome = await Runner(fetch_stages(job), None, settings, handle_signals=False, plan_stage="").run()
    results = outcome.results
    fetched, template, verified = results["fetch-weights"], results["fetch-template"], results["verify"]
    assert isinstance(fetched, FetchResult) and isinstance(template, TemplateResult)
    assert isinstance(verified, VerifyResult)
    return PullResult(entry=entry.name, directory=str(dest), fetch=fetched, template=template, verify=verified)


async def pull_named(name: str, registry_file: str | None, settings: Settings, *, connections: int | None = None,
                     wait: bool = False) -> PullResult:
    """``hotfit pull NAME``: the entry of that name (never another), then :func:`pull_entry`."""
    return await pull_entry(find_entry(name, registry_file), settings, connections=connections, wait=wait)
