"""hotfit probe: what memory this machine offers (NVML, AMD sysfs, or host RAM)."""

from __future__ import annotations

import argparse
from pathlib import Path

from backends.select import gpu_listing_binaries
from pipeline.cli.context import CliContext
from pipeline.cli.render import probe_text
from stages.probe import probe_devices, save_probe


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("probe", parents=parents, help="probe device memory",
                       description="Probe device memory: NVIDIA via NVML, AMD via sysfs, else host RAM.")
    p.add_argument("--save", metavar="FILE", help="also write the probe JSON to FILE (for --probe-file)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    result = probe_devices(ggml_binaries=gpu_listing_binaries(ctx.settings))
    if args.save:
        save_probe(result, Path(args.save))
    text = probe_text(result) + (f"\nsaved to {args.save}" if args.save else "")
    ctx.emit(result.to_json(), text)
    return 0
