"""hotfit auto: the whole pipeline, resumable (probe -> plan -> fetch -> verify -> load -> probe call -> re-check).

The operator surface follows contenox's own ``auto`` (contenox-auto-facts.md, "The `auto`
command"): origin as a positional argument or ``--origin``; ``--dry-run`` prints the probe, the
plan and whether the previous model is reused, as JSON, and changes nothing; ``--refresh``
selects afresh instead of keeping the previous model; the KV type it planned with is printed,
with a hint when it is unset; the disk is checked before download (artifact + projector +
512 MiB). ``--model NAME`` runs the same pipeline for one named entry (tool-chat allowed, no
fallback). A completed provisioning that still holds makes ``auto`` a fast no-op (exit 0)
unless ``--recheck``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from pipeline.cli import CliContext
from pipeline.cli.plan import add_plan_options
from core.errors import UsageError
from pipeline.manifest import plan_from_json
from pipeline.runner import opened_context_tokens
from pipeline.worker import find_worker, worker_held_bytes
from stages.plan import PreviousModel


def add_parser(sub: argparse._SubParsersAction, parents: list[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("auto", parents=parents, help="provision the best model this machine can run",
                       description="Run every stage; a rerun resumes where the last one stopped.")
    p.add_argument("origin_pos", nargs="?", metavar="ORIGIN", help="publisher origin: us, eu, china, gus, auto")
    p.add_argument("--origin", metavar="ORIGIN", help="same as the positional ORIGIN")
    add_plan_options(p)
    p.add_argument("--model", metavar="NAME", help="provision this registry entry (tool-chat allowed; no fallback)")
    p.add_argument("--dry-run", action="store_true", help="print probe, plan and reuse decision as JSON; change nothing")
    p.add_argument("--refresh", action="store_true", help="select afresh instead of keeping the previous model")
    p.add_argument("--recheck", action="store_true", help="re-run load, probe call and re-check on a finished provisioning")
    p.add_argument("--wait", action="store_true", help="wait for another hotfit holding this --home")
    p.set_defaults(handler=handler)


@dataclass(frozen=True)
class AutoOptions:
    origin: str | None
    model: str | None
    backend: str
    kv_cache_type_flag: str | None
    probe_file: Path | None
    registry_file: Path | None
    refresh: bool
    recheck: bool
    dry_run: bool
    wait: bool
    device: str | None = None  # --device KIND|INDEX: plan only that device

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "AutoOptions":
        if args.origin_pos and args.origin and args.origin_pos != args.origin:
            raise UsageError(f"two origins given: {args.origin_pos!r} and --origin {args.origin!r}",
                             hint="give the origin once, as ORIGIN or as --origin")
        return cls(
            origin=args.origin or args.origin_pos,
            model=args.model,
            backend=args.backend,
            kv_cache_type_flag=args.kv_cache_type,
            probe_file=Path(args.probe_file) if args.probe_file else None,
            registry_file=Path(args.registry) if args.registry else None,
            refresh=args.refresh,
            recheck=args.recheck,
            dry_run=args.dry_run,
            wait=args.wait,
            device=args.device,
        )

    def to_json(self) -> dict[str, Any]:
        return {k: (str(v) if isinstance(v, Path) else v) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class AutoResult:
    data: dict[str, Any]  # what --json prints (the manifest, or the dry-run document)
    text: str  # the human summary
    kv_hint: str | None  # one line for stderr when the KV type was left unset


KV_HINT = ("CONTENOX_LLAMA_KV_CACHE_TYPE is unset, so the window was planned at f16; "
           "CONTENOX_LLAMA_KV_CACHE_TYPE=q8_0 halves what the window costs")


def _kv_hint(plan: Any) -> str | None:
    return KV_HINT if plan is not None and plan.kv_cache_type_source == "default" else None


def _noop_problems(manifest: Any, plan: Any) -> list[str]:
    """Pure-ish: why the last provisioning does not stand for ``plan`` ([] = a fast no-op)."""
    import dataclasses

    problems: list[str] = []
    if manifest.entry_name != plan.entry.name:
        problems.append(f"the plan picks {plan.entry.name}, not the provisioned {manifest.entry_name}")
    if manifest.kv_cache_type != plan.kv_cache_type:
        problems.append(f"KV type is {plan.kv_cache_type} now, {manifest.kv_cache_type} when provisioned")
    pinned = (manifest.plan.get("entry") or {}).get("artifact")
    now = dataclasses.asdict(plan.entry.artifact) if plan.entry.artifact else None
    if pinned != now:
        problems.append("the registry pins a different artifact for this entry")
    if (manifest.plan.get("entry") or {}).get("chat_template") != (
            dataclasses.asdict(plan.entry.chat_template) if plan.entry.chat_template else None):
        problems.append("the registry names a different chat template for this entry")
    problems += manifest.files_in_place()
    return problems


def _provisioned_device(manifest: Any) -> Any:
    """The device the manifest's plan was made for (None when the plan is unreadable: then the
    previous model is kept on whichever device it still qualifies)."""
    try:
        return plan_from_json(manifest.plan).probe.device
    except (KeyError, TypeError, ValueError, AttributeError, StopIteration):
        return None


def build_manifest(outcome: Any, settings: Any) -> Any:
    """The manifest of a finished run, from the stages' recorded outputs (pure)."""
    from pipeline.manifest import Manifest, utc_now_iso

    plan = outcome.plan
    out = outcome.outputs
    verify = out["verify"] or {}
    template = out["fetch-template"] or {}
    fetch = out["fetch-weights"] or {}
    load = out["load"] or {}
    call = out["probe-tool-call"] or {}
    recheck = out["re-check"] or {}
    verdict = call.get("verdict") or {}
    backend = load.get("backend") or {}
    device = plan.probe.device
    openvino = plan.backend == "openvino"
    # what each runtime reports beside the shared KV figures (a small adapter, not a Backend boundary)
    runtime_facts: dict[str, Any] = {
        "kv_precision": recheck.get("kv_precision"), "kv_bytes_per_token": recheck.get("kv_bytes_per_token"),
        "predicted_kv_bytes": recheck.get("predicted_kv_bytes"),
        "configured_kv_blocks": recheck.get("configured_kv_blocks"), "block_tokens": recheck.get("block_tokens"),
    } if openvino else {
        "actual_kv_bytes_uncertainty": recheck.get("actual_kv_bytes_uncertainty"),
        "flash_attn": recheck.get("flash_attn"),
        # where the session really put things: "offloaded N/N layers", KV buffers by device
        "offloaded_layers": recheck.get("offloaded_layers"),
        "kv_buffers": recheck.get("kv_buffers"),
    }
    return Manifest(
        run_id=outcome.run_id,
        plan_id=plan.plan_id,
        written_at=utc_now_iso(),
        entry_name=plan.entry.name,
        model_path=verify.get("weights_path"),
        model_size_bytes=verify.get("size_bytes"),
        model_sha256=verify.get("sha256"),
        template_path=template.get("path") or verify.get("chat_template_path"),
        template_sha256=template.get("sha256") if template.get("path") else None,
        projector_path=((fetch.get("projector") or {}).get("path")),
        kv_cache_type=plan.kv_cache_type,
        planned_hot_context_tokens=plan.hot_context_tokens,
        measured={
            # a measurement of one session on one day, not a setting (serve re-checks it)
            "opened_context_tokens": opened_context_tokens(recheck),
            "estimated_kv_bytes": recheck.get("estimated_kv_bytes"),
            "actual_kv_bytes": recheck.get("actual_kv_bytes"),
            "kv_ratio": recheck.get("ratio"),
            "verdict": recheck.get("verdict"),
            "warnings": recheck.get("warnings"),
            **runtime_facts,
            "measured_by_run": outcome.run_id,
        },
        probe_verdict={
            "passed": verdict.get("passed"),
            "reason": verdict.get("reason"),
            "tool": verdict.get("tool_name"),
            "template": call.get("template"),
            "prompt_tokens_per_s": call.get("prompt_tokens_per_s"),
            "generation_tokens_per_s": call.get("generation_tokens_per_s"),
        },
        llama_cpp={} if openvino else {
            "server_path": backend.get("server_path"),
            "source": backend.get("source"),
            **(backend.get("build") or {}),
            "build_info": recheck.get("build_info"),
        },
        device={"index": device.index, "kind": device.kind, "name": device.name,
                "total_bytes": device.total_bytes, "free_bytes_at_plan": device.free_bytes,
                "ggml_device": device.ggml_device},
        plan=plan.to_json(),
        extra={"vision": fetch.get("vision"), "load_argv": load.get("argv")} | ({"openvino": {
            "genai_version": backend.get("genai_version"), "session": load.get("config"),
            "snapshot_commit": (fetch.get("snapshot") or {}).get("commit"), "tool_call_family": call.get("family"),
        }} if openvino else {}),
        backend=plan.backend,
    )


