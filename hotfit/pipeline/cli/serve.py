"""hotfit serve: start the provisioned model's server with the verified parameters (the job:
:mod:`pipeline.serve`; the unit: :mod:`pipeline.systemd_unit`).

``--print-command`` and ``--print-systemd-unit`` hand the result to a service manager,
``--print-client-config`` to its clients (pipeline.endpoints); plain
``serve`` replaces itself with the server (exec), after saying what window it opens.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.endpoints import key_files, litellm_config, litellm_yaml, openai_config
from hotfit.pipeline.serve import ServeOptions, client_endpoint, prepare_serve, start_server

DEFAULT_HOST, DEFAULT_PORT = "127.0.0.1", 8080
CLIENT_KINDS = ("litellm", "openai")


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", parents=parents, help="serve the provisioned model with llama-server",
                       description="Start llama-server with the parameters `hotfit auto` verified, after "
                                   "checking the device still has the memory for them.")
    p.add_argument("--host", default=None, help=f"listen address (default {DEFAULT_HOST})")
    p.add_argument("--port", type=int, default=None, help=f"listen port (default {DEFAULT_PORT})")
    p.add_argument("--print-command", action="store_true", help="print the llama-server command line and exit")
    p.add_argument("--print-systemd-unit", action="store_true", help="print a systemd unit and exit")
    p.add_argument("--unit-user", metavar="USER",
                   help="with --print-systemd-unit: the account the service runs as "
                        "(default: the home's owner, or `hotfit` when root owns it)")
    p.add_argument("--probe-file", metavar="FILE",
                   help="check against a saved probe (hotfit probe --json) instead of probing now")
    p.add_argument("--api-key-file", metavar="FILE", help="require the API key in FILE (passed to llama-server)")
    p.add_argument("--print-client-config", choices=CLIENT_KINDS, metavar="KIND",
                   help="print a client's configuration for this endpoint and exit: litellm (a proxy "
                        "model_list) or openai (the SDK's base_url and model); from the running serve when "
                        "there is one and --host/--port are not given")
    p.set_defaults(handler=handler)


def handler(args: argparse.Namespace, ctx: CliContext) -> int:
    listen_given = args.host is not None or args.port is not None
    opts = ServeOptions(host=DEFAULT_HOST if args.host is None else args.host,
                        port=DEFAULT_PORT if args.port is None else args.port,
                        api_key_file=Path(args.api_key_file).resolve() if args.api_key_file else None,
                        probe_file=Path(args.probe_file) if args.probe_file else None,
                        print_command=args.print_command, systemd_unit=args.print_systemd_unit,
                        unit_user=args.unit_user)
    if args.print_client_config:
        endpoint = client_endpoint(ctx.settings, opts, listen_given=listen_given)
        if args.print_client_config == "openai":
            config = openai_config(endpoint)
            ctx.emit(config, json.dumps(config, indent=2))
        else:
            litellm = litellm_config([endpoint])
            ctx.emit(litellm, litellm_yaml(litellm, key_files([endpoint])).rstrip("\n"))
        return 0
    job = prepare_serve(ctx.settings, opts)
    if job.unit is not None:
        ctx.emit(job.to_json(), job.unit)
        return 0
    assert job.command is not None
    argv = list(job.command.argv)
    decision = job.decision
    if decision is None:  # a server hotfit does not run itself: its command, for the operator
        ctx.emit(job.to_json(), shlex.join(argv))
        return 0
    if decision.replanned:
        sys.stderr.write(f"hotfit: {decision.message}\n")
    if args.print_command:
        env = job.command.env
        prefix = ["env", *(f"{k}={v}" for k, v in sorted(env.items()))] if env else []
        ctx.emit(job.to_json(), shlex.join(prefix + argv))
        return 0
    start_server(ctx.settings, job, announce=None if ctx.json else
                 f"hotfit: {decision.message}\nhotfit: exec {shlex.join(argv)}\n")
