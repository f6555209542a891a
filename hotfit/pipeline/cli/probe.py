"""hotfit probe: what memory this machine offers (NVML, AMD sysfs, or host RAM)."""

from __future__ import annotations

import argparse
from pathlib import Path

from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.cli.render import probe_text
from hotfit.pipeline.probe import probe_machine
from hotfit.stages.probe import probe_document, this_machine


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("probe", parents=parents, help="probe device memory",
                       description="Probe device memory: NVIDIA via NVML, AMD via sysfs, else host RAM.")
    p.add_argument("--save", metavar="FILE", help="also write the probe JSON to FILE (for --probe-file)")
    p.add_argument("--remeasure", action="store_true",
                   help="measure the host's memory bandwidth again instead of the cached figure (e.g. when it was "
                        "measured on a busy machine)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    result = probe_machine(ctx.settings, save=Path(args.save) if args.save else None, remeasure=args.remeasure)
    text = probe_text(result) + (f"\nsaved to {args.save}" if args.save else "")
    ctx.emit(probe_document(result, this_machine()), text)
    return 0
