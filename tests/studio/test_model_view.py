"""The Model tab's chat template: a model without one (the real Gemma 3 270M) is said to
take no chats and why; a built-in template or a Jinja file picked there is the load's
setting, kept with the model's settings, and the warning goes."""

from __future__ import annotations

from pathlib import Path

import pytest
from PySide6.QtWidgets import QFileDialog

from backend.errors import SettingsError
from backend.llama.load import LoadSettings
from backend.models.gguf_info import read_model_info
from studio.model_view import ModelView
from studio.window import MainWindow
from tests.studio.test_pool_view import WAIT, select


@pytest.fixture
def view(qtbot) -> ModelView:
    shown = ModelView()
    qtbot.addWidget(shown)
    shown.show()
    return shown


def test_a_model_without_a_chat_template_is_said_to_take_no_chats_until_one_is_picked(
        qtbot, view: ModelView, gemma3_model: Path, tmp_path: Path, monkeypatch) -> None:
    view.show_info(str(gemma3_model), read_model_info(gemma3_model))
    assert view.facts["template"].text() == "none (the model has no chat template)"
    assert view.template_warning.isVisible()
    warning = view.template_warning.text()
    assert warning.startswith("This model has no chat template: chat requests")
    assert "400 model_has_no_chat_template" in warning and "/v1/completions" in warning

    # A built-in template, picked from the list.
    with qtbot.waitSignal(view.settings_edited, timeout=WAIT):
        view.chat_template.setCurrentIndex(view.chat_template.findText("gemma"))
    assert view.load_settings().chat_template == "gemma"
    assert view.facts["template"].text() == "gemma (llama.cpp's built-in, picked by the owner)"
    assert not view.template_warning.isVisible()

    # A Jinja file, picked with the file button.
    jinja = tmp_path / "turns.jinja"
    jinja.write_text("{{ messages[0]['content'] }}")
    monkeypatch.setattr(QFileDialog, "getOpenFileName", lambda *args, **kwargs: (str(jinja), ""))
    with qtbot.waitSignal(view.settings_edited, timeout=WAIT):
        view.template_file_button.click()
    assert view.load_settings().chat_template == str(jinja)
    assert view.facts["template"].text() == "turns.jinja (a template file the owner picked)"
    view.load_settings().validate()

    # A name llama.cpp does not know is refused when the load is made.
    view.chat_template.setCurrentText("gemma-3")
    with pytest.raises(SettingsError, match="'gemma-3' is neither"):
        view.load_settings().validate()


def test_a_template_turned_off_shows_as_none_and_the_models_own_as_its_own(
        view: ModelView, smollm2_model: Path) -> None:
    view.show_info(str(smollm2_model), read_model_info(smollm2_model))
    assert view.facts["template"].text() == "the model's own"
    assert not view.template_warning.isVisible()
    view.set_load_settings(LoadSettings(chat_template="none"))
    assert view.chat_template.currentText() == "None (plain completion only)"
    assert view.facts["template"].text() == "none (turned off by the owner)"
    assert view.template_warning.text().startswith("Its chat template is turned off")
    view.set_load_settings(LoadSettings())
    assert view.chat_template.currentText() == "Model's own"
    assert view.load_settings().chat_template == ""


def test_the_template_picked_for_a_model_is_kept_with_its_settings(
        open_window, qtbot, gemma3_model: Path) -> None:
    window: MainWindow = open_window()
    window.open_files([str(gemma3_model)])
    select(qtbot, window, gemma3_model)
    view = window.model_view
    assert view.template_warning.isVisible()
    view.chat_template.setCurrentIndex(view.chat_template.findText("gemma"))
    qtbot.waitUntil(lambda: window.library.settings_for(str(gemma3_model)).chat_template == "gemma",
                    timeout=WAIT)
