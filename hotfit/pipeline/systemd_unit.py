"""The systemd unit ``hotfit serve --print-systemd-unit`` prints (pure: built from a :class:`UnitSpec`).

The unit runs ``hotfit serve`` itself, so the memory check happens at every start, as an
unprivileged account in a sandbox that still reaches the plan's GPU, and does not restart on
hotfit's permanent exit codes (docs/recipes.md, "systemd").
"""

from __future__ import annotations

import pwd
import re
from dataclasses import dataclass
from pathlib import Path

from hotfit.core.errors import UsageError

__all__ = ["DEFAULT_UNIT_USER", "GPU_DEVICE_ALLOW", "PERMANENT_EXIT_CODES", "UnitSpec", "systemd_unit",
           "under_home_dirs", "unit_user", "unit_value", "unit_word"]


# Exit codes of `hotfit serve` that a restart cannot change (core/errors.py): 2 nothing provisioned
# or a bad setting, 3 the device no longer holds the floor (or is gone), 5 no usable llama-server.
# 7 (the hardware probe failed) stays restartable: at boot the GPU driver may come up late.
PERMANENT_EXIT_CODES = (2, 3, 5)
# Past this many starts in this interval systemd stops trying (a crash loop of llama-server itself).
START_LIMIT_BURST = 5
START_LIMIT_INTERVAL_S = 600
RESTART_SEC = 10
# Device-node groups (/proc/devices) a plan's accelerator is opened through; DevicePolicy=closed
# allows nothing else. NVIDIA: the cards, nvidiactl and modeset share "nvidia-frontend", UVM is
# CUDA's memory manager, "nvidia-caps" the MIG capabilities. AMD/Vulkan: DRM render nodes
# (/dev/dri), and /dev/kfd for ROCm builds.
GPU_DEVICE_ALLOW: dict[str, tuple[str, ...]] = {
    "nvidia": ("char-nvidia-frontend rw", "char-nvidia-uvm rw", "char-nvidia-caps rw"),
    "amd": ("char-drm rw", "/dev/kfd rw"),
    "vulkan": ("char-drm rw", "/dev/kfd rw"),
    "cpu": (),
}
# A word systemd reads as written without quotes: anything else is double-quoted (systemd.syntax, "Quoting").
_BARE_WORD = re.compile(r"[A-Za-z0-9_@%+=:,./-]+")
# A word with one of these cannot be written so every setting reads it back (ReadWritePaths= has no C escapes).
_UNWRITABLE = re.compile(r"[\x00-\x1f\x7f]")
# StateDirectory= splits its word again at ":" and keeps backslashes (systemd 252): a home under /var/lib
# whose name holds one of these is a ReadWritePaths= like any other home.
_STATE_DIR_UNSAFE = re.compile(r'[\\":]')
# Home directories ProtectHome= hides; a path under them needs ProtectHome=read-only.
_HOME_ROOTS = (Path("/home"), Path("/root"), Path("/run/user"))
_STATE_ROOT = Path("/var/lib")


@dataclass(frozen=True)
class UnitSpec:
    """What the printed unit depends on (built from the provisioned home; rendered purely)."""

    hotfit_argv: list[str]
    env: dict[str, str]
    description: str
    user: str
    home: Path
    device_kind: str
    paths: tuple[Path, ...] = ()  # files the service reads outside the home: hotfit, llama-server


def unit_value(text: str) -> str:
    """A setting's raw value with every ``%`` literal: systemd expands specifiers (``%h`` is the
    account's home) in nearly every setting (systemd.unit, "Specifiers")."""
    if _UNWRITABLE.search(text):
        raise UsageError(f"the systemd unit cannot name {text!r}: it holds a control character",
                         hint="use a home, hotfit and llama-server path without newlines or control characters")
    return text.replace("%", "%%")


