"""Tiny but real GGUF models for tests, benchmarks and the demo.

Every writer builds a file with the ``gguf`` package that the pinned llama-server loads in a
fraction of a second, and returns a frozen :class:`FixtureInfo` saying what was written, so a test
can compare it with what llama-server reports.

Writers
-------
- :func:`write_llama_model` — llama architecture, byte-level BPE vocabulary (256 byte tokens, no
  merges) plus the chat special tokens (``<|im_start|>``, ``<|im_end|>``, ``<tool_call>``,
  ``</tool_call>``, ``<think>``, ``</think>``); configurable layers / heads / KV heads / head dim /
  embedding size / trained context; optional embedded ``tokenizer.chat_template``; seeded random
  weights.
- :func:`write_gemma3_swa_model` — gemma3 with ``attention.sliding_window`` and a sliding-window
  pattern, which llama.cpp budgets per layer type (sliding layers get a small KV cache).
- :func:`write_unsupported_arch_model` — a well-formed GGUF whose ``general.architecture`` llama.cpp
  does not know (load must fail with "unknown model architecture").
- :func:`write_truncated_copy` / :func:`write_garbage_file` — broken files for load-error tests.
- :func:`write_tool_call_model` — the deterministic tool-call model (recipe in its docstring).

Helpers
-------
- :func:`require_llama_server` — the llama-server to test against, via ``backends.llama_server``;
  ``pytest.skip`` only when none exists and ``HOTFIT_REQUIRE_LLAMA`` is unset (CI sets it).
- :func:`llama_server` — context manager that starts llama-server on a model with nothing left to
  its defaults that matters here (``--fit off -np 1``), waits for ``/health`` and always kills it.
- :func:`pinned_template` / :func:`pinned_source_tree` — files of the pinned llama.cpp tree.

``python -m tests.gguf_fixtures KIND OUT.gguf`` writes one fixture and prints its record as JSON.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import gguf
import numpy as np

__all__ = [
    "FixtureInfo",
    "FixtureVocab",
    "LLAMA_VOCAB",
    "SPECIAL_TOKENS",
    "PROBE_TOOL",
    "QWEN3_TEMPLATE_NAME",
    "REQUIRE_ENV",
    "write_llama_model",
    "write_tool_call_model",
    "write_gemma3_swa_model",
    "swa_layer_pattern",
    "write_unsupported_arch_model",
    "UNSUPPORTED_ARCHITECTURE",
    "write_truncated_copy",
    "write_garbage_file",
    "byte_token_text",
    "require_llama_server",
    "pinned_source_tree",
    "pinned_template",
    "STANDIN_TOOL_TEMPLATE",
    "tool_template_text",
    "SHIPPED_QWEN3_TEMPLATE",
    "shipped_qwen3_template_text",
    "write_standin_llama_server",
    "free_port",
    "RunningServer",
    "ServerFailedToStart",
    "llama_server",
    "main",
]

REQUIRE_ENV = "HOTFIT_REQUIRE_LLAMA"
QWEN3_TEMPLATE_NAME = "Qwen-Qwen3-0.6B.jinja"

# Chat special tokens after the 256 byte tokens, in id order. CONTROL tokens are never printed as
# text; USER_DEFINED ones are (Qwen's tokenizer marks <tool_call>/<think> "special": false, so its
# GGUFs carry them as user-defined and the server sees them in the generated text).
_CONTROL = gguf.TokenType.CONTROL
_USER = gguf.TokenType.USER_DEFINED
SPECIAL_TOKENS: tuple[tuple[str, gguf.TokenType], ...] = (
    ("<|endoftext|>", _CONTROL),
    ("<|im_start|>", _CONTROL),
    ("<|im_end|>", _CONTROL),
    ("<tool_call>", _USER),
    ("</tool_call>", _USER),
    ("<think>", _USER),
    ("</think>", _USER),
)
N_BYTE_TOKENS = 256
TOKEN_ID = {text: N_BYTE_TOKENS + i for i, (text, _) in enumerate(SPECIAL_TOKENS)}
N_VOCAB = N_BYTE_TOKENS + len(SPECIAL_TOKENS)
BOS_ID = TOKEN_ID["<|endoftext|>"]
EOS_ID = TOKEN_ID["<|im_end|>"]  # Qwen-style: end of turn is also eos/eot
PAD_ID = TOKEN_ID["<|endoftext|>"]

# The probe tool the deterministic model was checked with: one required string
# parameter, one optional boolean parameter.
PROBE_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "hotfit_probe",
        "description": "Echo a short text back. Harmless; used to check that tool calls parse.",
        "parameters": {
            "type": "object",
            "properties": {
                "text": {"type": "string", "description": "text to echo"},
                "loud": {"type": "boolean", "description": "echo in capitals"},
            },
            "required": ["text"],
        },
    },
}


@dataclass(frozen=True)
class FixtureInfo:
    """What a writer put in the file (figures as llama.cpp will read them)."""

    path: Path
    kind: str  # "llama" | "gemma3-swa" | "unsupported" | "tool-call"
    architecture: str
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    n_embd: int
    n_ctx_train: int
    n_vocab: int
    tensor_type: str  # "f32" | "f16"
    has_chat_template: bool
    size_bytes: int
    sliding_window_tokens: int | None = None
    # per layer, True = sliding-window layer (empty for models without sliding window)
    swa_layers: tuple[bool, ...] = field(default_factory=tuple)
    eos_token_id: int = EOS_ID

    @property
    def n_swa_layers(self) -> int:
        return sum(self.swa_layers)

    @property
    def n_full_layers(self) -> int:
        return self.n_layers - self.n_swa_layers

    def kv_bytes_per_token_f16(self, layers: str = "all") -> int:
        """K+V bytes per cached token at f16 over the chosen layers ("all", "full", "swa")."""
        per_layer = self.n_kv_heads * (self.head_dim_k + self.head_dim_v) * 2
        if layers == "all":
            return per_layer * self.n_layers
        if layers == "full":
            return per_layer * self.n_full_layers
        if layers == "swa":
            return per_layer * self.n_swa_layers
        raise ValueError(layers)


# ---------------------------------------------------------------- vocabulary


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character map (what byte-level BPE vocabularies store)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars)}


_BYTE_TEXT = _bytes_to_unicode()


def byte_token_text(byte: int) -> str:
    """The vocabulary text of byte token ``byte`` (its id is the byte value)."""
    return _BYTE_TEXT[byte]


@dataclass(frozen=True)
class FixtureVocab:
    """The vocabulary past the byte and chat special tokens, and the BPE merge list.

    ``extra_tokens`` are NORMAL tokens appended after :data:`SPECIAL_TOKENS`, so every token id
    the recipes use stays the same whatever is appended."""

    extra_tokens: tuple[str, ...] = ()
    # Byte-level BPE without real merges: every byte is its own token. llama.cpp insists on the
    # merges key and gguf refuses an empty array, so the default is one merge of two special
    # tokens, which are split off before BPE runs and so never merge.
    merges: tuple[str, ...] = ("<|endoftext|> <|endoftext|>",)

    @property
    def n_vocab(self) -> int:
        return N_VOCAB + len(self.extra_tokens)


LLAMA_VOCAB = FixtureVocab()  # what the llama.cpp fixtures carry


def _add_vocab(w: gguf.GGUFWriter, vocab: FixtureVocab = LLAMA_VOCAB) -> None:
    tokens = [_BYTE_TEXT[b] for b in range(N_BYTE_TOKENS)] + [t for t, _ in SPECIAL_TOKENS] + list(vocab.extra_tokens)
    types = (
        [gguf.TokenType.NORMAL] * N_BYTE_TOKENS
        + [ty for _, ty in SPECIAL_TOKENS]
        + [gguf.TokenType.NORMAL] * len(vocab.extra_tokens)
    )
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(list(vocab.merges))
    w.add_bos_token_id(BOS_ID)
    w.add_eos_token_id(EOS_ID)
    w.add_eot_token_id(EOS_ID)
    w.add_pad_token_id(PAD_ID)
    w.add_add_bos_token(False)


# ---------------------------------------------------------------- writers


_DTYPES = {"f32": np.float32, "f16": np.float16}
# "q8_0": tests/moe_fixture.py writes its own Q8_0 blocks through _open_writer
_FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
               "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}


def _tensor(w: gguf.GGUFWriter, name: str, array: np.ndarray, tensor_type: str) -> None:
    # Norm weights stay f32 the way converters write them; matrices take the chosen type.
    dtype = np.float32 if array.ndim == 1 else _DTYPES[tensor_type]
    w.add_tensor(name, np.ascontiguousarray(array, dtype=dtype))


def _finish(w: gguf.GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _check_shape(n_heads: int, n_kv_heads: int, head_dim: int, tensor_type: str) -> None:
    if tensor_type not in _DTYPES:
        raise ValueError(f"tensor_type must be one of {sorted(_DTYPES)}, not {tensor_type!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads ({n_heads}) must be a multiple of n_kv_heads ({n_kv_heads})")
    # Quantized KV caches store blocks of 32 values (q8_0: 34 bytes per 32), per head row.
    if head_dim < 32 or head_dim % 32:
        raise ValueError(f"head_dim must be a multiple of 32 (quantized KV blocks), not {head_dim}")


@dataclass(frozen=True)
class _Shape:
    """The dimensions every llama-style fixture writer shares."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    n_embd: int
    n_ff: int
    n_ctx_train: int
    tensor_type: str


