"""``hotfit`` command line: global options, sub-command dispatch, error → exit-code mapping.

Each sub-command lives in its own module here with ``add_parser(subparsers, parents)`` and
``run(args, ctx) -> int``; it parses arguments, calls into ``pipeline`` and renders the result
(:class:`~pipeline.cli.context.CliContext`), nothing else. Errors from ``core.errors`` become
their exit code; with ``--json`` the error — a usage error too — is printed as ``{"error": {...}}``
on stdout so scripts can read it. Every invocation ends in :func:`main`, which logs its outcome
(``command.done`` / ``command.failed`` with the exit code, docs/events.md) and, for ``auto``,
writes the metrics (pipeline/metrics.py).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import Any, Literal, NoReturn, TextIO

from hotfit.core import log
from hotfit.core.diskspace import write_failure
from hotfit.core.errors import HotfitError, Interrupted, UsageError
from hotfit.core.settings import Settings, load_settings
from hotfit.pipeline.cli import auto, fleet, grade, plan, probe, pull, registry, serve, status, verify
from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.engine import STOP_SIGNALS
from hotfit.pipeline.metrics import last_run, record_run
from hotfit.state.files import checked_write_path, home_is_read_only, prepare_home, unusable_home

_log = log.get_logger()

EXIT_CODES_HELP = """exit codes:
  0    success
  2    usage or configuration error (bad argument, env var, registry file)
  3    no model qualifies (fail closed; the message names what would)
  4    download / verify failure (Hub error, pin or size mismatch, checksum, disk space, template,
       a disk turned read-only or failing: EROFS/EIO)
  5    load / tool-call probe / hot-allocation re-check failure
  6    locked: another hotfit holds this --home (its PID is named)
  7    hardware probe failure (NVML present but failing)
  8    grade: the model failed the multi-turn tool-use grade
  9    grade: inconclusive (a stack problem, named, or --budget-s ran out)
  10   status: the last `hotfit auto` failed or was interrupted (for alerting checks)
  11   download gave up on a passing fault (Hub or mirror unreachable, 5xx/429, no progress): rerun later
  130  interrupted (SIGINT, SIGTERM or SIGHUP); a rerun resumes
"""


def _commands() -> list[Any]:
    return [probe, plan, registry, pull, auto, status, serve, grade, verify, fleet]


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises its usage errors instead of printing and exiting, so they take the one
    failure path of :func:`main` (logged, ``--json`` honoured) like every other error."""

    def error(self, message: str) -> NoReturn:
        raise _ParseError(message, self)


class _ParseError(Exception):
    def __init__(self, message: str, parser: argparse.ArgumentParser) -> None:
        super().__init__(message)
        self.message, self.parser = message, parser


def build_parser() -> argparse.ArgumentParser:
    common = _ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="machine-readable JSON on stdout")
    parser = _ArgumentParser(
        prog="hotfit",
        description="Provision, unattended, the best local LLM this machine can run as a tool-calling agent.",
        epilog=EXIT_CODES_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action=_VersionAction, nargs=0, help="print hotfit's version and exit")
    parser.add_argument("--home", metavar="DIR",
                        help="state and model directory (default: $HOTFIT_HOME or ~/.local/share/hotfit)")
    parser.add_argument("--llama-server", metavar="PATH",
                        help="llama-server binary (default: $HOTFIT_LLAMA_SERVER, the build cache, then PATH)")
    parser.add_argument("--log-format", choices=("json", "console"), default=None,
                        help="log renderer on stderr (default: console on a TTY, json otherwise)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more log detail")
    parser.add_argument("-q", "--quiet", action="count", default=0,
                        help="warnings and errors only; nothing on stdout after a successful auto, pull or grade")
    parser.add_argument("--json", action="store_true", default=False, help="machine-readable JSON on stdout")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in _commands():
        module.add_parser(sub, [common])
    return parser


class _VersionAction(argparse.Action):
    """argparse's "version" action, with the version looked up only when asked (a few ms of
    importlib.metadata every command would otherwise pay)."""

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        sys.stdout.write(f"{parser.prog} {version()}\n")
        parser.exit()


def version() -> str:
    """The installed distribution's version (the source tree's pyproject.toml when not installed)."""
    try:
        return importlib.metadata.version("hotfit")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        return "unknown"


def _lenient(argv: Sequence[str]) -> argparse.Namespace:
    """--home/--json/-q/-v/--log-format as far as they can be read from an argv that did not parse,
    so a usage error is reported the way the operator asked and logged in the right home."""
    loose = argparse.ArgumentParser(add_help=False)
    loose.add_argument("--home")
    loose.add_argument("--json", action="store_true")
    loose.add_argument("--log-format", choices=("json", "console"))
    loose.add_argument("-v", "--verbose", action="count", default=0)
    loose.add_argument("-q", "--quiet", action="count", default=0)
    try:
        known, rest = loose.parse_known_args(list(argv))
    except SystemExit:  # e.g. --home without a value
        known, rest = argparse.Namespace(home=None, json="--json" in argv, log_format=None, verbose=0,
                                         quiet=0), list(argv)
    names = {m.__name__.rsplit(".", 1)[-1] for m in _commands()}
    known.command = next((a for a in rest if a in names), None)
    return known


