"""llama-server's command line and child environment for a plan (pure, apart from ``--help``).

llama.cpp's defaults can silently break a plan (llama.cpp's tools/server/README.md):
``--fit`` (on by default) shrinks the context to 4096 or moves layers to the CPU, ``-np`` auto
(4 slots) divides ``-c`` across slots, a quantized V cache needs flash attention. So every
parameter the plan depends on is passed explicitly (:func:`llama_server_argv`), the flags a build
accepts are read from its ``--help`` (:func:`probe_server_features`), and every llama-server
hotfit starts — the load stage's and ``hotfit serve``'s — gets one environment
(:func:`child_env`: no ``LLAMA_ARG_*`` overrides, the API key only in the environment, the plan's
device pin).
"""

from __future__ import annotations

import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Mapping

import anyio

from hotfit.core.errors import BackendError
from hotfit.planner.plan import Plan
from hotfit.registry.kv import LLAMA_UBATCH_TOKENS

__all__ = [
    "API_KEY_ENV",
    "LLAMA_BATCH_TOKENS",
    "LLAMA_UBATCH_TOKENS",
    "LOG_VERBOSITY",
    "PROMPT_CACHE_RAM_MIB",
    "QUANTIZED_KV_TYPES",
    "ServerFeatures",
    "TemplateUsed",
    "child_env",
    "device_env",
    "llama_server_argv",
    "new_api_key",
    "parse_server_features",
    "probe_server_features",
    "server_env",
    "template_used",
]

# llama-server reads its API key from this variable (``--help``: "--api-key KEY ... (env:
# LLAMA_API_KEY)"), which keeps the key out of argv.
API_KEY_ENV = "LLAMA_API_KEY"
# Suffix of every generated key. At log verbosity 4 llama-server prints the key's last four
# characters ("api_keys: ****abcd"); a fixed suffix makes those four characters carry no secret.
_API_KEY_SUFFIX = "-hfk"



# llama.cpp's own defaults, passed explicitly: the SWA cache holds window + n_ubatch cells
# (llama-kv-cache-iswa.cpp) and the compute buffer scales with n_ubatch, so these are plan facts;
# the micro-batch is registry.kv's, so the estimate and the command line cannot drift apart.
LLAMA_BATCH_TOKENS = 2048
# Verbosity 4 (trace) is the lowest at which libllama's INFO lines reach the log: common/log.cpp
# maps GGML_LOG_LEVEL_INFO to LOG_LEVEL_TRACE (4), and the default threshold is 3. The KV cache
# size records stages.recheck reads are such lines.
LOG_VERBOSITY = 4
# The prompt cache lives in host RAM (default 8192 MiB) outside the plan's budget: disabled, so
# the opened session holds only what was planned (a CPU plan's budget *is* host RAM).
PROMPT_CACHE_RAM_MIB = 0

# ggml cache types whose V cache needs flash attention (llama-context.cpp: "enabling flash_attn
# since it is required for quantized V cache"; anchors.md §4).
QUANTIZED_KV_TYPES = frozenset({"q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"})



TemplateKind = Literal["file", "embedded", "fallback", "unknown"]



# ---------------------------------------------------------------- pure core


@dataclass(frozen=True)
class ServerFeatures:
    """What this llama-server build accepts, read from its ``--help`` (flags drift between builds)."""

    log_jsonl: bool  # --log-jsonl
    fit: bool  # --fit [on|off]
    ngl_all: bool  # -ngl accepts 'all'
    api_key_env: bool  # --api-key reads LLAMA_API_KEY
    api_key_file: bool  # --api-key-file
    cache_ram: bool  # -cram / --cache-ram
    offline: bool  # --offline
    verbosity: bool  # -lv / --log-verbosity
    flash_attn_values: bool  # -fa takes on|off|auto (older builds: bare switch)
    alias: bool = False  # -a / --alias: the model name /v1/models and responses carry
    metrics: bool = False  # --metrics: Prometheus text on /metrics


def parse_server_features(help_text: str) -> ServerFeatures:
    """Pure: which flags ``llama-server --help`` lists."""

    def has(flag: str) -> bool:
        return re.search(r"(?<![\w-])" + re.escape(flag) + r"(?![\w-])", help_text) is not None

    ngl = re.search(r"--n-gpu-layers N\s+(.*?)\(default", help_text, re.S)
    api_key = re.search(r"--api-key KEY.*?\(env: (\w+)\)", help_text, re.S)
    return ServerFeatures(
        log_jsonl=has("--log-jsonl"),
        fit=has("--fit"),
        ngl_all=bool(ngl and "'all'" in ngl.group(1)),
        api_key_env=bool(api_key and api_key.group(1) == API_KEY_ENV),
        api_key_file=has("--api-key-file"),
        cache_ram=has("--cache-ram"),
        offline=has("--offline"),
        verbosity=has("--log-verbosity"),
        flash_attn_values=re.search(r"--flash-attn \[on\|off\|auto\]", help_text) is not None,
        alias=has("--alias"),
        metrics=has("--metrics"),
    )


