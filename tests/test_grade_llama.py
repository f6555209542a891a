"""hotfit's grade against the real llama-server with the deterministic tool-call fixture.

The fixture (tests/gguf_fixtures.py) ends its turn at once under ``tool_choice: "auto"``, so
it is a real never-calling model: the grade must call that a *model* failure (wrong_state),
not a stack failure. Without a tool-capable template the preflight must make it inconclusive.
This proves plumbing (template, parser, slots, timings), not model quality. The forced-correct /
forced-wrong packs, where the same fixture is made to call (``tool_choice:
"required"`` and single-value enums) and the grade must come out 100 % pass and 0 % fail, are in
tests/test_grade_forced.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hotfit.backends.http_chat import HttpChatEndpoint
from hotfit.stages.grade import grade_endpoint
from tests.gguf_fixtures import FixtureInfo, llama_server, write_tool_call_model

TIER = "unit"

pytestmark = [pytest.mark.llama, pytest.mark.anyio]


@pytest.fixture(scope="module")
def embedded(tmp_path_factory: pytest.TempPathFactory) -> FixtureInfo:
    return write_tool_call_model(tmp_path_factory.mktemp("models") / "tool-call.gguf", embed_template=True)


async def _grade(url: str) -> dict[str, Any]:
    async with HttpChatEndpoint(url) as endpoint:
        return await grade_endpoint(endpoint, endpoint_label=url, tier="quick")


async def test_never_calling_fixture_is_a_model_failure_and_deterministic(embedded: FixtureInfo) -> None:
    with llama_server(embedded.path, n_ctx=32768, extra_args=["--jinja"]) as srv:
        first = await _grade(srv.base_url)
        second = await _grade(srv.base_url)
    outcomes = {s["id"]: s["outcome"] for s in first["scenarios"]}
    assert set(outcomes.values()) == {"wrong_state"}, outcomes
    assert first["verdict"]["verdict"] == "fail" and first["verdict"]["stack_problem"] is None
    # this build refuses slot actions without --slot-save-path: the uncached first request stands in
    assert all(s["slot"] == "fresh_prompt" and s["first_cache_n"] == 0 for s in first["scenarios"])
    assert [s["transcript_sha256"] for s in first["scenarios"]] == [s["transcript_sha256"] for s in second["scenarios"]]
    fp = first["fingerprint"]
    assert fp["model_path"] == str(embedded.path) and fp["supports_tools"] is True and fp["slots"] == 1
    assert fp["build"] != "unknown" and fp["chat_template_sha256"] != "unknown"
    assert fp["template_roundtrip"] == "ok"  # /apply-template rendered tools, the call and its result
    assert first["speeds"]["prompt_tokens"] > 0 and first["speeds"]["prompt_tokens_per_s"] > 0


async def test_slot_erase_works_when_the_server_allows_slot_actions(embedded: FixtureInfo, tmp_path: Path) -> None:
    with llama_server(embedded.path, n_ctx=32768, extra_args=["--jinja", "--slot-save-path", str(tmp_path)]) as srv:
        report = await _grade(srv.base_url)
    assert all(s["slot"] == "erased" and s["first_cache_n"] == 0 for s in report["scenarios"])
    assert report["determinism_notes"] == []


async def test_no_tool_template_is_inconclusive_not_fail(tmp_path: Path) -> None:
    plain = write_tool_call_model(tmp_path / "plain.gguf")
    with llama_server(plain.path, n_ctx=32768) as srv:
        report = await _grade(srv.base_url)
    assert report["verdict"]["verdict"] == "inconclusive"
    assert report["verdict"]["stack_problem"].startswith("preflight_failed:")
    assert report["scenarios"] == []
