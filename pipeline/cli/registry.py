"""hotfit registry list|lock: the curated catalog."""

from __future__ import annotations

import argparse

from pipeline.cli import not_implemented


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("registry", parents=parents, help="curated registry commands")
    rsub = p.add_subparsers(dest="registry_command", metavar="SUBCOMMAND", required=True)
    lst = rsub.add_parser("list", parents=parents, help="list downloadable entries")
    lst.add_argument("--registry", metavar="FILE", help="registry file (default: the bundled one)")
    lst.set_defaults(handler=not_implemented("registry list"))
    lock = rsub.add_parser("lock", parents=parents,
                           help="resolve unpinned revisions, sizes and sha256 from the Hub (online)")
    lock.add_argument("--registry", metavar="FILE", help="registry file to update (default: the bundled one)")
    lock.add_argument("--output", metavar="FILE", help="write the locked registry here instead of in place")
    lock.set_defaults(handler=not_implemented("registry lock"))
