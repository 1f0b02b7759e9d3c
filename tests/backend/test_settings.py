"""Settings: saved file < environment < command line, and what gets saved."""

from __future__ import annotations

import json
import os
import stat

import pytest

from backend.errors import SettingsError
from backend.settings import Settings, remember_keys_required


def test_environment_overrides_the_saved_file_and_flags_override_both(tmp_path):
    path = tmp_path / "settings.json"
    Settings(port=9000, max_queue=5).save(path, environ={})
    settings = Settings.load(path, environ={"GGUF_STUDIO_PORT": "9100"})
    assert (settings.port, settings.max_queue) == (9100, 5)
    assert settings.with_overrides({"port": 9200, "max_queue": None}).port == 9200


def test_values_from_the_environment_are_not_made_permanent_by_saving(tmp_path):
    path = tmp_path / "settings.json"
    Settings(api_key="gs-saved-key-0123456789").save(path, environ={})
    environ = {"GGUF_STUDIO_API_KEY": "gs-from-env-0123456789", "GGUF_STUDIO_LLAMA_SERVER": "/opt/llama-server"}
    settings = Settings.load(path, environ=environ)
    assert settings.api_key == "gs-from-env-0123456789"
    settings.replace(port=9999).save(path, environ=environ)
    written = json.loads(path.read_text())
    assert written["api_key"] == "gs-saved-key-0123456789"
    assert written["llama_server"] == ""
    assert written["port"] == 9999


def test_an_unusable_value_is_named(tmp_path):
    with pytest.raises(SettingsError, match="queue_timeout"):
        Settings.load(tmp_path / "none.json", environ={"GGUF_STUDIO_QUEUE_TIMEOUT": "soon"})
    with pytest.raises(SettingsError, match="must not be negative"):
        Settings().with_overrides({"max_queue": "-1"})
    bad = tmp_path / "settings.json"
    bad.write_text('{"port": "eighty"}')
    with pytest.raises(SettingsError, match="port"):
        Settings.load(bad, environ={})


def test_a_broken_settings_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "settings.json"
    bad.write_text("{not json")
    with pytest.raises(SettingsError, match="settings.json is not readable JSON"):
        Settings.load(bad, environ={})


def test_default_queue_is_sixteen_per_slot_and_at_least_64():
    assert Settings().effective_max_queue(1) == 64
    assert Settings().effective_max_queue(8) == 128
    assert Settings(max_queue=3).effective_max_queue(8) == 3


# --- the key file is private ------------------------------------------------------------


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_saved_settings_are_private_to_the_user(tmp_path, loose_umask):
    path = tmp_path / "config" / "gguf-studio" / "settings.json"
    Settings(api_key="gs-secret-0123456789").save(path, environ={})
    assert _mode(path) == 0o600
    assert _mode(path.parent) == 0o700
    Settings(api_key="gs-other-0123456789").save(path, environ={})  # rewriting keeps it private
    assert _mode(path) == 0o600
    assert json.loads(path.read_text())["api_key"] == "gs-other-0123456789"


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_a_world_readable_settings_file_is_made_private_on_load(tmp_path, loose_umask):
    config = tmp_path / "gguf-studio"
    config.mkdir(mode=0o755)
    path = config / "settings.json"
    path.write_text(json.dumps({"api_key": "gs-old-version-0123456789"}))
    os.chmod(path, 0o644)
    os.chmod(config, 0o755)
    assert Settings.load(path, environ={}).api_key == "gs-old-version-0123456789"
    assert _mode(path) == 0o600
    assert _mode(config) == 0o700


def test_the_key_can_come_from_a_file_named_in_the_environment(tmp_path):
    path = tmp_path / "settings.json"
    Settings(api_key="gs-saved-0123456789").save(path, environ={})
    key_file = tmp_path / "key"
    key_file.write_text("gs-from-file-0123456789\n")
    environ = {"GGUF_STUDIO_API_KEY_FILE": str(key_file)}
    settings = Settings.load(path, environ=environ)
    assert settings.api_key == "gs-from-file-0123456789"
    settings.replace(port=9001).save(path, environ=environ)
    assert json.loads(path.read_text())["api_key"] == "gs-saved-0123456789"  # the file's key stays in the file