def llama_server_argv(
    plan: Plan,
    model_path: Path,
    template_path: Path | None,
    port: int,
    *,
    binary: Path,
    features: ServerFeatures,
    host: str = "127.0.0.1",
    api_key_file: Path | None = None,
    threads: int | None = None,
    warmup: bool = True,
    alias: str | None = None,
    metrics: bool = False,
) -> list[str]:
    """The full llama-server command line for ``plan`` (pure; ``hotfit serve`` reuses it).

    The API key is *not* in argv: pass it with :func:`server_env`, or name a key file
    (``api_key_file``, for a long-running ``hotfit serve``). ``alias`` names the model to clients
    (``/v1/models``, ``model`` in answers) instead of the GGUF's path; ``metrics`` turns on
    ``/metrics`` — both for ``hotfit serve``, where a fleet's clients and Prometheus read them."""
    kv = plan.kv_cache_type
    accelerator = plan.placement.device.kind != "cpu"
    argv = [
        str(binary.absolute()),
        "-m", str(model_path.absolute()),  # absolute: the server runs in its binary's folder
        "--jinja",
        "-c", str(plan.hot_context_tokens),
        "-ctk", kv,
        "-ctv", kv,
        # A quantized V cache needs flash attention; otherwise let llama.cpp choose per device
        # (auto = on where the backend supports it; it does not change the KV size).
        "-fa", "on" if kv in QUANTIZED_KV_TYPES else "auto",
        "-np", "1",  # one slot: -np N divides -c by N (anchors.md §4 "Slots gotcha")
        "-b", str(LLAMA_BATCH_TOKENS),
        "-ub", str(LLAMA_UBATCH_TOKENS),
        "--host", host,
        "--port", str(port),
    ]  # fmt: skip
    if template_path is not None:
        argv += ["--chat-template-file", str(template_path.absolute())]
    if accelerator:
        argv += ["-ngl", "all" if features.ngl_all else "999"]
        ggml_device = plan.placement.device.ggml_device
        if ggml_device and plan.placement.device.kind in ("vulkan", "amd"):
            # Only a Vulkan build serves these kinds: pin it to the probed device by ggml's name
            # (NVIDIA is pinned by UUID in the environment, which CUDA and Vulkan builds differ on).
            argv += ["-dev", ggml_device]
    else:
        argv += ["-ngl", "0", "-dev", "none"]  # CPU plan: nothing offloaded, no accelerator touched
    if features.fit:
        argv += ["--fit", "off"]  # the plan decides context and placement, not llama.cpp's fit
    if features.cache_ram:
        argv += ["--cache-ram", str(PROMPT_CACHE_RAM_MIB)]
    if features.offline:
        argv += ["--offline"]  # the model is local; never let the server reach the network
    if features.log_jsonl:
        argv += ["--log-jsonl"]
    if features.verbosity:
        argv += ["-lv", str(LOG_VERBOSITY)]
    if api_key_file is not None:
        argv += ["--api-key-file", str(api_key_file)]
    if threads is not None:
        argv += ["-t", str(threads)]
    if not warmup:
        argv += ["--no-warmup"]
    if alias and features.alias:
        argv += ["--alias", alias]
    if metrics and features.metrics:
        argv += ["--metrics"]
    return argv


def new_api_key() -> str:
    return secrets.token_urlsafe(32) + _API_KEY_SUFFIX


def server_env(api_key: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """The child's environment: ours, minus llama.cpp's ``LLAMA_ARG_*`` overrides (they would
    silently change what argv says), plus the API key."""
    env = {k: v for k, v in (os.environ if base is None else base).items() if not k.startswith("LLAMA_ARG_")}
    env.pop("LLAMA_API_KEY", None)
    env[API_KEY_ENV] = api_key
    return env


def device_env(plan: Plan) -> dict[str, str]:
    """Pin an NVIDIA plan to the probed card: CUDA numbering need not match NVML's, a UUID does."""
    device = plan.placement.device
    uuid = getattr(device, "uuid", None)
    if device.kind == "nvidia" and uuid:
        return {"CUDA_VISIBLE_DEVICES": str(uuid)}
    return {}


def child_env(plan: Plan, api_key: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The one environment every llama-server hotfit starts gets (the load stage and ``hotfit
    serve`` both build it here, so a served model runs on the card it was verified on): ``base``
    (default ours) without ``LLAMA_ARG_*`` overrides or a stale key, the API key when given
    (None: the caller names a key file in argv, or runs without one), and the plan's device pin."""
    env = server_env(api_key or "", dict(os.environ if base is None else base))
    if api_key is None:
        env.pop(API_KEY_ENV, None)
    return env | device_env(plan)



@dataclass(frozen=True)
class TemplateUsed:
    """Which chat template the server formats with (named in a failed tool-call probe)."""

    kind: TemplateKind
    path: Path | None = None

    def describe(self) -> str:
        if self.kind == "file":
            return str(self.path)
        if self.kind == "embedded":
            return "embedded (the GGUF's tokenizer.chat_template)"
        if self.kind == "unknown":
            return "the GGUF's embedded template, or llama.cpp's ChatML fallback if it has none (header unreadable)"
        return "llama.cpp ChatML fallback (no template file, none embedded in the GGUF)"


def template_used(template_path: Path | None, gguf_has_template: bool | None) -> TemplateUsed:
    if template_path is not None:
        return TemplateUsed("file", template_path)
    if gguf_has_template is None:
        return TemplateUsed("unknown")
    return TemplateUsed("embedded" if gguf_has_template else "fallback")





_features_cache: dict[tuple[str, int, int], ServerFeatures] = {}


async def probe_server_features(binary: Path) -> ServerFeatures:
    """Run ``llama-server --help`` once per binary (cached by path, size and mtime)."""
    st = binary.stat()
    key = (str(binary), st.st_size, st.st_mtime_ns)
    if key not in _features_cache:
        try:
            with anyio.fail_after(30):
                proc = await anyio.run_process([str(binary), "--help"], check=False)
        except TimeoutError:
            raise BackendError(f"`{binary} --help` did not answer within 30 s", binary=str(binary)) from None
        text = (proc.stdout or b"").decode(errors="replace") + (proc.stderr or b"").decode(errors="replace")
        _features_cache[key] = parse_server_features(text)
    return _features_cache[key]