def _gaussian(seed: int) -> Callable[..., np.ndarray]:
    """Seeded small-normal weights: files are byte-identical for the same arguments."""
    rng = np.random.default_rng(seed)
    return lambda *shape: rng.normal(0.0, 0.02, size=shape)


def _open_writer(path: Path, architecture: str, name: str, s: _Shape, chat_template: str | None,
                 vocab: FixtureVocab = LLAMA_VOCAB) -> gguf.GGUFWriter:
    """A writer with the hyperparameters, vocabulary and optional template every fixture carries."""
    w = gguf.GGUFWriter(path, architecture)
    w.add_name(name)
    w.add_file_type(_FILE_TYPES[s.tensor_type])
    w.add_context_length(s.n_ctx_train)
    w.add_embedding_length(s.n_embd)
    w.add_block_count(s.n_layers)
    w.add_feed_forward_length(s.n_ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_rope_dimension_count(s.head_dim)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    _add_vocab(w, vocab)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    return w


def _fixture_info(path: Path, kind: str, architecture: str, s: _Shape, chat_template: str | None,
                  vocab: FixtureVocab = LLAMA_VOCAB, **extra: Any) -> FixtureInfo:
    return FixtureInfo(
        path=path,
        kind=kind,
        architecture=architecture,
        n_layers=s.n_layers,
        n_heads=s.n_heads,
        n_kv_heads=s.n_kv_heads,
        head_dim_k=s.head_dim,
        head_dim_v=s.head_dim,
        n_embd=s.n_embd,
        n_ctx_train=s.n_ctx_train,
        n_vocab=vocab.n_vocab,
        tensor_type=s.tensor_type,
        has_chat_template=chat_template is not None,
        size_bytes=path.stat().st_size,
        **extra,
    )


def write_llama_model(
    path: str | os.PathLike[str],
    *,
    n_layers: int = 2,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 64,
    n_embd: int = 64,
    n_ff: int = 128,
    n_ctx_train: int = 65536,
    chat_template: str | None = None,
    tensor_type: str = "f16",
    seed: int = 0,
    name: str = "hotfit-fixture-llama",
    vocab: FixtureVocab = LLAMA_VOCAB,
) -> FixtureInfo:
    """A llama-architecture model with seeded random weights (output is noise, shapes are real).

    ``head_dim`` is written as ``attention.key_length``/``value_length``, so it need not equal
    ``n_embd / n_heads``. Defaults make a ~100 KB file. ``vocab``: see :class:`FixtureVocab`."""
    _check_shape(n_heads, n_kv_heads, head_dim, tensor_type)
    path = Path(path)
    shape = _Shape(n_layers, n_heads, n_kv_heads, head_dim, n_embd, n_ff, n_ctx_train, tensor_type)
    rand = _gaussian(seed)
    w = _open_writer(path, "llama", name, shape, chat_template, vocab)
    # numpy shapes are ggml's ne reversed: ggml {n_embd, n_vocab} is numpy (n_vocab, n_embd).
    _tensor(w, "token_embd.weight", rand(vocab.n_vocab, n_embd), tensor_type)
    _tensor(w, "output_norm.weight", np.ones(n_embd), tensor_type)
    _tensor(w, "output.weight", rand(vocab.n_vocab, n_embd), tensor_type)
    for i in range(n_layers):
        _llama_block(w, i, rand, shape)
    _finish(w)
    return _fixture_info(path, "llama", "llama", shape, chat_template, vocab)


def _llama_block(w: gguf.GGUFWriter, i: int, rand: Any, s: _Shape, *, zero_out: bool = False) -> None:
    """One llama block. ``zero_out``: attention output and FFN down are zero, so the block adds
    nothing to the residual stream (the deterministic model's trick)."""
    n_heads, n_kv_heads, head_dim, n_embd, n_ff, tensor_type = (
        s.n_heads, s.n_kv_heads, s.head_dim, s.n_embd, s.n_ff, s.tensor_type)
    p = f"blk.{i}."
    _tensor(w, p + "attn_norm.weight", np.ones(n_embd), tensor_type)
    _tensor(w, p + "attn_q.weight", rand(n_heads * head_dim, n_embd), tensor_type)
    _tensor(w, p + "attn_k.weight", rand(n_kv_heads * head_dim, n_embd), tensor_type)
    _tensor(w, p + "attn_v.weight", rand(n_kv_heads * head_dim, n_embd), tensor_type)
    out = np.zeros((n_embd, n_heads * head_dim)) if zero_out else rand(n_embd, n_heads * head_dim)
    _tensor(w, p + "attn_output.weight", out, tensor_type)
    _tensor(w, p + "ffn_norm.weight", np.ones(n_embd), tensor_type)
    _tensor(w, p + "ffn_gate.weight", rand(n_ff, n_embd), tensor_type)
    _tensor(w, p + "ffn_up.weight", rand(n_ff, n_embd), tensor_type)
    down = np.zeros((n_embd, n_ff)) if zero_out else rand(n_embd, n_ff)
    _tensor(w, p + "ffn_down.weight", down, tensor_type)


def swa_layer_pattern(n_layers: int, pattern: int | Sequence[bool]) -> tuple[bool, ...]:
    """Which layers slide, the way llama.cpp expands ``attention.sliding_window_pattern``.

    An integer ``n`` means "every n-th layer is full attention, the rest slide" (llama.cpp
    ``llama_hparams::set_swa_pattern``: layer ``il`` slides when ``il % n < n - 1``; 0 = all
    slide); a sequence gives the flag per layer."""
    if isinstance(pattern, int):
        return tuple(pattern == 0 or (il % pattern < pattern - 1) for il in range(n_layers))
    flags = tuple(bool(x) for x in pattern)
    if len(flags) != n_layers:
        raise ValueError(f"sliding-window pattern has {len(flags)} entries for {n_layers} layers")
    return flags


def write_gemma3_swa_model(
    path: str | os.PathLike[str],
    *,
    n_layers: int = 6,
    n_heads: int = 4,
    n_kv_heads: int = 2,
    head_dim: int = 64,
    n_embd: int = 64,
    n_ff: int = 128,
    n_ctx_train: int = 131072,
    sliding_window_tokens: int = 512,
    swa_pattern: int | Sequence[bool] = 3,
    chat_template: str | None = None,
    tensor_type: str = "f16",
    seed: int = 0,
    name: str = "hotfit-fixture-gemma3-swa",
) -> FixtureInfo:
    """A gemma3 model with interleaved sliding-window attention.

    llama.cpp reads ``gemma3.attention.sliding_window`` (window in tokens) and
    ``gemma3.attention.sliding_window_pattern`` (an integer period, default 6, or one bool per
    layer) and keeps two KV caches: sliding layers hold only about a window of cells, full layers
    the whole context (``src/models/gemma3.cpp``, ``llama-kv-cache-iswa``). ``swa_pattern`` is
    written as given (int → uint32, sequence → bool array); ``FixtureInfo.swa_layers`` is the
    per-layer expansion."""
    _check_shape(n_heads, n_kv_heads, head_dim, tensor_type)
    if sliding_window_tokens <= 0:
        raise ValueError("sliding_window_tokens must be positive (0 disables sliding in llama.cpp)")
    swa_layers = swa_layer_pattern(n_layers, swa_pattern)
    path = Path(path)
    shape = _Shape(n_layers, n_heads, n_kv_heads, head_dim, n_embd, n_ff, n_ctx_train, tensor_type)
    rand = _gaussian(seed)
    w = _open_writer(path, "gemma3", name, shape, chat_template)
    w.add_sliding_window(sliding_window_tokens)
    if isinstance(swa_pattern, int):
        w.add_uint32(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch="gemma3"), swa_pattern)
    else:
        w.add_sliding_window_pattern(list(swa_layers))
    _tensor(w, "token_embd.weight", rand(N_VOCAB, n_embd), tensor_type)
    _tensor(w, "output_norm.weight", np.ones(n_embd), tensor_type)
    for i in range(n_layers):
        _llama_block(w, i, rand, shape)
        p = f"blk.{i}."
        _tensor(w, p + "post_attention_norm.weight", np.ones(n_embd), tensor_type)
        _tensor(w, p + "attn_q_norm.weight", np.ones(head_dim), tensor_type)
        _tensor(w, p + "attn_k_norm.weight", np.ones(head_dim), tensor_type)
        _tensor(w, p + "post_ffw_norm.weight", np.ones(n_embd), tensor_type)
    _finish(w)
    return _fixture_info(path, "gemma3-swa", "gemma3", shape, chat_template,
                         sliding_window_tokens=sliding_window_tokens, swa_layers=swa_layers)


