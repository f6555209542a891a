"""`hotfit serve` for an OpenVINO manifest: the OVMS command line it prints (pure parts; the CLI run
on a provisioned fixture is in tests/test_auto_openvino_e2e.py)."""

from __future__ import annotations

import pytest

from hotfit.backends.openvino.backend import GB, OVMS_TOOL_PARSERS, ovms_cache_size_gb

TIER = "unit"


@pytest.mark.parametrize(("kv_bytes", "gb"), [(1, 1), (5 << 20, 1), (GB, 1), (GB + 1, 2),
                                              (1280 * 32 * 85_248, 4)])  # Qwen3-8B u8 at 40960 tokens: 3.25 GiB
def test_ovms_cache_size_is_whole_gb_covering_the_verified_kv(kv_bytes: int, gb: int) -> None:
    assert ovms_cache_size_gb(kv_bytes) == gb
    assert ovms_cache_size_gb(kv_bytes) * GB >= kv_bytes


def test_every_probe_family_has_its_ovms_tool_parser() -> None:
    from hotfit.backends.openvino.toolcall import FAMILIES

    assert set(OVMS_TOOL_PARSERS) == set(FAMILIES)
    assert OVMS_TOOL_PARSERS["hermes"] == "hermes3" and OVMS_TOOL_PARSERS["harmony"] == "gptoss"
    assert OVMS_TOOL_PARSERS["qwen3_coder"] == "qwen3coder"
