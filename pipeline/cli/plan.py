"""hotfit plan: which curated model fits, with every candidate's verdict and the budget."""

from __future__ import annotations

import argparse
import sys

from backends.llama_server import gpu_listing_binaries
from pipeline.cli.context import CliContext
from pipeline.registry_file import load_registry
from registry.select import normalize_origin
from stages.plan import build_plan, describe, outcome_json, resolve_kv_cache_type
from stages.probe import load_probe_file, probe_devices


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe-file", metavar="FILE", help="use a saved probe (hotfit probe --json) instead of probing")
    p.add_argument("--kv-cache-type", metavar="TYPE",
                   help="KV cache type to plan for (default: $CONTENOX_LLAMA_KV_CACHE_TYPE, unset = f16)")
    p.add_argument("--backend", choices=("llama", "openvino"), default="llama", help="backend (default llama)")
    p.add_argument("--registry", metavar="FILE", help="curated registry file (default: the bundled one)")
    p.add_argument("--device", metavar="KIND|INDEX",
                   help="plan only this device: a kind (nvidia, amd, cpu, ...) or a probe index "
                        "(default: plan every device and take the best plan)")


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", parents=parents, help="plan the model and hot context for this machine",
                       description="Select the largest curated agentic model that holds >= 32768 hot tokens.")
    add_plan_options(p)
    p.add_argument("--origin", metavar="ORIGIN", help="publisher origin: us, eu, china, gus, or auto (default: any)")
    p.add_argument("--previous", metavar="NAME", help="keep this model while it still qualifies")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    # Validate the cheap inputs before probing hardware.
    cache_type, source = resolve_kv_cache_type(args.kv_cache_type, ctx.settings.kv_cache_type_raw)
    origin = normalize_origin(args.origin)
    registry = load_registry(args.registry)
    probe = (load_probe_file(args.probe_file) if args.probe_file
             else probe_devices(ggml_binaries=gpu_listing_binaries(ctx.settings)))
    outcome = build_plan(probe, registry.entries, cache_type, source, origin=origin, backend=args.backend,
                         previous=args.previous, device=args.device)
    ctx.emit(outcome_json(outcome), describe(outcome))
    refusal = outcome.selection.refusal
    if outcome.plan is None and refusal is not None:
        err = refusal.error()
        sys.stderr.write(f"hotfit: error: {refusal.message.splitlines()[0]}\n")
        return err.exit_code
    return 0