UNSUPPORTED_ARCHITECTURE = "hotfit-no-such-arch"


def write_unsupported_arch_model(
    path: str | os.PathLike[str], *, architecture: str = UNSUPPORTED_ARCHITECTURE, n_ctx_train: int = 4096
) -> FixtureInfo:
    """A well-formed GGUF whose ``general.architecture`` llama.cpp does not know; loading it
    fails with ``unknown model architecture: '<name>'``."""
    path = Path(path)
    n_embd = 64
    w = gguf.GGUFWriter(path, architecture)
    w.add_name("hotfit-fixture-unsupported")
    w.add_context_length(n_ctx_train)
    w.add_embedding_length(n_embd)
    w.add_block_count(1)
    w.add_head_count(1)
    _add_vocab(w)
    _tensor(w, "token_embd.weight", np.zeros((N_VOCAB, n_embd)), "f32")
    _finish(w)
    return FixtureInfo(
        path=path,
        kind="unsupported",
        architecture=architecture,
        n_layers=1,
        n_heads=1,
        n_kv_heads=1,
        head_dim_k=n_embd,
        head_dim_v=n_embd,
        n_embd=n_embd,
        n_ctx_train=n_ctx_train,
        n_vocab=N_VOCAB,
        tensor_type="f32",
        has_chat_template=False,
        size_bytes=path.stat().st_size,
    )


