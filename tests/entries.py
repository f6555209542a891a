"""Registry entries built in tests (not downloaded): the geometry of real models, stated inline."""

from __future__ import annotations

from hotfit.core.entry import Artifact, Entry, Evidence, LayerGroup, SourceConfig

MiB = 1 << 20
GiB = 1 << 30


def entry(
    name: str,
    *,
    params_b: float | None = 4.0,
    weights: int | None = 2 * GiB,
    projector: int | None = None,
    groups: tuple[LayerGroup, ...] | None = (LayerGroup(32, 8, 128, 128),),
    n_layers: int | None = None,
    context_limit: int | None = 131072,
    tier: str = "agentic",
    origin: str = "china",
    backend: str = "llama",
    auto_eligible: bool = True,
    license: str | None = "Apache-2.0",
    architecture: str | None = "llama",
    mla: bool = False,
    recurrent: bool = False,
    release_date: str | None = "2026-01-01",
) -> Entry:
    if n_layers is None and groups is not None:
        n_layers = sum(g.count for g in groups)
    return Entry(
        name=name,
        display_name=name,
        backend=backend,  # type: ignore[arg-type]
        origin=origin,  # type: ignore[arg-type]
        license=license,
        params_total_b=params_b,
        params_active_b=None,
        release_date=release_date,
        architecture=architecture,
        agentic_tier=tier,  # type: ignore[arg-type]
        evidence=(Evidence("provenance", "test", "tests/entries.py"),),
        auto_eligible=auto_eligible,
        ineligible_reason=None if auto_eligible else "test: not eligible",
        artifact=Artifact(f"test/{name}", "0" * 40, f"{name}.gguf", weights, None),
        projector=None if projector is None else Artifact(f"test/{name}", "0" * 40, "mmproj.gguf", projector, None),
        chat_template=None,
        config=SourceConfig(n_layers=n_layers, layer_groups=groups, mla=mla, recurrent=recurrent, source="test"),
        context_limit=context_limit,
    )


# minicpm5-2b: 42 layers, 2 KV heads, head_dim 128, 131072 ceiling (model-facts.json), Q4_K_M
# 1561318368 bytes at openbmb/MiniCPM5-2B-GGUF@2079a22f (pinned-artifacts.json).
MINICPM5_2B = entry("minicpm5-2b", params_b=2.5, weights=1_561_318_368,
                    groups=(LayerGroup(42, 2, 128, 128),), context_limit=131072, origin="china")
