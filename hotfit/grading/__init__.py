"""hotfit's multi-turn tool-use grade: pure core (docs/grade.md).

- :mod:`grading.world` — stateful environments (files, calendar, shop), tools by name, no I/O;
- :mod:`grading.schema` — the flat JSON-Schema subset the tool arguments are checked against;
- :mod:`grading.scenarios` — scripted scenarios with reference solutions, tiers, pack hash;
- :mod:`grading.protocol` — the one chat boundary to a model server: :class:`ChatReply`,
  :class:`ChatFailed` and the grade's :class:`ChatEndpoint`;
- :mod:`grading.preflight` — does the server's template carry tools, a call and its result;
- :mod:`grading.runner` — runs a scenario and decides its outcome class;
- :mod:`grading.report` — score, verdict, speeds, the human summary.

The effectful runner (HTTP endpoint, budget, files, events) is :mod:`stages.grade`.
"""

from __future__ import annotations

from hotfit.grading.protocol import SAMPLING, ChatEndpoint, ChatFailed, ChatReply, ServerFacts
from hotfit.grading.report import GRADE_VERSION, Verdict, decide_verdict
from hotfit.grading.runner import MODEL_FAILURES, STACK_FAILURES, ScenarioResult, run_scenario
from hotfit.grading.scenarios import SCENARIOS, TIERS, Scenario, pack_hash, scenarios_for

__all__ = [
    "GRADE_VERSION",
    "MODEL_FAILURES",
    "SAMPLING",
    "SCENARIOS",
    "STACK_FAILURES",
    "TIERS",
    "ChatEndpoint",
    "ChatFailed",
    "ChatReply",
    "Scenario",
    "ScenarioResult",
    "ServerFacts",
    "Verdict",
    "decide_verdict",
    "pack_hash",
    "run_scenario",
    "scenarios_for",
]