def unit_word(text: str, *, command: bool = False) -> str:
    """One word of a setting that takes a list (``ReadWritePaths=``, ``Environment=``, ``ExecStart=``),
    read back by systemd as exactly ``text``: double-quoted with ``\\`` and ``\"`` escaped where it is not
    a plain word (systemd.syntax, "Quoting"), ``%`` doubled, and in a command line ``$`` doubled too
    (systemd.service, "Command lines": ``$$`` is one literal ``$``)."""
    value = unit_value(text)
    if command:
        value = value.replace("$", "$$")
    if _BARE_WORD.fullmatch(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def under_home_dirs(path: Path) -> bool:
    return any(path == root or root in path.parents for root in _HOME_ROOTS)


def systemd_unit(spec: UnitSpec) -> str:
    """Pure: a hardened unit that runs `hotfit serve` (the memory check repeats at every start).

    The service runs as ``spec.user`` (not root) with no capabilities, a read-only system, a
    system-call filter and a closed device policy that still admits the plan's accelerator
    (docs/recipes.md, "systemd"). A home under /var/lib is the unit's StateDirectory (systemd
    creates it and hands it to the user); elsewhere it is the one writable path."""
    home = spec.home
    state_dir = str(home.relative_to(_STATE_ROOT)) if _STATE_ROOT in home.parents else None
    if state_dir is not None and _STATE_DIR_UNSAFE.search(state_dir):
        state_dir = None
    hidden = any(under_home_dirs(p) for p in (home, *spec.paths))
    kind = spec.device_kind
    devices = GPU_DEVICE_ALLOW.get(kind, GPU_DEVICE_ALLOW["vulkan"])
    lines = [
        "[Unit]",
        f"Description={unit_value(spec.description)}",
        "Wants=network-online.target",
        "After=network-online.target",
        # a crash loop ends: after START_LIMIT_BURST starts in the interval the unit stays failed
        f"StartLimitIntervalSec={START_LIMIT_INTERVAL_S}",
        f"StartLimitBurst={START_LIMIT_BURST}",
        "",
        "[Service]",
        "Type=exec",
        f"User={unit_value(spec.user)}",
        *(f"Environment={unit_word(f'{k}={v}')}" for k, v in sorted(spec.env.items())),
        f"ExecStart={' '.join(unit_word(arg, command=True) for arg in spec.hotfit_argv)}",
        "Restart=on-failure",
        f"RestartSec={RESTART_SEC}",
        f"RestartPreventExitStatus={' '.join(map(str, PERMANENT_EXIT_CODES))}",
        "KillSignal=SIGTERM",
        # one quoted path: unquoted, a space splits it and ProtectSystem=strict ignores the pieces
        *([f"StateDirectory={unit_word(state_dir)}", "StateDirectoryMode=0750"] if state_dir
          else [f"ReadWritePaths={unit_word(str(home))}"]),
        "ProtectSystem=strict",
        # hotfit, llama-server or the home under /home or /root: readable, not writable (but the home)
        "ProtectHome=read-only" if hidden else "ProtectHome=yes",
        "PrivateTmp=yes",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=",
        "AmbientCapabilities=",
        "PrivateUsers=yes",
        "ProtectKernelTunables=yes",
        "ProtectKernelModules=yes",
        "ProtectKernelLogs=yes",
        "ProtectControlGroups=yes",
        "ProtectClock=yes",
        "ProtectHostname=yes",
        "ProtectProc=invisible",
        "RestrictNamespaces=yes",
        "RestrictRealtime=yes",
        "RestrictSUIDSGID=yes",
        "LockPersonality=yes",
        "RemoveIPC=yes",
        "RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6",
        "SystemCallArchitectures=native",
        "SystemCallFilter=@system-service",
        "SystemCallFilter=~@privileged",
        # a call outside the filter fails with EPERM instead of killing the server (SIGSYS)
        "SystemCallErrorNumber=EPERM",
        "UMask=0027",
        # PrivateDevices= would hide the GPU: a closed policy with the accelerator's nodes instead
        "DevicePolicy=closed",
        *(f"DeviceAllow={d}" for d in devices),
        # render nodes are group-owned (render, video on older systems)
        *(["SupplementaryGroups=render video"] if any("drm" in d for d in devices) else []),
        "",
        "[Install]",
        "WantedBy=multi-user.target",
        "",
    ]
    return "\n".join(lines)


def unit_user(home: Path, named: str | None) -> str:
    """``--unit-user``, else the owner of the home when that is not root, else ``hotfit``."""
    if named:
        return named
    try:
        uid = home.stat().st_uid
    except OSError:
        return DEFAULT_UNIT_USER
    if uid == 0:
        return DEFAULT_UNIT_USER
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


DEFAULT_UNIT_USER = "hotfit"
