"""The real test models for scripts/bench-backend and scripts/gpu-check, and what those scripts
measure with them.

The models, their pins (package versions, wheel and file sha256) and their cache are
``scripts/fetch-test-models``'s, loaded as a module the way the tests load it
(``tests.real_models.fetch_script``): one table, so the scripts and the test suite cannot come to
disagree on a pin. :func:`locate` finds a model in that cache by its receipt; when it is absent it
runs ``scripts/fetch-test-models --only NAME`` (PyPI only), which downloads, checks and assembles it.

Also here: the GGUF facts a throughput bound needs (:func:`gguf_facts`: bytes a generated token
reads), llama-server with the pipeline's flags (:class:`Server`) and one ``/completion``
measurement (:func:`complete`). Not a project module: the scripts put this directory on ``sys.path``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Sequence
from typing import Any, Self

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: its modules below

from hotfit.backends.llama_server.flags import LLAMA_BATCH_TOKENS, LLAMA_UBATCH_TOKENS, LOG_VERBOSITY
from hotfit.backends.llama_server.logs import read_server_log
from hotfit.backends.llama_server.process import free_port
from hotfit.backends.llama_server.allocation import parse_log_allocation
from hotfit.stages.verify import read_gguf_header

# GEMMA3, SMOLLM2: re-exported, the scripts' default models
from tests.real_models import FETCH_SCRIPT, GEMMA3, SMOLLM2, cache_dir, fetch_script  # noqa: F401

MiB = 1 << 20


class ModelUnavailable(Exception):
    """The model could not be found or fetched; the message says what to do."""


def pinned() -> dict[str, Any]:
    """fetch-test-models' ModelSpec of every pinned model, by name."""
    return {m.name: m for m in fetch_script().MODELS}


def spec(name: str) -> Any:
    """The pins of model ``name`` (fetch-test-models' ModelSpec)."""
    specs = pinned()
    if name not in specs:
        raise ModelUnavailable(f"unknown model {name!r}: {FETCH_SCRIPT.name} pins {', '.join(specs)}")
    return specs[name]


def locate(name: str, explicit: Path | None = None, *, fetch: bool = True) -> Path:
    """The GGUF of model ``name``: ``explicit`` as is (named by the operator), else the cached file
    whose receipt matches the pins, else (``fetch``) what ``fetch-test-models --only NAME`` assembles.
    ``NAME@QUANT`` (``qwen2.5-coder-0.5b@Q8_0``): that model's weights requantized (:func:`requantized`)."""
    base, _, quant = name.partition("@")
    if quant:
        return requantized(locate(base, explicit, fetch=fetch), quant)
    model = spec(name)
    if explicit is not None:
        if not explicit.is_file():
            raise ModelUnavailable(f"{name}: {explicit} does not exist (drop the path to use the fetched one)")
        return explicit
    root = cache_dir()
    hit = fetch_script().cached(model, root)
    if hit is not None:
        return hit
    command = [sys.executable, str(FETCH_SCRIPT), "--cache-dir", str(root), "--only", name]
    if not fetch:
        raise ModelUnavailable(f"{name} is not in the cache {root}: run {' '.join(command[1:])}")
    print(f"{name} is not in the cache {root}: running {' '.join(command[1:])}", file=sys.stderr, flush=True)
    # Its pip has its own socket timeout and retries, so a stalled index fails it rather than hangs it.
    proc = subprocess.run(command, stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False)
    hit = fetch_script().cached(model, root)
    if proc.returncode != 0 or hit is None:
        why = proc.stderr.strip()[-800:] or f"exit {proc.returncode}, no message"
        raise ModelUnavailable(f"{name}: {FETCH_SCRIPT.name} --only {name} did not fetch it: {why} "
                               "(or pass the GGUF's path)")
    print(proc.stderr, end="", file=sys.stderr, flush=True)  # its download and check timings
    return hit


REQUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16")  # the types gguf-py's quants.quantize writes


