"""The Sharing tab's named keys with the real window, service and port (and the real
engine with the tiny model where a request must be answered): a key made in the window
works at once and its secret is shown only there; edits show; a revoked key gets 401;
usage shows after a request."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import httpx
from PySide6.QtCore import Qt
from PySide6.QtGui import QGuiApplication
from PySide6.QtWidgets import QApplication, QLabel, QLineEdit, QPlainTextEdit

from backend.app.sharing.key_table import COLUMNS
from backend.app.sharing.snippets import KEY_ENV_VAR, PROVIDER_ID
from backend.keys.key_store import KeyRecord
from backend.llama.load import State
from studio.keys_view import KeysView
from studio.window import CHAT_TAB, MainWindow

LOAD_WAIT = 60_000
WAIT = 15_000


def load_tiny(window: MainWindow, qtbot, tiny_model: Path) -> None:
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    # A load leads to the Chat tab unless the person went elsewhere meanwhile: from the
    # Chat tab, to the Sharing tab once the model is ready.
    window.tabs.setCurrentIndex(CHAT_TAB)
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    window.show_sharing(keys=True)


def chat(window: MainWindow, key: str) -> httpx.Response:
    """One short chat completion with `key` (from the test's thread; the port and the
    engine run on the backend's)."""
    return httpx.post(f"http://127.0.0.1:{window.bridge.gateway_port}/v1/chat/completions",
                      headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=60,
                      json={"model": "tiny", "max_tokens": 4,
                            "messages": [{"role": "user", "content": "Hello there"}]})


def row_of(keys: KeysView, name: str) -> dict[str, str]:
    for row in keys.rows():
        if row[0] == name:
            return dict(zip(COLUMNS, row))
    return {}


def make_key(window: MainWindow, qtbot, name: str, **limits: Any) -> str:
    """A key made through the bridge, as the dialog makes it; its secret."""
    made: list[tuple[KeyRecord, str]] = []
    errors: list[str] = []
    window.bridge.add_key(name, limits, on_done=made.append, on_error=errors.append)
    qtbot.waitUntil(lambda: bool(made or errors), timeout=WAIT)
    assert errors == []
    qtbot.waitUntil(lambda: bool(row_of(window.sharing.keys, name)), timeout=WAIT)
    return made[0][1]


def every_text_on_screen() -> str:
    texts = []
    for widget in QApplication.allWidgets():
        if isinstance(widget, (QLineEdit, QLabel)):
            texts.append(widget.text())
        elif isinstance(widget, QPlainTextEdit):
            texts.append(widget.toPlainText())
    return "\n".join(texts)


def test_a_key_made_in_the_window_is_shown_once_with_its_set_up_and_works_at_once(
        open_window, qtbot, with_engine: Path, tiny_model: Path, studio_home: Path) -> None:
    window = open_window()
    window.show_sharing(keys=True)
    load_tiny(window, qtbot, tiny_model)
    keys = window.sharing.keys
    qtbot.waitUntil(lambda: keys.table_shown is not None, timeout=WAIT)
    assert keys.rows() == []  # no owner key on this computer only, no named keys

    qtbot.mouseClick(keys.create_button, Qt.MouseButton.LeftButton)
    dialog = keys.dialog
    assert dialog is not None and dialog.isVisible()
    assert "get 401" in dialog.warning.text()  # the first key changes what clients need
    qtbot.keyClicks(dialog.name, "alice")
    dialog.models.setText("tiny")
    dialog.tokens_per_minute.setValue(100_000)
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: keys.secret_dialog is not None, timeout=WAIT)
    assert keys.dialog is None or not keys.dialog.isVisible()

    shown = keys.secret_dialog
    assert shown is not None
    secret = shown.secret.text()
    assert secret.startswith("gs-") and len(secret) > 40
    qtbot.mouseClick(shown.copy_secret, Qt.MouseButton.LeftButton)
    assert QGuiApplication.clipboard().text() == secret
    codex, opencode, claude = shown.snippets()
    base_url = window.sharing.urls[0]
    assert codex.shell == f"export {KEY_ENV_VAR}={secret}" == opencode.shell == claude.shell
    config = tomllib.loads(codex.text)
    assert config["model"] == "tiny" and secret not in codex.text
    assert config["model_providers"][PROVIDER_ID]["base_url"] == base_url
    assert json.loads(opencode.text)["provider"][PROVIDER_ID]["options"]["baseURL"] == base_url
    settings = json.loads(claude.text)
    assert settings["env"]["ANTHROPIC_BASE_URL"] + "/v1" == base_url and secret not in claude.text
    assert [shown.snippet_tabs.tabText(i) for i in range(shown.snippet_tabs.count())] == \
        ["Codex CLI", "OpenCode", "Claude Code"]
    assert shown.shells[0].text() == codex.shell

    # The port takes the key at once, and now asks every client for one.
    answer = chat(window, secret)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["role"] == "assistant"
    assert chat(window, "").status_code == 401
    qtbot.waitUntil(lambda: row_of(keys, "alice").get("Tokens/min") == "100,000", timeout=WAIT)
    assert row_of(keys, "alice")["Models"] == "tiny"
    assert "a named key" in window.sharing.key_hint.text()

    # Closed, the dialog leaves the secret nowhere: not on screen, not in any file.
    shown.close()
    qtbot.waitUntil(lambda: keys.secret_dialog is None, timeout=WAIT)
    assert secret not in every_text_on_screen()
    window.bridge.service.usage.save()  # the ledger's file too (it names keys by name)
    for path in studio_home.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
            assert secret[3:].encode() not in path.read_bytes(), path


