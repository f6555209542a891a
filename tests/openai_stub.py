"""A scripted stand-in for llama-server's HTTP API, for tests that need an exact answer no fixture
model can be made to give (e.g. a tool call written as plain JSON without the template's markers).

``python tests/openai_stub.py --script FILE [llama-server argv...]`` takes ``--host``/``--port``
from llama-server's command line (anything else is ignored) and serves on 127.0.0.1 only:

- ``GET /health``  -> 200 ``{"status": "ok"}``
- ``GET /props``   -> the script's ``props`` (e.g. ``{"chat_template_caps": {"supports_tools": true}}``)
- ``POST /v1/chat/completions`` -> the script's ``answer``; the request body is appended, one JSON
  line each, to the script's ``requests_log`` file so a test can check what was sent; with the
  script's ``die_by`` (e.g. ``"SEGV"``) the stub then kills itself by that signal instead of answering.

``--help`` / ``--version`` print one line and exit 0, so hotfit can probe it like a binary; with
the script's ``api_key`` true, ``--help`` also lists llama-server's ``--api-key`` line, so hotfit
hands a key over in ``LLAMA_API_KEY`` and the stub answers 401 to a request without it (as
llama-server does; ``/health`` stays public). Standard library only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--script", type=Path, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int)
    args, _ignored = ap.parse_known_args(argv)
    script: dict[str, Any] = json.loads(args.script.read_text(encoding="utf-8"))
    if "--help" in argv or "--version" in argv:
        print("openai_stub: scripted llama-server stand-in (tests/openai_stub.py)")
        if script.get("api_key"):
            print("--api-key KEY   API key to use for authentication (default: none)\n"
                  "                (env: LLAMA_API_KEY)")
        return 0
    requests_log = Path(script["requests_log"])
    key = os.environ.get("LLAMA_API_KEY") if script.get("api_key") else None

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, format: str, *a: Any) -> None:  # noqa: A002 - stdlib signature
            print(f"openai_stub: {self.command} {self.path}", file=sys.stderr, flush=True)

        def _send(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorised(self) -> bool:
            if key is None or self.headers.get("Authorization") == f"Bearer {key}":
                return True
            self._send(401, {"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}})
            return False

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, {"status": "ok"})
            elif not self._authorised():
                return
            elif self.path == "/props":
                self._send(200, script.get("props", {}))
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if not self._authorised():
                return
            if self.path != "/v1/chat/completions":
                self._send(404, {"error": "not found"})
                return
            with open(requests_log, "a", encoding="utf-8") as fh:
                fh.write(json.dumps(json.loads(body)) + "\n")
            if script.get("die_by"):  # a crash at the first inference: the process really dies by it
                print(f"openai_stub: dying by SIG{script['die_by']} (not a real crash)", file=sys.stderr, flush=True)
                # at this thread (a process-wide kill is delivered asynchronously: the answer
                # below could still go out first on a loaded machine), and never answer after it
                signal.pthread_kill(threading.get_ident(), getattr(signal, f"SIG{script['die_by']}"))
                time.sleep(3600)
            self._send(200, script["answer"])

    host = "127.0.0.1" if args.host not in ("127.0.0.1", "localhost") else args.host  # loopback only
    server = ThreadingHTTPServer((host, args.port), Handler)
    print(f"openai_stub: listening on {host}:{args.port}", file=sys.stderr, flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