def summary(manifest: Any, plan: Any, *, noop: bool, resumed: bool = False, skipped: tuple[str, ...] = ()) -> str:
    opened = manifest.opened_context_tokens
    own_template = "(none: the GGUF template)"
    if manifest.backend == "openvino":  # GenAI (and OVMS) render the export's own template; the probe proved it
        own_template = "the export's own" + (f" (registry copy checked: {manifest.template_path})"
                                             if manifest.template_path else "")
    lines = [
        ("already provisioned (nothing to do): " if noop else "provisioned: ") + manifest.entry_name,
        f"  KV cache type   {manifest.kv_cache_type} ({plan.kv_cache_type_source})",
        f"  hot context     {plan.hot_context_tokens} tokens planned"
        + (f", {opened} opened at verification" if opened is not None else ""),
        f"  model           {manifest.model_path}",
        f"  chat template   {own_template if manifest.backend == 'openvino' else manifest.template_path or own_template}",
        f"  tool-call probe {'passed' if manifest.probe_verdict.get('passed') else 'FAILED'}"
        + (f" ({manifest.probe_verdict.get('generation_tokens_per_s'):.1f} tok/s generation)"
           if manifest.probe_verdict.get("generation_tokens_per_s") else ""),
        f"  KV allocation   {manifest.measured.get('actual_kv_bytes')} bytes "
        f"(estimate {manifest.measured.get('estimated_kv_bytes')}, ratio {manifest.measured.get('kv_ratio')})",
    ]
    if plan.reused_previous:
        lines.append("  kept the previous model (it still qualifies; --refresh selects afresh)")
    if resumed:
        lines.append(f"  resumed an interrupted run; reused: {', '.join(skipped) or 'nothing'}")
    lines.append("  serve it with: hotfit serve --print-command   (OpenVINO Model Server; see the README)"
                 if manifest.backend == "openvino" else "  serve it with: hotfit serve   (or --print-systemd-unit)")
    return "\n".join(lines)


