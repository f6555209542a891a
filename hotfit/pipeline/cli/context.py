"""What every sub-command's handler gets: settings, output mode, and how to print a result."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, TextIO

from hotfit.core.settings import Settings


@dataclass
class CliContext:
    settings: Settings
    json: bool
    log_format: str | None
    verbosity: int
    out: TextIO

    def emit(self, data: Any, text: str | None = None) -> None:
        """Print ``data`` as JSON with --json, else the human ``text`` (or the JSON if none)."""
        if self.json or text is None:
            self.out.write(json.dumps(data, indent=2, default=str) + "\n")
        else:
            self.out.write(text.rstrip("\n") + "\n")
        self.out.flush()

    def report(self, data: Any, text: str) -> None:
        """The outcome of a command that changes things (auto, pull, grade): like :meth:`emit`, but
        ``-q`` prints nothing (cron mails only a failure); ``--json`` still prints the JSON asked for."""
        if self.verbosity < 0 and not self.json:
            return
        self.emit(data, text)
