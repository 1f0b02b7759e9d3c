"""Client snippets: valid TOML/JSON, filled with the live URL, model id, context and key."""

from __future__ import annotations

import json
import shlex
import tomllib

from backend.app.sharing.snippets import (KEY_ENV_VAR, PROVIDER_ID, ClientModel, ClientTarget, client_snippets,
                                  key_requirement)
from backend.keys.key_store import KeyStore

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


def test_claude_code_settings_point_every_alias_at_the_port_and_read_the_key_from_its_variable(
        ) -> None:
    target = ClientTarget(URL, "qwen-7b", KEY, context_length=16384, size=5,
                          others=(ClientModel("qwen-0.5b", 8192, size=1),))
    claude = by_client(target)["Claude Code"]
    settings = json.loads(claude.text)
    env = settings["env"]
    assert env["ANTHROPIC_BASE_URL"] == "http://192.168.1.20:8899"  # the SDK adds /v1/messages
    for alias in ("ANTHROPIC_MODEL", "ANTHROPIC_DEFAULT_OPUS_MODEL", "ANTHROPIC_DEFAULT_SONNET_MODEL",
                  "ANTHROPIC_DEFAULT_FABLE_MODEL", "CLAUDE_CODE_SUBAGENT_MODEL"):
        assert env[alias] == "qwen-7b", alias
    # Side questions and titles go to the smallest model, as OpenCode's small_model.
    assert env["ANTHROPIC_SMALL_FAST_MODEL"] == env["ANTHROPIC_DEFAULT_HAIKU_MODEL"] == "qwen-0.5b"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "2048"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "16384"
    assert env["CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC"] == "1"
    assert settings["apiKeyHelper"] == f"printenv {KEY_ENV_VAR}"
    assert KEY not in claude.text  # the helper reads the variable the shell line sets
    assert shlex.split(claude.shell) == ["export", f"{KEY_ENV_VAR}={KEY}"]
    assert "claude --settings ~/.claude/" in claude.where


def test_claude_code_without_a_key_has_no_key_helper_nor_window_when_unknown() -> None:
    settings = json.loads(by_client(ClientTarget(URL, "m"))["Claude Code"].text)
    assert "apiKeyHelper" not in settings
    assert "CLAUDE_CODE_MAX_CONTEXT_TOKENS" not in settings["env"]


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


async def test_with_named_keys_the_hint_asks_for_one_also_without_an_owner_key(gw, tmp_path):
    """A named key makes the port ask every request for a key, this computer's too: the
    hint must not say that none is needed."""
    gw.ctx.keys = KeyStore(tmp_path / "keys.json")
    _, secret = gw.ctx.keys.add("alice")
    assert (await gw.client.get("/v1/models")).status_code == 401  # loopback, no key
    headers = {"Authorization": f"Bearer {secret}"}
    assert (await gw.client.get("/v1/models", headers=headers)).status_code == 200
    hint = key_requirement(shared_on_network=False, has_key=False, named_keys=1)
    assert "must send a named key" in hint and "on this computer too" in hint
    assert "this key or a named key" in key_requirement(shared_on_network=True, has_key=True,
                                                         named_keys=2)


# --- several models ----------------------------------------------------------------------------

POOL = ClientTarget(URL, "coder", KEY, context_length=32768, size=4_000_000_000,
                    others=(ClientModel("qwen2.5:0.5b", 8192, 400_000_000),
                            ClientModel("qwen2.5/0.5b", 4096, 900_000_000)))


