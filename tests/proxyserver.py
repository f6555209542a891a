"""A real forward proxy on loopback for tests: Debian's ``tinyproxy``, its own log as the witness.

``with TinyProxy(tmp_path) as proxy: ...`` starts ``tinyproxy -d`` on a free 127.0.0.1 port with a
config written into ``tmp_path``; ``proxy.url`` is ``http://127.0.0.1:PORT``; ``proxy.requests()``
reads every request line tinyproxy logged (``GET http://host:port/path`` for absolute-form requests,
``CONNECT host:port`` for tunnels). ``scripts/bootstrap --test`` installs tinyproxy.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from tests.hubserver import free_port_closed
from tests.polling import accepts_connections, wait_until

# "CONNECT   Dec 01 21:10:11.480 [18335]: Request (file descriptor 5): GET http://127.0.0.1:18999/ HTTP/1.1"
_REQUEST_RE = re.compile(r"Request \(file descriptor \d+\): (\S+) (\S+) HTTP/")


@dataclass(frozen=True)
class ProxiedRequest:
    method: str
    target: str  # as the client sent it: an absolute URL, or host:port for CONNECT

    @property
    def host_port(self) -> str:
        return self.target if self.method == "CONNECT" else urlsplit(self.target).netloc

    @property
    def path(self) -> str:
        return "" if self.method == "CONNECT" else urlsplit(self.target).path


class TinyProxy:
    def __init__(self, directory: Path, *, basic_auth: tuple[str, str] | None = None) -> None:
        exe = shutil.which("tinyproxy")
        if exe is None:
            raise RuntimeError("tinyproxy is not installed: apt-get install tinyproxy (scripts/bootstrap --test does)")
        self.exe = exe
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "tinyproxy.log"
        self.port = 0
        self.basic_auth = basic_auth  # (user, password): 407 to requests without them
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> TinyProxy:
        self.port = free_port_closed()
        conf = self.dir / "tinyproxy.conf"
        # No ConnectPort line: CONNECT to any port (the default config allows 443 and 563 only).
        conf.write_text(f'Port {self.port}\nListen 127.0.0.1\nTimeout 60\nLogFile "{self.log_path}"\n'
                        "LogLevel Connect\nMaxClients 64\nAllow 127.0.0.1\n"
                        + (f"BasicAuth {self.basic_auth[0]} {self.basic_auth[1]}\n" if self.basic_auth else ""))
        self._proc = subprocess.Popen([self.exe, "-d", "-c", str(conf)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
        try:
            wait_until(lambda: accepts_connections(self.port), "tinyproxy to accept connections", timeout_s=10,
                       proc=self._proc)
        except AssertionError as exc:
            self.stop()
            raise RuntimeError(f"tinyproxy did not start ({exc}): {self.log_text()[-2000:]}") from None
        return self

    def stop(self) -> None:
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
            self._proc = None

    def __enter__(self) -> TinyProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def requests(self) -> list[ProxiedRequest]:
        return [ProxiedRequest(m.group(1), m.group(2)) for m in _REQUEST_RE.finditer(self.log_text())]
