"""The Requests tab: a request through the port shows up live as a row, filters narrow the
table, and a row opens its details."""

from __future__ import annotations

from pathlib import Path

import httpx
from PySide6.QtCore import Qt

from backend.llama.load import State
from studio.window import REQUESTS_TAB

LOAD_WAIT = 60_000
WAIT = 15_000


def test_a_request_through_the_port_shows_as_a_row_that_opens_its_details(
        open_window, qtbot, with_engine, tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    window.tabs.setCurrentIndex(REQUESTS_TAB)
    view = window.requests
    assert view.table.topLevelItemCount() == 0

    port = window.bridge.gateway_port
    key = window.settings.api_key
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    answer = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers,
                        timeout=60, json={"model": "tiny", "max_tokens": 6, "ignore_eos": True,
                                          "messages": [{"role": "user", "content": "Hello"}]})
    assert answer.status_code == 200, answer.text
    refused = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", headers=headers,
                         timeout=60, json={"model": "no-such-model", "messages": []})
    assert refused.status_code >= 400

    # Live: the tab asks for new records while shown, no click needed.
    qtbot.waitUntil(lambda: view.table.topLevelItemCount() == 2, timeout=WAIT)
    newest, answered = view.table.topLevelItem(0), view.table.topLevelItem(1)
    assert answered.text(2) == "tiny" and answered.text(3) == "200"
    assert answered.text(8) == "6"  # output tokens
    assert newest.text(3).startswith(str(refused.status_code))

    view.status_filter.setCurrentText("Errors")
    assert answered.isHidden() and not newest.isHidden()
    view.status_filter.setCurrentText("All")
    view.model_filter.setCurrentText("tiny")
    assert not answered.isHidden() and newest.isHidden()

    view.table.setCurrentItem(answered)
    details = view.details.toPlainText()
    assert "Model:" in details and "tiny" in details
    assert "Output tokens:" in details and "Time to first token:" not in details  # not streamed
    assert "Engine:" in details and "this machine" in details
    assert "Prompt tokens:" in details and "Status:" in details
    assert "Hello" not in details