def test_codex_gets_the_default_model_and_a_profile_file_per_other_model() -> None:
    codex = by_client(POOL)["Codex CLI"]
    base = tomllib.loads(codex.text)
    assert (base["model"], base["model_context_window"]) == ("coder", 32768)
    # Codex takes plain profile names: letters, digits, - and _; each one once.
    assert [(f.where, f.usage) for f in codex.files] == [
        ("~/.codex/qwen2-5-0-5b.config.toml", "codex --profile qwen2-5-0-5b"),
        ("~/.codex/qwen2-5-0-5b-2.config.toml", "codex --profile qwen2-5-0-5b-2")]
    small, other = (tomllib.loads(f.text) for f in codex.files)
    assert small == {"model": "qwen2.5:0.5b", "model_provider": PROVIDER_ID,
                     "model_context_window": 8192, "model_auto_compact_token_limit": 8192 - 2048}
    assert other["model"] == "qwen2.5/0.5b" and other["model_context_window"] == 4096
    assert all(KEY not in f.text for f in codex.files)


def test_opencode_lists_every_model_with_its_limits_and_the_smallest_as_small_model() -> None:
    config = json.loads(by_client(POOL)["OpenCode"].text)
    models = config["provider"][PROVIDER_ID]["models"]
    assert list(models) == ["coder", "qwen2.5:0.5b", "qwen2.5/0.5b"]
    assert models["qwen2.5/0.5b"]["limit"] == {"context": 4096, "output": 2048}
    assert config["model"] == f"{PROVIDER_ID}/coder"
    assert config["small_model"] == f"{PROVIDER_ID}/qwen2.5:0.5b"


def test_opencodes_small_model_is_the_one_chosen_else_the_default_when_sizes_are_unknown() -> None:
    chosen = ClientTarget(URL, "coder", others=(ClientModel("a", size=1), ClientModel("b", size=2)),
                          small_model="b")
    assert json.loads(by_client(chosen)["OpenCode"].text)["small_model"] == f"{PROVIDER_ID}/b"
    unknown = ClientTarget(URL, "coder", others=(ClientModel("tiny", size=1),))  # coder's size unknown
    assert json.loads(by_client(unknown)["OpenCode"].text)["small_model"] == f"{PROVIDER_ID}/coder"
    single = by_client(ClientTarget(URL, "coder"))
    assert json.loads(single["OpenCode"].text)["small_model"] == f"{PROVIDER_ID}/coder"
    assert single["Codex CLI"].files == ()


def test_any_model_id_makes_valid_toml_even_outside_the_basic_plane() -> None:
    codex = by_client(ClientTarget(URL, "modèle-😀\x7f", others=(ClientModel("😀"),)))["Codex CLI"]
    assert tomllib.loads(codex.text)["model"] == "modèle-😀\x7f"
    assert codex.files[0].where == "~/.codex/model.config.toml"
    assert tomllib.loads(codex.files[0].text)["model"] == "😀"


# --- the default model's stable name ----------------------------------------------------

ALIASED = ClientTarget(URL, "qwen-7b", KEY, context_length=16384, default_alias="default",
                       others=(ClientModel("small", 4096),))


def test_with_a_default_alias_every_snippet_names_the_default_model_by_it():
    snippets = by_client(ALIASED)
    codex = tomllib.loads(snippets["Codex CLI"].text)
    assert codex["model"] == "default" and codex["model_context_window"] == 16384
    opencode = json.loads(snippets["OpenCode"].text)
    assert opencode["model"] == f"{PROVIDER_ID}/default"
    assert set(opencode["provider"][PROVIDER_ID]["models"]) == {"default", "small"}
    assert '"model": "default"' in snippets["curl"].text
    assert "qwen-7b" not in "".join(s.text for s in snippets.values())


def test_a_key_limited_to_some_models_is_given_their_own_names_not_the_alias():
    from backend.app.sharing.key_table import key_target
    from backend.keys.key_store import KeyRecord
    every = key_target(ALIASED, KeyRecord("bob"), "gs-bob")
    assert [m.model_id for m in every.models] == ["default", "small"]
    assert tomllib.loads(client_snippets(every)[0].text)["model"] == "default"
    limited = key_target(ALIASED, KeyRecord("alice", models=("qwen-7b",)), "gs-alice")
    assert [m.model_id for m in limited.models] == ["qwen-7b"]
    assert tomllib.loads(client_snippets(limited)[0].text)["model"] == "qwen-7b"