async def provision(opts: AutoOptions, settings: Any) -> AutoResult:
    """Dry run, fast no-op, or the resumable pipeline under the one-per-home lock."""
    import anyio

    from core.log import get_logger
    from pipeline.manifest import read_manifest, write_manifest
    from pipeline.runner import SESSION_STAGES, Runner, compute_plan, hotfit_stages
    from state.locks import FileLock
    from state.store import StateStore
    from stages.probe import load_probe_file, probe_devices

    log = get_logger()

    async def probe_and_plan(previous: str | None) -> tuple[Any, Any]:
        if opts.probe_file is not None:
            probe = await anyio.to_thread.run_sync(load_probe_file, opts.probe_file)
        else:
            from backends.llama_server.discovery import gpu_listing_binaries

            binaries = gpu_listing_binaries(settings)
            probe = await anyio.to_thread.run_sync(lambda: probe_devices(ggml_binaries=binaries))
        return probe, compute_plan(opts, settings, probe, previous)

    async def previous_model() -> tuple[Any, PreviousModel | None]:
        manifest = read_manifest(settings.manifest_path)
        if opts.refresh or opts.model or manifest is None:
            return manifest, None
        # Kept while it qualifies on the device it was provisioned on; a worker of this home
        # serving it right now holds memory that is the previous model's own (issue 10 item 1).
        worker = await anyio.to_thread.run_sync(find_worker, settings.serve_pid_path, manifest)
        held = 0
        if worker is not None:
            try:
                held = worker_held_bytes(manifest, worker)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:  # unusable plan in the manifest
                log.info("worker.unjudged", reason=str(exc))
        return manifest, PreviousModel(manifest.entry_name, device=_provisioned_device(manifest),
                                       worker_held_bytes=held)

    if opts.dry_run:  # changes nothing: no lock, no state, no files
        from stages.plan import outcome_json

        manifest, previous = await previous_model()
        probe, outcome = await probe_and_plan(previous)
        plan = outcome.plan
        data = {
            "dry_run": True,
            "probe": probe.to_json(),
            "plan": plan.to_json() | {"plan_id": plan.plan_id},
            "selection": outcome_json(outcome),
            "model": plan.entry.name,
            "kv_cache_type": plan.kv_cache_type,
            "estimated_hot_context_tokens": plan.hot_context_tokens,
            "previous_model": manifest.entry_name if manifest else None,
            "device": {"index": plan.probe.device.index, "kind": plan.probe.device.kind,
                       "name": plan.probe.device.name},
            "reused": plan.reused_previous,
            "would": ("nothing (provisioned and still valid)"
                      if manifest and not opts.recheck and not _noop_problems(manifest, plan) else "provision"),
        }
        return AutoResult(data, json_text(data), _kv_hint(plan))

    lock = FileLock(settings.lock_path, wait=opts.wait, what=f"hotfit home {settings.home}")
    async with _held_interruptibly(lock):
        manifest, previous = await previous_model()
        if manifest is not None and not opts.recheck and not opts.refresh:
            probe, outcome = await probe_and_plan(previous)
            problems = _noop_problems(manifest, outcome.plan)
            if not problems:
                log.info("run.noop", model=manifest.entry_name, plan_id=outcome.plan.plan_id,
                         provisioned_by_run=manifest.run_id,
                         serving_worker_held_bytes=previous.worker_held_bytes if previous else 0)
                return AutoResult(manifest.to_json() | {"noop": True},
                                  summary(manifest, outcome.plan, noop=True), _kv_hint(outcome.plan))
            log.info("run.provisioning_stale", model=manifest.entry_name, reasons=problems)
        store = await StateStore.open(settings.state_db, lock_path=settings.lock_path)
        try:
            runner = Runner(hotfit_stages(), store, settings, run_args=opts.to_json(),
                            force=SESSION_STAGES if opts.recheck else (),
                            options={"auto": opts, "previous": previous})
            outcome = await runner.run()
        finally:
            with anyio.CancelScope(shield=True):
                await store.aclose()
        new_manifest = build_manifest(outcome, settings)
        await anyio.to_thread.run_sync(write_manifest, settings.manifest_path, new_manifest)
        log.info("manifest.written", path=str(settings.manifest_path), model=new_manifest.entry_name,
                 run_id=outcome.run_id, plan_id=new_manifest.plan_id)
        text = summary(new_manifest, outcome.plan, noop=False, resumed=outcome.resumed, skipped=outcome.skipped)
        return AutoResult(new_manifest.to_json(), text, _kv_hint(outcome.plan))


