"""Frozen records of the curated registry (pure data, no I/O).

A field that could not be verified from a public source is ``None``; an entry with an unknown
fact that selection needs is never auto-eligible (spec: "Unknown context or KV metadata excludes
a model from automatic selection").
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

Backend = Literal["llama", "openvino"]
Origin = Literal["us", "eu", "china", "gus"]
AgenticTier = Literal["agentic", "tool-chat", "none"]

ORIGINS: tuple[str, ...] = ("us", "eu", "china", "gus")
AGENTIC_TIERS: tuple[str, ...] = ("agentic", "tool-chat", "none")
PERMISSIVE_LICENSES: tuple[str, ...] = ("Apache-2.0", "MIT")
# Why an entry is not auto-eligible, as a machine-checkable category (the prose is
# ``Entry.ineligible_reason``). "architecture" is checked against the pinned llama.cpp tree by
# tests/test_registry_arch.py: an entry excluded for its architecture must be absent from it.
IneligibleCause = Literal["architecture", "tool-parser", "license", "unverified", "vision-path"]
INELIGIBLE_CAUSES: tuple[str, ...] = ("architecture", "tool-parser", "license", "unverified", "vision-path")
MAX_REPO_PATH_CHARS = 4096


@dataclass(frozen=True)
class WeightsLayout:
    """What a backend's registry artifact is and how its KV is priced: the facts the pure layers
    (registry/'s rules and KV arithmetic) and the file stages ask of an entry, which cannot ask its
    backend (backends/ sits above them). The rest of what differs is asked of the backend itself
    (backends/base.py; CONTRIBUTING.md, "Adding a backend")."""

    # a whole-repository snapshot directory (OpenVINO's IR), fetched and verified file by file and
    # following the repository's current commit (spec, "Publisher and artifact evidence"); else one
    # file pinned to a verified revision
    snapshot: bool
    file_format: str | None  # the one file's format ("GGUF", named ``*.gguf``); None for a snapshot
    # KV priced as OpenVINO GenAI's paged cache (registry/kv.py, PagedKV) rather than llama.cpp's
    paged_kv: bool
    architecture_required: bool  # an auto-eligible entry names its llama.cpp architecture

    @property
    def file_suffix(self) -> str | None:
        return None if self.file_format is None else "." + self.file_format.lower()


# Each backend's layout, by the registry's ``backend`` name: the one list of backend names the pure
# layers hold (backends/select.py maps the same names to their implementations).
WEIGHTS_LAYOUTS: dict[str, WeightsLayout] = {
    "llama": WeightsLayout(snapshot=False, file_format="GGUF", paged_kv=False, architecture_required=True),
    "openvino": WeightsLayout(snapshot=True, file_format=None, paged_kv=True, architecture_required=False),
}
BACKENDS: tuple[str, ...] = tuple(WEIGHTS_LAYOUTS)


def backend_names() -> tuple[str, ...]:
    """The backend names :data:`WEIGHTS_LAYOUTS` holds when asked: what the decoders (registry,
    manifest) and ``--backend`` accept, so a backend is registered in one place per layer
    (CONTRIBUTING.md "Adding a backend")."""
    return tuple(WEIGHTS_LAYOUTS)
DEFAULT_BACKEND: Backend = "llama"  # what a plan, a manifest and --backend mean when they name none


def safe_relpath(path: str) -> str:
    """The one check of a file name from the registry or the Hub (weights, projector, chat template,
    snapshot listing): a relative path that stays inside its directory, or ``ValueError`` (absolute,
    ``..``, ``.``, empty part, backslash, NUL, too long). The registry decoder and every stage that
    builds a URL or a path from such a name call it before any request (docs/faults.md)."""
    if (not isinstance(path, str) or not path or "\x00" in path or "\\" in path or path.startswith("/")
            or len(path) > MAX_REPO_PATH_CHARS):
        raise ValueError(f"unsafe path {path!r}")
    if any(p in ("", ".", "..") for p in path.split("/")):
        raise ValueError(f"unsafe path {path!r}")
    return path


@dataclass(frozen=True)
class Evidence:
    """Why an agentic tier was assigned: a measured multi-turn result, or training provenance."""

    kind: Literal["measured", "provenance"]
    summary: str
    source: str


@dataclass(frozen=True)
class Artifact:
    """A Hub file pinned to a commit. ``file`` is None for a whole-repository snapshot (OpenVINO)."""

    repo: str
    revision: str | None  # 40-hex commit; None = not yet pinned (`hotfit registry lock`)
    file: str | None
    size_bytes: int | None
    # a snapshot's: the pin of its file list (model_files.snapshot_listing_sha256; docs/fleet.md)
    sha256: str | None


@dataclass(frozen=True)
class TemplateSource:
    """Where the tool-capable chat template lives: a ``.jinja`` file or a ``tokenizer_config.json``.
    ``size_bytes``/``sha256`` (optional) pin the source file's bytes: with them a static mirror may
    serve it (docs/fleet.md); without them it is checked against the Hub's git blob id."""

    repo: str
    revision: str | None
    file: str
    size_bytes: int | None = None
    sha256: str | None = None


TEMPLATE_PIN_FIELDS = ("size_bytes", "sha256")


def template_json(template: TemplateSource | None) -> dict[str, Any] | None:
    """A template source as JSON, its optional pins left out when unset: an entry pinned as before
    keeps the JSON — and the plan id, the manifest's comparison — it had."""
    if template is None:
        return None
    out = dataclasses.asdict(template)
    for key in TEMPLATE_PIN_FIELDS:
        if out[key] is None:
            del out[key]
    return out


def entry_json(entry: Entry) -> dict[str, Any]:
    """``dataclasses.asdict(entry)`` with the chat template as :func:`template_json` writes it."""
    return dataclasses.asdict(entry) | {"chat_template": template_json(entry.chat_template)}


@dataclass(frozen=True)
class LayerGroup:
    """``count`` layers that share one KV shape. ``window_tokens`` set = sliding-window layers."""

    count: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    window_tokens: int | None = None


@dataclass(frozen=True)
class SourceConfig:
    """Architecture facts from the publisher's config.json (``source`` says which).

    ``layer_groups`` lists the layers that own a KV cache, grouped by shape. For a hybrid
    (``recurrent``) model they are its full-attention layers only and may cover fewer than
    ``n_layers``; the planner budgets such models (and MLA ones) dense over all ``n_layers``
    (spec, "Selection and hot context").
    """

    n_layers: int | None
    layer_groups: tuple[LayerGroup, ...] | None  # None = KV geometry not verified
    mla: bool = False  # multi-head latent attention: budgeted as dense (spec)
    recurrent: bool = False  # hybrid recurrent / linear attention: budgeted as dense (spec)
    source: str | None = None


@dataclass(frozen=True)
class Entry:
    name: str
    display_name: str
    backend: Backend
    origin: Origin
    license: str | None
    params_total_b: float | None
    params_active_b: float | None
    release_date: str | None  # ISO date; recorded, never a tiebreak
    architecture: str | None  # llama.cpp architecture name (llama backend)
    agentic_tier: AgenticTier
    evidence: tuple[Evidence, ...]
    auto_eligible: bool
    ineligible_reason: str | None
    artifact: Artifact | None
    projector: Artifact | None
    chat_template: TemplateSource | None
    config: SourceConfig
    context_limit: int | None  # verified context ceiling (tokens)
    tool_parser: str | None = None
    notes: str | None = None
    ineligible_cause: IneligibleCause | None = None  # set exactly when not auto_eligible

    @property
    def weights_bytes(self) -> int | None:
        """All weights the device must hold: artifact plus projector (spec: 'including a projector')."""
        if self.artifact is None or self.artifact.size_bytes is None:
            return None
        projector = 0
        if self.projector is not None:
            if self.projector.size_bytes is None:
                return None
            projector = self.projector.size_bytes
        return self.artifact.size_bytes + projector

    @property
    def layout(self) -> WeightsLayout:
        """How this entry's weights are laid out and priced (its backend's :class:`WeightsLayout`)."""
        return WEIGHTS_LAYOUTS[self.backend]
