"""``hotfit`` command line: global options, sub-command dispatch, error → exit-code mapping.

Each sub-command lives in its own module here with ``add_parser(subparsers, parents)`` and
``run(args, ctx) -> int``; it parses arguments, calls into ``pipeline`` and renders the result
(:class:`~pipeline.cli.context.CliContext`), nothing else. Errors from ``core.errors`` become
their exit code; with ``--json`` the error is printed as ``{"error": {...}}`` on stdout so
scripts can read it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TextIO

from core import log
from core.diskspace import from_os_error, is_disk_full
from core.errors import HotfitError, Interrupted
from core.settings import default_home, load_settings
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
    with _sigterm_is_an_interrupt() as received:
        return _main(argv, out, received)


def _main(argv: Sequence[str] | None, out: TextIO, received: list[int]) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or usage error (2)
        return int(exc.code or 0)
    except KeyboardInterrupt:
        return _report(_interrupted(received), False, out)
    want_json = bool(getattr(args, "json", False))
    logging_to: list[Path] = []  # the log file once configured: failures are recorded there
    try:
        settings = load_settings(home=args.home, llama_server=args.llama_server)
        verbosity = args.verbose - args.quiet
        prepare_home(settings.home, settings.home_named, settings.log_path.parent)
        targets: tuple[tuple[Path, Literal["file", "directory"]], ...] = (
            (settings.log_path, "file"), (settings.state_db, "file"), (settings.lock_path, "file"),
            (settings.manifest_path, "file"), (settings.models_dir, "directory"))
        for path, kind in targets:
            checked_write_path(path, kind=kind)
        try:
            log.configure(args.log_format, verbosity, settings.log_path)
        except OSError as exc:
            raise unusable_home(settings.home, settings.home_named,
                                f"cannot append to {settings.log_path}: {exc.strerror or exc}",
                                errno=exc.errno) from None
        logging_to.append(settings.log_path)
        ctx = CliContext(settings=settings, json=want_json, log_format=args.log_format,
                         verbosity=verbosity, out=out)
        handler: Callable[[argparse.Namespace, CliContext], int] = args.handler
        return handler(args, ctx)
    except HotfitError as exc:
        err = exc
    except KeyboardInterrupt:
        err = _interrupted(received)
    except OSError as exc:  # the writers map a full disk themselves; this is the net under them
        if not is_disk_full(exc):
            _log_failure(args, logging_to, 1, {"code": "internal", "message": repr(exc)}, None)
            raise
        home = args.home or os.environ.get("HOTFIT_HOME")
        where = exc.filename or home or "?"
        what = "a file" if exc.filename else "a file in the home"
        err = from_os_error(exc, where, needed_bytes=None, what=what)
    except Exception as exc:  # a bug: recorded with exit 1, then the traceback
        _log_failure(args, logging_to, 1, {"code": "internal", "message": repr(exc)}, None)
        raise
    signal_name = (err.details.get("signal") or (signal.Signals(received[0]).name if received else None)
                   if isinstance(err, Interrupted) else None)
    _log_failure(args, logging_to, err.exit_code, err.to_json(), signal_name)
    return _report(err, want_json, out)


@contextlib.contextmanager
def _sigterm_is_an_interrupt() -> Iterator[list[int]]:
    """SIGTERM (a supervisor stopping hotfit) ends a command as Ctrl-C does: what runs is cancelled
    and cleaned up, and the command exits 130 with a message (the README's promise), not the default
    143 with none. The SIGINT handler in force is called, so inside ``anyio.run`` asyncio cancels the
    main task and the command unwinds through its ``finally`` blocks. (The stage runner and the lock
    wait catch both signals themselves while they run, and say which one came.)"""
    received: list[int] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:  # SIGINT ignored or left to the default: still an interrupt
            raise KeyboardInterrupt

    try:
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    except ValueError:  # not the main thread (an embedding caller): signals are left alone
        yield received
        return
    try:
        yield received
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupted(received: list[int]) -> Interrupted:
    name = signal.Signals(received[0]).name if received else "SIGINT"
    return Interrupted(f"interrupted by {name}; rerun the same command to resume",
                       hint="completed work and downloaded bytes are kept", signal=name)


def _log_failure(args: argparse.Namespace, logging_to: list[Path], exit_code: int, error: dict[str, Any],
                 signal_name: str | None) -> None:
    """``command.fail``: every failing command leaves its exit code and error in the home's log. Before
    the log is configured (a bad setting), only a home whose log directory exists already is written."""
    if not logging_to:
        try:
            home = Path(args.home).expanduser() if args.home else default_home(os.environ)
            log_path = home / "logs" / "hotfit.jsonl"
            if not log_path.parent.is_dir():
                return
            log.configure(args.log_format, args.verbose - args.quiet, log_path)
        except OSError:
            return
    command = " ".join(filter(None, (args.command, getattr(args, "registry_command", None))))
    fields: dict[str, Any] = {"command": command, "exit_code": exit_code, "error": error}
    if signal_name:
        fields["signal"] = signal_name
    # The log cannot make a failure worse: a full disk under the log (DiskSpaceError) leaves the
    # failure being reported as it is.
    with contextlib.suppress(OSError, HotfitError):
        log.get_logger().error("command.fail", **fields)


def _report(exc: HotfitError, want_json: bool, out: TextIO) -> int:
    if want_json:
        out.write(json.dumps({"error": exc.to_json()}, indent=2, default=str) + "\n")
        out.flush()
    sys.stderr.write(f"hotfit: error: {exc}\n")
    return exc.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
