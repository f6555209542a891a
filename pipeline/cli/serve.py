"""hotfit serve: start llama-server with the verified parameters."""

from __future__ import annotations

import argparse

from pipeline.cli import not_implemented


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", parents=parents, help="serve the provisioned model with llama-server")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="listen port (default 8080)")
    p.add_argument("--print-command", action="store_true", help="print the llama-server command line and exit")
    p.add_argument("--print-systemd-unit", action="store_true", help="print a systemd unit and exit")
    p.set_defaults(handler=not_implemented("serve"))
