"""Load settings: the one shape they are kept in, and the spec built from them."""

from __future__ import annotations

import re

import pytest

from backend.errors import SettingsError
from backend.llama.chat_template import ChatTemplate, TemplateSource
from backend.llama.load import OWNED_FLAGS, LoadSettings
from backend.settings import Settings


def test_load_settings_become_a_load_spec() -> None:
    spec = LoadSettings(ctx_size=2048, parallel="2", extra_args=("--temp", "0.1")).to_spec(
        "/m.gguf", own_template=False)
    assert (spec.model_path, spec.settings.parallel, spec.settings.ctx_size,
            spec.settings.extra_args, spec.own_template) == ("/m.gguf", "2", 2048, ("--temp", "0.1"), False)
    # A file without a template of its own, and none picked: no chats.
    assert spec.chat_template == ChatTemplate(TemplateSource.NONE, model_has_one=False)


def test_the_chat_template_picked_is_kept_with_the_models_settings_and_a_wrong_one_is_refused(tmp_path) -> None:
    wanted = LoadSettings(ctx_size=2048, chat_template=" Gemma ")
    assert wanted.chat_template == "gemma"  # a built-in's name, as llama.cpp spells it
    assert LoadSettings.from_dict(wanted.to_dict()) == wanted  # the library's, per model
    # Not as the last load: a `serve --model` of another model would take it for its own.
    wanted.remembered_in(Settings()).save(tmp_path / "s.json", environ={})
    assert LoadSettings.last_load(Settings.load(tmp_path / "s.json", environ={})) == LoadSettings(
        ctx_size=2048)
    assert LoadSettings.last_load(Settings(chat_template="chatml")).chat_template == "chatml"
    assert wanted.to_spec("/m.gguf", own_template=False).chat_template.describe() == (
        "gemma (llama.cpp's built-in, picked by the owner)")
    with pytest.raises(SettingsError, match="neither one of llama.cpp's built-in templates"):
        LoadSettings(chat_template="gemma-7").to_spec("/m.gguf")
    with pytest.raises(SettingsError, match="neither one of llama.cpp's built-in templates"):
        LoadSettings(chat_template=str(tmp_path / "missing.jinja")).validate()


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
                   "--model_url", "--host=0.0.0.0", "-n", "--predict", "--n-predict=5",
                   "--n_predict", "--chat-template", "--chat_template_file=t.jinja"]


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


def test_rpc_workers_are_kept_with_the_load_and_reach_the_spec_normalised(tmp_path) -> None:
    wanted = LoadSettings(ctx_size=2048, rpc=("10.0.0.2:50052", "Gpu-Box"))
    assert wanted.rpc == ("10.0.0.2:50052", "gpu-box:50052")
    assert LoadSettings.from_dict(wanted.to_dict()) == wanted
    assert wanted.to_spec("/m.gguf").settings.rpc == ("10.0.0.2:50052", "gpu-box:50052")
    wanted.remembered_in(Settings()).save(tmp_path / "s.json", environ={})
    assert LoadSettings.last_load(Settings.load(tmp_path / "s.json", environ={})) == wanted
    # A models file may give them as one line, as typed on the command line.
    assert LoadSettings.from_dict({"rpc": "10.0.0.2:50052, 10.0.0.3:50052"}).rpc == (
        "10.0.0.2:50052", "10.0.0.3:50052")


def test_unusable_rpc_workers_are_refused_at_load_not_dropped() -> None:
    saved = LoadSettings.from_dict({"rpc": ["10.0.0.2:99999"]})
    assert saved.rpc == ("10.0.0.2:99999",)  # kept as saved, so the load says what is wrong
    with pytest.raises(SettingsError, match="RPC worker '10.0.0.2:99999'.*port"):
        saved.to_spec("/m.gguf")


def test_rpc_workers_with_gpu_layers_none_are_refused_because_no_layer_would_reach_them():
    with pytest.raises(SettingsError, match="GPU layers \"none\" keeps every layer"):
        LoadSettings(n_gpu_layers="none", rpc=("10.0.0.2:50052",)).validate()
    LoadSettings(n_gpu_layers="all", rpc=("10.0.0.2:50052",)).validate()


def test_rpc_workers_cannot_be_passed_around_the_setting() -> None:
    with pytest.raises(SettingsError, match="--rpc cannot be given as extra arguments"):
        LoadSettings(extra_args=("--rpc", "10.0.0.2:50052")).validate()
    with pytest.raises(SettingsError, match="--rpc cannot be given"):
        LoadSettings(extra_args=("--rpc=10.0.0.2:50052",)).validate()
