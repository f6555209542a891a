"""hotfit fleet endpoints: a LiteLLM proxy configuration over the machines' ``hotfit status --json``
(one deployment per serving machine, one model name per model; pipeline.endpoints)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from hotfit.core.errors import HotfitError, UsageError
from hotfit.pipeline.cli.context import CliContext
from hotfit.pipeline.endpoints import ServedEndpoint, endpoint_from_status, key_files, litellm_config, litellm_yaml


def add_parser(fsub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = fsub.add_parser(
        "endpoints", parents=parents, help="a LiteLLM proxy model_list over the machines' saved status",
        description="Read each machine's `hotfit --json status` (files, or directories of *.json) and print a "
                    "LiteLLM proxy configuration: one deployment per serving machine, named by the model it "
                    "serves, so the proxy balances the machines and retries on another. A file that cannot be "
                    "used is reported and left out; the others are written (exit 2 when any was left out).")
    p.add_argument("paths", nargs="+", metavar="STATUS.json", help="`hotfit --json status` files or directories")
    p.add_argument("--format", choices=("yaml", "json"), default="yaml",
                   help="yaml (default; the proxy's config.yaml) or json")
    p.set_defaults(handler=handler)


def status_files(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.glob("*.json") if p.is_file())
        else:
            found.append(path)
    return found


def read_endpoint(path: Path) -> ServedEndpoint:
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise UsageError(f"{path}: cannot read it as JSON ({exc})",
                         hint="pass each machine's `hotfit --json status` output") from None
    return endpoint_from_status(doc, str(path))


def handler(args: argparse.Namespace, ctx: CliContext) -> int:
    files = status_files(args.paths)
    if not files:
        raise UsageError(f"no status files in {' '.join(args.paths)}", hint="save `hotfit --json status` per machine")
    endpoints: list[ServedEndpoint] = []
    problems: list[dict[str, str]] = []
    for path in files:  # one bad file never stops the others
        try:
            endpoints.append(read_endpoint(path))
        except HotfitError as exc:
            problems.append({"file": str(path), "message": exc.what, "hint": exc.hint or ""})
    config = litellm_config(endpoints)
    if ctx.json:
        ctx.emit({**config, "api_key_files": key_files(endpoints), "left_out": problems})
    else:
        text = (json.dumps(config, indent=2) if args.format == "json"
                else litellm_yaml(config, key_files(endpoints)))
        ctx.out.write(text.rstrip("\n") + "\n")
        ctx.out.flush()
    for problem in problems:
        sys.stderr.write(f"hotfit: left out {problem['file']}: {problem['message']}"
                         + (f"\n  → {problem['hint']}" if problem["hint"] else "") + "\n")
    return UsageError.exit_code if problems else 0