def test_a_refused_key_is_said_in_the_dialog_which_stays_open(open_window, qtbot) -> None:
    window = open_window()
    window.show_sharing(keys=True)
    keys = window.sharing.keys
    make_key(window, qtbot, "alice")
    qtbot.mouseClick(keys.create_button, Qt.MouseButton.LeftButton)
    dialog = keys.dialog
    assert dialog is not None
    assert not dialog.warning.isVisible()  # keys exist already: nothing new for clients
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)  # no name
    assert "Give the key a name" in dialog.error.text() and dialog.isVisible()
    qtbot.keyClicks(dialog.name, "Alice")
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "already exists" in dialog.error.text(), timeout=WAIT)
    assert dialog.isVisible() and keys.secret_dialog is None
    dialog.name.setText("carol")
    dialog.expires.setText("yesterday")
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    assert "is not a date" in dialog.error.text()
    dialog.expires.setText("2w")
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: keys.secret_dialog is not None, timeout=WAIT)
    qtbot.waitUntil(lambda: row_of(keys, "carol").get("State") == "active", timeout=WAIT)


def test_an_edit_changes_the_limits_shown_and_those_the_port_applies(open_window, qtbot) -> None:
    window = open_window()
    window.show_sharing(keys=True)
    keys = window.sharing.keys
    make_key(window, qtbot, "bob", tokens_per_minute=1000, max_concurrent=2)
    assert row_of(keys, "bob")["Tokens/min"] == "1,000"
    assert not keys.edit_button.isEnabled()
    assert keys.select("bob") and keys.edit_button.isEnabled()

    qtbot.mouseClick(keys.edit_button, Qt.MouseButton.LeftButton)
    dialog = keys.dialog
    assert dialog is not None and dialog.name.isReadOnly() and dialog.name.text() == "bob"
    assert dialog.tokens_per_minute.value() == 1000 and dialog.max_concurrent.value() == 2
    dialog.tokens_per_minute.setValue(5000)
    dialog.max_concurrent.setValue(0)  # no limit
    dialog.priority.setCurrentIndex(dialog.priority.findData("batch"))
    qtbot.mouseClick(dialog.ok_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: row_of(keys, "bob").get("Tokens/min") == "5,000", timeout=WAIT)
    row = row_of(keys, "bob")
    assert (row["At once"], row["Priority"]) == ("no limit", "batch")
    assert keys.dialog is None  # closed once the service took the change
    record = window.bridge.service.keys.get("bob")
    assert record is not None and (record.tokens_per_minute, record.max_concurrent) == (5000, None)