def write_truncated_copy(
    source: str | os.PathLike[str], dest: str | os.PathLike[str], *, keep_bytes: int | None = None
) -> Path:
    """Copy the first ``keep_bytes`` (default: half) of a GGUF: a download cut short. The header
    still parses; the tensor data runs past the end of the file."""
    data = Path(source).read_bytes()
    keep = len(data) // 2 if keep_bytes is None else keep_bytes
    if not 0 <= keep < len(data):
        raise ValueError(f"keep_bytes must be in [0, {len(data)}), not {keep}")
    dest = Path(dest)
    dest.write_bytes(data[:keep])
    return dest


def write_garbage_file(path: str | os.PathLike[str], *, size_bytes: int = 4096, gguf_magic: bool = False) -> Path:
    """Seeded random bytes (optionally behind a valid ``GGUF`` magic and version 3)."""
    rng = np.random.default_rng(7)
    body = rng.integers(0, 256, size=size_bytes, dtype=np.uint8).tobytes()
    if gguf_magic:
        body = b"GGUF" + (3).to_bytes(4, "little") + body[8:]
    path = Path(path)
    path.write_bytes(body)
    return path


# ---------------------------------------------------------------- llama-server helpers


def pinned_source_tree() -> Path:
    """The pinned llama.cpp source tree (kept by scripts/install-llama-server)."""
    from hotfit.backends.llama_server.discovery import pinned_source_tree as tree
    from hotfit.core.settings import load_settings

    return tree(load_settings())


