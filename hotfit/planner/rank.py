"""The one ranking of candidates (spec: "Selection and hot context"), on one device and across
devices, and the "wins by …" sentence derived from it.

A :class:`Candidate` is one qualifying model on one device, with every figure the ranking reads
computed once, where the candidate is made. :data:`RANKING` is the ordering, term by term: each term
is a key (smaller ranks first) and the words for why the better of two candidates that first differ
on it wins. :func:`rank_key` (the sort key) and :func:`wins_by` (the explanation) both read
:data:`RANKING`, so a new term — a predicted speed, a device set — is one entry here: a field on
:class:`Candidate` and a :class:`RankTerm`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hotfit.registry.budget import ACCELERATOR_KINDS, DeviceBudget
from hotfit.registry.speed import SpeedPrediction
from hotfit.registry.verdict import Verdict


@dataclass(frozen=True)
class Candidate:
    """A qualifying verdict on one device's budget; ``kept``: the previous model, kept while it
    qualifies (spec: the caller keeps the previous model while it qualifies)."""

    verdict: Verdict
    budget: DeviceBudget
    device_index: int = 0
    kept: bool = False

    @property
    def name(self) -> str:
        return self.verdict.entry.name

    @property
    def params_b(self) -> float:
        return self.verdict.entry.params_total_b or 0.0  # eligibility requires it of every qualifying entry

    @property
    def hot_context_tokens(self) -> int:
        assert self.verdict.fit is not None  # a qualifying verdict has its fit
        return self.verdict.fit.hot_context_tokens

    @property
    def speed(self) -> SpeedPrediction | None:
        """The predicted speed, made once with the verdict (planner/select.py); not a ranking term:
        speed floors are eligibility, so a candidate below one is never ranked."""
        return self.verdict.speed

    @property
    def accelerator(self) -> bool:
        return self.budget.kind in ACCELERATOR_KINDS

    @property
    def usable_bytes(self) -> int:
        return self.budget.usable_bytes


@dataclass(frozen=True)
class RankTerm:
    """One term of the ordering: ``key`` (smaller first) and ``why`` the better of ``(a, b)`` wins on it."""

    name: str
    key: Callable[[Candidate], Any]
    why: Callable[[Candidate, Candidate], str]


_TIE = "a tie (same model and hot context): "

# The spec's ordering: larger model (parameters), larger hot context, then name; then, between
# devices offering the same model and window, an accelerator over host memory (faster), the larger
# usable budget (more room for everything else), the lower device index.
RANKING: tuple[RankTerm, ...] = (
    RankTerm("previous model", lambda c: not c.kept,
             lambda a, b: f"the previous model {a.name} still qualifying there"),
    RankTerm("parameters", lambda c: -c.params_b,
             lambda a, b: (f"the larger model ({a.name}, {a.verdict.entry.params_total_b}B parameters, over "
                           f"{b.name}, {b.verdict.entry.params_total_b}B)")),
    RankTerm("hot context", lambda c: -c.hot_context_tokens,
             lambda a, b: f"the larger hot context ({a.hot_context_tokens} over {b.hot_context_tokens} tokens)"),
    RankTerm("name", lambda c: c.name, lambda a, b: f"the name ({a.name} before {b.name})"),
    RankTerm("accelerator", lambda c: not c.accelerator,
             lambda a, b: _TIE + "the accelerator is preferred over host memory"),
    RankTerm("usable budget", lambda c: -c.usable_bytes, lambda a, b: _TIE + "the larger usable budget"),
    RankTerm("device index", lambda c: c.device_index, lambda a, b: _TIE + "the lower device index"),
)
# What "wins by" names as the ordering (the terms an operator chooses between models by).
ORDERING_WORDS = "parameters, then hot context, then name"


def rank_key(c: Candidate) -> tuple[Any, ...]:
    """The sort key of :data:`RANKING`: the best candidate sorts first."""
    return tuple(term.key(c) for term in RANKING)


def ranked(candidates: list[Candidate]) -> list[Candidate]:
    return sorted(candidates, key=rank_key)


def wins_by(best: Candidate, runner_up: Candidate) -> str:
    """Why ``best`` ranks before ``runner_up``: the first term of :data:`RANKING` they differ on."""
    for term in RANKING:
        if term.key(best) != term.key(runner_up):
            return term.why(best, runner_up)
    return _TIE + "the first listed"