@contextlib.asynccontextmanager
async def _held_interruptibly(lock: Any) -> AsyncIterator[Any]:
    """Hold the home lock. SIGINT/SIGTERM while queued behind another run (--wait) ends with
    Interrupted (exit 130) and a ``lock.wait_interrupted`` event; nothing was written, since
    state belongs to the lock holder. (Once held, the runner handles signals itself.)"""
    import signal

    import anyio

    from core.errors import Interrupted
    from core.log import get_logger

    received: list[int] = []
    failure: Exception | None = None
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                async for signum in signals:
                    received.append(signum)
                    tg.cancel_scope.cancel()
                    return

            tg.start_soon(watch)
            try:
                await lock.acquire_async()
            except Exception as exc:  # LockedError: kept out of the task group's ExceptionGroup
                failure = exc
            finally:
                tg.cancel_scope.cancel()
    if failure is not None:
        raise failure
    if received:
        lock.release()  # held only if it was granted as the signal arrived
        name = signal.Signals(received[0]).name
        get_logger().warning("lock.wait_interrupted", signal=name, lock=str(lock.path))
        raise Interrupted(f"interrupted by {name} while waiting for {lock.what}; nothing was changed",
                          hint="rerun the same command to queue again")
    try:
        yield lock
    finally:
        lock.release()


def json_text(data: Any) -> str:
    import json

    return json.dumps(data, indent=2, default=str)


def handler(args: argparse.Namespace, ctx: CliContext) -> int:
    import anyio

    opts = AutoOptions.from_args(args)
    result = anyio.run(provision, opts, ctx.settings)
    if result.kv_hint:
        sys.stderr.write(f"hotfit: hint: {result.kv_hint}\n")
    ctx.emit(result.data, result.text)
    return 0