def pinned_template(name: str = QWEN3_TEMPLATE_NAME) -> Path:
    """A chat template from the pinned tree's ``models/templates`` (skip/fail like the server)."""
    path = pinned_source_tree() / "models" / "templates" / name
    if not path.is_file():
        _absent(f"pinned llama.cpp template {path} not found (run scripts/install-llama-server)")
    return path


# The pinned Qwen3 template, shipped in the repository byte for byte (tests/data/templates/SOURCE.md):
# what the offline demo serves, so it runs on a machine with no llama.cpp source tree (a build
# installed with --from) and without pytest.
SHIPPED_QWEN3_TEMPLATE = Path(__file__).parent / "data" / "templates" / QWEN3_TEMPLATE_NAME
SHIPPED_QWEN3_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"


def shipped_qwen3_template_text() -> str:
    """The shipped Qwen3 template, refused (ValueError) unless it is the pinned tree's bytes."""
    data = SHIPPED_QWEN3_TEMPLATE.read_bytes()
    got = hashlib.sha256(data).hexdigest()
    if got != SHIPPED_QWEN3_TEMPLATE_SHA256:
        raise ValueError(f"{SHIPPED_QWEN3_TEMPLATE} has sha256 {got}, not the pinned template's "
                         f"{SHIPPED_QWEN3_TEMPLATE_SHA256}: restore it (git checkout -- {SHIPPED_QWEN3_TEMPLATE.name})")
    return data.decode("utf-8")