@pytest.mark.parametrize("content,message", [(None, "cannot be read"), ("\n", "is empty"),
                                             ("gs-a gs-b\n", "must hold the key alone")])
def test_an_unusable_key_file_is_named(tmp_path, content, message):
    key_file = tmp_path / "my.key"
    if content is not None:
        key_file.write_text(content)
    with pytest.raises(SettingsError, match=f"my.key {message}"):
        Settings.load(tmp_path / "none.json", environ={"GGUF_STUDIO_API_KEY_FILE": str(key_file)})


def test_a_key_and_a_key_file_together_are_refused(tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text("gs-a")
    with pytest.raises(SettingsError, match="only one"):
        Settings.load(tmp_path / "none.json", environ={"GGUF_STUDIO_API_KEY_FILE": str(key_file),
                                                       "GGUF_STUDIO_API_KEY": "gs-b"})


@pytest.mark.skipif(os.name == "nt", reason="POSIX file modes")
def test_a_key_file_others_can_read_is_used_with_a_warning(tmp_path, caplog):
    key_file = tmp_path / "key"
    key_file.write_text("gs-shared-0123456789")
    os.chmod(key_file, 0o644)
    settings = Settings.load(tmp_path / "none.json", environ={"GGUF_STUDIO_API_KEY_FILE": str(key_file)})
    assert settings.api_key == "gs-shared-0123456789"
    assert "can be read by other users" in caplog.text and "gs-shared-0123456789" not in caplog.text


def test_the_client_stall_timeout_comes_from_the_environment_and_the_command_line(tmp_path):
    from backend.app.cli import _parser
    path = tmp_path / "settings.json"
    assert Settings.load(path, environ={}).client_stall_timeout == 120.0
    assert Settings.load(path, environ={"GGUF_STUDIO_CLIENT_STALL_TIMEOUT": "30"}
                         ).client_stall_timeout == 30.0
    args = _parser().parse_args(["serve", "--client-stall-timeout", "0"])
    assert args.client_stall_timeout == 0.0


def test_the_bounds_of_work_before_admission_come_from_file_environment_and_command_line(tmp_path):
    from backend.app.cli import _SERVE_SETTINGS, _parser
    path = tmp_path / "settings.json"
    defaults = Settings.load(path, environ={})
    assert defaults.max_incoming_body_bytes == 64 * 1024 * 1024
    assert defaults.effective_max_prompt_counts(4) == 8  # 0: twice the slots
    Settings(max_incoming_body_bytes=1000, max_prompt_counts=3).save(path, environ={})
    saved = Settings.load(path, environ={})
    assert (saved.max_incoming_body_bytes, saved.effective_max_prompt_counts(4)) == (1000, 3)
    env = Settings.load(path, environ={"GGUF_STUDIO_MAX_INCOMING_BODY_BYTES": "2000",
                                       "GGUF_STUDIO_MAX_PROMPT_COUNTS": "5"})
    assert (env.max_incoming_body_bytes, env.max_prompt_counts) == (2000, 5)
    args = _parser().parse_args(["serve", "--max-incoming-body-bytes", "0",
                                 "--max-prompt-counts", "7"])
    flags = env.with_overrides({name: getattr(args, name) for name in _SERVE_SETTINGS})
    assert (flags.max_incoming_body_bytes, flags.max_prompt_counts) == (0, 7)


# --- the key is long enough ---------------------------------------------------------------


@pytest.mark.parametrize("source", ["saved", "environment", "key file", "flag", "window"])
def test_a_key_shorter_than_16_characters_is_refused_wherever_it_comes_from(tmp_path, source):
    short = "gs-short-key"  # 12 characters
    path = tmp_path / "settings.json"
    key_file = tmp_path / "key"
    key_file.write_text(short + "\n")
    with pytest.raises(SettingsError, match="API key is too short \\(12 characters\\).*at least 16"):
        if source == "saved":
            path.write_text(json.dumps({"api_key": short}))
            Settings.load(path, environ={})
        elif source == "environment":
            Settings.load(path, environ={"GGUF_STUDIO_API_KEY": short})
        elif source == "key file":
            Settings.load(path, environ={"GGUF_STUDIO_API_KEY_FILE": str(key_file)})
        elif source == "flag":
            Settings().with_overrides({"api_key": short})
        else:  # the window changes settings with replace()
            Settings().replace(api_key=short)


def test_a_key_of_16_characters_and_no_key_at_all_are_accepted():
    assert Settings(api_key="x" * 16).api_key == "x" * 16
    assert Settings(api_key="").api_key == ""


def test_the_upstreams_kv_layout_comes_from_the_environment_and_the_command_line(tmp_path):
    from backend.app.cli import _parser
    path = tmp_path / "settings.json"
    assert Settings.load(path, environ={}).upstream_kv == ""
    assert Settings.load(path, environ={"GGUF_STUDIO_UPSTREAM_KV": "Split"}).upstream_kv == "split"
    with pytest.raises(SettingsError, match="upstream_kv has an unusable value 'shared'"):
        Settings.load(path, environ={"GGUF_STUDIO_UPSTREAM_KV": "shared"})
    args = _parser().parse_args(["serve", "--upstream", "http://gpu-box:8080", "--upstream-kv", "unified"])
    assert args.upstream_kv == ["unified"]


def test_rpc_workers_come_from_the_environment_comma_separated_and_bad_ones_are_named(tmp_path):
    environ = {"GGUF_STUDIO_RPC": "10.0.0.2:50052,10.0.0.3:6000"}
    settings = Settings.load(tmp_path / "none.json", environ=environ)
    assert settings.rpc == ["10.0.0.2:50052", "10.0.0.3:6000"]
    assert settings.with_overrides({"rpc": "10.0.0.4"}).rpc == ["10.0.0.4:50052"]
    with pytest.raises(SettingsError, match="RPC worker '10.0.0.2:x'"):
        Settings.load(tmp_path / "none.json", environ={"GGUF_STUDIO_RPC": "10.0.0.2:x"})


def test_keys_required_once_marked_survives_a_window_saving_its_older_settings(tmp_path):
    path = tmp_path / "settings.json"
    window = Settings(port=9000)  # loaded before named keys were made
    window.save(path, environ={})
    remember_keys_required(path)  # the port saw the first named key
    saved = json.loads(path.read_text())
    assert saved["keys_required"] is True and saved["port"] == 9000  # only the marker changed
    window.replace(queue_timeout=30.0).save(path, environ={})  # a limit changed in the window
    again = Settings.load(path, environ={})
    assert again.keys_required and again.queue_timeout == 30.0


def test_the_placement_comes_from_the_file_the_environment_and_serve_and_names_one_policy(tmp_path):
    from backend.app.cli import _parser, serve_settings
    path = tmp_path / "settings.json"
    assert Settings.load(path, environ={}).placement == "keep-prefixes"
    assert Settings.load(path, environ={"GGUF_STUDIO_PLACEMENT": "Hash-Ring"}).placement == "hash-ring"
    with pytest.raises(SettingsError, match="one of keep-prefixes, hash-ring, not 'round-robin'"):
        Settings.load(path, environ={"GGUF_STUDIO_PLACEMENT": "round-robin"})
    with pytest.raises(SettingsError, match="not 'random'"):
        Settings(placement="random")
    args = _parser().parse_args(["serve", "--upstream", "http://gpu-box:8080", "--placement", "hash-ring"])
    assert serve_settings(args).placement == "hash-ring"


def test_the_resend_grace_comes_from_the_file_the_environment_and_serve(tmp_path):
    from backend.app.cli import _parser, serve_settings
    path = tmp_path / "settings.json"
    assert Settings.load(path, environ={}).resend_grace == 30.0
    assert Settings.load(path, environ={"GGUF_STUDIO_RESEND_GRACE": "5"}).resend_grace == 5.0
    args = _parser().parse_args(["serve", "--upstream", "http://gpu-box:8080", "--resend-grace", "0"])
    assert serve_settings(args).resend_grace == 0.0
