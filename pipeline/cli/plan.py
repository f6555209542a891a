"""hotfit plan: which curated model fits, with every candidate's verdict and the budget."""

from __future__ import annotations

import argparse

from pipeline.cli import not_implemented


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe-file", metavar="FILE", help="use a saved probe (hotfit probe --json) instead of probing")
    p.add_argument("--kv-cache-type", metavar="TYPE",
                   help="KV cache type to plan for (default: $CONTENOX_LLAMA_KV_CACHE_TYPE, unset = f16)")
    p.add_argument("--backend", choices=("llama", "openvino"), default="llama", help="backend (default llama)")
    p.add_argument("--registry", metavar="FILE", help="curated registry file (default: the bundled one)")


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", parents=parents, help="plan the model and hot context for this machine",
                       description="Select the largest curated agentic model that holds >= 32768 hot tokens.")
    add_plan_options(p)
    p.add_argument("--origin", metavar="ORIGIN", help="publisher origin: us, eu, china, gus, or auto (default: any)")
    p.add_argument("--previous", metavar="NAME", help="keep this model while it still qualifies")
    p.set_defaults(handler=not_implemented("plan"))
