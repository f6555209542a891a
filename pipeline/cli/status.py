"""hotfit status: each stage's state for the current run and what a rerun would do."""

from __future__ import annotations

import argparse

from pipeline.cli import not_implemented


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("status", parents=parents, help="show stage state and the provisioned model")
    p.set_defaults(handler=not_implemented("status"))
