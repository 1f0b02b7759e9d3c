"""What `connect` writes into a teammate's home: the key in a 0600 file only, a Codex
profile per model, an OpenCode provider beside theirs, a Claude Code settings file beside
theirs, a backup of whatever changed."""

from __future__ import annotations

import json
import stat
import tomllib
from pathlib import Path

import pytest

from backend.app.sharing.client_config import write_client_config
from backend.app.sharing.snippets import ClientModel, ClientTarget

SECRET = "gs-" + "s" * 43


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / ".config"))
    monkeypatch.setenv("CODEX_HOME", str(tmp_path / ".codex"))
    monkeypatch.delenv("CLAUDE_CONFIG_DIR", raising=False)
    return tmp_path


def target() -> ClientTarget:
    return ClientTarget("http://10.0.0.5:8899/v1", "coder", SECRET, 8192, 512,
                        others=(ClientModel("small", 4096),), default_alias="default")


def test_a_second_connect_backs_up_what_the_first_wrote_and_keeps_the_users_own(home,
                                                                                loose_umask):
    opencode = home / ".config" / "opencode" / "opencode.json"
    opencode.parent.mkdir(parents=True)
    opencode.write_text(json.dumps({"model": "mine/x", "provider": {"mine": {}}}))
    first = write_client_config(target(), "office", "Office box")
    second = write_client_config(target(), "office", "Office box")

    key_file = home / ".config" / "gguf-studio" / "connections" / "office.key"
    assert first.key_file == key_file and stat.S_IMODE(key_file.stat().st_mode) == 0o600
    profile = tomllib.loads((home / ".codex" / "office.config.toml").read_text())
    assert profile["model"] == "default" and profile["model_provider"] == "office"
    provider = profile["model_providers"]["office"]
    assert provider["base_url"] == "http://10.0.0.5:8899/v1"
    assert provider["auth"] == {"command": "cat", "args": [str(key_file)]}
    small = tomllib.loads((home / ".codex" / "office-small.config.toml").read_text())
    assert small["model"] == "small" and small["model_context_window"] == 4096
    config = json.loads(opencode.read_text())
    assert config["model"] == "mine/x" and set(config["provider"]) == {"mine", "office"}
    assert config["provider"]["office"]["options"]["apiKey"] == "{file:" + str(key_file) + "}"
    # The key, opencode.json, 2 profiles, Claude Code's settings.
    assert len(first.backups) == 1 and len(second.backups) == 5
    assert json.loads(first.backups[0].read_text()) == {"model": "mine/x", "provider": {"mine": {}}}
    (key_backup,) = (b for b in second.backups if b.name.startswith("office.key.bak-"))
    assert key_backup.read_text() == SECRET + "\n"  # the key it replaced, kept
    for path in [*first.files, *second.backups]:
        assert path == key_backup or SECRET not in path.read_text()
    assert second.codex_command == "codex --profile office"


def test_claude_code_gets_a_settings_file_of_its_own_that_reads_the_key_file(home):
    users_own = home / ".claude" / "settings.json"
    users_own.parent.mkdir()
    users_own.write_text('{"theme": "dark"}')

    written = write_client_config(target(), "office", "Office box")

    path = home / ".claude" / "settings.gguf-studio-office.json"
    assert path in written.files and users_own.read_text() == '{"theme": "dark"}'
    settings = json.loads(path.read_text())
    assert settings["apiKeyHelper"] == f"cat {written.key_file}"
    assert SECRET not in path.read_text()
    env = settings["env"]
    assert env["ANTHROPIC_BASE_URL"] == "http://10.0.0.5:8899"
    assert env["ANTHROPIC_MODEL"] == "default" and env["ANTHROPIC_SMALL_FAST_MODEL"] == "default"
    assert env["CLAUDE_CODE_MAX_OUTPUT_TOKENS"] == "512"
    assert env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == "8192"
    assert written.claude_command == f"claude --settings {path}"


def test_claude_codes_settings_go_to_its_config_dir_when_one_is_set(home, monkeypatch):
    monkeypatch.setenv("CLAUDE_CONFIG_DIR", str(home / "elsewhere"))

    written = write_client_config(target(), "office", "Office box")

    assert home / "elsewhere" / "settings.gguf-studio-office.json" in written.files


def test_an_opencode_config_with_comments_is_left_alone_and_said_so(home):
    jsonc = home / ".config" / "opencode" / "opencode.jsonc"
    jsonc.parent.mkdir(parents=True)
    jsonc.write_text('{ // mine\n "model": "mine/x" }\n')

    written = write_client_config(target(), "office", "Office box")

    assert jsonc.read_text() == '{ // mine\n "model": "mine/x" }\n'
    assert not (home / ".config" / "opencode" / "opencode.json").exists()
    assert any("left as it is" in note for note in written.notes)


def test_opencodes_small_model_is_left_to_the_user(home):
    """OpenCode's small_model titles every provider's conversations: set by connect, it
    would send the titles of the user's other work to this port."""
    opencode = home / ".config" / "opencode" / "opencode.json"

    write_client_config(target(), "office", "Office box")  # no OpenCode config yet

    config = json.loads(opencode.read_text())
    assert config["model"].startswith("office/")
    assert "small_model" not in config
    opencode.write_text(json.dumps({"small_model": "mine/tiny"}))
    write_client_config(target(), "office", "Office box")
    assert json.loads(opencode.read_text())["small_model"] == "mine/tiny"