def test_a_revoked_key_gets_401_from_the_running_port(open_window, qtbot, with_engine: Path,
                                                       tiny_model: Path) -> None:
    window = open_window()
    window.show_sharing(keys=True)
    load_tiny(window, qtbot, tiny_model)
    keys = window.sharing.keys
    secret = make_key(window, qtbot, "mallory")
    assert chat(window, secret).status_code == 200
    asked: list[str] = []

    def decline(title: str, _text: str) -> bool:
        asked.append(title)
        return False

    keys.confirm = decline
    assert keys.select("mallory")
    qtbot.mouseClick(keys.revoke_button, Qt.MouseButton.LeftButton)
    assert asked == ["Revoke the key 'mallory'?"]
    assert chat(window, secret).status_code == 200  # declined: nothing changed

    keys.confirm = lambda _title, _text: True
    qtbot.mouseClick(keys.revoke_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: row_of(keys, "mallory").get("State") == "revoked", timeout=WAIT)
    refused = chat(window, secret)
    assert refused.status_code == 401
    assert "was revoked" in refused.json()["error"]["message"]
    assert not keys.edit_button.isEnabled() and not keys.revoke_button.isEnabled()


def test_usage_shows_in_the_table_and_the_chart_after_a_request(
        open_window, qtbot, with_engine: Path, tiny_model: Path) -> None:
    window = open_window()
    window.show_sharing(keys=True)
    load_tiny(window, qtbot, tiny_model)
    keys = window.sharing.keys
    alice = make_key(window, qtbot, "alice")
    make_key(window, qtbot, "bob")
    assert row_of(keys, "alice")["Requests"] == "0"
    assert row_of(keys, "alice")["Last used"] == "never"

    answer = chat(window, alice)
    assert answer.status_code == 200
    usage = answer.json()["usage"]
    qtbot.waitUntil(lambda: row_of(keys, "alice").get("Requests") == "1", timeout=WAIT)
    row = row_of(keys, "alice")
    assert row["Prompt tokens"] == f"{usage['prompt_tokens']:,}"
    assert row["Completion tokens"] == f"{usage['completion_tokens']:,}"
    assert row["Last used"] != "never" and row["Mean queue wait"].endswith(" s")
    assert row_of(keys, "bob")["Requests"] == "0"

    # The chart: every key, then alice's, then bob's (nothing).
    qtbot.waitUntil(lambda: keys.chart.chart.requests == 1, timeout=WAIT)
    assert keys.chart_key.currentText() == "All keys"
    assert [keys.chart_key.itemText(i) for i in range(keys.chart_key.count())] == \
        ["All keys", "alice", "bob"]
    keys.chart_key.setCurrentIndex(keys.chart_key.findData("alice"))
    qtbot.waitUntil(lambda: keys.chart.chart.key == "alice", timeout=WAIT)
    assert keys.chart.chart.total_tokens == usage["total_tokens"]
    assert keys.chart_summary.text().startswith("1 request with the key 'alice'")
    assert keys.chart.accessibleDescription() == keys.chart_summary.text()
    keys.chart_key.setCurrentIndex(keys.chart_key.findData("bob"))
    qtbot.waitUntil(lambda: keys.chart.chart.key == "bob", timeout=WAIT)
    assert keys.chart.chart.requests == 0 and "No requests" in keys.chart_summary.text()
    keys.chart_span.setCurrentIndex(keys.chart_span.count() - 1)
    qtbot.waitUntil(lambda: keys.chart.chart.span == 24 * 60, timeout=WAIT)
    keys.chart.grab()  # paints with bars and without
