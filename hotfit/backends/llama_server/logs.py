"""llama-server's log files: where they are, how their lines parse, what a failed start says.

The server's stdout (JSONL with ``--log-jsonl`` when the build has it) and stderr go straight to
files in the run directory, so they survive whatever happens to hotfit; the allocation report
(:mod:`backends.llama_server.allocation`) and the failure diagnosis read them back. Pure apart
from :func:`read_server_log`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

__all__ = [
    "STDERR_LOG",
    "STDOUT_LOG_JSONL",
    "STDOUT_LOG_TEXT",
    "LogLine",
    "diagnose_load_failure",
    "parse_log_lines",
    "read_server_log",
    "relevant_log_lines",
]

STDOUT_LOG_JSONL = "llama-server.jsonl"
STDOUT_LOG_TEXT = "llama-server.log"
STDERR_LOG = "llama-server.stderr.log"


@dataclass(frozen=True)
class LogLine:
    level: str  # "info" | "warn" | "error" | "debug" | "output" | "" (plain text: unknown)
    msg: str  # one line, no trailing newline


def parse_log_lines(text: str) -> list[LogLine]:
    """Pure: llama-server log text → lines. JSONL records (``{"type":"log","level",...,"msg"}``)
    and plain text (stderr, builds without ``--log-jsonl``) are both accepted."""
    out: list[LogLine] = []
    for raw in text.splitlines():
        raw = raw.rstrip()
        if not raw:
            continue
        if raw.startswith("{"):
            try:
                rec = json.loads(raw)
            except ValueError:
                rec = None
            if isinstance(rec, dict):
                if rec.get("type") == "log":
                    for part in str(rec.get("msg", "")).splitlines():
                        if part.strip():
                            out.append(LogLine(str(rec.get("level", "")), part.rstrip()))
                else:  # typed records (e.g. fit_memory_breakdown): keep them, as JSON text
                    out.append(LogLine(str(rec.get("type", "")), raw))
                continue
        out.append(LogLine("", raw))
    return out


_FAILURE_RE = re.compile(
    r"error|failed|failure|unknown model architecture|out of memory|cannot|unable|abort|invalid|"
    r"terminate|exception|not supported|unsupported",
    re.I,
)


def relevant_log_lines(lines: Sequence[LogLine], limit: int = 12) -> list[str]:
    """The lines that say why a load failed: errors and warnings first; else the log's tail."""
    picked = [
        ln.msg for ln in lines if ln.level in ("error", "warn") or (ln.level == "" and _FAILURE_RE.search(ln.msg))
    ]
    picked = [m for m in picked if "no API key is set" not in m]  # our key is set; noise otherwise
    if not picked:
        picked = [ln.msg for ln in lines]
    return picked[-limit:]


_CAUSES: tuple[tuple[str, re.Pattern[str], str], ...] = (
    (
        "unsupported_architecture",
        re.compile(r"unknown model architecture", re.I),
        "this llama-server build does not support the model's architecture: the registry entry "
        "must not be auto-eligible for this backend, or build a llama.cpp that supports it",
    ),
    (
        "out_of_memory",
        re.compile(r"out of memory|insufficient memory|failed to allocate|cudaMalloc|unable to allocate|alloc.*failed|OOM", re.I),
        "the device did not have the memory the plan counted on (another process may hold it): "
        "free memory, or re-plan (`hotfit plan`) against the memory free now",
    ),
    (
        "bad_model_file",
        re.compile(r"gguf_init|invalid magic|failed to read|tensor .* data is not within|corrupt|"
                   r"error loading model|failed to load model", re.I),
        "the model file is not a valid GGUF for this build: re-run verify (`hotfit pull NAME`), "
        "which re-downloads a file whose hash does not match",
    ),
    (
        "bad_chat_template",
        re.compile(r"chat template|jinja", re.I),
        "the chat template did not parse in llama-server: re-fetch it (`hotfit pull NAME`)",
    ),
    (
        "port_in_use",
        re.compile(r"couldn't bind|address already in use", re.I),
        "another process took the port; retry",
    ),
)


def diagnose_load_failure(lines: Sequence[LogLine]) -> tuple[str, str]:
    """Pure: (cause, hint) for a failed start, from the first matching error/warning line."""
    candidates = [ln.msg for ln in lines if ln.level in ("error", "warn", "")]
    for cause, pattern, hint in _CAUSES:
        if any(pattern.search(m) for m in candidates):
            return cause, hint
    return "unknown", "read the quoted llama-server log lines; the full log is in the run directory"



def read_server_log(run_dir: Path) -> list[LogLine]:
    """Every log line llama-server wrote into ``run_dir`` (stdout log, then stderr)."""
    lines: list[LogLine] = []
    for name in (STDOUT_LOG_JSONL, STDOUT_LOG_TEXT, STDERR_LOG):
        path = run_dir / name
        if path.is_file():
            lines += parse_log_lines(path.read_text(encoding="utf-8", errors="replace"))
    return lines

