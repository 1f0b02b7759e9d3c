"""No silent swaps: a Load while another model serves asks (add beside, or replace) and
says what teammates see; `default` moves only when the owner says so, also on Unload.
With the real window, service and engines (two tiny models)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel

from backend.app.model_swap import LoadChoice, LoadQuestion, UnloadQuestion
from backend.llama.load import State
from studio.swap_dialog import LoadDialog, UnloadDialog
from studio.window import CHAT_TAB, MainWindow
from tests.model_factory import write_tiny_model
from tests.studio.test_pool_view import LOAD_WAIT, WAIT, select

QUESTION = LoadQuestion("gemma", "smol", "Load gemma while smol serves?", "smol is the default.",
                        "Replace: smol goes; agents set up with `default` get gemma.",
                        "Add beside: smol keeps serving and stays `default`.",
                        "…and make gemma the default: agents set up with `default` get gemma.")


@pytest.fixture(scope="module")
def other_model(tmp_path_factory: pytest.TempPathFactory, vocab_path: Path) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("other") / "other.gguf", vocab_path, seed=7)


def test_the_load_question_starts_at_add_beside_and_says_what_each_answer_does(qtbot) -> None:
    dialog = LoadDialog(QUESTION)
    qtbot.addWidget(dialog)
    assert dialog.beside.isChecked() and dialog.choice() is LoadChoice.BESIDE
    dialog.make_default.setChecked(True)
    assert dialog.choice() is LoadChoice.BESIDE_AS_DEFAULT
    assert dialog.make_default.text() == "Make gemma the default"
    dialog.replace.setChecked(True)
    assert dialog.choice() is LoadChoice.REPLACE and not dialog.make_default.isEnabled()
    words = " ".join(label.text() for label in dialog.findChildren(QLabel))
    assert "smol goes; agents set up with `default` get gemma." in words
    assert "smol keeps serving and stays `default`." in words


def test_the_unload_question_names_the_next_default_or_none(qtbot) -> None:
    dialog = UnloadDialog(UnloadQuestion("smol", ("coder", "gemma"), "Unload smol?", "…"))
    qtbot.addWidget(dialog)
    assert dialog.new_default() == "coder"
    dialog.next_default.setCurrentIndex(dialog.next_default.count() - 1)
    assert dialog.new_default() is None


def default_answer(window: MainWindow) -> httpx.Response:
    port = window.bridge.gateway_port
    return httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=60,
                      json={"model": "default", "max_tokens": 2,
                            "messages": [{"role": "user", "content": "Hi"}]})


def test_a_second_load_asks_and_adding_beside_leaves_default_where_it_was(
        open_window, qtbot, with_engine: Path, tiny_model: Path, other_model: Path) -> None:
    window = open_window()
    asked: list[LoadQuestion] = []
    answers = [LoadChoice.BESIDE]

    def ask_load(question: LoadQuestion) -> LoadChoice:
        asked.append(question)
        return answers.pop(0)
    window.ask_load = ask_load
    window.open_files([str(tiny_model), str(other_model)])
    select(qtbot, window, tiny_model)
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    window.tabs.setCurrentIndex(CHAT_TAB + 1)
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    # Nothing served before: no question; the load leads to the Chat tab, model chosen.
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    qtbot.waitUntil(lambda: window.tabs.currentIndex() == CHAT_TAB, timeout=WAIT)
    qtbot.waitUntil(lambda: window.chat.model.currentText() == "tiny", timeout=WAIT)
    assert window.focusWidget() is window.chat.input  # ready to type the first message
    assert asked == []

    select(qtbot, window, other_model)
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    window.tabs.setCurrentIndex(CHAT_TAB + 1)
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: bool(asked), timeout=WAIT)
    assert asked[0].current == "tiny" and asked[0].new == "other"
    assert "agents set up with `default`" in asked[0].replace
    # Added beside: both served, `default` still the first; the chat turns to the new one.
    qtbot.waitUntil(lambda: [(m.name, m.default, m.residency.value)
                             for m in window.bridge.pool_state.models] ==
                    [("tiny", True, "ready"), ("other", False, "ready")], timeout=LOAD_WAIT)
    qtbot.waitUntil(lambda: window.chat.model.currentText() == "other", timeout=WAIT)
    assert window.tabs.currentIndex() == CHAT_TAB
    assert default_answer(window).json()["model"] == "tiny"
    # Each heading tells its own model's engine.
    qtbot.waitUntil(lambda: window.model_view.state.text().startswith("Ready — "), timeout=WAIT)
    select(qtbot, window, tiny_model)
    qtbot.waitUntil(lambda: window.model_view.state.text().startswith(
        "Ready (the default model) — "), timeout=WAIT)

    # Unload the default: asked which model `default` names; none chosen: refused.
    unload_asked: list[UnloadQuestion] = []

    def ask_unload(question: UnloadQuestion) -> tuple[str | None]:
        unload_asked.append(question)
        return (None,)
    window.ask_unload = ask_unload
    qtbot.mouseClick(window.model_view.unload_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: [m.name for m in window.bridge.pool_state.models] == ["other"],
                    timeout=WAIT)
    assert unload_asked and unload_asked[0].others == ("other",)
    refused = default_answer(window)
    assert refused.status_code == 503 and "default model (tiny)" in refused.text
