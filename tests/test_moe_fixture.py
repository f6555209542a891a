"""The MoE fixture (tests/moe_fixture.py): llama-server loads it and generates, and its GGUF facts
say a token reads the active experts only — the speed model's MoE input (scripts/bench-speed
--moe-fixture measures the speed itself; docs/benchmarks.md). A fixture, since no real MoE GGUF
ships on PyPI: random weights, random routing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import ModuleType

import gguf
import pytest

from hotfit.registry.kv import KV_CACHE_TYPES
from hotfit.registry.speed import model_speed_facts
from tests.gguf_fixtures import LLAMA_VOCAB, llama_server
from tests.moe_fixture import EXPERT_TENSORS, MoEShape, moe_fixture
from tests.real_models import entry_from_header
from hotfit.stages.verify import read_gguf_header

TIER = "integration"

SHAPE = MoEShape()


@pytest.fixture(scope="module")
def moe_path() -> Path:
    return moe_fixture(SHAPE)  # written once into the test-model cache, then reused


def test_the_fixture_is_written_once_and_deterministically(tmp_path: Path, moe_path: Path) -> None:
    assert moe_fixture(SHAPE) == moe_path  # cached: the same file, not written again
    small = MoEShape(n_layers=1, n_embd=256, n_heads=2, n_kv_heads=1, n_expert=8, n_expert_used=2, n_ff_expert=64)
    a, b = moe_fixture(small, tmp_path / "a"), moe_fixture(small, tmp_path / "b")
    assert a.read_bytes() == b.read_bytes() and a.name == b.name != moe_path.name
    assert not list((tmp_path / "a" / "moe-fixture").glob("*.partial"))


def test_its_gguf_facts_read_the_active_experts_only(moe_path: Path, realmodels: ModuleType) -> None:
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(str(moe_path)).tensors}  # the gguf package's reader
    experts = sum(v for k, v in sizes.items() if k.split(".")[-2] in EXPERT_TENSORS)
    share = SHAPE.n_expert_used / SHAPE.n_expert
    assert experts > 0.9 * sum(sizes.values())  # nearly all of the file is experts
    facts = realmodels.gguf_facts(moe_path)
    assert (facts.n_expert, facts.n_expert_used, facts.tensor_bytes) == (SHAPE.n_expert, SHAPE.n_expert_used,
                                                                         sum(sizes.values()))
    # a token reads the non-expert tensors (one embedding row) and `share` of every expert tensor
    dense = sum(sizes.values()) - experts - sizes["token_embd.weight"] + sizes["token_embd.weight"] // LLAMA_VOCAB.n_vocab
    assert facts.weights_read_per_token_bytes == pytest.approx(dense + experts * share, rel=1e-6)
    assert 6 < facts.tensor_bytes / facts.weights_read_per_token_bytes < 12  # ~1/9 of the file
    active, total = realmodels.matmul_params(moe_path), realmodels.matmul_params(moe_path, all_experts=True)
    assert 6 < total / active < 12
    # its dense twin (one FFN as wide as the active experts) multiplies and reads what a routed token does,
    # less the router (experts x embedding, f32, read whole)
    twin = moe_fixture(SHAPE, dense_twin=True)
    router = SHAPE.n_layers * SHAPE.n_expert * SHAPE.n_embd
    assert realmodels.matmul_params(twin) == active - router
    assert realmodels.gguf_facts(twin).weights_read_per_token_bytes == pytest.approx(
        facts.weights_read_per_token_bytes - 4 * router, rel=1e-3)
    # the registry's route (entry figures: total and active parameters) reads the same share
    entry = entry_from_header("moe", read_gguf_header(moe_path), moe_path)
    entry = dataclasses.replace(entry, params_total_b=total / 1e9, params_active_b=active / 1e9)
    registry = model_speed_facts(entry, KV_CACHE_TYPES["f16"])
    assert registry is not None and "active of" in registry.basis
    assert registry.weights_read_per_token_bytes == pytest.approx(facts.weights_read_per_token_bytes, rel=0.15)


@pytest.mark.llama
def test_llama_server_loads_it_and_counts_every_expert(moe_path: Path, tmp_path: Path,
                                                        realmodels: ModuleType) -> None:
    with llama_server(moe_path, n_ctx=1024, log_path=tmp_path / "server.log") as server:
        models = server.get_json("/v1/models")
        answer = server.post_json("/completion", {"prompt": "The experts are", "n_predict": 8, "ignore_eos": True,
                                                  "cache_prompt": False}, timeout_s=120)
    meta = models["data"][0]["meta"]
    assert meta["n_params"] == realmodels.matmul_params(moe_path, all_experts=True) + embedding_params(moe_path)
    assert answer["timings"]["predicted_n"] == 8 and answer["timings"]["predicted_per_second"] > 0


def embedding_params(path: Path) -> int:
    """The parameters outside the blocks' matrices: the embedding, the output and every norm/router vector."""
    reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_elements) for t in reader.tensors
               if not (t.name.startswith("blk.") and len(t.shape) >= 2))