def main(argv: Sequence[str] | None = None, *, out: TextIO | None = None) -> int:
    """Parse, dispatch, map errors to exit codes, and record the outcome — the one place every
    command ends: each invocation leaves one ``command.done`` or ``command.failed`` event (with its
    exit code) in the home's log, and ``hotfit auto`` its metrics (pipeline/metrics.py)."""
    out = out or sys.stdout
    with _sigterm_is_an_interrupt() as received:
        return _main(argv, out, received)


def _main(argv: Sequence[str] | None, out: TextIO, received: list[int]) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    started, started_wall = time.monotonic(), time.time()
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version (0)
        return int(exc.code or 0)
    except KeyboardInterrupt:
        return _report(_interrupted(received), False, out)
    except _ParseError as exc:
        loose = _lenient(argv)
        helped = exc.parser.prog if exc.parser is not parser or loose.command is None else f"hotfit {loose.command}"
        usage = UsageError(exc.message, hint=f"see `{helped} --help`")
        sys.stderr.write(exc.parser.format_usage())
        return _finish(loose.command, usage, usage.exit_code, bool(loose.json), out, started, started_wall,
                       home=loose.home, log_format=loose.log_format, verbosity=loose.verbose - loose.quiet,
                       prefix=f"{exc.parser.prog}: error: ")
    want_json = bool(getattr(args, "json", False))
    verbosity = args.verbose - args.quiet
    settings = None
    logged = False
    error: HotfitError | None
    try:
        settings = load_settings(home=args.home, llama_server=args.llama_server)
        # a reader (status) reads a home it cannot write — the operator's first look after a disk
        # error turned it read-only — and logs to stderr only
        read_only = bool(getattr(args, "reads_home_only", False)) and home_is_read_only(settings.home)
        if not read_only:
            prepare_home(settings.home, settings.home_named, settings.log_path.parent)
            targets: tuple[tuple[Path, Literal["file", "directory"]], ...] = (
                (settings.log_path, "file"), (settings.state_db, "file"), (settings.lock_path, "file"),
                # SQLite opens these beside the database itself, following a symlink
                (settings.state_db.with_name(settings.state_db.name + "-wal"), "file"),
                (settings.state_db.with_name(settings.state_db.name + "-shm"), "file"),
                (settings.manifest_path, "file"), (settings.models_dir, "directory"))
            for path, kind in targets:
                checked_write_path(path, kind=kind)
        try:
            log.configure(args.log_format, verbosity, None if read_only else settings.log_path,
                          max_bytes=settings.log_max_bytes, keep=settings.log_keep)
            logged = not read_only
        except OSError as exc:
            raise unusable_home(settings.home, settings.home_named,
                                f"cannot append to {settings.log_path}: {exc.strerror or exc}",
                                errno=exc.errno) from None
        if read_only:
            _log.warning("home.read_only", home=str(settings.home), command=_command_name(args))
        ctx = CliContext(settings=settings, json=want_json, log_format=args.log_format,
                         verbosity=verbosity, out=out)
        handler: Callable[[argparse.Namespace, CliContext], int] = args.handler
        code = handler(args, ctx)
        error = None
    except HotfitError as exc:
        code, error = exc.exit_code, exc
    except KeyboardInterrupt:
        error = _interrupted(received)
        code = error.exit_code
    except OSError as exc:  # the writers map a full or refusing disk themselves; this is the net under them
        home = args.home or os.environ.get("HOTFIT_HOME")
        where = exc.filename or home or "?"
        mapped = write_failure(exc, where, needed_bytes=None, what="a file" if exc.filename else "a file in the home")
        if mapped is None:
            if logged:
                _record(_command_name(args), 1, {"code": "internal", "message": repr(exc)}, started)
            raise
        error = mapped
        code = error.exit_code
    except Exception as exc:  # a bug: logged with exit 1, then Python's traceback
        if logged:
            _record(_command_name(args), 1, {"code": "internal", "message": repr(exc)}, started)
        raise
    return _finish(_command_name(args), error, code, want_json, out, started, started_wall, settings=settings,
                   logged=logged, home=args.home, log_format=args.log_format, verbosity=verbosity,
                   metrics=args.command == "auto" and not getattr(args, "dry_run", False))


