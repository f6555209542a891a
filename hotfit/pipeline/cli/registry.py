"""hotfit registry list|lock: the curated catalog.

``list`` prints every entry with its agentic tier, origin, backend, parameters, download size, verified
context ceiling, automatic-selection eligibility (with the reason when excluded) and whether ``pull``
can fetch it as recorded (an entry without a pinned artifact is marked, with what to do).
``lock`` (online) pins the revisions, sizes and sha256 the registry leaves null (pipeline/registry_lock.py);
exit 0 when everything resolved, 4 when the Hub disagreed with a pinned value or could not answer.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.registry_file import load_registry
from hotfit.registry.catalog import download_blocker, entry_summary
from hotfit.pipeline.registry_lock import lock_registry


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("registry", parents=parents, help="curated registry commands")
    rsub = p.add_subparsers(dest="registry_command", metavar="SUBCOMMAND", required=True)
    lst = rsub.add_parser("list", parents=parents, help="list downloadable entries")
    lst.add_argument("--registry", metavar="FILE", help="registry file (default: the bundled one)")
    lst.set_defaults(handler=run_list)
    lock = rsub.add_parser("lock", parents=parents,
                           help="resolve unpinned revisions, sizes and sha256 from the Hub (online)")
    lock.add_argument("--registry", metavar="FILE", help="registry file to update (default: the bundled one)")
    lock.add_argument("--output", metavar="FILE", help="write the locked registry here instead of in place")
    lock.add_argument("--verify", action="store_true",
                      help="also check already-pinned entries against the Hub (report, never overwrite)")
    lock.set_defaults(handler=run_lock)


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / (1 << 30):.2f} GiB"


def _params(total: float | None, active: float | None) -> str:
    if total is None:
        return "?"
    return f"{total:g}B" + (f" (A{active:g}B)" if active is not None else "")


def _ctx(tokens: int | None) -> str:
    return "?" if tokens is None else f"{tokens // 1024}K" if tokens % 1024 == 0 else str(tokens)


def run_list(args: argparse.Namespace, ctx: CliContext) -> int:
    registry = load_registry(Path(args.registry) if args.registry else None)
    entries = list(registry.entries)
    rows = [entry_summary(e) for e in entries]
    blocked = [(e, reason) for e in entries if (reason := download_blocker(e)) is not None]
    header = ("NAME", "TIER", "ORIGIN", "BACKEND", "PARAMS", "DOWNLOAD", "CONTEXT", "AUTO", "PULL")
    table = [header] + [
        (e.name, e.agentic_tier, e.origin, e.backend, _params(e.params_total_b, e.params_active_b),
         _gib(e.weights_bytes), _ctx(e.context_limit), "yes" if e.auto_eligible else "no",
         "yes" if download_blocker(e) is None else "no")
        for e in entries
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in table]
    excluded = [e for e in entries if not e.auto_eligible]
    if excluded:
        lines += ["", "not auto-eligible (installable by name at the operator's risk once pinned):"]
        lines += [f"  {e.name}: {e.ineligible_reason}" for e in excluded]
    if blocked:
        lines += ["", "cannot be downloaded (no pinned artifact); `hotfit pull` refuses these until they are pinned:"]
        lines += [f"  {e.name}: {reason}" for e, reason in blocked]
    lines += ["", "automatic selection also requires the agentic tier; tool-chat entries are picked only by name.",
              f"registry: {registry.source}"]
    ctx.emit({"schema": 1, "registry": registry.source, "entries": rows}, "\n".join(lines))
    return 0


def run_lock(args: argparse.Namespace, ctx: CliContext) -> int:
    report = lock_registry(
        Path(args.registry) if args.registry else None,
        Path(args.output) if args.output else None,
        endpoint=ctx.settings.hf_endpoint,
        offline=ctx.settings.hf_offline,
        verify_pinned=args.verify,
        proxy_env=dict(ctx.settings.proxy_env),
    )
    lines = [f"checked {len(report.checked)} entr{'y' if len(report.checked) == 1 else 'ies'} "
             f"against {ctx.settings.hf_endpoint}: {', '.join(report.checked) or 'none needed it'}"]
    lines += [f"  pinned {c.entry} {c.field} = {c.new}" for c in report.changes]
    lines += [f"  {p.kind}: {p.entry} {p.field}: {p.message}" for p in report.problems]
    lines.append(f"wrote {report.output}" if report.output else "nothing to write")
    if report.all_failed:
        lines.append("no lookup succeeded: nothing was pinned or compared; fix what the errors name "
                     "(HF_ENDPOINT, the network, HF_TOKEN) and rerun")
    elif any(p.kind == "mismatch" for p in report.problems):
        lines.append("recorded values are never overwritten: check the source of each mismatch and fix it by hand")
    ctx.emit({"schema": 1, **report.to_json(), "exit_code": report.exit_code}, "\n".join(lines))
    return report.exit_code
