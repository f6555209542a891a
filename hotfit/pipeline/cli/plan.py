"""hotfit plan: which curated model fits, with every candidate's verdict and the budget."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from hotfit.core.entry import DEFAULT_BACKEND, backend_names
from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.provision import SelectionOptions, plan_machine
from hotfit.registry.select import MIN_AGENTIC_HOT_CONTEXT
from hotfit.registry.speed import DEFAULT_AGENT_PROMPT_TOKENS
from hotfit.pipeline.cli.render import plan_text
from hotfit.planner.document import outcome_json


def add_selection_options(p: argparse.ArgumentParser) -> None:
    """The options every selection takes — one machine's (plan, auto) or a fleet's (fleet plan);
    ``selection_from_args`` reads them (with ``--origin``/``--previous`` where the command has them)."""
    p.add_argument("--kv-cache-type", metavar="TYPE",
                   help="KV cache type to plan for (default: $CONTENOX_LLAMA_KV_CACHE_TYPE, unset = f16)")
    p.add_argument("--backend", choices=backend_names(), default=DEFAULT_BACKEND, help=f"backend (default {DEFAULT_BACKEND})")
    p.add_argument("--registry", metavar="FILE", help="curated registry file (default: the bundled one)")
    add_speed_options(p)


def add_origin_previous_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--origin", metavar="ORIGIN", help="publisher origin: us, eu, china, gus, or auto (default: any)")
    p.add_argument("--previous", metavar="NAME", help="keep this model while it still qualifies")


def selection_from_args(args: argparse.Namespace) -> SelectionOptions:
    """The :class:`SelectionOptions` of ``hotfit plan`` / ``hotfit fleet plan`` as parsed."""
    return SelectionOptions(
        kv_cache_type_flag=args.kv_cache_type, origin=args.origin, backend=args.backend,
        registry_file=Path(args.registry) if args.registry else None, previous=args.previous,
        device=getattr(args, "device", None), admit_graded=getattr(args, "admit_graded", False),
        agent_prompt_tokens=args.agent_prompt_tokens, min_decode_tokens_per_s=args.min_decode_tokens_per_s,
        max_first_token_s=args.max_first_token_s, min_context_tokens=args.min_context)


def add_plan_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--probe-file", metavar="FILE", help="use a saved probe (hotfit probe --json) instead of probing")
    add_selection_options(p)
    p.add_argument("--device", metavar="KIND|INDEX",
                   help="plan only this device: a kind (nvidia, amd, cpu, ...) or a probe index "
                        "(default: plan every device and take the best plan)")
    p.add_argument("--admit-graded", action="store_true",
                   help="also pick a tool-chat model whose full-tier `hotfit grade` passed on this machine, while "
                        "its fingerprint (model file, template, backend build, grade version, scenario pack) "
                        "still matches (<home>/grades/evidence.json); default: curated agentic models only")


def _positive_number(flag: str) -> Callable[[str], float]:
    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not (0 < value < float("inf")):
            raise argparse.ArgumentTypeError(f"{flag} takes a positive number, got {raw!r}")
        return value
    return parse


def _tokens(flag: str, low: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"{flag} takes a whole number of tokens >= {low}, got {raw!r}"
                                             + (" (the spec's agentic floor)" if low == MIN_AGENTIC_HOT_CONTEXT else ""))
        return value
    return parse


def add_speed_options(p: argparse.ArgumentParser) -> None:
    """The speed prediction's prompt and the opt-in floors (registry/speed.py; docs/usage.md)."""
    p.add_argument("--agent-prompt-tokens", metavar="TOKENS", type=_tokens("--agent-prompt-tokens", 1),
                   default=DEFAULT_AGENT_PROMPT_TOKENS,
                   help=f"predict speed for an agent prompt of this many tokens (default {DEFAULT_AGENT_PROMPT_TOKENS})")
    p.add_argument("--min-decode-tokens-per-s", metavar="X", type=_positive_number("--min-decode-tokens-per-s"),
                   help="pick only a model predicted to generate at least X tokens/s after the agent prompt "
                        "(default: $HOTFIT_MIN_DECODE_TOKENS_PER_S, unset = no floor)")
    p.add_argument("--max-first-token-s", metavar="S", type=_positive_number("--max-first-token-s"),
                   help="pick only a model predicted to answer the agent prompt's first token within S seconds "
                        "(default: $HOTFIT_MAX_FIRST_TOKEN_S, unset = no floor)")
    p.add_argument("--min-context", metavar="TOKENS", type=_tokens("--min-context", MIN_AGENTIC_HOT_CONTEXT),
                   help=f"pick only a model that holds at least this many hot tokens (at least "
                        f"{MIN_AGENTIC_HOT_CONTEXT}; coding harnesses ask for 65536)")


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", parents=parents, help="plan the model and hot context for this machine",
                       description="Select the largest curated agentic model that holds >= 32768 hot tokens.")
    add_plan_options(p)
    add_origin_previous_options(p)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace, ctx: CliContext) -> int:
    outcome = plan_machine(ctx.settings, selection_from_args(args), probe_file=args.probe_file)
    ctx.emit(outcome_json(outcome), plan_text(outcome))
    refusal = outcome.selection.refusal
    if outcome.plan is None and refusal is not None:
        err = refusal.error()
        sys.stderr.write(f"hotfit: error: {refusal.message.splitlines()[0]}\n")
        return err.exit_code
    return 0
