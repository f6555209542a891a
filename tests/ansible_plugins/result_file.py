"""An Ansible callback for tests/test_recipes.py: every task's result per host, and the play
stats, as one JSON document written to ``$HOTFIT_ANSIBLE_REPORT`` at the end of the run
(ansible-core ships no JSON callback since the json one moved to the ansible.posix collection).
"""

from __future__ import annotations

import json
import os
from typing import Any

from ansible.plugins.callback import CallbackBase

DOCUMENTATION = """
name: result_file
type: aggregate
short_description: task results as JSON in $HOTFIT_ANSIBLE_REPORT (hotfit's tests)
description: Writes each task's result per host and the stats to the file the variable names.
"""


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "result_file"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self.tasks: list[dict[str, Any]] = []

    def _record(self, result: Any, **status: bool) -> None:
        self.tasks.append({"task": result._task.get_name(), "host": result._host.get_name(),
                           **status, "result": result._result})

    def v2_runner_on_ok(self, result: Any) -> None:
        self._record(result, failed=False, skipped=False)

    def v2_runner_on_failed(self, result: Any, ignore_errors: bool = False) -> None:
        self._record(result, failed=True, skipped=False)

    def v2_runner_on_skipped(self, result: Any) -> None:
        self._record(result, failed=False, skipped=True)

    def v2_playbook_on_stats(self, stats: Any) -> None:
        hosts = sorted(stats.processed)
        report = {"tasks": self.tasks, "stats": {h: stats.summarize(h) for h in hosts}}
        with open(os.environ["HOTFIT_ANSIBLE_REPORT"], "w", encoding="utf-8") as fh:
            json.dump(report, fh, default=str)
