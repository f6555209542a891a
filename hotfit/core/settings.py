"""Configuration read from the environment, once, into a frozen object.

Environment variables (all optional):

==============================  ===============================================================
``HOTFIT_HOME``                 state/model directory (default ``$XDG_DATA_HOME/hotfit`` or
                                ``~/.local/share/hotfit``); ``--home`` overrides it
``HOTFIT_LLAMA_SERVER``         path to a llama-server binary (after ``--llama-server``)
``HOTFIT_LLAMA_CACHE``          where ``scripts/install-llama-server`` builds
                                (default ``$XDG_CACHE_HOME/hotfit/llama.cpp``)
``HOTFIT_DOWNLOAD_CONNECTIONS``  parallel byte ranges per large file (default 4)
``CONTENOX_LLAMA_KV_CACHE_TYPE``  KV cache type the worker runs (unset = f16); the same
                                variable contenox's modeld reads, so plan and worker agree
``HF_ENDPOINT``                 Hub (or mirror) base URL (default https://huggingface.co); a
                                malformed one is exit 2 naming it (not checked offline)
``HF_TOKEN``                    Hub token; else huggingface_hub's token store
``HF_HUB_OFFLINE``              1 = never touch the network
``HTTP_PROXY`` ``HTTPS_PROXY``   proxies for every request, either case (download.proxy reads
``ALL_PROXY`` ``NO_PROXY``       them with httpx's rules; docs/network.md)
``HF_HUB_CACHE`` / ``HF_HOME``  the Hugging Face cache pinned files are taken from (docs/network.md)
``HOTFIT_TEXTFILE_DIR``         node_exporter's textfile directory: ``hotfit auto`` also writes
                                ``hotfit.prom`` there (docs/operations.md)
``HOTFIT_LOG_MAX_BYTES``        rotate ``logs/hotfit.jsonl`` at this size (default 10 MiB)
``HOTFIT_LOG_KEEP``             rotated log files kept (default 5)
``HOTFIT_KEEP_RUNS``            runs kept in state.db and runs/ (default 20; older ones pruned)
``HOTFIT_MIN_DECODE_TOKENS_PER_S``  opt-in floor: a candidate predicted to generate slower is not
                                picked (``--min-decode-tokens-per-s`` wins; docs/usage.md)
``HOTFIT_MAX_FIRST_TOKEN_S``    opt-in floor: a candidate predicted to take longer to the first
                                token of an agent prompt is not picked (``--max-first-token-s``)
``HOTFIT_HOST_SPEED_CACHE``     the probe's per-machine bandwidth cache (default
                                ``$XDG_CACHE_HOME/hotfit/host-speed.json``)
==============================  ===============================================================

On-disk layout under the home directory (the one place it is written down)::

    <home>/
      state.db                 SQLite (WAL) stage state, one row per (run, stage); meta records the home
                               (a copied home re-roots its records: docs/faults-state.md)
      pipeline.lock            flock held by the running pipeline (holder PID inside)
      logs/hotfit.jsonl        JSON event log, appended by every command (+ .1 … .N, rotated by size)
      metrics/hotfit.prom      Prometheus textfile of the last `hotfit auto` (docs/operations.md)
      metrics/last-run.json    the last `hotfit auto`: exit code, error, when (read by `hotfit status`)
      models/<entry>/          verified weights, projector, chat_template.jinja
      models/<entry>/.partial/ partial downloads + JSON sidecars (resume state), per-target locks
      models/<entry>/.partial/template/  fetch-template's own (a template source from outside the snapshot)
      models/<entry>/.verified/ receipts of verified files (size, sha256, pinned commit)
      models/<entry>/snapshot/ OpenVINO repository snapshot (+ snapshot.json: commit, file list)
      runs/<run_id>/           per-run files (llama-server logs, probe transcript)
      manifest.json            the last successful provisioning
      grades/                  `hotfit grade` records (score, transcripts, fingerprint), one JSON each
      serve.pid                the llama-server `hotfit serve` exec'd (JSON: pid, start time, port,
                               model, window); trusted only while that process is it (pipeline/worker.py)
      speed-calibration.json   measured / predicted speed of the last measure-speed on this machine,
                               with its device, probe figure, backend build and provenance
                               (registry/speed.py; another build sets it aside)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Self, overload
from urllib.parse import urlsplit

from hotfit.core.errors import UsageError
from hotfit.core.log import DEFAULT_LOG_KEEP, DEFAULT_LOG_MAX_BYTES

DEFAULT_HF_ENDPOINT = "https://huggingface.co"
DEFAULT_DOWNLOAD_CONNECTIONS = 4
DEFAULT_KEEP_RUNS = 20  # runs kept in state.db: a resume needs only the last, reuse the recent ones
KV_CACHE_ENV = "CONTENOX_LLAMA_KV_CACHE_TYPE"
PROXY_VARIABLES = ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")  # either case
LLAMA_SDIST_VERSION = "0.3.36"  # keep in step with scripts/install-llama-server


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in {"1", "true", "yes", "on"}


def _xdg_dir(env: Mapping[str, str], override: str, xdg: str, xdg_default: str, *under: str) -> Path:
    """``$override`` if set, else ``<$xdg or ~/xdg_default>/under...`` (the XDG base directory rule)."""
    if env.get(override):
        return Path(env[override]).expanduser()
    base = env.get(xdg) or str(Path(env.get("HOME", "~")).expanduser() / xdg_default)
    return Path(base).joinpath(*under)


def default_home(env: Mapping[str, str]) -> Path:
    return _xdg_dir(env, "HOTFIT_HOME", "XDG_DATA_HOME", ".local/share", "hotfit")


def default_llama_cache(env: Mapping[str, str]) -> Path:
    return _xdg_dir(env, "HOTFIT_LLAMA_CACHE", "XDG_CACHE_HOME", ".cache", "hotfit", "llama.cpp")


def default_hf_hub_cache(env: Mapping[str, str]) -> Path:
    """huggingface_hub's cache directory (its constants.py): ``HF_HUB_CACHE`` (or the legacy
    ``HUGGINGFACE_HUB_CACHE``), else ``HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(name):
            return Path(os.path.expandvars(env[name])).expanduser()
    return _xdg_dir(env, "HF_HOME", "XDG_CACHE_HOME", ".cache", "huggingface") / "hub"


