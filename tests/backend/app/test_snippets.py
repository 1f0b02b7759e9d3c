"""Client snippets: valid TOML/JSON, filled with the live URL, model id, context and key."""

from __future__ import annotations

import json
import shlex
import tomllib

from backend.app.snippets import KEY_ENV_VAR, PROVIDER_ID, ClientTarget, client_snippets, key_requirement

URL = "http://192.168.1.20:8899/v1"
KEY = "gs-secretsecretsecret"


def by_client(target: ClientTarget) -> dict:
    return {s.client: s for s in client_snippets(target)}


def test_codex_uses_the_responses_wire_and_the_key_variable() -> None:
    codex = by_client(ClientTarget(URL, "qwen-7b", KEY, context_length=16384))["Codex CLI"]
    config = tomllib.loads(codex.text)
    assert config["model"] == "qwen-7b"
    assert config["model_provider"] == PROVIDER_ID
    assert config["model_context_window"] == 16384
    # Codex sends no output limit; the port reserves 2,048 beside the prompt.
    assert config["model_auto_compact_token_limit"] == 16384 - 2048
    provider = config["model_providers"][PROVIDER_ID]
    assert provider == {"name": "GGUF Studio", "base_url": URL, "env_key": KEY_ENV_VAR,
                        "wire_api": "responses"}
    assert KEY not in codex.text  # the file names the variable, never the key
    assert shlex.split(codex.shell) == ["export", f"{KEY_ENV_VAR}={KEY}"]


def test_snippets_plan_for_the_operators_cap_else_the_reserved_budget() -> None:
    capped = by_client(ClientTarget(URL, "m", context_length=8192, max_output_tokens=1000))
    assert tomllib.loads(capped["Codex CLI"].text)["model_auto_compact_token_limit"] == 7192
    budget = by_client(ClientTarget(URL, "m", context_length=8192, default_output_tokens=4096))
    limit = json.loads(budget["OpenCode"].text)["provider"][PROVIDER_ID]["models"]["m"]["limit"]
    assert limit == {"context": 8192, "output": 4096}


def test_codex_without_a_key_names_no_variable() -> None:
    codex = by_client(ClientTarget("http://127.0.0.1:8899/v1", "m"))["Codex CLI"]
    provider = tomllib.loads(codex.text)["model_providers"][PROVIDER_ID]
    assert "env_key" not in provider
    assert codex.shell == ""


def test_opencode_provider_has_model_and_limits() -> None:
    opencode = by_client(ClientTarget(URL, "qwen-7b", KEY, context_length=16384,
                                      max_output_tokens=2048))["OpenCode"]
    config = json.loads(opencode.text)
    provider = config["provider"][PROVIDER_ID]
    assert provider["npm"] == "@ai-sdk/openai-compatible"
    assert provider["options"] == {"baseURL": URL, "apiKey": "{env:" + KEY_ENV_VAR + "}"}
    assert provider["models"]["qwen-7b"]["limit"] == {"context": 16384, "output": 2048}
    assert config["model"] == f"{PROVIDER_ID}/qwen-7b"
    assert KEY not in opencode.text and KEY in opencode.shell


def test_opencode_output_limit_never_exceeds_the_context() -> None:
    opencode = by_client(ClientTarget(URL, "m", context_length=2048))["OpenCode"]
    assert json.loads(opencode.text)["provider"][PROVIDER_ID]["models"]["m"]["limit"] == {
        "context": 2048, "output": 2048}
    no_ctx = by_client(ClientTarget(URL, "m"))["OpenCode"]
    model = json.loads(no_ctx.text)["provider"][PROVIDER_ID]["models"]["m"]
    assert "limit" not in model


def test_curl_is_a_runnable_command_with_the_key() -> None:
    curl = by_client(ClientTarget(URL, "it's-a-model", KEY))["curl"]
    argv = shlex.split(curl.text.replace("\\\n", " "))
    assert argv[0] == "curl" and argv[1] == URL + "/chat/completions"
    assert f"Authorization: Bearer {KEY}" in argv
    body = json.loads(argv[argv.index("-d") + 1])
    assert body["model"] == "it's-a-model"


def test_masked_snippets_hide_the_key() -> None:
    for snippet in client_snippets(ClientTarget(URL, "m", KEY)):
        masked = snippet.masked()
        assert KEY not in masked.text and KEY not in masked.shell
    curl = by_client(ClientTarget(URL, "m", KEY))["curl"].masked()
    assert "gs-" in curl.text and "•" in curl.text


def test_toml_strings_are_escaped() -> None:
    codex = by_client(ClientTarget(URL, 'we"ird\\name', KEY))["Codex CLI"]
    assert tomllib.loads(codex.text)["model"] == 'we"ird\\name'


async def test_the_key_hint_says_what_the_port_enforces_on_this_computer(gw):
    """Once a key is set, a client on this computer that sends nothing is refused: the
    hint must not say it may send nothing (it did)."""
    gw.configure(api_key=KEY)
    assert (await gw.client.get("/v1/models")).status_code == 401  # gw listens on 127.0.0.1
    hint = key_requirement(shared_on_network=False, has_key=True)
    assert "must send this key" in hint and "on this computer too" in hint
    assert "nothing" not in hint
    assert "must send this key" in key_requirement(shared_on_network=True, has_key=True)
    assert "No key is needed" in key_requirement(shared_on_network=False, has_key=False)
    assert "anyone" in key_requirement(shared_on_network=True, has_key=False)
