"""The human text of ``hotfit probe`` and ``hotfit plan`` (a stage returns its result; the CLI renders it)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hotfit.planner.devices import PlanOutcome, device_label
from hotfit.planner.document import device_refusal
from hotfit.planner.probe import ProbeResult
from hotfit.registry.select import MAX_HOT_CONTEXT_TOKENS, MIN_AGENTIC_HOT_CONTEXT, fmt_bytes
from hotfit.registry.speed import fmt_seconds

__all__ = ["plan_text", "probe_text", "speed_lines"]


def _figures(p: Mapping[str, Any]) -> str:
    def num(key: str, fmt: str) -> str:
        return "?" if not isinstance(p.get(key), (int, float)) else format(p[key], fmt)
    first = fmt_seconds(p["first_token_s"]) if isinstance(p.get("first_token_s"), (int, float)) else "?"
    return (f"prefill {num('prefill_tokens_per_s', '.0f')} tok/s, first token {first} for {p.get('prompt_tokens')} "
            f"tokens, generation {num('decode_tokens_per_s', '.1f')} tok/s")


def speed_lines(predicted: Mapping[str, Any] | None, speed: Mapping[str, Any] | None = None) -> list[str]:
    """The pick's predicted speed (a plan's ``speed_predicted``, registry/speed.py) and, once measured
    (the manifest's ``speed``), the measured figures and their ratio, for the summary and ``hotfit
    status``; and the slow-first-token warning when there is one."""
    lines = []
    if isinstance(predicted, Mapping):
        lines.append(f"  speed predicted {_figures(predicted)}")
    measured = speed.get("measured") if isinstance(speed, Mapping) else None
    if isinstance(measured, Mapping) and measured.get("first_token_s") is None:
        lines.append(f"  speed measured  {measured.get('basis', 'not measured')}")
    elif isinstance(measured, Mapping):
        ratio = speed.get("ratio") if isinstance(speed, Mapping) else None
        follow = measured.get("follow_up_first_token_s")
        lines.append(f"  speed measured  {_figures(measured)}; follow-up turn first token "
                     f"{fmt_seconds(follow) if isinstance(follow, (int, float)) else '?'}"
                     + (f"; predicted/measured {', '.join(f'{k} {v}' for k, v in ratio.items())}"
                        if isinstance(ratio, Mapping) and ratio else ""))
    elif isinstance(speed, Mapping) and speed.get("skipped"):
        lines.append(f"  speed measured  not measured ({speed['skipped']})")
    if isinstance(predicted, Mapping) and predicted.get("warning"):
        lines.append(f"  WARNING         {predicted['warning']}")
    return lines


def probe_text(result: ProbeResult) -> str:
    """Human summary of a probe."""
    lines = []
    for d in result.devices:
        mark = "*" if d.index == result.preferred.index else " "
        extra = "" if d.processes_used_bytes is None else f", {d.processes_used_bytes / (1 << 30):.2f} GiB held by other processes"
        extra += "" if d.compute_capability is None else f", compute capability {d.compute_capability}"
        extra += "" if d.read_bandwidth_bytes_per_s is None else (
            f", read bandwidth {d.read_bandwidth_bytes_per_s / 1e9:.1f} GB/s"
            + ("" if d.compute_threads is None else f" with {d.compute_threads} thread(s)")
            + f" ({d.bandwidth_basis or 'probed'})")
        lines.append(f"{mark} [{d.index}] {d.kind:6} {d.name}: {d.free_bytes / (1 << 30):.2f} GiB free of "
                     f"{d.total_bytes / (1 << 30):.2f} GiB{extra}")
    lines += [f"  note: {n}" for n in result.notes]
    return "\n".join(lines)


def plan_text(outcome: PlanOutcome) -> str:
    """Human report: device, budget breakdown, every candidate with its verdict, the pick or refusal."""
    sel = outcome.selection
    b = sel.budget
    d = outcome.placement.device
    lines = [f"device   {device_label(d)}"]
    if len(outcome.devices) > 1:
        lines.append(f"why      {outcome.device_choice}")
    for dp in outcome.devices if len(outcome.devices) > 1 else ():
        what = (f"{dp.chosen_name} ({dp.chosen.fit.hot_context_tokens} hot tokens)"
                if dp.chosen is not None and dp.chosen.fit is not None
                else f"refused: {device_refusal(dp, outcome.devices)}")
        if not dp.considered:
            what = dp.unserved or f"not considered (--device {outcome.forced_device})"
        lines.append(f"  {'*' if dp.device.index == d.index else ' '} {device_label(dp.device)}: {what}")
    lines += [

        f"KV cache {sel.cache_type.name} ({outcome.kv_cache_type_source})"
        + ("" if sel.cache_type.name != "f16" else "  — q8_0 would halve what the window costs"),
        f"origin   {sel.origin or 'auto (all)'}   backend {sel.backend}   floor {MIN_AGENTIC_HOT_CONTEXT} tokens, "
        f"cap {MAX_HOT_CONTEXT_TOKENS}",
        f"budget   free {fmt_bytes(b.free_bytes)} - reserve {fmt_bytes(b.reserve_bytes)} - headroom "
        f"{fmt_bytes(b.headroom_bytes)} = usable {fmt_bytes(b.usable_bytes)} ({b.usable_bytes} bytes)",
        "",
        f"speed    predicted for a {outcome.speed.prompt_tokens}-token agent prompt on this device"
        + (f"; floors {outcome.speed.floors.flags()}" if outcome.speed.floors.flags() else ""),
        "",
        f"  {'verdict':9} {'model':28} {'hot ctx':>8} {'prefill/s':>9} {'1st token':>9} {'gen/s':>6}  reason",
    ]
    for v in sel.verdicts:
        hot = "-" if v.hot_context_tokens is None else str(v.hot_context_tokens)
        p = v.speed
        figures = (f"{'-':>9} {'-':>9} {'-':>6}" if p is None else
                   f"{p.prefill_tokens_per_s:>9.0f} {fmt_seconds(p.first_token_s):>9} {p.decode_tokens_per_s:>6.1f}")
        lines.append(f"  {v.verdict:9} {v.entry.name:28} {hot:>8} {figures}  {v.reason}")
    lines.append("")
    chosen = sel.chosen
    if chosen is not None and chosen.fit is not None:
        f = chosen.fit
        lines.append(f"selected {chosen.entry.name}: usable {fmt_bytes(b.usable_bytes)} - weights "
                     f"{fmt_bytes(f.weights_bytes)} - allowance {fmt_bytes(f.allowance_bytes)} = KV budget "
                     f"{fmt_bytes(f.kv_budget_bytes)} → {f.hot_context_tokens} hot tokens at {sel.cache_type.name} "
                     f"(KV {fmt_bytes(f.kv_bytes)})" + ("  [kept: previous model]" if sel.reused_previous else ""))
        if chosen.speed is not None:
            lines.append(f"speed    {chosen.speed.text()}")
            lines += [f"  basis: {k}: {why}" for k, why in chosen.speed.basis.items()]
    elif sel.refusal is not None:
        lines.append(sel.refusal.message)
    lines += [f"note: {n}" for n in sel.notes]
    if sel.speed_warning is not None:
        lines.append(f"WARNING: {sel.speed_warning}")
    if outcome.admission is not None:
        lines += _admission_lines(outcome)
    return "\n".join(lines)


def _admission_lines(outcome: PlanOutcome) -> list[str]:
    """--admit-graded: which tool-chat models grade evidence admitted, and why the others were not."""
    assert outcome.admission is not None
    ev = outcome.admitted_evidence
    lines = []
    if ev is not None:
        e = ev["evidence"]
        lines.append(f"admitted by grade: {e['model']} — full tier {e['passed']}/{e['total']} on this machine's "
                     f"{e['device_kind']} device, {e['graded_at']} ({e['grade_record']})")
    for r in outcome.admission.report:
        if r["status"] != "valid":
            lines.append(f"not admitted: {r['model']} on [{r['device_index']}] {r['device_kind']} — {r['reason']}")
    if not outcome.admission.report:
        lines.append(f"--admit-graded: no grade evidence recorded ({outcome.admission.evidence_file})")
    return lines