def endpoint_url(raw: str, variable: str = "HF_ENDPOINT") -> str:
    """``raw`` as an http(s) base URL without the trailing slash, or a UsageError naming ``variable``
    (exit 2) — never a ValueError or OverflowError from deep in a connect. A path after the host (a
    mirror under a prefix) is fine; a query or fragment is not (the Hub's paths are appended)."""
    problem = None
    try:
        parts = urlsplit(raw)
        port = parts.port  # ValueError when not a number from 0 to 65535
    except ValueError as exc:
        parts, port, problem = None, None, str(exc)
    if parts is not None:
        if parts.scheme.lower() not in ("http", "https"):
            problem = "not an http(s) URL"
        elif not parts.hostname:
            problem = "no host"
        elif any(c.isspace() for c in raw) or not raw.isprintable():
            problem = "it contains a space or control character"
        elif parts.query or parts.fragment or raw.rstrip("/").endswith(("?", "#")):
            problem = "a base URL takes no query or fragment"
        elif port == 0:
            problem = "port 0"
    if problem is not None:
        raise UsageError(f"{variable}={raw!r} is not an http(s) URL ({problem})",
                         hint=f"set {variable} to the Hub or mirror base URL, e.g. {DEFAULT_HF_ENDPOINT} "
                              "(or unset it)", variable=variable, value=raw)
    return raw.rstrip("/")


class _InHome:
    """A path of the home's layout (the module docstring's table), as a read-only attribute."""

    def __init__(self, *parts: str) -> None:
        self.parts = parts
        self.__doc__ = f"<home>/{'/'.join(parts)}"

    @overload
    def __get__(self, settings: None, owner: type[Settings]) -> Self: ...

    @overload
    def __get__(self, settings: Settings, owner: type[Settings] | None = None) -> Path: ...

    def __get__(self, settings: Settings | None, owner: type[Settings] | None = None) -> Path | Self:
        return self if settings is None else settings.home.joinpath(*self.parts)

    def __set__(self, settings: Settings, value: object) -> None:  # a data descriptor, as a property is
        raise AttributeError(f"<home>/{'/'.join(self.parts)} is derived from the home, not set")


@dataclass(frozen=True)
class Settings:
    home: Path
    llama_server: Path | None
    llama_cache: Path
    hf_endpoint: str
    hf_offline: bool
    kv_cache_type_raw: str | None  # None = unset (planner uses f16); validated by registry.kv
    download_connections: int
    # where llama_server came from: "flag" (--llama-server), "env" (HOTFIT_LLAMA_SERVER) or None
    llama_server_source: str | None = None
    # where home came from: "flag" (--home), "env" (HOTFIT_HOME) or "default" (XDG/HOME)
    home_source: str = "default"
    # the proxy variables as set (name as spelled, value); parsed where a request is made (download.proxy)
    proxy_env: tuple[tuple[str, str], ...] = ()
    # the Hugging Face cache's hub directory (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)
    hf_hub_cache: Path | None = None
    textfile_dir: Path | None = None  # node_exporter's textfile collector directory
    log_max_bytes: int = DEFAULT_LOG_MAX_BYTES
    log_keep: int = DEFAULT_LOG_KEEP
    keep_runs: int = DEFAULT_KEEP_RUNS
    # HOTFIT_MIRROR_TOKEN=1: send the Hub token to an HF_ENDPOINT that has not shown itself a Hub
    # (a static mirror); by default it goes only to the Hub itself (docs/fleet.md, "Serving the mirror")
    mirror_token: bool = False
    # opt-in speed floors from the environment (registry/speed.py; flags win over them); None = unset
    min_decode_tokens_per_s: float | None = None
    max_first_token_s: float | None = None
    host_speed_file: Path | None = None  # the probe's bandwidth measurement, cached per machine

    @property
    def home_named(self) -> str:
        """The home as the operator set it, for messages: ``--home X``, ``HOTFIT_HOME=X`` or the default."""
        if self.home_source == "flag":
            return f"--home {self.home}"
        if self.home_source == "env":
            return f"HOTFIT_HOME={self.home}"
        return f"the default home {self.home}"

    state_db = _InHome("state.db")
    lock_path = _InHome("pipeline.lock")
    log_path = _InHome("logs", "hotfit.jsonl")
    models_dir = _InHome("models")
    runs_dir = _InHome("runs")
    manifest_path = _InHome("manifest.json")
    metrics_dir = _InHome("metrics")
    serve_pid_path = _InHome("serve.pid")
    speed_calibration_path = _InHome("speed-calibration.json")

    def model_dir(self, entry_name: str) -> Path:
        return self.models_dir / entry_name


