"""``hotfit fleet endpoints STATUS.json…`` (docs/recipes.md, "One endpoint over the fleet"): a LiteLLM
proxy configuration from the machines' saved ``hotfit --json status``, one deployment per serving
machine under one model name per model; a file that cannot be used is left out and said. The real
proxy in front of two real servers is tests/test_fleet_endpoints_litellm.py.
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest

from hotfit.pipeline.worker import WorkerRecord, write_worker_record
from tests.test_client_config import cli, provisioned


def record(home: Path, port: int, key_file: str | None) -> None:
    write_worker_record(home / "serve.pid", WorkerRecord(
        pid=os.getpid(), start_ticks=1, host="0.0.0.0", port=port, model_path=str(home / "m.gguf"),
        entry_name="fx-agent", context_tokens=40960, kv_cache_type="q8_0", device={"index": 0, "kind": "cpu"},
        api_key_file=key_file))


def saved_status(home: Path, where: Path) -> Path:
    code, out = cli(home, "--json", "status")
    assert code in (0, 10), out
    where.write_text(out)
    return where


def test_fleet_endpoints_one_model_name_per_model_and_a_bad_file_left_out(tmp_path: Path) -> None:
    statuses = tmp_path / "statuses"
    statuses.mkdir()
    for name, port, speed in (("a", 8081, 30.0), ("b", 8082, 10.0)):
        home = provisioned(tmp_path / name, speed=speed)
        record(home, port, "/etc/hotfit/api-key")
        saved_status(home, statuses / f"{name}.json")
        doc = json.loads((statuses / f"{name}.json").read_text())
        # status says how the last serve listened, and that this record is not a live server
        assert doc["serving"]["port"] == port and doc["serving"]["alive"] is False
    saved_status(tmp_path / "never-served", statuses / "c.json")  # nothing provisioned, never served
    (statuses / "d.json").write_text("{not json")
    code, out = cli(tmp_path / "x", "--json", "fleet", "endpoints", str(statuses))
    assert code == 2, out  # some were left out: said, and the rest is written
    doc = json.loads(out)
    models = doc["model_list"]
    assert [m["model_name"] for m in models] == ["fx-agent", "fx-agent"]  # one name: the proxy balances
    assert [m["litellm_params"]["api_base"] for m in models] == [f"http://{socket.getfqdn()}:8081/v1",
                                                                f"http://{socket.getfqdn()}:8082/v1"]
    assert [m["litellm_params"]["weight"] for m in models] == [30, 10]  # measured speed
    assert all(m["model_info"]["max_input_tokens"] == 40960 for m in models)  # the window serve opened
    assert doc["api_key_files"] == ["/etc/hotfit/api-key"]
    left = {Path(p["file"]).name: p["message"] for p in doc["left_out"]}
    assert set(left) == {"c.json", "d.json"} and "nothing is provisioned" in left["c.json"]
    assert "cannot read it as JSON" in left["d.json"]


@pytest.mark.parametrize("doc", [[], {"provisioned": None}, {"provisioned": {"entry_name": "x"}, "serving": None}])
def test_a_status_that_cannot_give_an_endpoint_is_a_usage_error(doc: Any, tmp_path: Path) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(doc))
    code, out = cli(tmp_path / "x", "--json", "fleet", "endpoints", str(path))
    assert code == 2 and json.loads(out)["left_out"][0]["file"] == str(path)
