"""hotfit probe: what memory this machine offers (NVML, AMD sysfs, or host RAM)."""

from __future__ import annotations

import argparse

from pipeline.cli import not_implemented


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("probe", parents=parents, help="probe device memory",
                       description="Probe device memory: NVIDIA via NVML, AMD via sysfs, else host RAM.")
    p.add_argument("--save", metavar="FILE", help="also write the probe JSON to FILE (for --probe-file)")
    p.set_defaults(handler=not_implemented("probe"))
