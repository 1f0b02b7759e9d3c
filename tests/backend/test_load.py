"""Load settings: the one shape they are kept in, and the spec built from them."""

from __future__ import annotations

import pytest

from backend.errors import SettingsError
from backend.load import LoadSettings
from backend.settings import Settings


def test_load_settings_become_a_load_spec() -> None:
    spec = LoadSettings(ctx_size=2048, parallel="2", extra_args=("--temp", "0.1")).to_spec(
        "/m.gguf", chat_template=False)
    assert (spec.model_path, spec.settings.parallel, spec.settings.ctx_size,
            spec.settings.extra_args, spec.chat_template) == ("/m.gguf", "2", 2048, ("--temp", "0.1"), False)


@pytest.mark.parametrize("extra", [("--port", "9"), ("-m", "x.gguf"), ("--host", "0.0.0.0"),
                                   ("--api-key", "k"), ("-np", "4")])
def test_owned_flags_are_refused(extra: tuple[str, ...]) -> None:
    with pytest.raises(SettingsError, match="GGUF Studio sets"):
        LoadSettings(extra_args=extra).to_spec("/m.gguf")


def test_bad_parallel_is_refused() -> None:
    with pytest.raises(SettingsError, match="Parallel"):
        LoadSettings(parallel="many").to_spec("/m.gguf")


def test_extra_args_are_split_like_a_shell() -> None:
    assert LoadSettings.parse_extra_args("--temp 0.2 --system-prompt 'be brief'") == (
        "--temp", "0.2", "--system-prompt", "be brief")
    with pytest.raises(SettingsError, match="cannot be read"):
        LoadSettings.parse_extra_args("--x 'unclosed")


def test_the_last_load_survives_the_settings_file_in_the_same_shape(tmp_path) -> None:
    wanted = LoadSettings(ctx_size=4096, parallel="3", n_gpu_layers=7, threads=2,
                          extra_args=("--temp", "0.1"))
    Settings().with_load_settings(wanted).save(tmp_path / "s.json", environ={})
    assert Settings.load(tmp_path / "s.json", environ={}).load_settings() == wanted
