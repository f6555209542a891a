"""hotfit verify [NAME ...]: re-hash every installed model file against its receipt, on demand.

A file damaged in place (same size, other bytes) is found only by its hash; ``auto`` trusts a
receipt without reading the file, so this is how an operator checks a fleet's disks (docs/faults.md).
Each damaged file is removed with its receipt and named with both hashes (exit 4); ``hotfit pull
NAME`` or ``hotfit auto`` then fetches it again. ``pull`` and ``auto --recheck`` re-hash what they
trust on their own.
"""

from __future__ import annotations

import argparse

from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.verify import verify_installed
from hotfit.stages.verify import InstalledFile


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("verify", parents=parents, help="re-hash installed models against their receipts",
                       description="Re-hash every installed model file (weights, projector, template, snapshot) "
                                   "against its verification receipt; a damaged file is removed and named (exit 4).")
    p.add_argument("names", nargs="*", metavar="NAME", help="installed models to check (default: all)")
    p.add_argument("--wait", action="store_true", help="wait for a pull of the same model to finish")
    p.set_defaults(handler=run)


def _line(f: InstalledFile) -> str:
    if f.ok:
        return f"  ok       {f.path} ({f.algorithm} {f.expected[:16]}…)"
    if f.actual is None:
        return f"  missing  {f.path} (its receipt says {f.algorithm} {f.expected})"
    return f"  DAMAGED  {f.path}: {f.algorithm} {f.actual}, its receipt says {f.expected} (removed)"


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    checked = verify_installed(ctx.settings, args.names, wait=args.wait)
    text = "\n".join([f"verified {len(checked)} installed file(s) in {ctx.settings.models_dir}",
                      *(_line(f) for f in checked)])
    ctx.emit({"models_dir": str(ctx.settings.models_dir), "files": [f.to_json() for f in checked],
              "damaged": 0}, text)
    return 0
