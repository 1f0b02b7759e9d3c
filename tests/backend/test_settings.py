"""Settings: saved file < environment < command line, and what gets saved."""

from __future__ import annotations

import json

import pytest

from backend.errors import SettingsError
from backend.settings import Settings


def test_environment_overrides_the_saved_file_and_flags_override_both(tmp_path):
    path = tmp_path / "settings.json"
    Settings(port=9000, max_queue=5).save(path, environ={})
    settings = Settings.load(path, environ={"GGUF_STUDIO_PORT": "9100"})
    assert (settings.port, settings.max_queue) == (9100, 5)
    assert settings.with_overrides({"port": 9200, "max_queue": None}).port == 9200


def test_values_from_the_environment_are_not_made_permanent_by_saving(tmp_path):
    path = tmp_path / "settings.json"
    Settings(api_key="saved-key").save(path, environ={})
    environ = {"GGUF_STUDIO_API_KEY": "from-env", "GGUF_STUDIO_LLAMA_SERVER": "/opt/llama-server"}
    settings = Settings.load(path, environ=environ)
    assert settings.api_key == "from-env"
    settings.replace(port=9999).save(path, environ=environ)
    written = json.loads(path.read_text())
    assert written["api_key"] == "saved-key"
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
