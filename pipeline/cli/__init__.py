"""``hotfit`` command line: global options, sub-command dispatch, error → exit-code mapping.

Each sub-command lives in its own module here with ``add_parser(subparsers, parents)`` and
``run(args, ctx) -> int``; it parses arguments, calls into ``pipeline`` and renders the result
(:class:`~pipeline.cli.context.CliContext`), nothing else. Errors from ``core.errors`` become
their exit code; with ``--json`` the error is printed as ``{"error": {...}}`` on stdout so
scripts can read it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from core import log
from core.diskspace import from_os_error, is_disk_full
from core.errors import HotfitError, Interrupted
from core.settings import load_settings
from pipeline.cli import auto, grade, plan, probe, pull, registry, serve, status, verify
from pipeline.cli.context import CliContext
from state.files import checked_write_path, prepare_home, unusable_home

EXIT_CODES_HELP = """exit codes:
  0    success
  2    usage or configuration error (bad argument, env var, registry file)
  3    no model qualifies (fail closed; the message names what would)
  4    download / verify failure (Hub error, pin or size mismatch, checksum, disk space, template)
  5    load / tool-call probe / hot-allocation re-check failure
  6    locked: another hotfit holds this --home (its PID is named)
  7    hardware probe failure (NVML present but failing)
  8    grade: the model failed the multi-turn tool-use grade
  9    grade: inconclusive (a stack problem, named, or --budget-s ran out)
  130  interrupted (SIGINT/SIGTERM); a rerun resumes
"""


def _commands() -> list[Any]:
    return [probe, plan, registry, pull, auto, status, serve, grade, verify]


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable JSON on stdout")
    parser = argparse.ArgumentParser(
        prog="hotfit",
        description="Provision, unattended, the best local LLM this machine can run as a tool-calling agent.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--home", metavar="DIR",
                        help="state and model directory (default: $HOTFIT_HOME or ~/.local/share/hotfit)")
    parser.add_argument("--llama-server", metavar="PATH",
                        help="llama-server binary (default: $HOTFIT_LLAMA_SERVER, the build cache, then PATH)")
    parser.add_argument("--log-format", choices=("json", "console"), default=None,
                        help="log renderer on stderr (default: console on a TTY, json otherwise)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log detail")
    parser.add_argument("-q", "--quiet", action="count", default=0, help="warnings and errors only")
    parser.add_argument("--json", action="store_true", default=False, help="machine-readable JSON on stdout")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _commands():
        module.add_parser(sub, [common])
    return parser


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or usage error (2)
        return int(exc.code or 0)
    want_json = bool(getattr(args, "json", False))
    try:
        settings = load_settings(home=args.home, llama_server=args.llama_server)
        verbosity = args.verbose - args.quiet
        prepare_home(settings.home, settings.home_named, settings.log_path.parent)
        for path, kind in ((settings.log_path, "file"), (settings.state_db, "file"), (settings.lock_path, "file"),
                           (settings.manifest_path, "file"), (settings.models_dir, "directory")):
            checked_write_path(path, kind=kind)  # type: ignore[arg-type]
        try:
            log.configure(args.log_format, verbosity, settings.log_path)
        except OSError as exc:
            raise unusable_home(settings.home, settings.home_named,
                                f"cannot append to {settings.log_path}: {exc.strerror or exc}",
                                errno=exc.errno) from None
        ctx = CliContext(settings=settings, json=want_json, log_format=args.log_format,
                         verbosity=verbosity, out=out)
        handler: Callable[[argparse.Namespace, CliContext], int] = args.handler
        return handler(args, ctx)
    except HotfitError as exc:
        return _report(exc, want_json, out)
    except KeyboardInterrupt:
        return _report(Interrupted("interrupted; rerun the same command to resume"), want_json, out)
    except OSError as exc:  # the writers map a full disk themselves; this is the net under them
        if not is_disk_full(exc):
            raise
        home = args.home or os.environ.get("HOTFIT_HOME")
        where = exc.filename or home or "?"
        what = "a file" if exc.filename else "a file in the home"
        return _report(from_os_error(exc, where, needed_bytes=None, what=what), want_json, out)


def _report(exc: HotfitError, want_json: bool, out: TextIO) -> int:
    if want_json:
        out.write(json.dumps({"error": exc.to_json()}, indent=2, default=str) + "\n")
        out.flush()
    sys.stderr.write(f"hotfit: error: {exc}\n")
    return exc.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
