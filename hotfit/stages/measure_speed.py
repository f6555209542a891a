"""measure-speed: after re-check, one agent-sized prompt and a follow-up turn in the opened session,
timed by the server itself, beside the plan's prediction (registry/speed.py).

The prompt is what an agent sends first: a system prompt, a catalogue of tools with JSON-schema
parameters and a conversation, clipped to the opened window (and to ``--agent-prompt-tokens``).
The follow-up adds about 1.5k tokens on the cached prefix, as an agent's next turn does. The
figures are llama-server's own ``timings`` (``prompt_n``, ``prompt_ms``, ``predicted_per_second``);
a backend that reports none records them as null. An opt-in floor (``--min-decode-tokens-per-s``,
``--max-first-token-s``) the measured figures miss fails the run (exit 5) naming predicted and
measured. ``hotfit auto --skip-speed-check`` leaves the stage out; nothing skips it silently.
Cost: the prefill of the prompt (docs/benchmarks.md, "Predicted against measured speed").
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from hotfit.backends.base import BackendBinary, BuildUnavailable
from hotfit.backends.select import backend_for
from hotfit.core.errors import BackendError, SpeedFloorMissed, StageRecordError, UsageError
from hotfit.core.log import get_logger
from hotfit.core.records import decode_record
from hotfit.core.settings import Settings
from hotfit.grading.protocol import ChatFailed, ChatReply
from hotfit.planner.plan import Plan
from hotfit.registry.speed import DEFAULT_AGENT_PROMPT_TOKENS, Calibration, SpeedFloors, calibration_from
from hotfit.stages.declaration import StageContext, StageDeclaration
from hotfit.stages.load import SERVER_SESSION, LoadResult
from hotfit.stages.probe_tool_call import ProbeToolCallResult
from hotfit.state.files import write_text_atomic

log = get_logger()

SPEED_STAGE = "measure-speed"
SPEED_FILE = "speed.json"
# Room kept free in the window: the follow-up turn, the answers, and the template's own tokens.
WINDOW_MARGIN_TOKENS = 4096
FOLLOW_UP_TOKENS = 1536
ANSWER_TOKENS = 32
CHARS_PER_TOKEN = 4  # English prose and JSON in BPE vocabularies: 3.5-4.5 characters a token
SPEED_TIMEOUT_S = 3600.0
CALIBRATION_SCHEMA = 2  # 2: keyed by the backend build that measured it
OLD_CALIBRATION_SCHEMAS = (1,)
# Predicted past this, the check measures two shorter prompts and extrapolates (its cost stays near it).
SPEED_CHECK_BUDGET_S = 120.0
MIN_DEPTH_TOKENS = 512


def utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


# --------------------------------------------------------------------------- the prompt (pure)


def _tool(i: int) -> dict[str, Any]:
    return {"type": "function", "function": {
        "name": f"workspace_tool_{i}",
        "description": (f"Tool {i} of the workspace: reads, searches or edits files under the project root and "
                        "returns a JSON object with the result, the paths touched and any warnings. Use it when "
                        "the user's request needs the project's files; never guess their content."),
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "a path relative to the project root"},
            "pattern": {"type": "string", "description": "a regular expression to search for, if any"},
            "limit": {"type": "integer", "description": "the most results to return (default 50)"},
            "dry_run": {"type": "boolean", "description": "describe the change without making it"}},
            "required": ["path"]}}}


_TURN = ("Here is the next part of the file listing and the build log you asked for. The service reads its "
         "configuration from the environment, opens the database through a pool of connections, and every "
         "handler logs one JSON line per request with its duration and status. ")


def agent_request(prompt_tokens: int, *, fresh: bool = False, chars_per_token: float = CHARS_PER_TOKEN) -> dict[str, Any]:
    """A chat request of about ``prompt_tokens`` tokens: tools and a conversation (greedy, a short
    answer). ``fresh``: evaluated whole, not from a prefix an earlier request left in the cache.
    ``chars_per_token``: this model's (from the tool-call probe: :func:`chars_per_token`)."""
    total_chars = int(prompt_tokens * chars_per_token)
    # the catalogue takes about a quarter of the prompt, as in agent harnesses (up to 64 tools)
    n_tools = max(1, min(64, total_chars // (4 * len(json.dumps(_tool(0))))))
    tools = [_tool(i) for i in range(n_tools)]
    budget_chars = max(0, total_chars - len(json.dumps(tools)))
    history = (_TURN * (budget_chars // len(_TURN) + 1))[:budget_chars]
    return {"messages": [{"role": "system", "content": "You are a coding agent working in the user's repository."},
                         {"role": "user", "content": history},
                         {"role": "user", "content": "Summarise what you have read in one sentence."}],
            "tools": tools, "tool_choice": "none", "max_tokens": ANSWER_TOKENS, "temperature": 0.0,
            "cache_prompt": not fresh}


def sized_chars_per_token(asked_tokens: int, chars_per_token_sent: float, got_tokens: int | None) -> float:
    """This model's characters a token of the agent prompt itself, from one the server counted: the
    probe's estimate is off by its template's own tokens (Qwen2.5's tool preamble: the agent prompt
    came out at 65 % of the tokens asked, docs/benchmarks.md)."""
    if not got_tokens:
        return chars_per_token_sent
    return min(4 * CHARS_PER_TOKEN, max(1.0, int(asked_tokens * chars_per_token_sent) / got_tokens))


def chars_per_token(request: Mapping[str, Any], prompt_tokens: int | None) -> float:
    """Characters a token of this model's vocabulary holds, from a request it tokenized (the
    tool-call probe's; its template's own tokens make it an underestimate), between 1 (a byte
    vocabulary) and CHARS_PER_TOKEN: the first estimate, which :func:`sized_chars_per_token` corrects
    from the server's count of the first prompt the check sends."""
    if not prompt_tokens:
        return CHARS_PER_TOKEN
    return min(CHARS_PER_TOKEN, max(1.0, len(json.dumps(request)) / prompt_tokens))


def short_depths(wanted_tokens: int, expected_first_token_s: float | None) -> tuple[int, int] | None:
    """Two shorter prompts to extrapolate from when the predicted first token of the full one is past
    SPEED_CHECK_BUDGET_S (their prefill costs about that budget); None: measure the full prompt."""
    if expected_first_token_s is None or expected_first_token_s <= SPEED_CHECK_BUDGET_S:
        return None
    n2 = int(wanted_tokens * SPEED_CHECK_BUDGET_S / (1.5 * expected_first_token_s))
    n2 = min(max(n2, 2 * MIN_DEPTH_TOKENS), wanted_tokens // 2)
    if n2 < 2 * MIN_DEPTH_TOKENS:
        return None
    return n2 // 2, n2


def follow_up(request: Mapping[str, Any], answer: Mapping[str, Any], *,
              chars_per_token: float = CHARS_PER_TOKEN) -> dict[str, Any]:
    """The next turn on the cached prefix (sent with the prompt cache on, whatever the first turn
    was sent with): the answer, and about FOLLOW_UP_TOKENS more of the conversation (in this
    model's characters per token, as :func:`agent_request` sizes the prompt)."""
    said = ((answer.get("choices") or [{}])[0].get("message") or {}).get("content") or ""
    chars = int(FOLLOW_UP_TOKENS * chars_per_token)
    more = (_TURN * (chars // len(_TURN) + 1))[:chars]
    return {**request, "cache_prompt": True,
            "messages": [*request["messages"], {"role": "assistant", "content": said}, {"role": "user", "content": more}]}


def prompt_size(window_tokens: int | None, wanted_tokens: int) -> int:
    """The agent prompt to send: ``wanted_tokens``, clipped to the opened window less the margin."""
    if window_tokens is None:
        return wanted_tokens
    return max(512, min(wanted_tokens, window_tokens - WINDOW_MARGIN_TOKENS))


# --------------------------------------------------------------------------- the figures (pure)


@dataclass(frozen=True)
class Timing:
    prompt_tokens: int | None
    first_token_s: float | None
    decode_tokens_per_s: float | None

    @classmethod
    def of(cls, got: ChatReply) -> Timing:
        """The backend's own timings of one answer (llama-server: timings.prompt_ms and
        predicted_per_second, 0 when it generated one token only: unmeasured; OpenVINO GenAI: the
        request's time to first token and time per output token)."""
        if got.prompt_ms is not None:
            return cls(got.prompt_tokens, got.prompt_ms / 1000, got.generation_tokens_per_s or None)
        first = (got.prompt_tokens / got.prompt_tokens_per_s
                 if got.prompt_tokens and got.prompt_tokens_per_s else None)
        return cls(got.prompt_tokens, first, got.generation_tokens_per_s)


@dataclass(frozen=True)
class SpeedResult:
    """What the session measured, the plan's prediction for the same prompt length, their ratio."""

    measured: dict[str, Any]  # prompt_tokens, prefill_tokens_per_s, decode_tokens_per_s, first_token_s, follow_up_*
    predicted: dict[str, Any] | None  # the plan's speed_predicted (for its own prompt length)
    ratio: dict[str, float] = field(default_factory=dict)  # predicted / measured, where both exist

    def to_json(self) -> dict[str, Any]:
        return {"measured": dict(self.measured), "predicted": self.predicted, "ratio": dict(self.ratio)}

    @classmethod
    def decode(cls, record: Mapping[str, Any]) -> SpeedResult:
        return decode_record(cls, record)


OWN_TIMINGS = ("the backend's own timings (llama-server: timings.prompt_ms, predicted_per_second; "
               "OpenVINO GenAI: the request's TTFT and TPOT)")


def measured_figures(first: Timing, second: Timing) -> dict[str, Any]:
    prefill = (first.prompt_tokens / first.first_token_s
               if first.prompt_tokens and first.first_token_s else None)
    return {"prompt_tokens": first.prompt_tokens, "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": first.decode_tokens_per_s, "first_token_s": first.first_token_s,
            "follow_up_prompt_tokens": second.prompt_tokens, "follow_up_first_token_s": second.first_token_s,
            "basis": OWN_TIMINGS}


def extrapolated_figures(short: Timing, longer: Timing, follow: Timing, wanted_tokens: int) -> dict[str, Any]:
    """The full prompt's figures from two shorter ones: prefill time a·n + b·n² (the matmuls, and
    attention over the growing depth) through both points; a decode step's time linear in the depth;
    the follow-up turn's first token as the same curve's cost of its new tokens at the full depth."""
    n1, t1, n2, t2 = short.prompt_tokens, short.first_token_s, longer.prompt_tokens, longer.first_token_s
    if not (n1 and n2 and t1 and t2) or n1 == n2:
        return measured_figures(longer, follow) | {"basis": "the backend's own timings at a shorter prompt "
                                                            f"({n2} tokens): too little to extrapolate"}
    a, b = fit_prefill(n1, t1, n2, t2)
    first = a * wanted_tokens + b * wanted_tokens ** 2
    decode = None
    if short.decode_tokens_per_s and longer.decode_tokens_per_s:
        s1, s2 = 1 / short.decode_tokens_per_s, 1 / longer.decode_tokens_per_s
        slope = max(0.0, (s2 - s1) / (n2 - n1))
        decode = 1 / (s2 + slope * (wanted_tokens - n2))
    added = follow.prompt_tokens or 0
    follow_s = a * added + b * ((wanted_tokens + added) ** 2 - wanted_tokens ** 2) if added else None
    return {"prompt_tokens": wanted_tokens, "prefill_tokens_per_s": wanted_tokens / first,
            "decode_tokens_per_s": decode, "first_token_s": first, "follow_up_prompt_tokens": added or None,
            "follow_up_first_token_s": follow_s,
            "basis": (f"extrapolated to {wanted_tokens} tokens from the backend's own timings at {n1} and {n2} "
                      f"(the full prompt was predicted past {SPEED_CHECK_BUDGET_S:g} s)")}


def fit_prefill(n1: int, t1: float, n2: int, t2: float) -> tuple[float, float]:
    """(a, b) with t = a·n + b·n² through both points; b ≥ 0 (a prefill never gets cheaper per token
    with depth): a noisy pair that says otherwise is read as linear through the longer point."""
    det = n1 * n2 * n2 - n2 * n1 * n1
    a = (t1 * n2 * n2 - t2 * n1 * n1) / det
    b = (n1 * t2 - n2 * t1) / det
    if b < 0 or a < 0:
        return t2 / n2, 0.0
    return a, b


# The sizing prompt before a full one: a quarter of it, at most 4096 tokens, so the template's own
# tokens (Qwen2.5: ~80) are a small share of its count (prefill cost: under a quarter of the full one's)
SIZING_MAX_TOKENS = 4096


async def timed_check(ask: Callable[[dict[str, Any], str], Awaitable[ChatReply]], wanted: int,
                      depths: tuple[int, int] | None, ratio: float) -> dict[str, Any]:
    """The speed check's requests, through ``ask``: every measured prompt evaluated whole, sized in
    this model's characters per token as counted by the server on a shorter one first (a sizing
    prompt, or the first of the two depths), and the follow-up turn on its cached prefix. The full
    prompt (``depths`` None) or the two shorter ones, extrapolated to ``wanted``."""
    if depths is None:
        size = max(MIN_DEPTH_TOKENS, min(SIZING_MAX_TOKENS, wanted // 4))
        sizing = await ask(agent_request(size, fresh=True, chars_per_token=ratio), "the speed check (sizing)")
        ratio = sized_chars_per_token(size, ratio, sizing.prompt_tokens)
        request = agent_request(wanted, fresh=True, chars_per_token=ratio)
        first = await ask(request, "the speed check")
        second = await ask(follow_up(request, first.body, chars_per_token=ratio), "the speed check's follow-up turn")
        return measured_figures(Timing.of(first), Timing.of(second))
    n1, n2 = depths  # the full prompt would take too long: two shorter ones, extrapolated (docs/benchmarks.md)
    short = await ask(agent_request(n1, fresh=True, chars_per_token=ratio), "the speed check (first depth)")
    ratio = sized_chars_per_token(n1, ratio, short.prompt_tokens)
    request = agent_request(n2, fresh=True, chars_per_token=ratio)
    longer = await ask(request, "the speed check (second depth)")
    second = await ask(follow_up(request, longer.body, chars_per_token=ratio), "the speed check's follow-up turn")
    return extrapolated_figures(Timing.of(short), Timing.of(longer), Timing.of(second), wanted)


# A prompt measured this close to the predicted length is compared with the prediction (the check
# sizes it to a few percent of the tokens asked, docs/benchmarks.md); a prompt cut shorter (an
# OpenVINO tokenizer's limit) is not: a small model's prefill rate moves with the length (docs/openvino.md)
COMPARED_WITHIN = 0.25


def comparable(predicted: Mapping[str, Any] | None, measured: Mapping[str, Any]) -> bool:
    """Whether the measured prompt is within COMPARED_WITHIN of the predicted one's length."""
    n_pred, n_meas = (predicted or {}).get("prompt_tokens"), measured.get("prompt_tokens")
    if not (isinstance(n_pred, int) and isinstance(n_meas, int) and n_pred > 0 and n_meas > 0):
        return False
    return abs(n_meas / n_pred - 1) <= COMPARED_WITHIN


def ratios(predicted: Mapping[str, Any] | None, measured: Mapping[str, Any]) -> dict[str, float]:
    """predicted / measured for each figure both carry, at comparable prompt lengths (none else). The
    first token at the measured length: the predicted prefill rate's time for the measured prompt."""
    if predicted is None or not comparable(predicted, measured):
        return {}
    out = {k: round(predicted[k] / measured[k], 3) for k in ("prefill_tokens_per_s", "decode_tokens_per_s")
           if predicted.get(k) and measured.get(k)}
    first_pred, first_meas = predicted.get("first_token_s"), measured.get("first_token_s")
    if measured["prompt_tokens"] != predicted["prompt_tokens"]:
        rate = predicted.get("prefill_tokens_per_s")
        first_pred = measured["prompt_tokens"] / rate if rate else None
    if first_pred and first_meas:
        out["first_token_s"] = round(first_pred / first_meas, 3)
    return out


def floor_misses(measured: Mapping[str, Any], predicted: Mapping[str, Any] | None, floors: SpeedFloors) -> list[str]:
    """Each floor the measured figures miss, naming predicted and measured."""
    out = []
    pred = predicted or {}
    decode, first = measured.get("decode_tokens_per_s"), measured.get("first_token_s")
    if floors.min_decode_tokens_per_s is not None and decode is not None and decode < floors.min_decode_tokens_per_s:
        out.append(f"measured {decode:.1f} generated tokens/s < {floors.min_decode_tokens_per_s:g} "
                   f"(predicted {pred.get('decode_tokens_per_s', '?')})")
    if floors.max_first_token_s is not None and first is not None and first > floors.max_first_token_s:
        out.append(f"measured first token after {first:.0f} s > {floors.max_first_token_s:g} s for "
                   f"{measured.get('prompt_tokens')} prompt tokens (predicted {pred.get('first_token_s', '?')} s "
                   f"for {pred.get('prompt_tokens', '?')})")
    return out


# --------------------------------------------------------------------------- the stage


@dataclass(frozen=True)
class SpeedCheckJob:
    prompt_tokens: int = DEFAULT_AGENT_PROMPT_TOKENS
    floors: SpeedFloors = SpeedFloors()


async def measure_speed_work(ctx: StageContext) -> SpeedResult:
    job = ctx.job(SpeedCheckJob)
    plan = ctx.require_plan()
    session = ctx.result("load", LoadResult).live()
    probe = ctx.result("probe-tool-call", ProbeToolCallResult)
    ratio = chars_per_token(probe.request, probe.prompt_tokens)
    full = prompt_size(plan.hot_context_tokens, job.prompt_tokens)
    cap = session.prompt_max_tokens  # an OpenVINO export's tokenizer may cut a longer prompt
    wanted = full if cap is None else min(full, prompt_size(cap, job.prompt_tokens))
    expected_s = (plan.speed_predicted or {}).get("first_token_s")
    depths = short_depths(wanted, expected_s if isinstance(expected_s, (int, float)) else None)

    async def ask(request: dict[str, Any], what: str) -> ChatReply:
        try:
            return await session.call_tools(request, timeout_s=SPEED_TIMEOUT_S, purpose=what)
        except ChatFailed as exc:
            raise BackendError(f"speed check: {exc.what}", hint=exc.hint, cause=exc.cause, **exc.details) from None

    measured = await timed_check(ask, wanted, depths, ratio)
    if wanted < full:
        measured["basis"] += f"; the prompt kept within the {cap} tokens this export's tokenizer passes"
    predicted = dict(plan.speed_predicted) if plan.speed_predicted else None
    if predicted is not None:
        predicted.pop("warning", None)
    if measured.get("first_token_s") is None:  # recorded and logged, never silent, never calibrated on
        why = (f"not measured: the {plan.backend} backend's answers carried no prompt timing "
               "(an OpenVINO GenAI release without per-request perf metrics)")
        log.warning("speed.not_measured", backend=plan.backend, reason=why)
        return SpeedResult({"basis": why}, predicted)
    result = SpeedResult(measured, predicted, ratios(predicted, measured))
    (session.run_dir / SPEED_FILE).write_text(json.dumps(result.to_json(), indent=2) + "\n", encoding="utf-8")
    log.info("speed.measured", **{k: v for k, v in measured.items() if k != "basis"}, ratio=result.ratio)
    if predicted is not None and comparable(predicted, measured):  # later plans here start from what was measured
        calibrate(plan, ctx.settings, ctx.run_id, predicted, measured, ctx.result("load", LoadResult).binary)
    elif predicted is not None:
        log.info("speed.not_compared", predicted_prompt_tokens=predicted.get("prompt_tokens"),
                 measured_prompt_tokens=measured.get("prompt_tokens"),
                 reason="the prompt measured is not the length predicted: no ratio, no calibration")
    floors = job.floors.over(ctx.settings.min_decode_tokens_per_s, ctx.settings.max_first_token_s)
    missed = floor_misses(measured, predicted, floors)
    if missed:
        log.error("speed.floor_missed", problems=missed)
        raise SpeedFloorMissed(f"the opened session is slower than the floor: {'; '.join(missed)}",
                               hint="lower the floor, or provision a smaller model (a floor the prediction also "
                                    "misses excludes it at plan time); see " + str(session.run_dir / SPEED_FILE),
                               measured=measured, predicted=predicted)
    return result


def calibrate(plan: Plan, settings: Settings, run_id: str, predicted: dict[str, Any], measured: dict[str, Any],
              binary: BackendBinary | None) -> None:
    """Store measured / predicted for the plan's device, keyed by the build that measured it: the
    ``binary`` the load ran (the plan stage's preflight found it), or where the load found its own,
    the same search again; a build that cannot be named keeps no calibration."""
    device = plan.placement.device
    try:
        build = (binary.build_identity() if binary is not None
                 else backend_for(plan.backend).build_identity(device.kind, settings))
    except (BuildUnavailable, OSError) as exc:  # OSError: the binary's bytes could not be read to name it
        what = exc.what if isinstance(exc, BuildUnavailable) else str(exc)
        log.warning("speed.calibration_unwritten", path=str(settings.speed_calibration_path),
                    error=f"the build that measured cannot be named: {what}")
        return
    provenance = f"run {run_id} ({plan.entry.name}, {build[1]}, {utc_now()})"
    calibration = calibration_from(device, plan.backend, build, predicted, measured, provenance)
    if calibration is not None:
        write_calibration(settings.speed_calibration_path, calibration)


def write_calibration(path: Path, calibration: Calibration) -> None:
    try:
        write_text_atomic(path, json.dumps({"schema": CALIBRATION_SCHEMA, **asdict(calibration)}, indent=2) + "\n")
        log.info("speed.calibrated", path=str(path), prefill_factor=calibration.prefill_factor,
                 decode_factor=calibration.decode_factor, provenance=calibration.provenance)
    except OSError as exc:
        log.warning("speed.calibration_unwritten", path=str(path), error=str(exc))


def read_calibration(path: Path) -> Calibration | None:
    """This machine's calibration, or None (none yet; a damaged file is named in a warning and
    ignored: it is a cache of a measurement, measured again by the next run)."""
    try:
        doc = json.loads(path.read_text())
        schema = doc.pop("schema", None)
        if schema in OLD_CALIBRATION_SCHEMAS:
            log.info("speed.calibration_reset", path=str(path), reason="it does not name the build that measured it "
                     "(written by an older hotfit)", hint="the next measure-speed stores one for its build")
            return None
        if schema != CALIBRATION_SCHEMA:
            raise ValueError("unknown schema")
        cal = decode_record(Calibration, doc)
        if not (float(cal.prefill_factor) > 0 and float(cal.decode_factor) > 0):
            raise ValueError("factors must be positive")
        return cal
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError, AttributeError, StageRecordError) as exc:
        log.warning("speed.calibration_ignored", path=str(path), error=str(exc),
                    hint="it is rewritten by the next measure-speed; delete it to silence this")
        return None


def calibration_build_now(calibration: Calibration, settings: Settings) -> tuple[str, str] | None:
    """(identity, description) of the build the calibration's backend would run on its device kind
    now; None where none is found (the calibration then holds for no plan)."""
    try:
        return backend_for(calibration.backend).build_identity(calibration.device_kind, settings)
    except (BuildUnavailable, UsageError):  # no build found; a backend this hotfit no longer has
        return None


def speed_figures(result: SpeedResult) -> dict[str, Any]:
    return {**{k: v for k, v in result.measured.items() if k != "basis"}, "ratio": result.ratio}


def _inputs(ctx: StageContext) -> Any:
    job = ctx.job(SpeedCheckJob)
    floors = job.floors.over(ctx.settings.min_decode_tokens_per_s, ctx.settings.max_first_token_s)
    # Another prompt size or floor measures again, with its session: a floor is checked against figures
    # measured under it, never against a record a run without it left (the plan id leaves speed out)
    return {"plan_id": ctx.require_plan().plan_id, "prompt_tokens": job.prompt_tokens, "floors": floors.to_json()}


DECLARATION = StageDeclaration(
    SPEED_STAGE, measure_speed_work, deps=("load", "probe-tool-call", "re-check"), inputs=_inputs,
    session=SERVER_SESSION, decode=SpeedResult.decode, figures=speed_figures, version=1, result_type=SpeedResult,
    job=SpeedCheckJob())
