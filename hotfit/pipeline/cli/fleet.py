"""hotfit fleet: commands over many machines (docs/recipes.md). ``fleet endpoints`` is in
:mod:`pipeline.cli.fleet_endpoints`."""

from __future__ import annotations

import argparse

from hotfit.pipeline.cli import fleet_endpoints


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("fleet", parents=parents, help="commands over a fleet's machines")
    fsub = p.add_subparsers(dest="fleet_command", metavar="SUBCOMMAND", required=True)
    fleet_endpoints.add_parser(fsub, parents)
