"""hotfit fleet plan | mirror: a fleet's saved probes planned with ``hotfit plan``'s selection, and what
the fleet needs once — the artifacts to mirror and the builds to make; and the mirror filled
(docs/fleet.md). ``fleet endpoints`` is in :mod:`pipeline.cli.fleet_endpoints` (docs/recipes.md)."""

from __future__ import annotations

import argparse
import csv
import functools
import io
from pathlib import Path
from typing import Any

import anyio

from hotfit.pipeline.cli import fleet_endpoints
from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.cli.plan import add_origin_previous_options, add_selection_options, selection_from_args
from hotfit.core.errors import UsageError
from hotfit.pipeline.fleet import FleetPlan, plan_fleet
from hotfit.pipeline.mirror import MirrorResult, entries_named, fill_mirror, wanted_from_plan
from hotfit.registry.select import fmt_bytes
from hotfit.registry.speed import fmt_seconds

CSV_TABLES = ("machines", "artifacts", "builds")


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fleet", parents=parents, help="plan a fleet from its saved probes; fill its mirror; one endpoint over it")
    fsub = p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND", required=True)
    plan = fsub.add_parser(
        "plan", parents=parents, help="plan every saved probe as `hotfit plan` would",
        description="Plan each saved probe (hotfit probe --save) with hotfit plan's rules and options; list the "
                    "artifacts a mirror must hold (each once) and the llama-server builds to make.")
    plan.add_argument("paths", nargs="+", metavar="PATH", help="probe files, or directories of *.json probe files")
    add_selection_options(plan)
    add_origin_previous_options(plan)
    plan.add_argument("--manifests", metavar="DIR",
                      help="previous models: DIR/<machine>.json is that machine's saved manifest.json, its model "
                           "kept on its device while it qualifies (overrides --previous for that machine)")
    plan.add_argument("--csv", choices=CSV_TABLES, metavar="TABLE",
                      help=f"print one table as CSV instead of text ({', '.join(CSV_TABLES)})")
    plan.set_defaults(handler=run_plan)
    mirror = fsub.add_parser(
        "mirror", parents=parents, help="fill a directory any static server can serve as the fleet's HF_ENDPOINT",
        description="Fetch each artifact once (from HF_ENDPOINT or the Hugging Face cache), verified against the "
                    "registry's pins, into DIR/{repo}/resolve/{commit}/{file}; place the builds' export archives in "
                    "DIR/builds/ with their sha256.")
    mirror.add_argument("directory", metavar="DIR", help="the mirror's root (a static server serves it as HF_ENDPOINT)")
    mirror.add_argument("names", nargs="*", metavar="NAME", help="registry entries to mirror (instead of --plan)")
    mirror.add_argument("--plan", metavar="PLAN.json", help="the JSON of `hotfit --json fleet plan`: its machines' models "
                                                           "and its builds")
    mirror.add_argument("--registry", metavar="FILE", help="curated registry file (default: the bundled one): the "
                                                           "only pins trusted")
    mirror.add_argument("--builds", metavar="DIR", help="where the export archives are (llama-server-<flavour>.tar.gz, "
                                                        "as fleet plan's export commands name them)")
    mirror.set_defaults(handler=run_mirror)
    fleet_endpoints.add_parser(fsub, parents)  # `fleet endpoints`: pipeline.cli.fleet_endpoints


def run_plan(args: argparse.Namespace, ctx: CliContext) -> int:
    fleet = plan_fleet(ctx.settings, selection_from_args(args), args.paths,
                       manifests=Path(args.manifests) if args.manifests else None)
    if args.csv and not ctx.json:
        ctx.out.write(fleet_csv(fleet, args.csv))
        ctx.out.flush()
    else:
        ctx.emit(fleet.to_json(), fleet_text(fleet))
    return fleet.exit_code


def run_mirror(args: argparse.Namespace, ctx: CliContext) -> int:
    registry = Path(args.registry) if args.registry else None
    if bool(args.plan) == bool(args.names):
        raise UsageError("fleet mirror: give --plan PLAN.json or entry names (one of the two)",
                         hint="e.g. hotfit fleet mirror /srv/mirror --plan plan.json")
    if args.plan:
        wanted, builds = wanted_from_plan(Path(args.plan), registry)
    else:
        wanted, builds = entries_named({n: 1 for n in args.names}, registry), []
    result = anyio.run(functools.partial(fill_mirror, ctx.settings, Path(args.directory), wanted, builds=builds,
                                         builds_from=Path(args.builds) if args.builds else None))
    ctx.report(result.to_json(), mirror_text(result))
    return result.exit_code


def mirror_text(result: MirrorResult) -> str:
    lines = [f"mirror {result.directory}:"]
    for f in result.files:
        a = f.artifact
        what = f"{a.repo}/resolve/{a.revision or '?'}/{a.file or '*'}"
        extra = f" ({f.fetched_bytes} bytes fetched)" if f.status == "fetched" else ""
        lines.append(f"  {f.status:8} {what}{extra}" + (f"\n           {f.reason}" if f.reason else ""))
    for b in result.builds:
        if b.status == "missing":
            lines.append(f"  missing  build {b.flavour}: make it with `{b.export_command}`, then pass --builds DIR")
        else:
            lines.append(f"  {b.status:8} build {b.flavour}: {b.path} sha256 {b.sha256}")
    data = result.to_json()
    lines.append(f"{data['fetched_bytes']} bytes fetched; the mirror holds {data['mirror_bytes']} bytes. Serve "
                 f"{result.directory} with any static file server and set HF_ENDPOINT to its URL (docs/fleet.md).")
    return "\n".join(lines)


