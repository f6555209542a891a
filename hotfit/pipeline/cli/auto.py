"""hotfit auto: the whole pipeline, resumable (probe -> plan -> fetch -> verify -> load -> probe call -> re-check).

The operator surface follows contenox's own ``auto`` (contenox-auto-facts.md, "The `auto`
command"): origin as a positional argument or ``--origin``; ``--dry-run`` prints the probe, the
plan and whether the previous model is reused, as JSON, and changes nothing; ``--refresh``
selects afresh instead of keeping the previous model; the KV type it planned with is printed,
with a hint in the summary when it is unset (``-q`` prints no summary: nothing on success); the disk is checked before download (artifact + projector +
512 MiB). ``--model NAME`` runs the same pipeline for one named entry (tool-chat allowed, no
fallback). A completed provisioning that still holds makes ``auto`` a fast no-op (exit 0)
unless ``--recheck``. ``--grade`` adds the multi-turn tool-use grade after the re-check; its verdict
goes into the manifest and does not change the exit status (see :mod:`pipeline.auto`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import anyio

from hotfit.backends.select import backend_for
from hotfit.core.errors import UsageError
from hotfit.planner.plan import Plan
from hotfit.grading.scenarios import TIERS
from hotfit.pipeline.auto import AutoOutcome, provision
from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.cli.grade import evidence_change
from hotfit.pipeline.cli.plan import add_plan_options
from hotfit.pipeline.cli.render import speed_lines
from hotfit.pipeline.manifest import Manifest
from hotfit.pipeline.provision import AutoOptions
from hotfit.pipeline.session_stages import GradeOptions


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("auto", parents=parents, help="provision the best model this machine can run",
                       description="Run every stage; a rerun resumes where the last one stopped.")
    p.add_argument("origin_pos", nargs="?", metavar="ORIGIN", help="publisher origin: us, eu, china, gus, auto")
    p.add_argument("--origin", metavar="ORIGIN", help="same as the positional ORIGIN")
    add_plan_options(p)
    p.add_argument("--skip-speed-check", action="store_true",
                   help="do not measure the opened model's speed on an agent-sized prompt after re-check "
                        "(docs/usage.md, 'Speed'); never skipped otherwise")
    p.add_argument("--model", metavar="NAME", help="provision this registry entry (tool-chat allowed; no fallback)")
    p.add_argument("--dry-run", action="store_true", help="print probe, plan and reuse decision as JSON; change nothing")
    p.add_argument("--refresh", action="store_true", help="select afresh instead of keeping the previous model")
    p.add_argument("--recheck", action="store_true", help="re-run load, probe call and re-check on a finished provisioning")
    p.add_argument("--wait", action="store_true", help="wait for another hotfit holding this --home")
    p.add_argument("--grade", action="store_true",
                   help="also grade multi-turn tool use of the opened model (recorded in the manifest; "
                        "a failed or inconclusive grade does not fail auto)")
    p.add_argument("--grade-tier", choices=TIERS, default="full", help="with --grade: quick (6 scenarios) or full (16)")
    p.add_argument("--grade-budget-s", type=float, metavar="S",
                   help="with --grade: stop the grade after S seconds as inconclusive")
    p.set_defaults(handler=handler)


def grade_from_args(args: argparse.Namespace) -> GradeOptions | None:
    if not args.grade:
        if args.grade_budget_s is not None or args.grade_tier != "full":
            raise UsageError("--grade-tier/--grade-budget-s need --grade", hint="add --grade, or drop them")
        return None
    if args.grade_budget_s is not None and not args.grade_budget_s > 0:
        raise UsageError(f"--grade-budget-s {args.grade_budget_s:g} must be a positive number of seconds",
                         hint="e.g. --grade-budget-s 600")
    return GradeOptions(tier=args.grade_tier, budget_s=args.grade_budget_s)


def options_from_args(args: argparse.Namespace) -> AutoOptions:
    if args.origin_pos and args.origin and args.origin_pos != args.origin:
        raise UsageError(f"two origins given: {args.origin_pos!r} and --origin {args.origin!r}",
                         hint="give the origin once, as ORIGIN or as --origin")
    return AutoOptions(
        origin=args.origin or args.origin_pos,
        model=args.model,
        backend=args.backend,
        kv_cache_type_flag=args.kv_cache_type,
        probe_file=Path(args.probe_file) if args.probe_file else None,
        registry_file=Path(args.registry) if args.registry else None,
        refresh=args.refresh,
        recheck=args.recheck,
        dry_run=args.dry_run,
        wait=args.wait,
        device=args.device,
        admit_graded=args.admit_graded,
        agent_prompt_tokens=args.agent_prompt_tokens,
        min_decode_tokens_per_s=args.min_decode_tokens_per_s,
        max_first_token_s=args.max_first_token_s,
        min_context_tokens=args.min_context,
        skip_speed_check=args.skip_speed_check,
    )


KV_HINT = ("CONTENOX_LLAMA_KV_CACHE_TYPE is unset, so the window was planned at f16; "
           "CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0 halves what the window costs")


def kv_hint(plan: Plan) -> str | None:
    return KV_HINT if plan is not None and plan.kv_cache_type_source == "default" else None


def summary(manifest: Manifest, plan: Plan, *, noop: bool, resumed: bool = False, skipped: tuple[str, ...] = ()) -> str:
    opened = manifest.opened_context_tokens
    backend = backend_for(manifest.backend)  # what differs between servers is asked of it
    lines = [
        ("already provisioned (nothing to do): " if noop else "provisioned: ") + manifest.entry_name,
        f"  KV cache type   {manifest.kv_cache_type} ({plan.kv_cache_type_source})",
        f"  hot context     {plan.hot_context_tokens} tokens planned"
        + (f", {opened} opened at verification" if opened is not None else ""),
        f"  model           {manifest.model_path}",
        f"  chat template   {backend.template_summary(manifest.template_path)}",
        f"  tool-call probe {'passed' if manifest.probe_verdict.get('passed') else 'FAILED'}"
        + (f" ({manifest.probe_verdict.get('generation_tokens_per_s'):.1f} tok/s generation)"
           if manifest.probe_verdict.get("generation_tokens_per_s") else ""),
        f"  KV allocation   {manifest.measured.get('actual_kv_bytes')} bytes "
        f"(estimate {manifest.measured.get('estimated_kv_bytes')}, ratio {manifest.measured.get('kv_ratio')})",
    ]
    lines += [f"  WARNING         {w}" for w in manifest.measured.get("warnings") or ()]  # the re-check's
    lines += speed_lines(plan.speed_predicted, manifest.speed)
    if manifest.grade:
        g = manifest.grade
        lines.append(f"  grade           {str(g.get('verdict')).upper()} {g.get('passed')}/{g.get('total')} "
                     f"({g.get('tier')} tier)" + (f", {g['stack_problem']}" if g.get("stack_problem") else "")
                     + f": {g.get('path')}")
    admitted = manifest.extra.get("admitted_by_grade")
    if admitted:
        e = admitted["evidence"]
        lines.append(f"  admitted by grade  tool-chat, selected on its full-tier pass {e['passed']}/{e['total']} "
                     f"of {e['graded_at']} (--admit-graded; {e['grade_record']})")
    if plan.reused_previous:
        lines.append("  kept the previous model (it still qualifies; --refresh selects afresh)")
    if resumed:
        lines.append(f"  resumed an interrupted run; reused: {', '.join(skipped) or 'nothing'}")
    lines.append(f"  serve it with: {backend.serve_hint}")
    return "\n".join(lines)


def render(outcome: AutoOutcome) -> str:
    """The human summary of what ``hotfit auto`` did."""
    if outcome.kind == "dry_run" or outcome.manifest is None:
        return json_text(outcome.data)
    text = summary(outcome.manifest, outcome.plan, noop=outcome.kind == "noop", resumed=outcome.resumed,
                   skipped=outcome.skipped)
    evidence = outcome.data.get("grade_evidence")
    if evidence:
        text += f"\n  grade evidence  {evidence_change(evidence)}: {evidence['why']}"
    hint = kv_hint(outcome.plan)
    if hint:  # part of the summary on stdout, so -q (and a no-op under cron) prints nothing
        text += f"\n  hint: {hint}"
    return text


def json_text(data: Any) -> str:
    return json.dumps(data, indent=2, default=str)


def handler(args: argparse.Namespace, ctx: CliContext) -> int:
    opts = options_from_args(args)
    outcome = anyio.run(provision, opts, ctx.settings, grade_from_args(args))
    hint = kv_hint(outcome.plan)
    show = ctx.emit if outcome.kind == "dry_run" else ctx.report  # a dry run's output is what was asked for
    show(outcome.data | ({"kv_cache_type_hint": hint} if hint else {}), render(outcome))
    return 0
