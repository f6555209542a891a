"""The child process that holds one OpenVINO GenAI pipeline (run by :mod:`backends.openvino.session`).

Why a child process and not a worker thread: GenAI's constructor and ``generate`` are C++ calls
that Python cannot cancel (a timed-out thread keeps compiling and holding memory), and an
out-of-memory during compilation would take hotfit down with it. A child can be killed at a
deadline, the OOM killer takes only it, ``OPENVINO_LOG_LEVEL`` output (printed by C++ to stdout)
lands in a log file instead of our protocol, and ``PR_SET_PDEATHSIG`` makes it die with hotfit.

Protocol: one JSON object per line on stdin (``{"op": ...}``), one JSON reply per line on the
original stdout; fd 1 itself is pointed at stderr (the log file) before GenAI is imported. Every
reply has ``ok``; failures carry ``error`` (the exception text) and ``exception`` (its type).
This module imports nothing from hotfit: it must start fast and fail only for GenAI reasons.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from typing import Any, TextIO

_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the parent's reaping still applies
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


class _Worker:
    def __init__(self) -> None:
        self.pipe: Any = None
        self.tokenizer: Any = None
        self.og: Any = None
        self.request_id = 0
        self.prompt_cap: int | None = None

    def open(self, req: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        import openvino_genai as og

        self.og = og
        sc = og.SchedulerConfig()
        s = req["scheduler"]
        sc.num_kv_blocks = int(s["num_kv_blocks"])
        sc.cache_size = int(s["cache_size"])
        sc.max_num_batched_tokens = int(s["max_num_batched_tokens"])
        sc.max_num_seqs = int(s["max_num_seqs"])
        sc.enable_prefix_caching = bool(s["enable_prefix_caching"])
        sc.dynamic_split_fuse = bool(s["dynamic_split_fuse"])
        sc.use_cache_eviction = bool(s["use_cache_eviction"])
        self.pipe = og.ContinuousBatchingPipeline(req["ir_dir"], sc, req["device"], dict(req["properties"]))
        self.tokenizer = self.pipe.get_tokenizer()
        self.prompt_cap = _prompt_cap(self.tokenizer, int(req.get("planned_tokens") or 0))
        return {
            "ok": True,
            "load_seconds": time.monotonic() - started,
            "prompt_max_tokens": self.prompt_cap,
            "genai_version": og.get_version(),
            "scheduler": sc.to_string() if hasattr(sc, "to_string") else None,
            "has_chat_template": bool(self.tokenizer.chat_template),
        }

    def render(self, req: dict[str, Any]) -> dict[str, Any]:
        history = self.og.ChatHistory(req["messages"])
        prompt = self.tokenizer.apply_chat_template(history, add_generation_prompt=True, tools=req["tools"])
        return {"ok": True, "prompt": prompt, "chat_template": self.tokenizer.chat_template}

    def generate(self, req: dict[str, Any]) -> dict[str, Any]:
        og = self.og
        ids = self.tokenizer.encode(req["prompt"], add_special_tokens=False).input_ids
        n_prompt = int(ids.get_shape()[-1])
        if self.prompt_cap is not None and n_prompt >= self.prompt_cap:  # cut by the tokenizer: never answered
            return {"ok": True, "status": "TRUNCATED", "text": "", "prompt_tokens": n_prompt, "generated_tokens": 0,
                    "seconds": 0.0, "ttft_ms": None, "tpot_ms": None, "prompt_max_tokens": self.prompt_cap}
        g = og.GenerationConfig()
        g.max_new_tokens = int(req["max_new_tokens"])
        g.do_sample = False
        g.apply_chat_template = False  # the prompt is already the template's rendering
        if req.get("structural_tag"):
            s = og.StructuredOutputConfig()
            s.structural_tags_config = req["structural_tag"]
            g.structured_output_config = s
        started = time.monotonic()
        # add_request + step, not generate(): the handle reports the status (IGNORED = did not fit
        # the cache, no exception) and the token ids, which are decoded with special tokens kept.
        self.request_id += 1
        handle = self.pipe.add_request(self.request_id, ids, g)
        while self.pipe.has_non_finished_requests():
            self.pipe.step()
        seconds = time.monotonic() - started
        status = str(handle.get_status()).rsplit(".", 1)[-1]
        outputs = handle.read_all() if status == "FINISHED" else []
        tokens = list(outputs[0].generated_ids) if outputs else []
        # Tool-call markers may be special tokens (harmony's <|call|>): never skip them here.
        text = self.tokenizer.decode(tokens, skip_special_tokens=False) if tokens else ""
        return {
            "ok": True,
            "status": status,
            "text": text,
            "prompt_tokens": n_prompt,
            "generated_tokens": len(tokens),
            "seconds": seconds,
            **_perf_metrics(handle),
        }

    def metrics(self, _req: dict[str, Any]) -> dict[str, Any]:
        m = self.pipe.get_metrics()
        return {
            "ok": True,
            "kv_cache_size_in_bytes": int(m.kv_cache_size_in_bytes),
            "cache_size_in_bytes": int(m.cache_size_in_bytes),
            "max_cache_usage": float(m.max_cache_usage),
            "requests": int(m.requests),
        }


def _prompt_cap(tokenizer: Any, planned_tokens: int) -> int | None:
    """The most tokens the export's tokenizer passes, when that is fewer than ``planned_tokens``:
    GenAI's GGUF reader bakes a limit into openvino_tokenizer.xml (8192, measured) that encode's
    ``truncation=False`` does not lift, and a longer prompt is cut without a word. A text of more
    words than the plan's tokens, then twice that text: the same count is the cap. None: no cap
    below the plan (or the vocabulary merges words, and no cap can be told)."""
    if planned_tokens <= 0:
        return None
    text = " hello" * (planned_tokens + 1)
    first = int(tokenizer.encode(text, add_special_tokens=False).input_ids.get_shape()[-1])
    if first > planned_tokens:
        return None
    second = int(tokenizer.encode(text + text, add_special_tokens=False).input_ids.get_shape()[-1])
    return first if second == first else None


def _perf_metrics(handle: Any) -> dict[str, Any]:
    """GenAI's own timing of one request (its PerfMetrics, in ms): time to the first token (the
    prompt's evaluation) and time per output token after it; None where GenAI has none (-1 with
    one generated token, or a release without per-request metrics)."""
    try:
        metrics = handle.get_perf_metrics()
        ttft_ms, tpot_ms = float(metrics.get_ttft().mean), float(metrics.get_tpot().mean)
    except (AttributeError, RuntimeError):
        return {"ttft_ms": None, "tpot_ms": None}
    return {"ttft_ms": ttft_ms if ttft_ms > 0 else None, "tpot_ms": tpot_ms if tpot_ms > 0 else None}


def _reply(out: TextIO, payload: dict[str, Any]) -> None:
    out.write(json.dumps(payload) + "\n")
    out.flush()


def main() -> int:
    parent = int(sys.argv[1]) if len(sys.argv) > 1 else os.getppid()
    _die_with_parent(parent)
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)  # C++ (OPENVINO_LOG_LEVEL, warnings) writes to stdout: send it to the log
    worker = _Worker()
    ops = {"open": worker.open, "render": worker.render, "generate": worker.generate, "metrics": worker.metrics}
    _reply(out, {"ok": True, "ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        req = json.loads(line)
        if req.get("op") == "close":
            _reply(out, {"ok": True, "closed": True})
            break
        try:
            _reply(out, ops[req["op"]](req))
        except Exception as exc:  # noqa: BLE001 - every GenAI failure goes back to the parent as text
            _reply(out, {"ok": False, "error": str(exc), "exception": type(exc).__name__})
    out.close()
    # Skip interpreter teardown: GenAI's static destructors are slow and need not run.
    os._exit(0)


if __name__ == "__main__":
    raise SystemExit(main())
