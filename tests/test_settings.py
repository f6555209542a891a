"""Settings are read once from the environment; flags win; bad values are usage errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hotfit.core.errors import UsageError
from hotfit.core.settings import DEFAULT_HF_ENDPOINT, load_settings

TIER = "unit"


def test_defaults_follow_xdg() -> None:
    s = load_settings({"HOME": "/home/op"})
    assert s.home == Path("/home/op/.local/share/hotfit")
    assert s.llama_cache == Path("/home/op/.cache/hotfit/llama.cpp")
    assert s.hf_endpoint == DEFAULT_HF_ENDPOINT
    assert s.kv_cache_type_raw is None and s.download_connections == 4 and not s.hf_offline
    assert s.state_db == s.home / "state.db" and s.log_path == s.home / "logs" / "hotfit.jsonl"


def test_env_and_flags() -> None:
    env = {"HOME": "/h", "HOTFIT_HOME": "/data/hf", "XDG_CACHE_HOME": "/c", "HF_ENDPOINT": "http://mirror:8080/",
           "HF_HUB_OFFLINE": "1", "CONTENOX_LLAMA_KV_CACHE_TYPE": "q8_0", "HOTFIT_DOWNLOAD_CONNECTIONS": "8",
           "HOTFIT_LLAMA_SERVER": "/opt/ls"}
    s = load_settings(env)
    assert s.home == Path("/data/hf") and s.llama_cache == Path("/c/hotfit/llama.cpp")
    assert s.hf_endpoint == "http://mirror:8080" and s.hf_offline
    assert s.kv_cache_type_raw == "q8_0" and s.download_connections == 8
    assert s.llama_server == Path("/opt/ls")
    flagged = load_settings(env, home="/flag/home", llama_server="/flag/ls")
    assert flagged.home == Path("/flag/home") and flagged.llama_server == Path("/flag/ls")


def test_empty_kv_type_means_unset() -> None:
    assert load_settings({"HOME": "/h", "CONTENOX_LLAMA_KV_CACHE_TYPE": ""}).kv_cache_type_raw is None


@pytest.mark.parametrize("raw", ["0", "33", "four", "-1"])
def test_bad_connection_count_names_the_variable(raw: str) -> None:
    with pytest.raises(UsageError, match="HOTFIT_DOWNLOAD_CONNECTIONS"):
        load_settings({"HOME": "/h", "HOTFIT_DOWNLOAD_CONNECTIONS": raw})


@pytest.mark.parametrize("raw", [
    "http://[::1",  # an unclosed IPv6 bracket: urlsplit raises ValueError
    "http://127.0.0.1:99999",  # a port past 65535: connect() raised OverflowError
    "http://127.0.0.1:port",
    "127.0.0.1:8080",  # no scheme
    "huggingface.co",
    "ftp://mirror.example",
    "http://",
    "http://:8080",
    "https://hf.example/?x=1",  # a query: the Hub's paths would be appended after it
    "https://hf.example/#frag",
    "https://hf example.org",
])
def test_malformed_hf_endpoint_is_a_usage_error_naming_the_variable(raw: str) -> None:
    with pytest.raises(UsageError, match="HF_ENDPOINT") as caught:
        load_settings({"HOME": "/h", "HF_ENDPOINT": raw})
    assert caught.value.details["variable"] == "HF_ENDPOINT" and caught.value.details["value"] == raw


@pytest.mark.parametrize("raw, expected", [
    ("https://huggingface.co/", "https://huggingface.co"),
    ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
    ("http://[::1]:8080/", "http://[::1]:8080"),
    ("https://mirror.example/hf/", "https://mirror.example/hf"),  # a mirror under a prefix
    ("HTTPS://HF.Example", "HTTPS://HF.Example"),
])
def test_well_formed_hf_endpoints_are_kept(raw: str, expected: str) -> None:
    assert load_settings({"HOME": "/h", "HF_ENDPOINT": raw}).hf_endpoint == expected


def test_offline_a_stale_hf_endpoint_is_not_read() -> None:
    # Offline nothing is requested: a stale variable must not break a rerun from disk.
    s = load_settings({"HOME": "/h", "HF_ENDPOINT": "http://[::1", "HF_HUB_OFFLINE": "1"})
    assert s.hf_offline and s.hf_endpoint == "http://[::1"


@pytest.mark.parametrize("name, raw", [("HOTFIT_LOG_MAX_BYTES", "10M"), ("HOTFIT_LOG_MAX_BYTES", "100"),
                                       ("HOTFIT_LOG_KEEP", "-1"), ("HOTFIT_KEEP_RUNS", "0")])
def test_operations_variables_are_checked(name: str, raw: str) -> None:
    with pytest.raises(UsageError) as caught:
        load_settings({name: raw})
    assert name in caught.value.what and caught.value.hint


def test_operations_variables_are_read() -> None:
    s = load_settings({"HOTFIT_TEXTFILE_DIR": "/var/lib/node_exporter", "HOTFIT_LOG_MAX_BYTES": "65536",
                       "HOTFIT_LOG_KEEP": "0", "HOTFIT_KEEP_RUNS": "3", "HOME": "/home/x"})
    assert (s.textfile_dir, s.log_max_bytes, s.log_keep, s.keep_runs) == (Path("/var/lib/node_exporter"), 65536, 0, 3)
    assert s.metrics_dir == Path("/home/x/.local/share/hotfit/metrics")
