"""planner/rank.py: one ranking, from which both the order and the "wins by …" sentence come.

For every term of the ranking, two candidates that differ only there: the better sorts first and
the explanation names that term — so a term added to RANKING orders and explains at once, and no
second copy of the rule (a sort key here, prose there) can drift from it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from hotfit.planner.rank import RANKING, Candidate, rank_key, ranked, wins_by
from hotfit.planner.select import select_auto
from hotfit.registry.budget import DeviceBudget, device_budget
from hotfit.registry.kv import parse_kv_cache_type
from tests.entries import MINICPM5_2B, GiB

TIER = "unit"

F16 = parse_kv_cache_type("f16")


def _base() -> Candidate:
    v = select_auto([MINICPM5_2B], device_budget("nvidia", 24 * GiB, 20 * GiB), F16).chosen
    assert v is not None
    return Candidate(v, device_budget("nvidia", 24 * GiB, 20 * GiB), device_index=1)


def _with_fit(c: Candidate, tokens: int) -> Candidate:
    assert c.verdict.fit is not None
    fit = dataclasses.replace(c.verdict.fit, hot_context_tokens=tokens)
    return dataclasses.replace(c, verdict=dataclasses.replace(c.verdict, fit=fit))


def _with_entry(c: Candidate, **changes: Any) -> Candidate:
    return dataclasses.replace(c, verdict=dataclasses.replace(c.verdict, entry=dataclasses.replace(
        c.verdict.entry, **changes)))


# (term, better, worse, words the explanation must hold) — the worse differs from the better on that term only
BETTER_WORSE: dict[str, Callable[[Candidate], tuple[Candidate, Candidate, str]]] = {
    "previous model": lambda c: (dataclasses.replace(c, kept=True), c, "previous model"),
    "parameters": lambda c: (_with_entry(c, params_total_b=9.0), _with_entry(c, params_total_b=2.5), "larger model"),
    "hot context": lambda c: (_with_fit(c, 65536), _with_fit(c, 32768), "larger hot context (65536 over 32768"),
    "name": lambda c: (_with_entry(c, name="a-model"), _with_entry(c, name="b-model"), "name (a-model before b-model)"),
    "accelerator": lambda c: (c, dataclasses.replace(c, budget=dataclasses.replace(c.budget, kind="cpu")),
                              "accelerator is preferred over host memory"),
    "usable budget": lambda c: (c, dataclasses.replace(c, budget=dataclasses.replace(
        c.budget, usable_bytes=c.budget.usable_bytes - GiB)), "larger usable budget"),
    "device index": lambda c: (dataclasses.replace(c, device_index=0), c, "lower device index"),
}


def test_every_term_of_the_ranking_is_tested() -> None:
    assert [t.name for t in RANKING] == list(BETTER_WORSE)


@pytest.mark.parametrize("term", list(BETTER_WORSE))
def test_a_candidate_better_on_one_term_ranks_first_and_the_explanation_names_that_term(term: str) -> None:
    better, worse, words = BETTER_WORSE[term](_base())
    assert rank_key(better) != rank_key(worse)
    assert ranked([worse, better]) == [better, worse]
    assert words in wins_by(better, worse)


def test_an_earlier_term_outranks_every_later_one() -> None:
    # a larger model on host memory beats a smaller one on the accelerator: parameters come first
    base = _base()
    big_on_host = dataclasses.replace(_with_entry(base, params_total_b=9.0),
                                      budget=DeviceBudget("cpu", "host", 64 * GiB, 60 * GiB, 0, 0, 50 * GiB))
    assert ranked([base, big_on_host])[0] is big_on_host
    assert "larger model" in wins_by(big_on_host, base)
