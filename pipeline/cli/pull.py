"""hotfit pull NAME: fetch-weights -> fetch-template -> verify for one named entry."""

from __future__ import annotations

import argparse

from pipeline.cli import not_implemented


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pull", parents=parents, help="download and verify one named registry entry",
                       description="Resumable, pinned, verified download of one registry entry (no fallback).")
    p.add_argument("name", help="registry entry name (hotfit registry list)")
    p.add_argument("--registry", metavar="FILE", help="registry file (default: the bundled one)")
    p.add_argument("--connections", type=int, metavar="N", help="parallel byte ranges per large file")
    p.add_argument("--wait", action="store_true", help="wait for another process holding the file lock")
    p.set_defaults(handler=not_implemented("pull"))
