"""hotfit pull NAME: fetch-weights -> fetch-template -> verify for one named entry (pipeline.pull).

The name is explicit: no fallback to another model or origin. Files go to
``Settings.model_dir(NAME)``; a rerun resumes an interrupted download and skips verified files.
One pull per model directory at a time: a second one exits 6 naming the holder's PID, or queues
behind it with ``--wait``.
"""

from __future__ import annotations

import argparse

import anyio

from hotfit.core.errors import UsageError
from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.pull import PullResult, pull_named


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pull", parents=parents, help="download and verify one named registry entry",
                       description="Resumable, pinned, verified download of one registry entry (no fallback).")
    p.add_argument("name", help="registry entry name (hotfit registry list)")
    p.add_argument("--registry", metavar="FILE", help="registry file (default: the bundled one)")
    p.add_argument("--connections", type=int, metavar="N", help="parallel byte ranges per large file")
    p.add_argument("--wait", action="store_true", help="wait for another process holding the file lock")
    p.set_defaults(handler=run)


def _human(result: PullResult) -> str:
    lines = [f"pulled {result.entry} into {result.directory}"]
    f = result.fetch
    if f.weights is not None:
        w = f.weights
        how = "already present" if w.already_present else (
            f"from the Hugging Face cache ({w.hf_cache})" if w.hf_cache else
            f"{w.bytes_transferred} bytes over {w.connections} connection(s)"
            + (f", resumed from {w.resumed_from_bytes}" if w.resumed_from_bytes else ""))
        against = result.verify.verified_against
        lines.append(f"  weights   {w.path} ({w.size_bytes} bytes, sha256 {w.sha256[:16]}…, "
                     f"verified against {'+'.join(against) or 'receipt'}; {how})")
    if f.snapshot is not None:
        s = f.snapshot
        lines.append(f"  snapshot  {s.directory} at {s.commit} ({s.files} files, {s.size_bytes} bytes)")
    t = result.template
    if t.path:
        snap = f.snapshot
        origin = (f"read from the snapshot's {t.source.rsplit('/', 1)[-1]}; "
                  if snap is not None and t.source and t.source.startswith(f"{snap.repo}@{snap.commit}/") else "")
        lines.append(f"  template  {t.path} ({origin}{t.variant}; tool markers: {', '.join(t.tool_markers)})")
    else:
        lines.append("  template  none named by the entry"
                     + (" (the GGUF embeds one)" if result.verify.gguf_embeds_chat_template else ""))
    lines.append(f"  vision    {'yes' if result.verify.vision else 'no'}")
    for warning in f.warnings:
        lines.append(f"  warning   {warning}")
    return "\n".join(lines)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    if args.connections is not None and not 1 <= args.connections <= 32:
        raise UsageError(f"--connections {args.connections} is not from 1 to 32", hint="e.g. --connections 4")
    result = anyio.run(lambda: pull_named(args.name, args.registry, ctx.settings, connections=args.connections,
                                          wait=args.wait))
    ctx.report(result.to_json(), _human(result))
    return 0
