"""Ready-to-paste client configuration for the shared models: Codex CLI, OpenCode, Claude
Code, curl.

Each snippet is filled with the live base URL, model ids and key.  Config files name the
key's environment variable rather than the key itself, so they can be committed or
shared; the `shell` line of the snippet sets that variable.

With several models, each client is offered all of them the way it switches models:
OpenCode lists every model under its provider, with its limits, and takes a
`small_model` for titles and summaries; Codex CLI (0.171) takes one model per config,
and switches with `codex --profile NAME`, which layers `$CODEX_HOME/NAME.config.toml`
over config.toml (its older `[profiles.NAME]` tables cannot hold a model's context
window), so every other model gets a profile file of its own (`Snippet.files`).

Claude Code (2.1) speaks `/v1/messages` and takes its settings from a file of their own,
`claude --settings FILE`, layered over the user's: the port's address and its model for
every alias Claude Code asks for (its main model, the small fast one for side
questions, haiku/sonnet/opus, subagents) in the file's `env`, and the key from an
`apiKeyHelper` command (which it sends as `Authorization: Bearer` and `x-api-key`).

The default model is best named by its stable alias (`ClientTarget.default_alias`, the
window's choice: `default`): the port keeps that name on whichever model is the default,
so loading another model in the window does not break every teammate's agent config.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass

from backend.api_keys import mask_api_key
from backend.toml_text import toml_string
from backend.admission.prompt_tokens import DEFAULT_OUTPUT_TOKENS

__all__ = [
    "KEY_ENV_VAR",
    "PROVIDER_ID",
    "ClientModel",
    "CLAUDE_SETTINGS",
    "ClientTarget",
    "Snippet",
    "SnippetFile",
    "claude_code_env",
    "claude_code_snippet",
    "client_snippets",
    "codex_model_lines",
    "codex_snippet",
    "curl_snippet",
    "key_requirement",
    "opencode_snippet",
]

KEY_ENV_VAR = "GGUF_STUDIO_API_KEY"
# Codex reserves "openai", "ollama" and "lmstudio"; this id is ours alone.
PROVIDER_ID = "gguf-studio"
PROVIDER_NAME = "GGUF Studio"
#: Where the Claude Code snippet goes: a settings file beside the user's own.
CLAUDE_SETTINGS = "~/.claude/gguf-studio.settings.json"


@dataclass(frozen=True)
class ClientModel:
    """One more model of the port a client may use (chat models only: an embeddings
    model answers no chat)."""

    model_id: str  # the name clients send
    context_length: int | None = None  # tokens one request may use (the per-slot context)
    size: int = 0  # bytes of its file, 0 when unknown: the smallest is OpenCode's small_model
    alias_of: str = ""  # the model `model_id` names now, when it is the default model's alias

    @property
    def served(self) -> str:
        """The model it is now (what a key's model list is checked against)."""
        return self.alias_of or self.model_id


@dataclass(frozen=True)
class ClientTarget:
    """What a client needs to know to use the shared models: the default one first."""

    base_url: str  # ends in /v1
    model_id: str  # the default model
    api_key: str = ""
    context_length: int | None = None  # tokens one request may use (the per-slot context)
    max_output_tokens: int = 0  # the operator's cap, 0 for none
    default_output_tokens: int = DEFAULT_OUTPUT_TOKENS  # reserved when a request sends none
    size: int = 0  # bytes of the default model's file, 0 when unknown
    others: tuple[ClientModel, ...] = ()  # the port's other chat models
    #: OpenCode's model for titles and summaries; "" for the smallest file when every
    #: size is known, else the default model.
    small_model: str = ""
    #: The name the snippets give the default model: a stable alias that follows the
    #: default (`backend.models.model_names.DEFAULT_MODEL_ALIAS`), or "" for `model_id`.
    default_alias: str = ""

    @property
    def output_limit(self) -> int:
        """The output a client should plan for: the operator's cap, else the budget the
        port reserves for a request without a limit.  OpenCode sends it as every
        request's limit and keeps the context minus it for the conversation, so a
        larger figure would cost both concurrency and room for the prompt."""
        return self.output_limit_of(self.default)

    def output_limit_of(self, model: ClientModel) -> int:
        limit = self.max_output_tokens or self.default_output_tokens
        if model.context_length:
            limit = min(limit, model.context_length)
        return limit

    @property
    def default(self) -> ClientModel:
        if self.default_alias:
            return ClientModel(self.default_alias, self.context_length, self.size, self.model_id)
        return ClientModel(self.model_id, self.context_length, self.size)

    @property
    def models(self) -> tuple[ClientModel, ...]:
        """Every model, the default first, each id once."""
        found: dict[str, ClientModel] = {}
        for model in (self.default, *self.others):
            found.setdefault(model.served, model)
        return tuple(found.values())

    @property
    def small(self) -> ClientModel:
        models = self.models
        chosen = next((m for m in models if self.small_model in (m.model_id, m.served)), None)
        if chosen is not None:
            return chosen
        if len(models) > 1 and all(m.size > 0 for m in models):
            return min(models, key=lambda m: m.size)  # the default wins a tie: it comes first
        return models[0]


@dataclass(frozen=True)
class SnippetFile:
    """One more file a snippet needs, e.g. a Codex profile per other model."""

    where: str  # "~/.codex/small.config.toml"
    text: str
    usage: str = ""  # how to use it: "codex --profile small"


@dataclass(frozen=True)
class Snippet:
    client: str  # "Codex CLI"
    where: str  # where the text goes, e.g. "~/.codex/config.toml"
    language: str  # "toml", "json", "shell"
    text: str
    shell: str = ""  # a line to run first (sets the key's variable), or ""
    secret: str = ""  # the key as it appears in text/shell, for masking
    files: tuple[SnippetFile, ...] = ()  # more files in the same language, after `text`'s

    def masked(self) -> "Snippet":
        """The same snippet with the key hidden, for display while the key is hidden."""
        if not self.secret:
            return self
        hidden = mask_api_key(self.secret)
        return Snippet(self.client, self.where, self.language,
                       self.text.replace(self.secret, hidden),
                       self.shell.replace(self.secret, hidden), "",
                       tuple(SnippetFile(f.where, f.text.replace(self.secret, hidden), f.usage)
                             for f in self.files))


def client_snippets(target: ClientTarget) -> list[Snippet]:
    return [codex_snippet(target), opencode_snippet(target), claude_code_snippet(target),
            curl_snippet(target)]


def codex_snippet(target: ClientTarget) -> Snippet:
    # Root keys must come before the first table in TOML.
    lines = codex_model_lines(target, target.default)
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
    files = tuple(SnippetFile(f"~/.codex/{profile}.config.toml",
                              "\n".join(codex_model_lines(target, model)) + "\n",
                              f"codex --profile {profile}")
                  for profile, model in _codex_profiles(target.models[1:]))
    return Snippet("Codex CLI", "~/.codex/config.toml", "toml", "\n".join(lines) + "\n",
                   _export_line(target.api_key), target.api_key, files)


def codex_model_lines(target: ClientTarget, model: ClientModel) -> list[str]:
    """config.toml's root lines that make Codex use `model` of the port."""
    lines = [f"model = {_toml_string(model.model_id)}",
             f"model_provider = {_toml_string(PROVIDER_ID)}"]
    if model.context_length:
        lines.append(f"model_context_window = {int(model.context_length)}")
        # Codex sends no output limit: the port reserves the output budget beside the
        # prompt, so Codex compacts its conversation before prompt + budget outgrow
        # what one request may use.
        room = int(model.context_length) - target.output_limit_of(model)
        if room > 0:
            lines.append(f"model_auto_compact_token_limit = {room}")
    return lines


def _codex_profiles(models: tuple[ClientModel, ...]) -> list[tuple[str, ClientModel]]:
    """A profile name per model: Codex takes plain names (letters, digits, - and _)."""
    taken: set[str] = set()
    named = []
    for model in models:
        base = re.sub(r"[^A-Za-z0-9_-]+", "-", model.model_id).strip("-_") or "model"
        name, n = base, 1
        while name.lower() in taken:
            n += 1
            name = f"{base}-{n}"
        taken.add(name.lower())
        named.append((name, model))
    return named


def opencode_snippet(target: ClientTarget) -> Snippet:
    models: dict[str, dict[str, object]] = {}
    for model in target.models:
        entry: dict[str, object] = {"name": model.model_id}
        if model.context_length:
            entry["limit"] = {"context": int(model.context_length),
                              "output": target.output_limit_of(model)}
        models[model.model_id] = entry
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
                "models": models,
            }
        },
        "model": f"{PROVIDER_ID}/{target.default.model_id}",
        # Titles and summaries.  Unset, OpenCode looks among the provider's models for
        # a family it knows (haiku, flash, nano), finds none of ours, and uses `model`.
        "small_model": f"{PROVIDER_ID}/{target.small.model_id}",
    }
    return Snippet("OpenCode", "opencode.json", "json", json.dumps(config, indent=2) + "\n",
                   _export_line(target.api_key), target.api_key)


