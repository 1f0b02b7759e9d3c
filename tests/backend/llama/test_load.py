"""Load settings: the one shape they are kept in, and the spec built from them."""

from __future__ import annotations

import re

import pytest

from backend.errors import SettingsError
from backend.llama.load import OWNED_FLAGS, LoadSettings
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
    wanted = LoadSettings(ctx_size=4096, parallel="3", n_gpu_layers="7", threads=2,
                          extra_args=("--temp", "0.1"))
    wanted.remembered_in(Settings()).save(tmp_path / "s.json", environ={})
    assert LoadSettings.last_load(Settings.load(tmp_path / "s.json", environ={})) == wanted


OWNED_SPELLINGS = ["--port", "--port=80", "--api_key", "--api-key=x", "--api_key_file", "-m",
                   "-m=x.gguf", "-np", "-a", "--alias=x", "--hf_repo", "-hfr",
                   "--model_url", "--host=0.0.0.0"]


@pytest.mark.parametrize("flag", OWNED_SPELLINGS)
def test_owned_flags_are_refused_in_every_spelling_llama_cpp_accepts(flag):
    with pytest.raises(SettingsError, match="cannot be given as extra arguments"):
        LoadSettings(extra_args=(flag, "1")).validate()


def test_flags_that_are_not_owned_are_passed_through():
    LoadSettings(extra_args=("--temp", "0.5", "-v", "--api-keys-are-not-a-flag", "-mg", "0")).validate()


def test_owned_flags_list_every_alias_of_the_pinned_llama_cpp(source_tree):
    """Each option we own, in each spelling arg.cpp of the pinned llama.cpp declares."""
    arg_cpp = (source_tree / "common" / "arg.cpp").read_text()
    declared = [re.findall(r'"(-[^"]+)"', group)
                for group in re.findall(r"common_arg\(\s*\{([^}]*)\}", arg_cpp)]
    owned_options = [spellings for spellings in declared if set(spellings) & OWNED_FLAGS]
    assert len(owned_options) >= 9
    for spellings in owned_options:
        assert set(spellings) <= OWNED_FLAGS, spellings
