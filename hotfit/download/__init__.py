"""The Hub download engine: one pinned Hub file into a complete, sha256-hashed partial, resumably.

Modules, leaves first: ``options`` (knobs, pin and path rules), ``progress``, ``proxy`` (the proxy
variables: one routing decision per URL), ``hub_errors`` (the one mapping of Hub answers to errors),
``sidecar`` (the resume file: one schema, one decoder), ``disk`` (the one free-space check and margin,
the write-path hints), ``hf_cache`` (pinned files taken from the Hugging Face cache), ``wire`` (a
body's GET on a blocking socket into pooled buffers), ``hashing`` (the write-behind threads: writes
in 64 KiB pieces, in-order sha256), ``hub`` (the session and the pinned HEAD), ``retry`` (the one
retry policy), ``stream`` (one ranged GET into the file), ``engine`` (the block scheduler). Imports
only ``core`` and ``state``; stages use the names re-exported here.
"""

from __future__ import annotations

from hotfit.download.disk import (
    DISK_MARGIN_BYTES,
    bytes_held,
    bytes_to_write,
    check_disk,
    check_disk_space,
    disk_needed_bytes,
)
from hotfit.download.engine import DownloadOutcome, adopt_as_partial, discard_partial, download_to_partial, plan_blocks
from hotfit.download.hashing import OrderedHasher
from hotfit.download.hf_cache import CacheHit, CacheMiss, snapshot_path, take_from_cache, take_into_partial
from hotfit.download.hub import HubSession, RemoteFile, StaticPins, check_endpoint, resolve_token, speaks_hub_endpoint
from hotfit.download.hub_errors import (
    NOT_A_HUB,
    hf_exception_not_a_hub,
    hub_error_from_hf_exception,
    is_not_a_hub,
    not_a_hub_error,
    redact_url,
)
from hotfit.download.options import TransferOptions, is_commit, partial_paths, safe_relpath
from hotfit.download.progress import ProgressReporter
from hotfit.download.proxy import Proxy, ProxyConfig, proxy_config
from hotfit.download.retry import head_retrying, hub_call_retrying, log_retry
from hotfit.state.files import finalize_file, write_text_atomic

__all__ = [
    "CacheHit", "CacheMiss", "DISK_MARGIN_BYTES", "DownloadOutcome", "HubSession", "NOT_A_HUB", "OrderedHasher",
    "ProgressReporter", "Proxy", "ProxyConfig", "RemoteFile", "StaticPins", "TransferOptions", "adopt_as_partial",
    "bytes_held", "bytes_to_write", "check_disk", "check_disk_space", "check_endpoint", "discard_partial", "disk_needed_bytes",
    "download_to_partial", "finalize_file", "head_retrying", "hf_exception_not_a_hub", "hub_call_retrying",
    "hub_error_from_hf_exception", "is_commit", "is_not_a_hub", "log_retry", "not_a_hub_error", "partial_paths",
    "plan_blocks", "proxy_config", "redact_url", "resolve_token", "safe_relpath", "snapshot_path", "speaks_hub_endpoint",
    "take_from_cache", "take_into_partial", "write_text_atomic",
]
