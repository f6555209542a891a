"""Score, verdict and the grade's JSON record (pure).

Verdict rule (docs/grade.md):

- **inconclusive** when the template preflight failed, when any scenario ended in a stack
  failure, or when the budget stopped the grade early: the stack problem is named and the model
  is neither blamed nor credited (a stack failure is never "fail");
- **pass** when the scenario score is at least :data:`PASS_SCORE`, each gated category
  (:data:`GATED_CATEGORIES`) reaches :data:`CATEGORY_FLOOR`, and call validity is at least
  :data:`CALL_VALIDITY_FLOOR`; a quick-tier pass is reported as provisional;
- **fail** otherwise, with the reasons.

These thresholds are uncalibrated (no registry anchor has been graded yet); they are frozen with
:data:`GRADE_VERSION`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hotfit.grading.runner import NOT_RUN, PASS, STACK_FAILURES, ScenarioResult

__all__ = [
    "CALL_VALIDITY_FLOOR",
    "CATEGORY_FLOOR",
    "GATED_CATEGORIES",
    "GRADE_VERSION",
    "PASS_SCORE",
    "Verdict",
    "call_validity",
    "category_results",
    "decide_verdict",
    "speeds",
    "summary_text",
]

GRADE_VERSION = "grade-0.1"
PASS_SCORE = 0.75  # 12 of 16 (full), 5 of 6 (quick)
CATEGORY_FLOOR = 0.5  # so eager calling alone cannot pass (When2Call, BFCL irrelevance)
GATED_CATEGORIES = ("base", "ask", "no_call", "parallel")
CALL_VALIDITY_FLOOR = 0.90
PASS_V, FAIL_V, INCONCLUSIVE_V = "pass", "fail", "inconclusive"


@dataclass(frozen=True)
class Verdict:
    verdict: str
    reasons: tuple[str, ...] = ()
    stack_problem: str | None = None
    provisional: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "stack_problem": self.stack_problem, "reasons": list(self.reasons),
                "provisional": self.provisional}


def category_results(results: Sequence[ScenarioResult]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for r in results:
        c = out.setdefault(r.category, {"passed": 0, "total": 0})
        c["total"] += 1
        c["passed"] += r.outcome == PASS
    for c in out.values():
        c["fraction"] = round(c["passed"] / c["total"], 4)
    return dict(sorted(out.items()))


def call_validity(results: Sequence[ScenarioResult]) -> float | None:
    calls = sum(len(r.calls) for r in results)
    return None if calls == 0 else round(1 - sum(r.invalid_calls for r in results) / calls, 4)


def decide_verdict(results: Sequence[ScenarioResult], *, tier: str, preflight_problem: str | None = None,
                   budget_problem: str | None = None) -> Verdict:
    if preflight_problem:
        return Verdict(INCONCLUSIVE_V, (preflight_problem,), f"preflight_failed: {preflight_problem}")
    stack = [r for r in results if r.outcome in STACK_FAILURES]
    if stack:
        kinds = Counter(r.outcome for r in stack)
        kind, _ = kinds.most_common(1)[0]
        first = next(r for r in stack if r.outcome == kind)
        return Verdict(INCONCLUSIVE_V, tuple(f"{r.scenario_id}: {r.outcome}: {r.detail}" for r in stack),
                       f"{kind} in {kinds[kind]} of {len(results)} scenarios (first: {first.scenario_id}: {first.detail})")
    if budget_problem or any(r.outcome == NOT_RUN for r in results):
        problem = budget_problem or "the budget ran out"
        return Verdict(INCONCLUSIVE_V, (problem,), f"budget: {problem}")
    reasons: list[str] = []
    passed = sum(r.outcome == PASS for r in results)
    if not results or passed / len(results) < PASS_SCORE:
        reasons.append(f"score {passed}/{len(results)} is below {PASS_SCORE:.0%}")
    for name, c in category_results(results).items():
        if name in GATED_CATEGORIES and c["fraction"] < CATEGORY_FLOOR:
            reasons.append(f"category {name} {c['passed']}/{c['total']} is below {CATEGORY_FLOOR:.0%}")
    validity = call_validity(results)
    if validity is not None and validity < CALL_VALIDITY_FLOOR:
        reasons.append(f"call validity {validity:.0%} is below {CALL_VALIDITY_FLOOR:.0%}")
    if reasons:
        return Verdict(FAIL_V, tuple(reasons))
    return Verdict(PASS_V, (), None, provisional=tier != "full")


def speeds(results: Sequence[ScenarioResult], wall_s: float | None) -> dict[str, Any]:
    """Token rates from the server's own timings where it reported them, else None."""
    prompt_tokens = sum(r.prompt_tokens for r in results)
    generated_tokens = sum(r.generated_tokens for r in results)
    prompt_ms = sum(r.prompt_ms for r in results)
    generated_ms = sum(r.generated_ms for r in results)
    requests = sum(r.requests for r in results)
    return {
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "requests": requests,
        "prompt_tokens_per_s": round(prompt_tokens / (prompt_ms / 1000), 2) if prompt_ms > 0 else None,
        # llama-server samples each reply's first token in the prompt pass, so predicted_ms covers
        # the tokens after it; with one token per reply (a model that stops at once) there is no rate
        "generation_tokens_per_s": (round(generated_tokens / (generated_ms / 1000), 2)
                                    if generated_ms > 0 and generated_tokens > requests else None),
        "wall_s": round(wall_s, 3) if wall_s is not None else None,
    }


def summary_text(report: Mapping[str, Any]) -> str:
    """The human rendering of a report dict (what `hotfit grade` prints without --json)."""
    v = report["verdict"]
    score = report["score"]
    head = f"grade {report['grade_version']} ({report['tier']} tier) of {report['endpoint']}: {v['verdict'].upper()}"
    if v.get("provisional"):
        head += " (provisional: quick tier)"
    lines = [head, f"score {score['passed']}/{score['total']}"
             + (f", call validity {report['call_validity']:.0%}" if report.get("call_validity") is not None else "")]
    if v.get("stack_problem"):
        lines.append(f"stack problem: {v['stack_problem']}")
    for reason in v.get("reasons", [])[:8]:
        if not v.get("stack_problem"):
            lines.append(f"  reason: {reason}")
    lines.append("categories: " + ", ".join(f"{k} {c['passed']}/{c['total']}" for k, c in report["categories"].items()))
    for s in report["scenarios"]:
        lines.append(f"  {s['id']:<7} {s['category']:<17} {s['outcome']:<16} {s['detail']}"[:200])
    sp = report["speeds"]

    def rate(x: float | None) -> str:
        return "unknown" if x is None else f"{x:.1f}"

    lines.append(f"speeds: prompt {rate(sp['prompt_tokens_per_s'])} tok/s, generation "
                 f"{rate(sp['generation_tokens_per_s'])} tok/s, {sp['requests']} requests, wall {sp['wall_s']} s")
    fp = report["fingerprint"]
    lines.append("fingerprint: " + ", ".join(f"{k}={fp[k]}" for k in
                                             ("model", "chat_format", "build", "scenario_pack_sha256") if k in fp))
    if report.get("output"):
        lines.append(f"written to {report['output']}")
    return "\n".join(lines)
