"""hotfit's side of the OpenVINO worker's line protocol (:mod:`backends.openvino.worker`).

One JSON object per line each way; every reply has ``ok``. A worker that closes its output or
answers something that is not a reply raised :class:`WorkerGone`; one that does not answer in
time is a ``TimeoutError`` (the caller kills it).
"""

from __future__ import annotations

import json
import subprocess
from typing import Any

import anyio

__all__ = ["WorkerGone", "worker_request"]


class WorkerGone(Exception):
    """The worker closed its stdout (it died) or sent something that is not a reply."""


async def worker_request(process: subprocess.Popen[bytes], payload: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    stdin, stdout = process.stdin, process.stdout
    assert stdin is not None and stdout is not None

    def exchange() -> bytes:
        if payload:
            stdin.write((json.dumps(payload) + "\n").encode())
            stdin.flush()
        return stdout.readline()

    with anyio.fail_after(timeout_s):
        try:
            raw = await anyio.to_thread.run_sync(exchange, abandon_on_cancel=True)
        except (BrokenPipeError, OSError) as exc:
            raise WorkerGone(str(exc)) from None
    if not raw:
        raise WorkerGone("the worker closed its output")
    try:
        reply = json.loads(raw)
    except ValueError:
        raise WorkerGone(f"not a reply: {raw[:200]!r}") from None
    if not isinstance(reply, dict):
        raise WorkerGone(f"not a reply: {raw[:200]!r}")
    return reply
