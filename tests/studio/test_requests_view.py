"""The Requests tab: a request through the port shows up live as a row, filters narrow the
table, and a row opens its details; each reason to wait reads as its own words."""

from __future__ import annotations

from pathlib import Path

import httpx
from PySide6.QtCore import Qt

from backend.admission.admission_ticket import WaitReason
from backend.llama.load import State
from backend.port.request_log import RequestRecord
from studio.requests_view import COLUMNS, RequestsView
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
    assert answered.text(COLUMNS.index("Output")) == "6"
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


def test_each_reason_to_wait_reads_as_its_own_words(qtbot) -> None:
    """A key held by its own concurrency limit must not read like a full server (the
    owner would add slots for nothing): every reason the line gives has words of its own."""
    view = RequestsView()
    qtbot.addWidget(view)
    reasons = [value for name, value in vars(WaitReason).items() if name.isupper()]
    view.add_records([RequestRecord(id=n, time=1_700_000_000.0, route="/v1/chat/completions",
                                    key="solo", wait=1.5, wait_reason=reason)
                      for n, reason in enumerate(reasons, 1)])
    shown = {}
    for row in range(len(reasons)):
        item = view.table.topLevelItem(row)
        assert item is not None
        record = view.record_of(item)
        assert record is not None
        shown[record.wait_reason] = item.text(COLUMNS.index("Waited")).removeprefix("1.50 s ")
    assert len(set(shown.values())) == len(reasons) and "_" not in "".join(shown.values())
    assert shown[WaitReason.KEY_CONCURRENCY] == "key's concurrency"
    assert shown[WaitReason.SLOTS_FULL] == "slots full"


def test_a_request_its_client_left_reads_stopped_by_the_client(qtbot) -> None:
    view = RequestsView()
    qtbot.addWidget(view)
    view.add_records([RequestRecord(id=1, time=1_700_000_000.0, route="/v1/chat/completions",
                                    key="alice", model="tiny", status=499, prompt_tokens=40,
                                    cached_tokens=39, wait=0.8, wait_reason="slots_full")])
    item = view.table.topLevelItem(0)
    assert item is not None
    assert item.text(COLUMNS.index("Status")) == "499 stopped by the client"
    assert item.text(COLUMNS.index("Waited")) == "800 ms slots full"
    assert item.text(COLUMNS.index("Prompt (cached)")) == "40 (39)"
    view.table.setCurrentItem(item)
    assert "499 — stopped by the client" in view.details.toPlainText()


def test_the_requests_tab_keeps_its_history_across_a_restart(open_window, qtbot,
                                                             studio_home: Path) -> None:
    from backend.app.request_history import HISTORY_FILE
    from tests.studio.conftest import close_and_stop

    window = open_window()

    async def asked() -> None:
        window.bridge.service.requests.add(route="/v1/chat/completions", key="alice",
                                           model="tiny", status=499)

    window.bridge.backend_thread.submit(asked()).result(10)
    close_and_stop(window)
    saved = studio_home / "data" / "gguf-studio" / HISTORY_FILE
    assert saved.stat().st_mode & 0o777 == 0o600

    again = open_window()
    again.tabs.setCurrentIndex(REQUESTS_TAB)
    qtbot.waitUntil(lambda: again.requests.table.topLevelItemCount() == 1, timeout=WAIT)
    row = again.requests.table.topLevelItem(0)
    assert row is not None and row.text(COLUMNS.index("Key")) == "alice"
    assert row.text(COLUMNS.index("Status")) == "499 stopped by the client"


def test_the_requests_under_way_read_in_one_line_with_a_long_prompt_and_its_time_left(qtbot) -> None:
    view = RequestsView()
    qtbot.addWidget(view)
    waiting = RequestRecord(id=0, time=1_700_000_000.0, route="/v1/chat/completions",
                            key="owner", status=0, wait=3.0)
    reading = RequestRecord(id=0, time=1_700_000_001.0, route="/v1/responses", key="ana",
                            status=0, prompt_tokens=6000, prefilled=2048, prefill_eta=39.6)
    view.show_under_way([waiting, reading])
    assert view.under_way.text() == ("2 under way; reading a prompt: 2,048 of 6,000 tokens, "
                                     "about 40 s left")
    view.show_under_way([waiting])
    assert view.under_way.text() == "1 under way"
    view.show_under_way([])
    assert view.under_way.text() == ""