def requantized(source: Path, quant: str) -> Path:
    """``source``'s weights dequantized and quantized again as ``quant`` by gguf-py (the quants it can
    write: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, BF16), metadata copied, cached beside the models as
    ``derived/<stem>.<quant>.gguf``: a third quant type for the speed benchmark from real weights (the
    tests' GGUFs ship as Q4_1 and Q4_K_M only). The same bytes each time; built in about a minute."""
    import gguf
    import numpy as np

    try:
        qtype = gguf.GGMLQuantizationType[quant.upper()]
    except KeyError:
        raise ModelUnavailable(f"unknown quant {quant!r}: name a GGML type such as Q8_0") from None
    if qtype.name not in REQUANTIZABLE:
        raise ModelUnavailable(f"gguf-py cannot write {qtype.name}: name one of {', '.join(REQUANTIZABLE)}")
    target = cache_dir() / "derived" / f"{source.stem}.{qtype.name}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(source)
    arch = str(reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
    partial = target.with_name(target.name + f".partial-{os.getpid()}")
    writer = gguf.GGUFWriter(partial, arch)
    try:
        for field in reader.fields.values():
            if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF."):
                continue
            value = field.contents()
            if field.name == gguf.Keys.General.FILE_TYPE:
                value = int(gguf.LlamaFileType[f"MOSTLY_{qtype.name}"])
            vtype = field.types[0]
            writer.add_key_value(field.name, value, vtype,
                                 sub_type=field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None)
        for t in reader.tensors:
            if t.tensor_type in (gguf.GGMLQuantizationType.F32, qtype) or len(t.shape) < 2:
                writer.add_tensor(t.name, t.data, raw_shape=t.data.shape if t.tensor_type != gguf.GGMLQuantizationType.F32
                                  else None, raw_dtype=t.tensor_type)
                continue
            weights = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            data = gguf.quants.quantize(weights, qtype)
            writer.add_tensor(t.name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


# ---------------------------------------------------------------- GGUF facts


@dataclass(frozen=True)
class GGUFFacts:
    architecture: str
    n_layers: int
    n_ctx_train: int
    sliding_window_tokens: int | None
    tensor_bytes: int  # every tensor's data
    weights_read_per_token_bytes: int  # what one decode step reads (see gguf_facts)
    token_embd_bytes: int
    tied_output: bool  # no output.weight: the logits matmul reads token_embd whole
    file_type: str
    n_kv_heads: int
    head_dim_k: int
    head_dim_v: int
    n_heads: int = 0  # query heads
    n_expert: int = 0  # MoE: experts per layer (0: dense)
    n_expert_used: int = 0  # MoE: experts a token is routed to


EXPERT_TENSOR_MARK = "_exps."  # llama.cpp's stacked expert tensors: blk.N.ffn_{gate,up,down}_exps.weight


def expert_share(meta: dict[str, Any], arch: str) -> float:
    """The share of an expert tensor one token uses: experts used / experts (1: dense)."""
    n, used = meta.get(f"{arch}.expert_count"), meta.get(f"{arch}.expert_used_count")
    return int(used) / int(n) if n and used else 1.0


def _used(name: str, value: int, share: float) -> int:
    """What a token touches of tensor ``name`` (bytes or parameters): ``share`` of a stacked expert tensor."""
    return round(value * share) if EXPERT_TENSOR_MARK in name else value


def tensor_infos(path: Path, header_bytes: int, tensor_count: int) -> list[tuple[str, tuple[int, ...], int]]:
    """(name, dims, ggml type) of each tensor, from the tensor-info table after the key/value header
    (``gguf.GGUFReader`` takes over a minute on Gemma 3's 262k-token vocabulary; this takes ms)."""
    import struct

    out = []
    with open(path, "rb", buffering=1 << 20) as fh:
        fh.seek(header_bytes)
        for _ in range(tensor_count):
            (n,) = struct.unpack("<Q", fh.read(8))
            name = fh.read(n).decode("utf-8", "replace")
            (n_dims,) = struct.unpack("<I", fh.read(4))
            dims = struct.unpack(f"<{n_dims}Q", fh.read(8 * n_dims))
            ttype, _offset = struct.unpack("<IQ", fh.read(12))
            out.append((name, tuple(dims), ttype))
    return out


def _elements(dims: tuple[int, ...]) -> int:
    elems = 1
    for d in dims:
        elems *= d
    return elems


def read_tensor_sizes(path: Path, header_bytes: int, tensor_count: int) -> dict[str, int]:
    """Bytes of each tensor's data (:func:`tensor_infos`)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out: dict[str, int] = {}
    for name, dims, ttype in tensor_infos(path, header_bytes, tensor_count):
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
        out[name] = _elements(dims) // block * type_size
        if name == "token_embd.weight":
            out["\0token_embd_rows"] = dims[-1]
    return out


def matmul_params(path: Path, *, all_experts: bool = False) -> int:
    """Parameters a prompt token is multiplied with: every 2-D weight of the blocks (the token
    embedding is a row lookup, and prefill computes the output projection for the last token only);
    of an MoE's expert tensors, the routed share (``all_experts``: every expert, as if dense)."""
    header = read_gguf_header(path)
    share = 1.0 if all_experts else expert_share(header.metadata, str(header.architecture))
    return sum(_used(name, _elements(dims), share)
               for name, dims, _ in tensor_infos(path, header.header_bytes, header.tensor_count)
               if len(dims) >= 2 and name.startswith("blk."))


def gguf_facts(path: Path, *, all_experts: bool = False) -> GGUFFacts:
    """Weights one generated token reads: every tensor once, except the token embedding, of which
    a decode step reads one row, unless the output projection is tied to it (no ``output.weight``:
    then the logits matmul reads it whole), and an MoE's expert tensors, of which it reads the
    experts it is routed to (``expert_used_count`` of ``expert_count``; ``all_experts``: every
    expert, as a prediction from the total parameter count would have it)."""
    from gguf import LlamaFileType

    header = read_gguf_header(path)
    meta = header.metadata
    arch = str(header.architecture)

    def key(k: str) -> Any:
        return meta.get(f"{arch}.{k}")

    sizes = read_tensor_sizes(path, header.header_bytes, header.tensor_count)
    rows = sizes.pop("\0token_embd_rows", 0)
    total = sum(sizes.values())
    embd = sizes.get("token_embd.weight", 0)
    tied = "output.weight" not in sizes
    share = 1.0 if all_experts else expert_share(meta, arch)
    active = sum(_used(name, size, share) for name, size in sizes.items())
    read = active if tied else active - embd + (embd // rows if rows else 0)
    ftype = meta.get("general.file_type")
    try:
        ftype_name = LlamaFileType(int(ftype)).name.removeprefix("MOSTLY_") if ftype is not None else "?"
    except ValueError:
        ftype_name = str(ftype)
    window = key("attention.sliding_window")
    n_head = int(key("attention.head_count"))
    n_kv = key("attention.head_count_kv")
    head_k, head_v = key("attention.key_length"), key("attention.value_length")
    head_default = int(key("embedding_length")) // n_head
    return GGUFFacts(
        architecture=arch, n_layers=int(key("block_count")), n_ctx_train=int(key("context_length")),
        sliding_window_tokens=int(window) if window else None,
        tensor_bytes=total, weights_read_per_token_bytes=read, token_embd_bytes=embd, tied_output=tied,
        file_type=ftype_name, n_kv_heads=int(n_kv) if n_kv is not None else n_head,
        head_dim_k=int(head_k) if head_k else head_default, head_dim_v=int(head_v) if head_v else head_default,
        n_heads=n_head, n_expert=int(key("expert_count") or 0), n_expert_used=int(key("expert_used_count") or 0),
    )  # fmt: skip


def kv_read_per_token_bytes(alloc: Any, window: int | None, prompt: int, gen: int) -> float:
    """Mean KV bytes a generated token attends, over positions prompt .. prompt+gen-1, from the
    server's KV records (``backends.llama_server.allocation.LogAllocation``: bytes per cell of each cache, all its
    layers, K and V): the token at position p attends p+1 cells of a full cache and
    min(p+1, window) of a sliding-window one. A lower bound: llama.cpp reads whole padded blocks."""
    total = 0.0
    for cache in alloc.caches:
        per_cell = cache.size_mib * MiB / cache.cells
        for p in range(prompt, prompt + gen):
            cells = p + 1
            if cache.role == "swa" and window:
                cells = min(cells, window)
            total += per_cell * cells
    return total / gen


# ---------------------------------------------------------------- llama-server


HEALTH_TIMEOUT_S = 180.0


class ServerFailed(Exception):
    """llama-server exited or did not become healthy; the message names its log."""


class Server:
    """One llama-server with the pipeline's flags (backends.llama_server.flags.llama_server_argv: f16 KV, -np 1, the
    same batch sizes, no prompt cache, trace-level log for the KV records), stopped on close.
    ``offload``: every layer on the accelerator (``-ngl all``), else the CPU plan's ``-ngl 0 -dev none``."""

    def __init__(self, binary: Path, model: Path, run_dir: Path, *, threads: int | None, ctx_tokens: int,
                 offload: bool = False, wrapper: Sequence[str] = ()):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        argv = [  # wrapper: e.g. an emulator (qemu-x86_64 -cpu Haswell) the server runs under
            *wrapper, str(binary), "-m", str(model), "-c", str(ctx_tokens), "-ctk", "f16", "-ctv", "f16",
            "-fa", "auto", "-np", "1", "-b", str(LLAMA_BATCH_TOKENS), "-ub", str(LLAMA_UBATCH_TOKENS),
            *(["-ngl", "all"] if offload else ["-ngl", "0", "-dev", "none"]),
            "--fit", "off", "--cache-ram", "0", "--offline", "--log-jsonl", "-lv", str(LOG_VERBOSITY),
            *(["-t", str(threads)] if threads else []),
            "--host", "127.0.0.1", "--port", str(self.port),
        ]  # fmt: skip
        self.argv = argv
        env = {k: v for k, v in os.environ.items() if not k.startswith("LLAMA_ARG_")}
        env.pop("LLAMA_API_KEY", None)
        with open(run_dir / "llama-server.jsonl", "wb") as out, open(run_dir / "llama-server.stderr.log", "wb") as err:
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=env,
                                         start_new_session=True, cwd=binary.parent)
        self.base_url = f"http://127.0.0.1:{self.port}"

    def wait_healthy(self, timeout_s: float = HEALTH_TIMEOUT_S) -> None:
        import time
        import urllib.error

        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerFailed(f"llama-server exited ({self.proc.returncode}) while loading; log: {self.run_dir}")
            try:
                with opener.open(f"{self.base_url}/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.1)
        raise ServerFailed(f"llama-server not healthy after {timeout_s:.0f} s; log: {self.run_dir}")

    def log_lines(self) -> list[Any]:
        return read_server_log(self.run_dir)

    def allocation(self) -> Any:
        """stages.recheck's reading of the KV records in this server's log."""
        return parse_log_allocation(self.log_lines())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------- llama-server requests


def post_json(url: str, body: dict[str, Any], timeout_s: float, headers: dict[str, str] | None = None) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback: never a proxy
    with opener.open(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def prompt_tokens(base_url: str, n_tokens: int, headers: dict[str, str] | None = None) -> list[int]:
    """Exactly ``n_tokens`` tokens of plain English text (tokenized by the server's own vocab)."""
    text = ("The quick brown fox jumps over the lazy dog while the river runs to the sea, and every "
            "morning the baker opens the shop at six to sell bread, cakes and coffee to the town. ") * 64
    ids: list[int] = []
    while len(ids) < n_tokens:
        ids += post_json(f"{base_url}/tokenize", {"content": text}, 60, headers)["tokens"]
    return ids[:n_tokens]


@dataclass(frozen=True)
class Timing:
    prompt_tokens: int
    prompt_tokens_per_s: float
    generated_tokens: int
    generated_tokens_per_s: float


def complete(base_url: str, tokens: list[int], n_predict: int, timeout_s: float = 300,
             headers: dict[str, str] | None = None) -> Timing:
    """One greedy ``/completion`` that re-evaluates the whole prompt (no prompt cache) and
    generates exactly ``n_predict`` tokens (EOS ignored); the server's own timings."""
    body = {"prompt": tokens, "n_predict": n_predict, "cache_prompt": False, "ignore_eos": True,
            "temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "stream": False}
    answer = post_json(f"{base_url}/completion", body, timeout_s, headers)
    t = answer["timings"]
    return Timing(int(t["prompt_n"]), float(t["prompt_per_second"]), int(t["predicted_n"]),
                  float(t["predicted_per_second"]))
