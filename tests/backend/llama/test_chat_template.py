"""The chat template a model's chats are rendered with: the built-in names are the pinned
llama.cpp's, each pick starts the engine with the flags that make it render with it, and
what a model takes is said without paths."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from backend.errors import SettingsError
from backend.llama.chat_template import (BUILT_IN_TEMPLATES, ChatTemplate, TemplateSource,
                                         chat_template_args, check_chat_template,
                                         resolved_chat_template)
from backend.llama.load import LoadSettings
from backend.llama.supervisor import build_command


def test_the_built_in_names_are_those_of_the_pinned_llama_cpp(source_tree: Path) -> None:
    source = (source_tree / "src" / "llama-chat.cpp").read_text()
    table = source.split("LLM_CHAT_TEMPLATES = {", 1)[1].split("};", 1)[0]
    assert BUILT_IN_TEMPLATES == tuple(re.findall(r'\{\s*"([^"]+)"', table))


def test_each_pick_starts_the_engine_with_the_flags_that_render_with_it(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[0]['content'] }}")
    assert chat_template_args("", model_has_one=True) == ["--jinja"]
    assert chat_template_args("", model_has_one=False) == []
    # ChatML is also Jinja in llama.cpp (so tools work); the other names only legacy.
    assert chat_template_args("chatml", model_has_one=False) == ["--jinja", "--chat-template", "chatml"]
    assert chat_template_args("gemma", model_has_one=False) == ["--no-jinja", "--chat-template", "gemma"]
    assert chat_template_args(str(template), model_has_one=True) == [
        "--jinja", "--chat-template-file", str(template)]
    # Turned off: the engine keeps its own (the port refuses the chats).
    assert chat_template_args("none", model_has_one=True) == ["--jinja"]


def test_the_engine_command_carries_the_pick_and_the_owners_extra_arguments_come_after() -> None:
    spec = LoadSettings(chat_template="llama3", extra_args=("--temp", "0.1")).to_spec(
        "/m.gguf", own_template=False)
    command = build_command(Path("llama-server"), spec, 1234, amx=False)
    at = command.index("--chat-template")
    assert command[at - 1:at + 2] == ["--no-jinja", "--chat-template", "llama3"]
    assert command[-2:] == ["--temp", "0.1"]


@pytest.mark.parametrize("pick, has_one, source, chats", [
    ("", True, TemplateSource.OWN, True),
    ("", False, TemplateSource.NONE, False),
    ("none", True, TemplateSource.NONE, False),
    ("gemma", False, TemplateSource.BUILT_IN, True),
    ("/templates/mine.jinja", False, TemplateSource.FILE, True),
])
def test_what_a_model_takes_follows_its_file_and_its_owners_pick(pick, has_one, source, chats) -> None:
    template = ChatTemplate.of(pick, model_has_one=has_one)
    assert (template.source, template.takes_chats) == (source, chats)
    assert bool(template.warning()) is not chats
    assert "/templates" not in str(template.to_dict()) + template.describe()


def test_a_model_without_one_says_what_its_clients_get_and_how_to_pick_one() -> None:
    template = ChatTemplate.of("", model_has_one=False)
    assert template.describe() == "none (the model has no chat template)"
    assert "400 model_has_no_chat_template" in template.warning()
    assert "/v1/completions" in template.warning() and "--chat-template" in template.warning()
    assert template.to_dict() == {"source": "none", "name": None, "model_has_one": False,
                                  "takes_chats": False}
    assert ChatTemplate.of("none", model_has_one=True).describe() == "none (turned off by the owner)"


def test_a_file_is_found_from_the_folder_it_was_given_in_and_a_wrong_pick_is_refused(
        tmp_path: Path) -> None:
    (tmp_path / "chat.jinja").write_text("x")
    assert resolved_chat_template("chat.jinja", tmp_path) == str(tmp_path / "chat.jinja")
    assert resolved_chat_template("ChatML", tmp_path) == "chatml"
    assert resolved_chat_template("", tmp_path) == ""
    check_chat_template(str(tmp_path / "chat.jinja"))
    with pytest.raises(SettingsError, match="'chat-ml' is neither"):
        check_chat_template("chat-ml")


def test_what_another_port_says_of_a_template_reads_back_and_nonsense_reads_as_unknown() -> None:
    for template in (ChatTemplate.of("", model_has_one=False), ChatTemplate.of("gemma", model_has_one=False),
                     ChatTemplate.of("/t/mine.jinja", model_has_one=True)):
        assert ChatTemplate.from_dict(template.to_dict()) == template
    assert ChatTemplate.from_dict(None) is None
    assert ChatTemplate.from_dict({"source": "jinja2"}) is None
    odd = ChatTemplate.from_dict({"source": "file", "name": "\x1b[2J" + "x" * 500})
    assert odd is not None and odd.name == ""