# A tool-capable chat template for tests that need one on disk or on the Hub but no llama-server to
# render it (plan, download, verify, serve's window decision). Tests that run the server read the
# pinned llama.cpp template (pinned_template): that one is what makes a fixture's tool call parse.
STANDIN_TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{#- a reply may carry <tool_call>{...}</tool_call> #}"
)


def tool_template_text() -> str:
    """The pinned Qwen3 template when the llama.cpp tree is here, else :data:`STANDIN_TOOL_TEMPLATE`
    (never a skip: the callers do not start llama-server)."""
    path = pinned_source_tree() / "models" / "templates" / QWEN3_TEMPLATE_NAME
    return path.read_text(encoding="utf-8") if path.is_file() else STANDIN_TOOL_TEMPLATE


def write_standin_llama_server(path: Path) -> Path:
    """A stand-in ``llama-server`` for tests that stop before load: it answers ``--version`` (what
    hotfit checks before downloading) and refuses to serve (exit 1), so a run that reaches load
    fails there with a LoadError."""
    path.write_text("#!/bin/sh\n"
                    'if [ "$1" = "--version" ]; then echo "version: 1 (0000000) stand-in" >&2; exit 0; fi\n'
                    'echo "stand-in llama-server: cannot serve (tests/gguf_fixtures.py)" >&2\nexit 1\n')
    path.chmod(0o755)
    return path


def _absent(why: str) -> None:
    import pytest

    if os.environ.get(REQUIRE_ENV):
        pytest.fail(f"{why}; {REQUIRE_ENV} is set, so this is a failure, not a skip")
    pytest.skip(why)