def claude_code_snippet(target: ClientTarget) -> Snippet:
    settings: dict[str, object] = {"env": claude_code_env(target)}
    if target.api_key:
        settings["apiKeyHelper"] = f"printenv {KEY_ENV_VAR}"
    return Snippet("Claude Code", f"{CLAUDE_SETTINGS}, then start it with "
                   f"claude --settings {CLAUDE_SETTINGS}", "json",
                   json.dumps(settings, indent=2) + "\n", _export_line(target.api_key),
                   target.api_key)


def claude_code_env(target: ClientTarget) -> dict[str, str]:
    """The `env` of Claude Code's settings for `target`: the port's address (the SDK
    adds /v1/messages), its default model for every alias but the small fast one (side
    questions, titles), which gets the small model; the output limit to plan for (it
    asks for 32,000 tokens otherwise) and the context window (it assumes a million for
    a model it does not know); no telemetry, error reports or update checks."""
    default, small = target.default.model_id, target.small.model_id
    env = {"ANTHROPIC_BASE_URL": target.base_url.rstrip("/").removesuffix("/v1"),
           "ANTHROPIC_MODEL": default,
           "ANTHROPIC_DEFAULT_OPUS_MODEL": default,
           "ANTHROPIC_DEFAULT_SONNET_MODEL": default,
           "ANTHROPIC_DEFAULT_FABLE_MODEL": default,
           "ANTHROPIC_DEFAULT_HAIKU_MODEL": small,
           "ANTHROPIC_SMALL_FAST_MODEL": small,
           "CLAUDE_CODE_SUBAGENT_MODEL": default,
           "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(target.output_limit)}
    if target.context_length:
        env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] = str(int(target.context_length))
    env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] = "1"
    return env