def _whole(env: Mapping[str, str], name: str, default: int, low: int, example: str) -> int:
    """``$name`` as a whole number >= ``low`` (``default`` when unset); else a UsageError naming it."""
    raw = env.get(name)
    if not raw:
        return default
    try:
        value = int(raw)
        if value < low:
            raise ValueError
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a whole number >= {low}",
                         hint=f"unset it (default {default}) or set e.g. {name}={example}") from None
    return value


def _positive(env: Mapping[str, str], name: str, example: str) -> float | None:
    """``$name`` as a positive finite number (None when unset or empty); else a UsageError naming it."""
    raw = env.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = float(raw)
        if not (value > 0 and value != float("inf")):
            raise ValueError
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a positive number",
                         hint=f"unset it (no floor) or set e.g. {name}={example}", variable=name, value=raw) from None
    return value


def load_settings(
    env: Mapping[str, str] | None = None,
    *,
    home: str | os.PathLike[str] | None = None,
    llama_server: str | os.PathLike[str] | None = None,
) -> Settings:
    """Read the environment once; explicit arguments (CLI flags) win over it."""
    env = os.environ if env is None else env
    raw_conn = env.get("HOTFIT_DOWNLOAD_CONNECTIONS")
    try:
        connections = int(raw_conn) if raw_conn else DEFAULT_DOWNLOAD_CONNECTIONS
        if not 1 <= connections <= 32:
            raise ValueError
    except ValueError:
        raise UsageError(
            f"HOTFIT_DOWNLOAD_CONNECTIONS={raw_conn!r} is not a whole number from 1 to 32",
            hint="unset it (default 4) or set e.g. HOTFIT_DOWNLOAD_CONNECTIONS=4",
        ) from None
    server = llama_server or env.get("HOTFIT_LLAMA_SERVER") or None
    kv_raw = env.get(KV_CACHE_ENV)
    offline = _truthy(env.get("HF_HUB_OFFLINE"))
    raw_endpoint = env.get("HF_ENDPOINT") or DEFAULT_HF_ENDPOINT
    # Offline nothing is requested, so a stale value must not break a rerun from disk.
    textfile = env.get("HOTFIT_TEXTFILE_DIR")
    return Settings(
        home=Path(home).expanduser() if home else default_home(env),
        llama_server=Path(server).expanduser() if server else None,
        llama_cache=default_llama_cache(env),
        hf_endpoint=raw_endpoint.rstrip("/") if offline else endpoint_url(raw_endpoint),
        hf_offline=offline,
        kv_cache_type_raw=kv_raw if kv_raw not in (None, "") else None,
        download_connections=connections,
        llama_server_source=("flag" if llama_server else "env") if server else None,
        home_source="flag" if home else ("env" if env.get("HOTFIT_HOME") else "default"),
        proxy_env=tuple(sorted((k, v) for k, v in env.items() if k.upper() in PROXY_VARIABLES)),
        hf_hub_cache=default_hf_hub_cache(env),
        mirror_token=_truthy(env.get("HOTFIT_MIRROR_TOKEN")),
        textfile_dir=Path(textfile).expanduser() if textfile else None,
        log_max_bytes=_whole(env, "HOTFIT_LOG_MAX_BYTES", DEFAULT_LOG_MAX_BYTES, 4096, "10485760"),
        log_keep=_whole(env, "HOTFIT_LOG_KEEP", DEFAULT_LOG_KEEP, 0, "5"),
        keep_runs=_whole(env, "HOTFIT_KEEP_RUNS", DEFAULT_KEEP_RUNS, 1, "20"),
        min_decode_tokens_per_s=_positive(env, "HOTFIT_MIN_DECODE_TOKENS_PER_S", "10"),
        max_first_token_s=_positive(env, "HOTFIT_MAX_FIRST_TOKEN_S", "120"),
        host_speed_file=_xdg_dir(env, "HOTFIT_HOST_SPEED_CACHE", "XDG_CACHE_HOME", ".cache", "hotfit",
                                 "host-speed.json"),
    )