def require_llama_server() -> Path:
    """The llama-server tests run (found the way hotfit finds it: backends.llama_server).

    Skips the calling test only when no binary exists and ``HOTFIT_REQUIRE_LLAMA`` is unset;
    with it set (CI) a missing binary fails loudly. A binary named by ``HOTFIT_LLAMA_SERVER``
    that is unusable always fails: someone asked for that one."""
    import pytest

    from hotfit.backends.llama_server.discovery import find_llama_server
    from hotfit.core.errors import BackendNotFound
    from hotfit.core.settings import load_settings

    settings = load_settings()
    try:
        return find_llama_server(settings).server_path
    except BackendNotFound as exc:
        if settings.llama_server is not None:
            pytest.fail(f"HOTFIT_LLAMA_SERVER is unusable: {exc}")
        _absent(f"llama-server not available: {exc.what}")
        raise  # unreachable: _absent skips or fails


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class RunningServer:
    """A started llama-server (see :func:`llama_server`)."""

    process: subprocess.Popen[bytes]
    base_url: str
    log_path: Path

    def get_json(self, route: str, timeout_s: float = 10.0) -> Any:
        with urllib.request.urlopen(self.base_url + route, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def post_json(self, route: str, body: Any, timeout_s: float = 60.0) -> Any:
        req = urllib.request.Request(
            self.base_url + route,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return json.loads(resp.read())

    def log_text(self) -> str:
        return self.log_path.read_text(encoding="utf-8", errors="replace")


class ServerFailedToStart(RuntimeError):
    def __init__(self, message: str, log: str, returncode: int | None) -> None:
        super().__init__(message)
        self.log = log
        self.returncode = returncode


@contextlib.contextmanager
def llama_server(
    model: str | os.PathLike[str],
    *,
    n_ctx: int,
    extra_args: Sequence[str] = (),
    server: Path | None = None,
    log_path: Path | None = None,
    startup_timeout_s: float = 60.0,
) -> Iterator[RunningServer]:
    """Start ``llama-server -m MODEL -c N --fit off -np 1`` on 127.0.0.1:<free port>, wait for
    ``/health``, yield, and always kill and reap it. A server that exits or never gets healthy
    raises :class:`ServerFailedToStart` carrying its log."""
    server = server or require_llama_server()
    port = free_port()
    if log_path is None:
        log_path = Path(model).with_suffix(f".server-{port}.log")
    cmd = [
        str(server),
        "-m", str(model),
        "-c", str(n_ctx),
        "--fit", "off",  # llama.cpp's default (on) may shrink the context: anchors.md §11.1
        "-np", "1",  # the default (auto = 4 slots) would divide -c across slots
        "--host", "127.0.0.1",
        "--port", str(port),
        "-t", "1",
        "--no-warmup",
        *extra_args,
    ]  # fmt: skip
    base_url = f"http://127.0.0.1:{port}"
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT)
        running = RunningServer(process=proc, base_url=base_url, log_path=log_path)
        try:
            deadline = time.monotonic() + startup_timeout_s
            while True:
                if proc.poll() is not None:
                    raise ServerFailedToStart(
                        f"llama-server exited with {proc.returncode} before it was healthy",
                        running.log_text(),
                        proc.returncode,
                    )
                try:
                    with urllib.request.urlopen(base_url + "/health", timeout=2) as resp:
                        if resp.status == 200:
                            break
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass  # not listening yet, or 503 while loading
                if time.monotonic() > deadline:
                    raise ServerFailedToStart(
                        f"llama-server not healthy after {startup_timeout_s:.0f} s", running.log_text(), None
                    )
                time.sleep(0.05)
            yield running
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=30)


# ---------------------------------------------------------------- deterministic tool-call model