def fleet_csv(fleet: FleetPlan, table: str) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    if table == "machines":
        w.writerow(("machine", "status", "model", "backend", "device_index", "device_kind", "device_name",
                    "hot_context_tokens", "decode_tokens_per_s", "first_token_s", "kv_cache_type", "build", "arch",
                    "reason", "probe_file"))
        for m in fleet.machines:
            j = m.to_json()
            d = j["device"] or {}
            speed = j["speed_predicted"] or {}
            w.writerow((m.name, m.status, j["model"], j["backend"], d.get("index"), d.get("kind"), d.get("name"),
                        j["hot_context_tokens"], speed.get("decode_tokens_per_s"), speed.get("first_token_s"),
                        j["kv_cache_type"], j["build"], m.arch, m.reason, m.probe_file))
    elif table == "artifacts":
        w.writerow(("role", "repo", "revision", "file", "size_bytes", "sha256", "pinned", "entries", "machines"))
        for a in fleet.artifacts:
            w.writerow((a.role, a.repo, a.revision, a.file, a.size_bytes, a.sha256, a.pinned, " ".join(a.entries),
                        a.machines))
    else:
        w.writerow(("flavour", "arch", "machines", "cuda_architectures", "export_command"))
        for b in fleet.builds:
            w.writerow((b.flavour, b.arch, b.machines, ";".join(b.cuda_architectures), b.export_command))
    return buf.getvalue()


def _machines(n: int) -> str:
    return f"{n} machine" + ("" if n == 1 else "s")


def _tally(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items()) or "none"


def _predicted_speed(predicted: dict[str, Any] | None) -> tuple[str, str]:
    """The pick's predicted generation tokens/s and first-token time (registry/speed.py), "-" when none."""
    p = predicted or {}
    gen, first = p.get("decode_tokens_per_s"), p.get("first_token_s")
    return ("-" if not isinstance(gen, (int, float)) else f"{gen:.1f}",
            "-" if not isinstance(first, (int, float)) else fmt_seconds(first))


def fleet_text(fleet: FleetPlan) -> str:
    s = fleet.summary()
    sel = fleet.selection
    lines = [f"fleet: {s['machines']} machines: {s['planned']} planned, {s['refused']} refused, {s['errors']} "
             f"unreadable   (KV {sel.cache_type.name} ({sel.kv_cache_type_source}), origin {sel.origin or 'auto'}, "
             f"backend {sel.options.backend})", ""]
    rows = [("MACHINE", "STATUS", "MODEL", "DEVICE", "WINDOW", "KV", "GEN/S", "1ST TOKEN", "BUILD / REASON")]
    for m in fleet.machines:
        j = m.to_json()
        d = j["device"]
        device = "-" if d is None or m.status != "planned" else f"[{d['index']}] {d['kind']} {d['name']}"
        tail = j["build"] or "-" if m.status == "planned" else (m.reason or "")
        gen, first = _predicted_speed(j["speed_predicted"])
        rows.append((m.name, m.status, j["model"] or "-", device, str(j["hot_context_tokens"] or "-"),
                     j["kv_cache_type"] or "-", gen, first, tail))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1] for r in rows]
    lines += ["", f"models    {_tally(s['per_model'])}", f"backends  {_tally(s['per_backend'])}",
              f"builds    {_tally(s['per_build'])}", f"refused   {s['refused']}   unreadable {s['errors']}", ""]
    unsized = f", {s['unsized_artifacts']} of unknown size" if s["unsized_artifacts"] else ""
    lines.append(f"mirror: {len(fleet.artifacts)} files, {fmt_bytes(fleet.mirror_bytes)} ({fleet.mirror_bytes} "
                 f"bytes), each once{unsized}")
    for a in fleet.artifacts:
        size = "?" if a.size_bytes is None else str(a.size_bytes)
        pin = "" if a.pinned else "   (not pinned by revision, size and sha256)"
        lines.append(f"  {a.role:9} {a.repo}/resolve/{a.revision or '?'}/{a.file or '*'}  {size} bytes  "
                     f"sha256 {a.sha256 or '?'}  ({_machines(a.machines)}){pin}")
    lines += ["", "builds to make:" if fleet.builds else "builds to make: none"]
    for b in fleet.builds:
        caps = ""
        if b.unknown_capability_machines:
            caps = (f"   ({_machines(b.unknown_capability_machines)} recorded no compute capability: "
                    "save their probes with NVML present)")
        lines.append(f"  {b.flavour} ({b.arch}, {_machines(b.machines)}): {b.export_command}{caps}")
    if any(m.arch is None for m in fleet.machines if m.status == "planned"):
        lines.append("  note: some probes do not name their CPU architecture (saved by an older hotfit): "
                     "x86_64 assumed for their builds")
    return "\n".join(lines)
