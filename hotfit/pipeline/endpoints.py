"""What a client needs to use a ``hotfit serve`` endpoint, from hotfit's own state (docs/recipes.md,
"Clients configured by hotfit"): the served alias, ``api_base`` from the serving host and port, the
API key file, the window the server opened, whether the tool-call probe passed, and the measured
generation speed. Pure: the CLI reads the state (the manifest, the worker record, ``hotfit status
--json`` documents) and renders what this module builds.

One endpoint is :func:`openai_config` or a LiteLLM ``model_list`` of one; a fleet's
``hotfit fleet endpoints`` is :func:`litellm_config` over many, one ``model_name`` per served model
so LiteLLM's router balances the machines serving it (and retries on another when one fails).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hotfit.core.errors import UsageError

__all__ = ["API_KEY_ENV", "ServedEndpoint", "api_base", "endpoint_from_status", "litellm_config", "openai_config"]

# The variable a LiteLLM config names for the key (LiteLLM reads ``os.environ/NAME``; it has no
# file reference): the operator exports it from the key file the config names in a comment.
API_KEY_ENV = "HOTFIT_API_KEY"
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::", "[::]"})
# LiteLLM retries a failed request; a machine whose request failed is left out for the cooldown at
# once (allowed_fails 0), so the retry goes to another machine serving the model. With 1 the
# retries of the first request after a machine stopped could all land on it (seen: HTTP 500).
ROUTER_SETTINGS = {"routing_strategy": "simple-shuffle", "num_retries": 2, "allowed_fails": 0, "cooldown_time": 30}


@dataclass(frozen=True)
class ServedEndpoint:
    machine: str
    alias: str  # the registry name: llama-server's --alias, the `model` clients send
    api_base: str  # ends in /v1
    api_key_file: str | None
    context_tokens: int | None  # the window the server opened (else the verified one)
    supports_function_calling: bool  # the tool-call probe passed on this machine
    generation_tokens_per_s: float | None = None  # measured by the tool-call probe

    def to_json(self) -> dict[str, Any]:
        return {"machine": self.machine, "alias": self.alias, "api_base": self.api_base,
                "api_key_file": self.api_key_file, "context_tokens": self.context_tokens,
                "supports_function_calling": self.supports_function_calling,
                "generation_tokens_per_s": self.generation_tokens_per_s}


def api_base(host: str, port: int, machine: str) -> str:
    """The URL clients use: a server listening on every address is reached by the machine's name."""
    where = machine if host in WILDCARD_HOSTS else host
    if ":" in where and not where.startswith("["):
        where = f"[{where}]"
    return f"http://{where}:{port}/v1"


def _speed(verdict: Mapping[str, Any]) -> float | None:
    value = verdict.get("generation_tokens_per_s")
    return float(value) if isinstance(value, (int, float)) and value > 0 else None


def endpoint_from_state(manifest: Mapping[str, Any], *, host: str, port: int, api_key_file: str | None,
                        context_tokens: int | None, machine: str) -> ServedEndpoint:
    """One machine's endpoint from its manifest (``Manifest.to_json()``) and how it is served."""
    verdict = manifest.get("probe_verdict") or {}
    measured = manifest.get("measured") or {}
    window = context_tokens or measured.get("opened_context_tokens") or manifest.get("planned_hot_context_tokens")
    return ServedEndpoint(machine=machine, alias=str(manifest["entry_name"]), api_base=api_base(host, port, machine),
                          api_key_file=api_key_file, context_tokens=int(window) if window else None,
                          supports_function_calling=verdict.get("passed") is True,
                          generation_tokens_per_s=_speed(verdict))


def endpoint_from_status(doc: Any, source: str) -> ServedEndpoint:
    """A machine's endpoint from its ``hotfit status --json`` (``source`` names the file in errors):
    what it provisioned and how its ``hotfit serve`` listens (``serving``)."""
    if not isinstance(doc, Mapping) or "provisioned" not in doc:
        raise UsageError(f"{source}: not a `hotfit status --json` document",
                         hint="save each machine's `hotfit --json status` output and pass those files")
    manifest, serving = doc.get("provisioned"), doc.get("serving")
    if not isinstance(manifest, Mapping) or not manifest.get("entry_name"):
        raise UsageError(f"{source}: nothing is provisioned on that machine", hint="run `hotfit auto` there first")
    if not isinstance(serving, Mapping) or not isinstance(serving.get("port"), int):
        raise UsageError(f"{source}: no `hotfit serve` has run on that machine (status has no serving section)",
                         hint="start `hotfit serve` there (or its unit), then save `hotfit --json status` again")
    machine = str(serving.get("machine") or source)
    return endpoint_from_state(manifest, host=str(serving.get("host") or ""), port=serving["port"],
                               api_key_file=serving.get("api_key_file"),
                               context_tokens=serving.get("context_tokens"), machine=machine)


def _model_entry(ep: ServedEndpoint) -> dict[str, Any]:
    params: dict[str, Any] = {"model": f"openai/{ep.alias}", "api_base": ep.api_base,
                              # llama-server without --api-key accepts any key; the openai client wants one
                              "api_key": f"os.environ/{API_KEY_ENV}" if ep.api_key_file else "none"}
    if ep.generation_tokens_per_s is not None:  # faster machines get more of the traffic
        params["weight"] = max(1, round(ep.generation_tokens_per_s))
    info: dict[str, Any] = {"supports_function_calling": ep.supports_function_calling,
                            "hotfit_machine": ep.machine}
    if ep.context_tokens:
        info["max_input_tokens"] = ep.context_tokens
    if ep.generation_tokens_per_s is not None:
        info["hotfit_generation_tokens_per_s"] = ep.generation_tokens_per_s
    return {"model_name": ep.alias, "litellm_params": params, "model_info": info}


def litellm_config(endpoints: Sequence[ServedEndpoint]) -> dict[str, Any]:
    """A LiteLLM proxy configuration: one deployment per machine, named by the model it serves."""
    ordered = sorted(endpoints, key=lambda e: (e.alias, e.machine, e.api_base))
    return {"model_list": [_model_entry(ep) for ep in ordered], "router_settings": dict(ROUTER_SETTINGS)}


def key_files(endpoints: Sequence[ServedEndpoint]) -> list[str]:
    return sorted({ep.api_key_file for ep in endpoints if ep.api_key_file})


def openai_config(ep: ServedEndpoint) -> dict[str, Any]:
    """The OpenAI SDK's settings for one endpoint (``OpenAI(base_url=..., api_key=<the file's text>)``,
    ``model=...``) and what the server offers."""
    return {"base_url": ep.api_base, "model": ep.alias, "api_key_file": ep.api_key_file,
            "context_window_tokens": ep.context_tokens, "supports_function_calling": ep.supports_function_calling,
            "generation_tokens_per_s": ep.generation_tokens_per_s, "machine": ep.machine}


def litellm_yaml(config: Mapping[str, Any], key_file_paths: Sequence[str]) -> str:
    """The config as YAML (JSON's syntax is YAML's: one value per line, no YAML library needed), with
    how to set the key variable as a comment."""
    import json

    head = ["# LiteLLM proxy configuration written by hotfit (docs/recipes.md, \"Clients configured by hotfit\")"]
    if key_file_paths:
        head.append(f"# export {API_KEY_ENV}=\"$(cat {key_file_paths[0]})\""
                    + (f"   # key files: {', '.join(key_file_paths)}" if len(key_file_paths) > 1 else ""))
    return "\n".join(head) + "\n" + json.dumps(config, indent=2) + "\n"
