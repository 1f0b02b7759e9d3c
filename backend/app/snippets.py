"""Ready-to-paste client configuration for the shared model: Codex CLI, OpenCode, curl.

Each snippet is filled with the live base URL, model id and key.  Config files name the
key's environment variable rather than the key itself, so they can be committed or
shared; the `shell` line of the snippet sets that variable.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from backend.api_keys import mask_api_key
from backend.port.prompt_tokens import DEFAULT_OUTPUT_TOKENS

__all__ = [
    "KEY_ENV_VAR",
    "PROVIDER_ID",
    "ClientTarget",
    "Snippet",
    "client_snippets",
    "codex_snippet",
    "curl_snippet",
    "key_requirement",
    "opencode_snippet",
]

KEY_ENV_VAR = "GGUF_STUDIO_API_KEY"
# Codex reserves "openai", "ollama" and "lmstudio"; this id is ours alone.
PROVIDER_ID = "gguf-studio"
PROVIDER_NAME = "GGUF Studio"


@dataclass(frozen=True)
class ClientTarget:
    """What a client needs to know to use the shared model."""

    base_url: str  # ends in /v1
    model_id: str
    api_key: str = ""
    context_length: int | None = None  # tokens one request may use (the per-slot context)
    max_output_tokens: int = 0  # the operator's cap, 0 for none
    default_output_tokens: int = DEFAULT_OUTPUT_TOKENS  # reserved when a request sends none

    @property
    def output_limit(self) -> int:
        """The output a client should plan for: the operator's cap, else the budget the
        port reserves for a request without a limit.  OpenCode sends it as every
        request's limit and keeps the context minus it for the conversation, so a
        larger figure would cost both concurrency and room for the prompt."""
        limit = self.max_output_tokens or self.default_output_tokens
        if self.context_length:
            limit = min(limit, self.context_length)
        return limit


@dataclass(frozen=True)
class Snippet:
    client: str  # "Codex CLI"
    where: str  # where the text goes, e.g. "~/.codex/config.toml"
    language: str  # "toml", "json", "shell"
    text: str
    shell: str = ""  # a line to run first (sets the key's variable), or ""
    secret: str = ""  # the key as it appears in text/shell, for masking

    def masked(self) -> "Snippet":
        """The same snippet with the key hidden, for display while the key is hidden."""
        if not self.secret:
            return self
        hidden = mask_api_key(self.secret)
        return Snippet(self.client, self.where, self.language,
                       self.text.replace(self.secret, hidden),
                       self.shell.replace(self.secret, hidden), "")


def client_snippets(target: ClientTarget) -> list[Snippet]:
    return [codex_snippet(target), opencode_snippet(target), curl_snippet(target)]


def codex_snippet(target: ClientTarget) -> Snippet:
    # Root keys must come before the first table in TOML.
    lines = [
        f"model = {_toml_string(target.model_id)}",
        f"model_provider = {_toml_string(PROVIDER_ID)}",
    ]
    if target.context_length:
        lines.append(f"model_context_window = {int(target.context_length)}")
        # Codex sends no output limit: the port reserves the output budget beside the
        # prompt, so Codex compacts its conversation before prompt + budget outgrow
        # what one request may use.
        room = int(target.context_length) - target.output_limit
        if room > 0:
            lines.append(f"model_auto_compact_token_limit = {room}")
    lines += [
        "",
        f"[model_providers.{PROVIDER_ID}]",
        f"name = {_toml_string(PROVIDER_NAME)}",
        f"base_url = {_toml_string(target.base_url)}",
    ]
    # Codex refuses to start when env_key names an unset variable, so only name it when
    # there is a key to put in it.
    if target.api_key:
        lines.append(f"env_key = {_toml_string(KEY_ENV_VAR)}")
    lines.append('wire_api = "responses"')
    return Snippet("Codex CLI", "~/.codex/config.toml", "toml", "\n".join(lines) + "\n",
                   _export_line(target.api_key), target.api_key)


def opencode_snippet(target: ClientTarget) -> Snippet:
    model: dict[str, object] = {"name": target.model_id}
    if target.context_length:
        model["limit"] = {"context": int(target.context_length), "output": target.output_limit}
    options: dict[str, object] = {"baseURL": target.base_url}
    if target.api_key:
        options["apiKey"] = "{env:" + KEY_ENV_VAR + "}"
    config = {
        "$schema": "https://opencode.ai/config.json",
        "provider": {
            PROVIDER_ID: {
                "npm": "@ai-sdk/openai-compatible",
                "name": PROVIDER_NAME,
                "options": options,
                "models": {target.model_id: model},
            }
        },
        "model": f"{PROVIDER_ID}/{target.model_id}",
    }
    return Snippet("OpenCode", "opencode.json", "json", json.dumps(config, indent=2) + "\n",
                   _export_line(target.api_key), target.api_key)


def curl_snippet(target: ClientTarget) -> Snippet:
    body = {"model": target.model_id,
            "messages": [{"role": "user", "content": "Say hello in five words."}]}
    lines = [f"curl {shlex.quote(target.base_url.rstrip('/') + '/chat/completions')}",
             "  -H 'Content-Type: application/json'"]
    if target.api_key:
        lines.append(f"  -H {shlex.quote('Authorization: Bearer ' + target.api_key)}")
    lines.append(f"  -d {shlex.quote(json.dumps(body))}")
    return Snippet("curl", "a terminal", "shell", " \\\n".join(lines) + "\n", "", target.api_key)


def key_requirement(*, shared_on_network: bool, has_key: bool) -> str:
    """What clients must send, as the gateway enforces it: a key, once set, is required
    from every client, this computer's included."""
    if has_key:
        where = "every client" if shared_on_network else "every client, on this computer too"
        return f"Clients must send this key (Authorization: Bearer …): {where}."
    if shared_on_network:
        return "No key is set: anyone who can reach this port can use the model."
    return "No key is needed on this computer only; one is made when you share on the network."


def _export_line(api_key: str) -> str:
    return f"export {KEY_ENV_VAR}={shlex.quote(api_key)}" if api_key else ""


def _toml_string(value: str) -> str:
    # JSON's escapes are a subset of TOML basic strings' escapes.
    return json.dumps(value)
