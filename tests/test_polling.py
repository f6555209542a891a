"""tests/polling.py: the one wait of the suite fails naming what never happened, and the socket facts
tests wait on are read right (a listener that never accepts, a request nobody reads)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.hubserver import LocalHub
from tests.polling import connections_to_accept_at, unread_request_bytes_at, wait_until

TIER = "integration"


def test_a_condition_that_never_holds_fails_naming_it() -> None:
    with pytest.raises(AssertionError, match="gave up after 0.1 s waiting for the moon"):
        wait_until(lambda: False, "the moon", timeout_s=0.1)


def test_the_process_that_should_bring_it_about_exiting_first_fails_with_its_stderr() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit('no such thing')"], stderr=subprocess.PIPE)
    with pytest.raises(AssertionError, match=r"the process exited \(1\) before a file: no such thing"):
        wait_until(lambda: False, "a file", proc=proc)


def test_a_connection_and_its_request_wait_at_a_listener_that_never_accepts() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        assert connections_to_accept_at(port) == 0 and unread_request_bytes_at(port) == 0
        with socket.create_connection(("127.0.0.1", port)) as client:
            wait_until(lambda: connections_to_accept_at(port) == 1, "the kernel to queue the connection")
            client.sendall(b"GET / HTTP/1.1\r\n\r\n")
            wait_until(lambda: unread_request_bytes_at(port) == 18, "the request to arrive unread")


def test_the_hub_is_idle_only_once_every_connection_has_ended(local_hub: LocalHub) -> None:
    assert local_hub.idle()
    client = socket.create_connection((local_hub.host, local_hub.port))
    assert not local_hub.idle()  # queued or accepted: either way not idle
    client.close()
    wait_until(local_hub.idle, "the Hub to see the connection end")
