"""hotfit grade: a multi-turn tool-use grade of a running OpenAI-compatible server.

``--endpoint URL`` grades what is already serving (``hotfit serve``, a llama-server started by
hand, a server on another machine) through :mod:`stages.grade`. Without it, the provisioned model
(or ``--model NAME``, a pulled one) is opened through the same Backend as load and serve and graded
(:mod:`pipeline.grade`).

Exit status: 0 pass, 8 fail (a model failure), 9 inconclusive (a stack problem, named; or the
budget ran out), 2 usage error.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import anyio

from hotfit.core.errors import UsageError
from hotfit.grading.report import summary_text
from hotfit.grading.scenarios import TIERS
from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.grade import grade_model, grade_server
from hotfit.stages.grade import brief

EXIT_PASS, EXIT_FAIL, EXIT_INCONCLUSIVE = 0, 8, 9
_EXIT = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "inconclusive": EXIT_INCONCLUSIVE}


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "grade", parents=parents, help="grade multi-turn tool use of the provisioned model or a running server",
        description="Run hotfit's deterministic multi-turn tool-use scenarios against an OpenAI-compatible "
                    "chat endpoint and report score, per-category results, a verdict (pass / fail / "
                    "inconclusive, naming the stack problem), speeds and a fingerprint.",
        epilog="exit codes: 0 pass, 8 fail, 9 inconclusive (stack problem or budget), 2 usage error",
    )
    p.add_argument("--endpoint", metavar="URL", help="grade a running server at this base URL, e.g. "
                   "http://127.0.0.1:8080 (default: open the provisioned model through its backend)")
    p.add_argument("--api-key-file", metavar="FILE", help="file whose first line is the server's API key")
    p.add_argument("--model", metavar="NAME", help="grade this pulled registry entry instead of the provisioned model "
                   "(planned for this machine like `hotfit plan --model NAME`)")
    p.add_argument("--registry", metavar="FILE", help="registry file for --model (default: the bundled one)")
    p.add_argument("--probe-file", metavar="FILE", help="plan --model against this saved probe (hotfit probe --save)")
    p.add_argument("--tier", choices=TIERS, default="full",
                   help="quick: 6 scenarios for CPU machines (a pass is provisional); full: 16 (default)")
    p.add_argument("--budget-s", type=float, metavar="S",
                   help="stop after S seconds with an inconclusive verdict instead of running past it")
    p.add_argument("--output", metavar="FILE",
                   help="write the record (with transcripts) here (default: <home>/grades/grade-<time>-<tier>.json)")
    p.set_defaults(handler=handler)


def evidence_change(evidence: dict[str, Any]) -> str:
    """What a grade did to the model's evidence (``pipeline.evidence.record_grade``'s answer), in a word."""
    return "recorded" if evidence["recorded"] else "removed" if evidence["removed"] else "not recorded"


def evidence_text(evidence: dict[str, Any] | None) -> str:
    """One line on what the grade did to the model's evidence for ``--admit-graded``."""
    if not evidence:
        return ""
    return f"\nevidence: {evidence_change(evidence)} — {evidence['why']} ({evidence['path']})"


def _check(args: argparse.Namespace) -> None:
    if args.model and args.endpoint:
        raise UsageError("--model and --endpoint both given: grade either a model of this home or a running server",
                         hint="drop --endpoint to open NAME here, or --model to grade what the URL serves")
    if args.api_key_file and not args.endpoint:
        raise UsageError("--api-key-file needs --endpoint (a model hotfit opens itself needs no key)",
                         hint="add --endpoint URL, or drop --api-key-file")
    if (args.registry or args.probe_file) and not args.model:
        raise UsageError("--registry/--probe-file need --model NAME (the provisioned model's plan is in the manifest)",
                         hint="add --model NAME, or drop them")
    if args.endpoint and not args.endpoint.startswith(("http://", "https://")):
        raise UsageError(f"--endpoint {args.endpoint!r} is not an http(s) URL",
                         hint="give the server's base URL, e.g. http://127.0.0.1:8080")
    if args.budget_s is not None and not args.budget_s > 0:
        raise UsageError(f"--budget-s {args.budget_s:g} must be a positive number of seconds",
                         hint="e.g. --budget-s 600")


def handler(args: argparse.Namespace, ctx: CliContext) -> int:
    _check(args)
    if not args.endpoint:
        report = anyio.run(lambda: grade_model(ctx.settings, model=args.model,
                                               registry_file=Path(args.registry) if args.registry else None,
                                               probe_file=Path(args.probe_file) if args.probe_file else None,
                                               tier=args.tier, budget_s=args.budget_s,
                                               output=Path(args.output) if args.output else None))
        shown = brief(report)
        code = _EXIT[report["verdict"]["verdict"]]
        (ctx.report if code == 0 else ctx.emit)(shown, summary_text(shown) + evidence_text(report.get("evidence")))
        return code
    report = anyio.run(lambda: grade_server(ctx.settings, args.endpoint,
                                            api_key_file=args.api_key_file,
                                            tier=args.tier, budget_s=args.budget_s,
                                            output=Path(args.output) if args.output else None))
    shown = brief(report)
    code = _EXIT[report["verdict"]["verdict"]]
    (ctx.report if code == 0 else ctx.emit)(shown, summary_text(shown))
    return code
