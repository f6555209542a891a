"""The Backend boundary: what a model server offers the stages, ``hotfit serve`` and the grade.

One implementation per server (:mod:`backends.llama_server`, :mod:`backends.openvino`); the stages
pick one with :func:`backends.select.backend_for` from the plan and never touch server specifics:

- :meth:`Backend.preflight` — binary/runtime discovery and capabilities, before any weight is
  fetched; its :class:`BackendBinary` rides forward to load, so it is resolved once per run;
- :meth:`Backend.open` — argv, child environment (device pin included), process lifetime, health:
  an async context manager yielding a :class:`Session` that is always stopped and reaped;
- :meth:`Backend.serve_command` — the long-running server command ``hotfit serve`` prints or execs,
  with what serve and ``auto``'s summary say of it (:attr:`Backend.serve_execs`,
  :meth:`Backend.serve_refusal`, :meth:`Backend.service_pin`, :attr:`Backend.serve_hint`,
  :meth:`Backend.template_summary`);
- :meth:`Backend.grade_build` — the identity of the build that would serve a model now (grade evidence);
- :meth:`Backend.build_for` — the build a fleet's build server makes for a planned device
  (``hotfit fleet plan``, docs/fleet.md);
- on the :class:`Session`: :meth:`~Session.call_tools` (one chat call, tool calls parsed into the
  OpenAI shape — the probe's), :meth:`~Session.chat_endpoint` (the grade's multi-turn endpoint),
  :meth:`~Session.allocation_report` (what the opened session really allocated, judged against the
  plan), log tail and exit description.

A chat call answers with the one reply type, :class:`~grading.protocol.ChatReply`; failures of the
call itself (no answer, a dead process, an HTTP error) raise the one failure type,
:class:`~grading.protocol.ChatFailed`, which the caller turns into its own error (the probe:
``ToolCallProbeFailed``; the grade: a stack failure). This module is pure: protocols and frozen result types only. Nothing outside ``backends/`` imports
more of a backend than this module and :mod:`backends.select` (an import-linter contract,
CONTRIBUTING.md "Adding a backend"); what differs between servers is asked here, never decided by
comparing a backend's name.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, Self, runtime_checkable

from hotfit.core.entry import Entry
from hotfit.core.errors import HotfitError
from hotfit.planner.plan import Plan
from hotfit.planner.probe import Device
from hotfit.core.records import JsonRecord
from hotfit.core.settings import Settings
from hotfit.grading.protocol import ChatEndpoint, ChatReply

__all__ = [
    "KV_EXCESS_TOLERANCE",
    "KV_SHORTFALL_WARN_RATIO",
    "AllocationReport",
    "ManifestFacts",
    "AllocationVerdict",
    "Backend",
    "BackendBinary",
    "BackendName",
    "BuildNeed",
    "BuildUnavailable",
    "DeviceListing",
    "ListedDevice",
    "ModelFiles",
    "ServeCommand",
    "ServicePin",
    "Session",
]

BackendName = Literal["llama", "openvino"]

# registry.kv mirrors each server's allocation byte for byte, so the real KV should equal the
# estimate; 1 % absorbs llama-server's MiB rounding and nothing a real excess would hide behind.
KV_EXCESS_TOLERANCE = 0.01
# Less than half the estimate means the plan's arithmetic and the server disagree (a window that
# shrank, layers without KV): not unsafe, but worth an operator's look.
KV_SHORTFALL_WARN_RATIO = 0.5


@dataclass(frozen=True)
class BuildNeed(JsonRecord):
    """The server build a planned machine needs, as its fleet's build server makes it once and
    exports (docs/fleet.md, "Builds to make"): ``flavour`` names the build cache's folder,
    ``install_flags`` what selects it; ``per_gpu_code``: the build holds code per GPU generation
    (CUDA), so one build for a fleet covers the union of ``cuda_capability`` (89 for 8.9; None: the
    probe did not record it)."""

    flavour: str
    arch: str
    install_flags: str
    per_gpu_code: bool = False
    cuda_capability: int | None = None


@runtime_checkable
class BackendBinary(Protocol):
    """What the preflight resolved (llama-server's path and build, OpenVINO's runtime version)."""

    def to_json(self) -> dict[str, Any]: ...

    def build_identity(self) -> tuple[str, str]:
        """(identity, description) of this build: what :meth:`Backend.build_identity` names when the
        search finds it, read from what was found, without searching again."""
        ...

    def manifest_facts(self, *, report: AllocationReport, session: Mapping[str, Any], snapshot_commit: str | None,
                       call_facts: Mapping[str, Any]) -> ManifestFacts:
        """What the manifest keeps of the session this binary ran, from the re-check's ``report``
        (this backend's), the load record (``session``), the snapshot fetched and the tool-call
        probe's backend facts."""
        ...


@dataclass(frozen=True)
class ManifestFacts:
    """A backend's own part of the manifest (pipeline/manifest.py): its figures in ``measured``
    beside the shared KV figures, its build (the manifest's ``backend_build``: llama-server's path,
    version, commit…), and what it adds to ``extra``."""

    measured: Mapping[str, Any]
    build: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ListedDevice:
    """A GPU a backend's runtime says it sees, as the probe merges it with NVML and sysfs."""

    name: str  # the runtime's name for it, what a session is pinned to ("Vulkan0", "CUDA0")
    api: str  # what it is reached through: "vulkan", "cuda"
    description: str  # "llvmpipe (LLVM 15.0.6, 256 bits)", "NVIDIA H200"
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class DeviceListing:
    """The GPUs a backend's runtimes list, and why a listing is missing (the probe's notes)."""

    devices: tuple[ListedDevice, ...] = ()
    notes: tuple[str, ...] = ()

    def __add__(self, other: DeviceListing) -> DeviceListing:
        return DeviceListing(self.devices + other.devices, self.notes + other.notes)


@dataclass(frozen=True)
class ModelFiles:
    """The verified files a session opens: a GGUF (llama) or an IR directory (OpenVINO)."""

    weights: Path
    template: Path | None = None
    embedded_template: bool | None = None  # the GGUF header's tokenizer.chat_template (None: unknown)


@dataclass(frozen=True)
class ServeCommand:
    """A long-running server command: argv, and the variables hotfit sets beyond the inherited
    environment (the device pin); ``server`` names the program for messages."""

    server: str
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    # inherited variables the child must not see (a trailing * matches a prefix): overrides that
    # would silently change what argv says, a stale key
    unset: tuple[str, ...] = ()

    def environment(self, base: Mapping[str, str]) -> dict[str, str]:
        """The child's whole environment: ``base`` without :attr:`unset`, plus :attr:`env`."""

        def dropped(name: str) -> bool:
            return any(name.startswith(u[:-1]) if u.endswith("*") else name == u for u in self.unset)

        return {k: v for k, v in base.items() if not dropped(k)} | dict(self.env)


@dataclass(frozen=True)
class ServicePin:
    """What a service running ``hotfit serve`` pins of the backend (the printed systemd unit): hotfit's
    global options naming the server found now (the service user's own build cache may hold none),
    the files outside the home the service reads, and the server's name for the unit's description."""

    server: str
    options: tuple[str, ...] = ()
    paths: tuple[Path, ...] = ()


class BuildUnavailable(Exception):
    """No build can be fingerprinted for grade evidence now: ``what`` says why, ``hint`` what to do."""

    def __init__(self, what: str, hint: str | None = None) -> None:
        super().__init__(what)
        self.what = what
        self.hint = hint


@dataclass(frozen=True)
class AllocationVerdict(JsonRecord):
    """The fields every backend's allocation report opens with (its own facts follow them), and
    its JSON: the fields, in that order."""

    verdict: str  # "pass" | "fail"
    problems: tuple[str, ...]
    warnings: tuple[str, ...]
    planned_hot_context_tokens: int
    floor_tokens: int

    @classmethod
    def judged(cls, problems: Sequence[str], warnings: Sequence[str], **facts: Any) -> Self:
        """The report of ``facts`` whose verdict follows from ``problems``: any problem fails it."""
        return cls(verdict="fail" if problems else "pass", problems=tuple(problems), warnings=tuple(warnings),
                   **facts)


class AllocationReport(Protocol):
    """A backend's verified allocation beside the plan's estimate (never merged)."""

    # Read-only members (properties): the backends' reports are frozen dataclasses.
    @property
    def verdict(self) -> str: ...  # "pass" | "fail"

    @property
    def problems(self) -> tuple[str, ...]: ...

    @property
    def warnings(self) -> tuple[str, ...]: ...

    @property
    def planned_hot_context_tokens(self) -> int: ...

    @property
    def estimated_kv_bytes(self) -> int: ...

    @property
    def actual_kv_bytes(self) -> int | None: ...

    @property
    def ratio(self) -> float | None: ...

    def to_json(self) -> dict[str, Any]: ...

    @property
    def opened_context_tokens(self) -> int | None: ...  # the window the session holds (None: unread)

    def opened_figure(self) -> Any:
        """How the re-check's figures show the opened window (llama-server: the window per slot;
        OpenVINO: the one window its bytes hold)."""
        ...

    def event_facts(self) -> dict[str, Any]:
        """The fields of the ``recheck.*`` events."""
        ...

    def warning_event(self, warning: str) -> str:
        """The event name a warning is logged under."""
        ...


class Session(Protocol):
    """An opened model server (valid inside :meth:`Backend.open`'s ``async with``)."""

    # Read-only (properties), so each backend's narrower Literal and class attributes satisfy them.
    @property
    def backend(self) -> BackendName: ...

    @property
    def server_name(self) -> str: ...  # "llama-server", "OpenVINO": how messages name the server

    plan: Plan
    run_dir: Path
    log_path: Path
    load_seconds: float

    @property
    def pid(self) -> int: ...

    def returncode(self) -> int | None: ...

    def describe_exit(self) -> str: ...

    @property
    def prompt_max_tokens(self) -> int | None:
        """The most prompt tokens the session takes whole, when fewer than the planned window (an
        OpenVINO export's tokenizer limit); None: the window."""
        ...

    def to_json(self) -> dict[str, Any]:
        """What the load record keeps (no secret)."""
        ...

    def load_figures(self) -> dict[str, Any]:
        """The load stage's figures for the run summary."""
        ...

    async def call_tools(self, request: Mapping[str, Any], *, timeout_s: float, purpose: str) -> ChatReply:
        """One chat completion of ``request`` (OpenAI body: messages, tools, tool_choice, max_tokens);
        raises :class:`~grading.protocol.ChatFailed`. ``purpose`` names the call in messages ("the tool-call probe")."""
        ...

    def tool_call_fix(self, cause: str, answer: ChatReply | None) -> str:
        """What the operator does about a failed tool call of ``cause`` on this server."""
        ...

    def chat_endpoint(self) -> AbstractAsyncContextManager[ChatEndpoint]:
        """The grade's multi-turn endpoint on this session."""
        ...

    async def allocation_report(self, plan: Plan, *, floor_tokens: int, tolerance: float,
                                timeout_s: float) -> AllocationReport:
        """Read what the session really allocated and judge it against ``plan`` (no raise for a
        failed verdict; raises ``AllocationMismatch`` only when nothing can be read)."""
        ...


class Backend(Protocol):
    """One kind of model server."""

    @property
    def name(self) -> BackendName: ...  # read-only: each backend's narrower Literal satisfies it

    # The probe's device kinds (registry.select.DEVICE_KINDS) this backend can run a model on; the
    # planner plans no other device for it (stages/plan.py).
    device_kinds: frozenset[str]

    def preflight(self, plan: Plan, settings: Settings) -> BackendBinary:
        """Refuse, with the fix named, a plan this machine cannot serve (before any download)."""
        ...

    def decode_binary(self, record: Mapping[str, Any], *, path: str = "") -> BackendBinary:
        """The preflight's binary back from its ``to_json()`` (a stage record); StageRecordError
        names a damaged field."""
        ...

    def decode_allocation(self, record: Mapping[str, Any]) -> AllocationReport:
        """The allocation report back from its ``to_json()`` (the re-check's record)."""
        ...

    def decode_load(self, record: Mapping[str, Any]) -> None:
        """Check a load record (its :meth:`Session.to_json` plus ``backend``, the binary's record) has
        this backend's shape; StageRecordError names a damaged field. The stage keeps it opaque."""
        ...

    def load_fingerprint(self, record: Mapping[str, Any]) -> Any:
        """What downstream stages hash of a load record: how the session was started, without what
        changes every start (a port, the pid, timings)."""
        ...

    def launch_flags(self, record: Mapping[str, Any]) -> Any:
        """The settings a load record says the session was started with, for a grade's fingerprint
        (its ``flags``): what a server cannot report of itself. Falsy: unknown."""
        ...

    def list_devices(self, settings: Settings, env: Mapping[str, str]) -> DeviceListing:
        """The GPUs this backend's runtimes see, before any plan names a backend (blocking: it may
        run a program). None listed: the probe has NVML, sysfs and host memory."""
        ...

    def device_env(self, plan: Plan) -> dict[str, str]:
        """The variables that pin a child to the planned device (none where argv does it)."""
        ...

    def open(self, plan: Plan, files: ModelFiles, *, run_dir: Path, binary: BackendBinary | None,
             settings: Settings) -> AbstractAsyncContextManager[Session]:
        """Start the server for ``plan``; yield the healthy :class:`Session`; always reap it."""
        ...

    async def serve_command(self, plan: Plan, files: ModelFiles, *, host: str, port: int,
                            api_key_file: Path | None, binary: BackendBinary | None, settings: Settings,
                            model_name: str = "", verified: Mapping[str, Any] | None = None) -> ServeCommand:
        """The long-running server for a provisioned model, with the load stage's settings and
        device pin (``verified``: the manifest's measured facts and extra records, where the command
        needs them)."""
        ...

    # ``hotfit serve``: True, it checks the window against the device and execs the command itself;
    # False, it prints the command (--print-command) and otherwise refuses with :meth:`serve_refusal`.
    serve_execs: bool
    # how ``auto``'s summary closes: the line after "serve it with: "
    serve_hint: str

    def serve_refusal(self, model_name: str, command: ServeCommand) -> HotfitError | None:
        """Why ``hotfit serve`` does not run ``command`` itself, naming what the operator runs
        instead (None where :attr:`serve_execs`: it does)."""
        ...

    def service_pin(self, plan: Plan, settings: Settings) -> ServicePin:
        """What the printed systemd unit pins of this backend for ``plan`` (blocking: it may search)."""
        ...

    def template_summary(self, template_path: str | None) -> str:
        """How ``auto``'s summary names the chat template the provisioned model is served with."""
        ...

    def build_for(self, device: Device, arch: str) -> BuildNeed | None:
        """The build that serves a model on ``device`` of a machine of CPU ``arch`` (``x86_64``,
        ``aarch64``), or None where nothing is built (a runtime installed from PyPI). Pure."""
        ...

    def build_identity(self, device_kind: str, settings: Settings) -> tuple[str, str]:
        """(identity, description) of the build this backend would run on a ``device_kind`` device
        now — the same search as the load stage; another build, flavour or version has another
        identity (a speed calibration is kept per build: registry/speed.py). Raises
        :class:`BuildUnavailable`."""
        ...

    def grade_build(self, entry: Entry, device_kind: str, settings: Settings) -> tuple[str, str]:
        """(identity, description) of the build that would serve ``entry`` on a ``device_kind`` device
        now — the same search and checks as the load stage; the identity covers the build's facts
        and bytes (docs/grade.md, "Earning a place"). Raises :class:`BuildUnavailable`."""
        ...
