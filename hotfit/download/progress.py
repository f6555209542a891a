"""One file's progress: a bar on a TTY, else throttled ``download.progress`` events."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from hotfit.core.log import get_logger

log = get_logger()


class ProgressReporter:
    """Events go out at most once per ``min_interval_s`` and only after ≥ 1 % more of the file, plus
    one at the end — never per chunk."""

    def __init__(self, label: str, total_bytes: int, *, done_bytes: int = 0, tty: bool | None = None,
                 stream: Any = None, min_interval_s: float = 1.0) -> None:
        self.label = label
        self.total_bytes = max(1, total_bytes)
        self.done_bytes = done_bytes
        self._start_done = done_bytes
        self._stream = stream or sys.stderr
        self.tty = (self._stream.isatty() and os.environ.get("TERM") != "dumb") if tty is None else tty
        self._interval = 0.1 if self.tty else min_interval_s
        self._t0 = time.monotonic()
        self._last_t = 0.0
        self._last_done = done_bytes
        self.events = 0

    def advance(self, n: int) -> None:
        self.done_bytes += n
        now = time.monotonic()
        if now - self._last_t < self._interval:
            return
        if not self.tty and (self.done_bytes - self._last_done) * 100 < self.total_bytes:
            return
        self._emit(now)

    def _rate(self, now: float) -> float:
        return (self.done_bytes - self._start_done) / max(1e-6, now - self._t0)

    def _emit(self, now: float, final: bool = False) -> None:
        self._last_t, self._last_done = now, self.done_bytes
        self.events += 1
        rate = self._rate(now)
        left = self.total_bytes - self.done_bytes
        eta = left / rate if rate > 0 else None
        if self.tty:
            frac = min(1.0, self.done_bytes / self.total_bytes)
            bar = "#" * int(frac * 30)
            eta_text = f"{eta:5.0f}s" if eta is not None else "    ?"
            self._stream.write(f"\r{self.label[:32]:32} [{bar:30}] {frac * 100:5.1f}% "
                               f"{_human(self.done_bytes)}/{_human(self.total_bytes)} "
                               f"{_human(rate)}/s ETA {eta_text}" + ("\n" if final else ""))
            self._stream.flush()
        else:
            log.info("download.progress", file=self.label, done_bytes=self.done_bytes,
                     total_bytes=self.total_bytes, percent=round(100 * self.done_bytes / self.total_bytes, 1),
                     rate_bytes_per_s=int(rate), eta_s=None if eta is None else round(eta, 1))

    def close(self) -> None:
        self._emit(time.monotonic(), final=True)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f}{unit}" if unit != "B" else f"{int(n)}B"
        n /= 1024
    return f"{n:.1f}GiB"