@contextlib.contextmanager
def _sigterm_is_an_interrupt() -> Iterator[list[int]]:
    """SIGTERM (a supervisor stopping hotfit) and SIGHUP (the ssh session or terminal went away) end
    a command as Ctrl-C does: what runs is cancelled and cleaned up, and the command exits 130 with a
    message and its ``command.failed`` event, not the default 143 / 129 with none. The SIGINT
    handler in force is called, so inside ``anyio.run`` asyncio cancels the main task and the command
    unwinds through its ``finally`` blocks. (The stage runner and the lock wait catch these signals
    themselves while they run, and say which one came: STOP_SIGNALS.)"""
    received: list[int] = []

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        received.append(signum)
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, frame)
        else:  # SIGINT ignored or left to the default: still an interrupt
            raise KeyboardInterrupt

    stops = [s for s in STOP_SIGNALS if s != signal.SIGINT]
    try:
        previous = {signum: signal.signal(signum, on_sigterm) for signum in stops}
    except ValueError:  # not the main thread (an embedding caller): signals are left alone
        yield received
        return
    try:
        yield received
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _interrupted(received: list[int]) -> Interrupted:
    name = signal.Signals(received[0]).name if received else "SIGINT"
    return Interrupted(f"interrupted by {name}; rerun the same command to resume",
                       hint="completed work and downloaded bytes are kept", signal=name)


def _finish(command: str | None, error: HotfitError | None, code: int, want_json: bool, out: TextIO,
            started: float, started_wall: float, *, settings: Settings | None = None, logged: bool = False,
            home: str | None = None, log_format: str | None = None, verbosity: int = 0, metrics: bool = False,
            prefix: str = "hotfit: error: ") -> int:
    if error is not None:
        # a hung-up terminal (SIGHUP) fails the write (EIO); the log below still gets the outcome
        with contextlib.suppress(OSError):
            _report(error, want_json, out, prefix)
    if not logged:  # failed before the log was open (argv, environment, home): open it if the home exists
        logged = _open_log_late(settings, home, log_format, verbosity)
    if logged:
        _record(command, code, error.to_json() if error is not None else None, started)
    if metrics and settings is not None and logged:
        _write_metrics(settings, code, error, started_wall)
    return code


def _write_metrics(settings: Settings, code: int, error: HotfitError | None, started_wall: float) -> None:
    """``auto``'s metrics; a failure to write them is one ``metrics.unwritable`` warning and never
    changes the exit code or hides the run's own error (docs/operations.md, "Metrics")."""
    run = last_run(code, error.to_json() if error is not None else None, log.events_seen(),
                   started_at=started_wall, finished_at=time.time())
    try:
        failed = record_run(settings, run)
    except (OSError, HotfitError) as exc:  # the manifest unreadable, the metrics directory unusable
        failed = [(settings.metrics_dir, getattr(exc, "what", None) or str(exc))]
    if failed:
        # the log may sit on the disk that failed: the warning then reaches stderr only (core/log.py)
        with contextlib.suppress(OSError, HotfitError):
            _log.warning("metrics.unwritable", path=str(failed[0][0]), error=failed[0][1],
                         paths=[str(path) for path, _why in failed], exit_code=code)


def _open_log_late(settings: Settings | None, home: str | None, log_format: str | None, verbosity: int) -> bool:
    """Open the home's log for a failure that came before it was opened; only an existing, usable
    home (a typo must not create one)."""
    try:
        settings = settings or load_settings(home=home)
    except HotfitError:
        try:
            # only what locates the home: the setting that failed (HF_ENDPOINT, a proxy, ...) is left out
            settings = load_settings({k: v for k, v in os.environ.items()
                                      if k in ("HOME", "XDG_DATA_HOME", "HOTFIT_HOME")}, home=home)
        except HotfitError:
            return False
    if not settings.home.is_dir() or not os.access(settings.home, os.W_OK | os.X_OK):
        return False
    try:
        log.configure(log_format, verbosity, settings.log_path, max_bytes=settings.log_max_bytes,
                      keep=settings.log_keep)
    except OSError:
        return False
    return True


def _command_name(args: argparse.Namespace) -> str:
    """The command as the log names it: ``auto``, ``registry lock``, ..."""
    return " ".join(filter(None, (args.command, getattr(args, "registry_command", None),
                                  getattr(args, "fleet_command", None))))


def _record(command: str | None, code: int, error: dict[str, Any] | None, started: float) -> None:
    """The invocation's own event, kept in the file only (the person already saw its outcome)."""
    duration_s = round(time.monotonic() - started, 3)
    # The log cannot make a failure worse: a full disk under it (DiskSpaceError) leaves the outcome
    # being reported as it is.
    with contextlib.suppress(OSError, HotfitError):
        if code == 0:
            _log.info("command.done", command=command, exit_code=code, duration_s=duration_s,
                      **{log.FILE_ONLY: True})
            return
        signal_name = ((error or {}).get("details") or {}).get("signal")  # an Interrupted names its signal
        extra = {"signal": signal_name} if signal_name else {}
        _log.error("command.failed", command=command, exit_code=code, duration_s=duration_s, error=error,
                   **extra, **{log.FILE_ONLY: True})


def _report(exc: HotfitError, want_json: bool, out: TextIO, prefix: str = "hotfit: error: ") -> int:
    if want_json:
        out.write(json.dumps({"error": exc.to_json()}, indent=2, default=str) + "\n")
        out.flush()
    sys.stderr.write(f"{prefix}{exc}\n")
    return exc.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
