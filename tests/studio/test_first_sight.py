"""The window as a newcomer first meets it: a model found is chosen, the Chat tab comes
first and says how to get a model, the menu's keys work, the list keeps its order and
names the model the way the heading does, the file dialogs open at home, and tooltips
read as text."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from PySide6.QtCore import QPoint, Qt
from PySide6.QtGui import QAction, QShortcut, QTextDocument
from PySide6.QtWidgets import QApplication, QFileDialog, QLabel, QToolTip

from backend.app.pool.pool_state import PoolState
from backend.app.pool.pool_status import ModelStatus, Residency
from studio.widgets import plain_tooltip
from studio.window import CHAT_TAB, SHARING_TAB

WAIT = 10_000


def lm_studio_model(home: Path, model: Path, name: str) -> Path:
    """`model` where LM Studio keeps its downloads, under `name`."""
    folder = home / "home" / ".lmstudio" / "models" / "someone" / f"{name}-GGUF"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(model, folder / f"{name}.gguf")
    return folder / f"{name}.gguf"


def ready_model(name: str, residency: Residency = Residency.READY) -> ModelStatus:
    return ModelStatus(name, (), True, residency, False, 0.0, False, True, 8192, "", None, ())


def test_a_model_found_is_selected_and_the_chat_tab_comes_first(
        open_window, qtbot, studio_home: Path, tiny_model: Path) -> None:
    found = lm_studio_model(studio_home, tiny_model, "found-model")
    window = open_window()
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    assert window.library_view.current_entry().path == str(found)
    assert window.model_view.load_button.isEnabled()
    assert window.tabs.currentIndex() == CHAT_TAB == 0
    assert window.tabs.tabText(CHAT_TAB) == "C&hat" and window.tabs.tabText(SHARING_TAB) == "&Sharing"
    # The Chat tab names the model chosen and the button to press, not "pick one".
    assert window.chat.status.text() == ("No model is loaded yet: press Load above to chat "
                                         "with found-model, or pick another in the list on "
                                         "the left.")


def test_the_chat_tab_says_where_to_load_and_never_that_nothing_is_served_when_one_is(
        open_window) -> None:
    window = open_window()
    chat = window.chat
    assert "pick one in the list on the left and press Load" in chat.status.text()
    assert "Pool" not in chat.status.text()
    window.bridge.pool_changed.emit(PoolState((ready_model("smol"),)))
    assert chat.model.currentText() == "smol"
    assert "No model" not in chat.status.text() and "not loaded" not in chat.status.text()
    window.bridge.pool_changed.emit(PoolState((ready_model("smol", Residency.EVICTED),)))
    assert chat.status.text() == "smol is not loaded right now: a message waits while it loads."


def test_ctrl_o_opens_the_file_dialog_and_f5_rescans(open_window, qtbot, monkeypatch,
                                                     studio_home: Path, tiny_model: Path) -> None:
    asked: list[str] = []

    def open_names(_parent, _title, folder, _filter):
        asked.append(folder)
        return [], ""
    monkeypatch.setattr(QFileDialog, "getOpenFileNames", open_names)
    window = open_window()
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=WAIT)  # window shortcuts need it
    qtbot.keyClick(window, Qt.Key.Key_O, Qt.KeyboardModifier.ControlModifier)
    assert asked == [str(studio_home / "home")]  # at home, not the working dir
    assert asked[0] != os.getcwd()

    lm_studio_model(studio_home, tiny_model, "arrived-later")
    qtbot.keyClick(window, Qt.Key.Key_F5)
    qtbot.waitUntil(lambda: [e.name for e in window.library_view.entries()] == ["arrived-later"],
                    timeout=WAIT)


def test_the_heading_names_the_model_as_the_list_does_and_a_load_does_not_reorder_the_list(
        open_window, qtbot, studio_home: Path, tiny_model: Path) -> None:
    for name in ("alpha", "beta", "gamma"):
        lm_studio_model(studio_home, tiny_model, name)
    window = open_window()
    view = window.library_view
    qtbot.waitUntil(lambda: len(view.entries()) == 3, timeout=WAIT)
    order = [e.name for e in view.entries()]
    view.select_path(view.entries()[2].path)
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    assert window.model_view.title.text() == order[2]  # the file's name, as listed
    assert "tiny-test-llama" in window.model_view.title.toolTip()  # general.name, on hover
    # A load marks the model used now; the list the person looks at keeps its order.
    window.library.mark_used(view.entries()[2].path)
    window.refresh_library()
    qtbot.waitUntil(lambda: view.entries()[2].last_used is not None, timeout=WAIT)
    assert [e.name for e in view.entries()] == order
    assert view.current_entry().name == order[2]


def test_a_tooltip_made_plain_reads_as_its_text_not_as_markup(open_window, qtbot) -> None:
    window = open_window()
    QToolTip.showText(window.mapToGlobal(QPoint(20, 20)), plain_tooltip("a <b>bold</b> claim"),
                      window)
    tip = next(w for w in QApplication.topLevelWidgets()
               if isinstance(w, QLabel) and w.windowType() == Qt.WindowType.ToolTip)
    qtbot.waitUntil(tip.isVisible, timeout=WAIT)
    # Read as Qt renders it: the characters given, tags and all, and no markup of ours.
    assert tip.textFormat() == Qt.TextFormat.AutoText
    rendered = QTextDocument()
    rendered.setHtml(tip.text())
    assert rendered.toPlainText() == "a <b>bold</b> claim"
    QToolTip.hideText()


def test_every_window_key_is_bound_once_and_none_is_ambiguous(open_window, qtbot, qtlog,
                                                              monkeypatch) -> None:
    window = open_window()
    bound: dict[str, int] = {}
    for action in window.findChildren(QAction):
        for sequence in action.shortcuts():
            bound[sequence.toString()] = bound.get(sequence.toString(), 0) + 1
    for shortcut in window.findChildren(QShortcut):
        if shortcut.context() in (Qt.ShortcutContext.WindowShortcut,
                                  Qt.ShortcutContext.ApplicationShortcut):
            text = shortcut.key().toString()
            bound[text] = bound.get(text, 0) + 1
    assert bound["Ctrl+O"] == 1 and bound["F5"] == 1
    assert {key: n for key, n in bound.items() if n > 1} == {}
    # Pressed, each runs its action, and Qt never calls one ambiguous.
    monkeypatch.setattr(QFileDialog, "getOpenFileNames", lambda *_args: ([], ""))
    window.activateWindow()
    qtbot.waitUntil(window.isActiveWindow, timeout=WAIT)
    for key, modifier in ((Qt.Key.Key_O, Qt.KeyboardModifier.ControlModifier),
                          (Qt.Key.Key_F5, Qt.KeyboardModifier.NoModifier),
                          (Qt.Key.Key_L, Qt.KeyboardModifier.ControlModifier)):
        qtbot.keyClick(window, key, modifier)
    assert not [m for m in qtlog.records if "Ambiguous" in m.message]
