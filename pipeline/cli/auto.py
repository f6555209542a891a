"""hotfit auto: the whole pipeline, resumable (probe -> plan -> fetch -> verify -> load -> probe call -> re-check)."""

from __future__ import annotations

import argparse

from pipeline.cli import not_implemented
from pipeline.cli.plan import add_plan_options


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("auto", parents=parents, help="provision the best model this machine can run",
                       description="Run every stage; a rerun resumes where the last one stopped.")
    p.add_argument("origin_pos", nargs="?", metavar="ORIGIN", help="publisher origin: us, eu, china, gus, auto")
    p.add_argument("--origin", metavar="ORIGIN", help="same as the positional ORIGIN")
    add_plan_options(p)
    p.add_argument("--model", metavar="NAME", help="provision this registry entry (tool-chat allowed; no fallback)")
    p.add_argument("--dry-run", action="store_true", help="print probe, plan and reuse decision as JSON; change nothing")
    p.add_argument("--refresh", action="store_true", help="select afresh instead of keeping the previous model")
    p.add_argument("--recheck", action="store_true", help="re-run load, probe call and re-check on a finished provisioning")
    p.add_argument("--wait", action="store_true", help="wait for another hotfit holding this --home")
    p.set_defaults(handler=not_implemented("auto"))