def write_tool_call_model(
    path: str | os.PathLike[str],
    *,
    embed_template: bool = False,
    chat_template: str | None = None,
    n_ctx_train: int = 65536,
    tensor_type: str = "f32",
    name: str = "hotfit-fixture-tool-call",
    vocab: FixtureVocab = LLAMA_VOCAB,
    n_layers: int = 1,
    n_ff: int = 32,
) -> FixtureInfo:
    """A llama model whose greedy output is fixed by construction.

    Recipe:

    - every block's ``attn_output`` and ``ffn_down`` are zero, so the residual stream at a
      position is exactly the current token's embedding: the next token depends only on the
      current one, never on context, threads or chance;
    - every token embedding holds a shared "default" direction (dim 0, value 1); ``<tool_call>``
      (dim 1) and ``"`` (dim 2) add their own direction with weight 4;
    - output rows along the default direction: end-of-turn 6 > ``<tool_call>`` 5 >
      ``</tool_call>`` 4 > ``"`` 3 > ``}`` 2 > ``{`` 1 > other tokens 0 > whitespace -1 (so
      optional JSON whitespace never wins a tie against ``:``); along the token directions
      newline (after ``<tool_call>``) and ``"`` (after ``"``) get +10, beating any default.

    With ``tool_choice: "required"`` llama-server's grammar forbids end-of-turn before a call,
    and greedy decoding walks: ``<tool_call>`` → newline → ``{`` → the forced literal name part
    → ``{"text":""}`` (the string closes at once because ``"`` prefers ``"``; ``}`` beats ``,``)
    → ``}`` → ``</tool_call>`` → end of turn. The server parses exactly one call of the first
    tool, arguments ``{"text":""}``, content empty, finish_reason ``tool_calls``.
    Without a tool-capable template (llama.cpp's ChatML fallback drops ``tools``) there is no
    grammar: the first token is end-of-turn, so the answer is an empty message with
    finish_reason ``stop`` and no ``tool_calls``.

    Why not "newline prefers ``{``": every generation prompt ends with
    ``assistant\n`` and the grammar allows free content before ``<tool_call>``, so a newline
    that prefers ``{`` puts a stray ``{`` into the content. After ``<tool_call>\n`` the grammar
    admits only whitespace or ``{``, where ``{`` (1) beats whitespace (-1) anyway.

    Checked with :data:`PROBE_TOOL` (required string ``text``, optional boolean ``loud``), the
    pinned ``Qwen-Qwen3-0.6B.jinja`` (``--jinja --chat-template-file`` or embedded), f16 and
    q8_0 KV with flash attention, temperature 0: identical answers on every run.
    With ``tool_choice: "auto"`` the grammar is lazy and the model ends its turn without a call.

    ``embed_template``: embed the pinned Qwen3 template (or ``chat_template`` when given) as
    ``tokenizer.chat_template``; otherwise the file carries none and a test passes the template
    with ``--jinja --chat-template-file``. ``tensor_type``: the matrices' type ("f32" | "f16").
    ``vocab``: tokens appended after the specials (ids past every one the recipe uses, so they
    take only the default direction) and the merge list; see :class:`FixtureVocab`.
    ``n_layers``, ``n_ff``: more and wider blocks (each zeroed the same way, so the answer is the
    same) make a model that is slower by construction: every decode step reads their weights and
    every prompt token multiplies them (the speed floors' end-to-end tests).
    """
    path = Path(path)
    n_embd, n_heads, n_kv_heads, head_dim = 64, 2, 1, 32
    template = chat_template
    if embed_template and template is None:
        template = pinned_template().read_text(encoding="utf-8")
    shape = _Shape(n_layers, n_heads, n_kv_heads, head_dim, n_embd, n_ff, n_ctx_train, tensor_type)
    rand = _gaussian(1)
    nl, quote, lbrace, rbrace = ord("\n"), ord('"'), ord("{"), ord("}")
    dim_default, dim_tool_call, dim_quote = 0, 1, 2
    embd = np.zeros((vocab.n_vocab, n_embd))
    embd[:, dim_default] = 1.0
    embd[TOKEN_ID["<tool_call>"], dim_tool_call] = 4.0
    embd[quote, dim_quote] = 4.0
    out = np.zeros((vocab.n_vocab, n_embd))
    for token, pref in (
        (EOS_ID, 6.0),
        (TOKEN_ID["<tool_call>"], 5.0),
        (TOKEN_ID["</tool_call>"], 4.0),
        (quote, 3.0),
        (rbrace, 2.0),
        (lbrace, 1.0),
        # optional JSON whitespace must never win a tie against ":" or "," (both 0)
        *((ord(ws), -1.0) for ws in " \t\n\r"),
    ):
        out[token, dim_default] = pref
    out[nl, dim_tool_call] = 10.0
    out[quote, dim_quote] = 10.0

    w = _open_writer(path, "llama", name, shape, template, vocab)
    _tensor(w, "token_embd.weight", embd, tensor_type)
    _tensor(w, "output_norm.weight", np.ones(n_embd), tensor_type)
    _tensor(w, "output.weight", out, tensor_type)
    for i in range(n_layers):
        _llama_block(w, i, rand, shape, zero_out=True)
    _finish(w)
    return _fixture_info(path, "tool-call", "llama", shape, template, vocab)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.gguf_fixtures KIND OUT.gguf``: write one fixture (demo, benchmarks)."""
    import argparse
    import dataclasses

    parser = argparse.ArgumentParser(prog="python -m tests.gguf_fixtures", description=main.__doc__)
    parser.add_argument("kind", choices=["llama", "gemma3-swa", "unsupported", "tool-call"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--embed-template", action="store_true", help="tool-call: embed the Qwen3 template")
    args = parser.parse_args(argv)
    writers = {
        "llama": lambda: write_llama_model(args.out),
        "gemma3-swa": lambda: write_gemma3_swa_model(args.out),
        "unsupported": lambda: write_unsupported_arch_model(args.out),
        "tool-call": lambda: write_tool_call_model(args.out, embed_template=args.embed_template),
    }
    info = writers[args.kind]()
    print(json.dumps(dataclasses.asdict(info), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