def curl_snippet(target: ClientTarget) -> Snippet:
    body = {"model": target.default.model_id,
            "messages": [{"role": "user", "content": "Say hello in five words."}]}
    lines = [f"curl {shlex.quote(target.base_url.rstrip('/') + '/chat/completions')}",
             "  -H 'Content-Type: application/json'"]
    if target.api_key:
        lines.append(f"  -H {shlex.quote('Authorization: Bearer ' + target.api_key)}")
    lines.append(f"  -d {shlex.quote(json.dumps(body))}")
    return Snippet("curl", "a terminal", "shell", " \\\n".join(lines) + "\n", "", target.api_key)


def key_requirement(*, shared_on_network: bool, has_key: bool, named_keys: int = 0) -> str:
    """What clients must send, as the gateway enforces it: a key, once set (the owner's
    or any named one), is required from every client, this computer's included."""
    where = "every client" if shared_on_network else "every client, on this computer too"
    if named_keys:
        which = "this key or a named key" if has_key else "a named key"
        return f"Clients must send {which} (Authorization: Bearer …): {where}."
    if has_key:
        return f"Clients must send this key (Authorization: Bearer …): {where}."
    if shared_on_network:
        return "No key is set: anyone who can reach this port can use the model."
    return "No key is needed on this computer only; one is made when you share on the network."


def _export_line(api_key: str) -> str:
    return f"export {KEY_ENV_VAR}={shlex.quote(api_key)}" if api_key else ""


def _toml_string(value: str) -> str:
    return toml_string(value)
