"""Every error hotfit raises on purpose, and the exit code each one maps to.

The tree (an operator can catch any level; the CLI maps the class to an exit code)::

    HotfitError                        exit 1   (never raised bare)
    ├── UsageError                     exit 2   bad CLI argument, env var or config value
    │   ├── RegistryError              exit 2   curated registry file fails its schema
    │   └── StageRecordError           exit 2   a stage record in state.db does not decode (the stage reruns)
    ├── NoModelQualifies               exit 3   fail closed: nothing agentic fits this budget
    ├── TransferError                  exit 4   fetch-weights / fetch-template / verify
    │   ├── HubError                   exit 4   the Hub answered with an error (repo, revision, entry, gated)
    │   ├── PinMismatch                exit 4   X-Repo-Commit or size differs from the pinned value
    │   ├── DiskSpaceError             exit 4   not enough free disk for what must be written
    │   ├── DiskWriteError             exit 4   the filesystem refused a write: read-only (EROFS) or failing (EIO)
    │   ├── IntegrityError             exit 4   sha256 / size / GGUF header disagree with the registry
    │   ├── CertificateError           exit 4   a server's TLS certificate failed verification (never retried)
    │   ├── TemplateError              exit 4   chat template missing, malformed, or cannot express tool calls
    │   └── TransientTransferError     exit 11  retries ran out on a passing fault (no progress, cut streams)
    │       └── HubUnreachable         exit 11  (also a HubError) no connection, or 5xx/429 after every retry
    ├── BackendError                   exit 5   load / probe-tool-call / re-check
    │   ├── BackendNotFound            exit 5   no llama-server binary could be found
    │   ├── LoadError                  exit 5   llama-server did not come up (log lines quoted)
    │   ├── ToolCallProbeFailed        exit 5   the probe call did not parse as a tool call
    │   ├── AllocationMismatch         exit 5   what the opened session allocated differs from the plan
    │   └── DeviceMismatch             exit 5   the build would not run on the planned device (before any download)
    ├── LockedError                    exit 6   another hotfit holds the lock (its PID is named)
    ├── HardwareProbeError             exit 7   NVML (or another probe) present but failing
    └── Interrupted                    exit 130 SIGINT/SIGTERM/SIGHUP; state marked interrupted, rerun resumes

Exit 4 is permanent until something changes (a pin, a file, the disk); exit 11 is a fault that
passes by itself, so a Kubernetes Job retries it and a systemd unit or cron restarts it, while 4 stops
them (docs/recipes.md, "Exit codes in a fleet").

Each error carries ``what`` happened, ``hint`` (what to do) and ``details`` (machine-readable
facts for ``--json``). Messages never contain secrets.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "EXIT_OK",
    "HotfitError",
    "UsageError",
    "RegistryError",
    "StageRecordError",
    "NoModelQualifies",
    "TransferError",
    "HubError",
    "PinMismatch",
    "DiskSpaceError",
    "DiskWriteError",
    "IntegrityError",
    "CertificateError",
    "TemplateError",
    "TransientTransferError",
    "HubUnreachable",
    "BackendError",
    "BackendNotFound",
    "LoadError",
    "ToolCallProbeFailed",
    "AllocationMismatch",
    "DeviceMismatch",
    "LockedError",
    "HardwareProbeError",
    "Interrupted",
]

EXIT_OK = 0


class HotfitError(Exception):
    """Base of every deliberate hotfit failure."""

    exit_code: int = 1
    code: str = "error"

    def __init__(self, what: str, *, hint: str | None = None, **details: Any) -> None:
        super().__init__(what)
        self.what = what
        self.hint = hint
        self.details = details

    def __str__(self) -> str:
        return self.what if not self.hint else f"{self.what}\n  → {self.hint}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"code": self.code, "message": self.what, "exit_code": self.exit_code}
        if self.hint:
            out["hint"] = self.hint
        if self.details:
            out["details"] = self.details
        return out


class UsageError(HotfitError):
    exit_code = 2
    code = "usage"


class RegistryError(UsageError):
    code = "registry"


class StageRecordError(UsageError):
    """A stage's stored outputs do not decode into its result type (damaged, or written by another
    version). The runner logs it and runs the stage again rather than trusting the record."""

    code = "stage_record"


class NoModelQualifies(HotfitError):
    exit_code = 3
    code = "no_model_qualifies"


class TransferError(HotfitError):
    exit_code = 4
    code = "transfer"


class HubError(TransferError):
    code = "hub"


class PinMismatch(TransferError):
    code = "pin_mismatch"


class DiskSpaceError(TransferError):
    code = "disk_space"


class DiskWriteError(TransferError):
    """The filesystem refused a write it has room for: turned read-only (EROFS; what the kernel does
    after a disk error) or failing (EIO). What was written before is kept; the rerun resumes."""

    code = "disk_unwritable"


class IntegrityError(TransferError):
    code = "integrity"


class CertificateError(TransferError):
    """The TLS certificate of the Hub, a mirror or a TLS-inspecting proxy failed verification (not yet
    valid, expired, not trusted, another name): permanent until the clock, the trust store or the
    endpoint changes, so it is never retried; the message carries the verifier's reason."""

    code = "tls_certificate"


class TemplateError(TransferError):
    code = "template"


class TransientTransferError(TransferError):
    """Retries ran out on a fault that passes by itself (no progress, a refused or cut connection, a
    5xx or 429 answer): nothing was found wrong with the files, and a later rerun resumes what is on
    disk. Its own exit code, so a fleet's scheduler can retry it and stop on exit 4."""

    exit_code = 11
    code = "transfer_transient"


class HubUnreachable(TransientTransferError, HubError):
    """The Hub (or the mirror, or the proxy in front of it) could not be reached at all."""

    code = "hub_unreachable"


class BackendError(HotfitError):
    exit_code = 5
    code = "backend"


class BackendNotFound(BackendError):
    code = "backend_not_found"


class LoadError(BackendError):
    code = "load"


class ToolCallProbeFailed(BackendError):
    code = "tool_call_probe"


class AllocationMismatch(BackendError):
    code = "allocation_mismatch"


class SpeedFloorMissed(BackendError):
    """The opened session measured below an operator's speed floor (stages/measure_speed.py)."""

    code = "speed_floor"


class DeviceMismatch(BackendError):
    code = "device_mismatch"


class LockedError(HotfitError):
    exit_code = 6
    code = "locked"


class HardwareProbeError(HotfitError):
    exit_code = 7
    code = "hardware_probe"


class Interrupted(HotfitError):
    exit_code = 130
    code = "interrupted"
