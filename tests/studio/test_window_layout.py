"""The window at its first size, 1240 x 860: the conversation has room, the named keys
are in view without scrolling, and the tables fit without scrolling sideways."""

from __future__ import annotations

import time

from PySide6.QtCore import QPoint, QRect
from PySide6.QtWidgets import QScrollArea, QSplitter

from backend.app.activity import ActivitySample, EngineActivity
from backend.app.pool.pool_state import PoolState
from backend.app.pool.pool_status import EngineStatus, ModelStatus, Residency
from backend.app.session_rows import SessionRow
from backend.app.sharing.key_table import key_table
from backend.keys.key_store import CHAT_NAME, KeyRecord
from backend.keys.usage import KeyUsage
from backend.port.metrics import ModelTotals
from backend.port.request_log import RequestRecord
from studio.window import (ACTIVITY_TAB, CHAT_TAB, ENGINE_TAB, POOL_TAB, REQUESTS_TAB,
                           SESSIONS_TAB, MainWindow)
from tests.studio.conftest import close_and_stop

WAIT = 10_000
LONG_NAME = "Qwen2.5-Coder-7B-Instruct-Q4_K_M"


def at_first_size(open_window, qtbot) -> MainWindow:
    window = open_window()
    assert (window.width(), window.height()) == (1240, 860)
    return window


def shown(qtbot, window: MainWindow, tab: int) -> None:
    window.tabs.setCurrentIndex(tab)
    qtbot.waitUntil(lambda: window.tabs.currentWidget().isVisible(), timeout=WAIT)
    qtbot.wait(50)  # a layout pass: sizes settle on the next turn of the loop


def test_the_conversation_has_most_of_the_height(open_window, qtbot) -> None:
    window = at_first_size(open_window, qtbot)
    shown(qtbot, window, CHAT_TAB)
    # Was about 160 px under a pane of facts, settings and five lines of engine status.
    assert window.chat.transcript.height() >= 300
    assert window.model_view.height() <= window.height() * 0.3


def test_the_named_keys_are_in_view_without_scrolling(open_window, qtbot) -> None:
    window = at_first_size(open_window, qtbot)
    window.show_sharing(keys=True)
    qtbot.waitUntil(window.sharing.keys.table.isVisible, timeout=WAIT)
    page = window.tabs.currentWidget()
    table = window.sharing.keys.table
    top_left = table.mapTo(page, QPoint(0, 0))
    assert QRect(QPoint(0, 0), page.size()).contains(top_left)
    assert top_left.y() + 100 < page.height()  # its first rows too
    assert window.sharing.keys.create_button.isVisible()


def test_the_tables_fit_without_scrolling_sideways(open_window, qtbot) -> None:
    window = at_first_size(open_window, qtbot)
    engine = EngineStatus("local:x", "this machine", "ready", 4, {"total": 32768, "per_request": 8192,
                                                                 "unified": True}, 2, 1, 12000)
    models = tuple(ModelStatus(name, (), True, Residency.READY, name == LONG_NAME, 1800.0, False,
                               name == LONG_NAME, 8192, "loaded on request: needs about 4.5 GiB, "
                               "fits beside the others (9.1 GiB of 30.0 GiB)", None, (engine,))
                   for name in (LONG_NAME, "SmolLM2-135M-Instruct-Q4_1"))
    window.bridge.pool_changed.emit(PoolState(models, (), {
        LONG_NAME: ModelTotals(1234, 56, 78), "SmolLM2-135M-Instruct-Q4_1": ModelTotals(9, 0, 1)}))
    window.requests.add_records([RequestRecord(
        id=n, time=1_700_000_000.0 + n, route="/v1/chat/completions", key="teammate-laptop",
        model=LONG_NAME, status=499 if n % 2 else 200, wait=0.8, wait_reason="slots_full",
        prompt_tokens=12_345, cached_tokens=12_000, output_tokens=1_234, stream=True,
        time_to_first_token=0.85, tokens_per_second=42.5) for n in range(1, 40)])
    window.bridge.activity_sampled.disconnect()  # the idle port's samples: no engines
    busy = ActivitySample(time=1.0, engines=tuple(
        EngineActivity(name, "this machine", 4, 2, 1, 12000, 32768, 123456, 42.0)
        for name in (LONG_NAME, "SmolLM2-135M-Instruct-Q4_1")))
    window.sessions.show_sessions([SessionRow(
        "teammate-laptop", f"codex-session-{n}", LONG_NAME, 12, 97.0, "this machine, slot 1",
        "prefix changed at token 1,024 (a changing line near the start)", 42.0) for n in range(5)])

    for tab, table in ((POOL_TAB, window.pool.models), (REQUESTS_TAB, window.requests.table),
                       (ACTIVITY_TAB, window.activity.engines),
                       (SESSIONS_TAB, window.sessions.table)):
        shown(qtbot, window, tab)
        if tab == ACTIVITY_TAB:  # after any sample of the idle port still on its way
            window.activity.add_sample(busy)
            qtbot.wait(50)
        assert table.isVisible()
        assert not table.horizontalScrollBar().isVisible(), window.tabs.tabText(tab)


def test_the_engine_tab_reads_without_cut_off_lines(open_window, qtbot) -> None:
    window = at_first_size(open_window, qtbot)
    shown(qtbot, window, ENGINE_TAB)
    qtbot.waitUntil(lambda: window.engine.accelerators.text().startswith("GPUs:"), timeout=WAIT)
    qtbot.wait(50)
    page = window.tabs.currentWidget()
    assert isinstance(page, QScrollArea)
    assert not page.horizontalScrollBar().isVisible()
    assert not window.engine.accelerator_table.horizontalScrollBar().isVisible()


def test_every_splitter_keeps_its_place_across_a_restart(open_window, qtbot) -> None:
    window = at_first_size(open_window, qtbot)
    splitters = {s.objectName(): s for s in window.findChildren(QSplitter)}
    # The library beside the rest, the model above the tabs, the access beside the named
    # keys, a request above its details, a search beside a repository's files.
    assert {"splitter", "right_splitter", "sharing_split", "requests_split",
            "discover_split"} <= splitters.keys()
    for tab in range(window.tabs.count()):  # each page laid out once, as a person sees it
        shown(qtbot, window, tab)
    for name, splitter in splitters.items():
        sizes = splitter.sizes()
        for step in (40, -40):  # whichever way its panes' minimums let it go
            splitter.setSizes([sizes[0] + step, sizes[1] - step] + sizes[2:])
            if splitter.sizes() != sizes:
                break
        assert splitter.sizes() != sizes, name
    for tab in range(window.tabs.count()):  # the panes within follow the outer ones
        shown(qtbot, window, tab)
    moved = {name: splitter.sizes() for name, splitter in splitters.items()}
    close_and_stop(window)

    again = open_window()
    for tab in range(again.tabs.count()):
        shown(qtbot, again, tab)
    kept = {s.objectName(): s.sizes() for s in again.findChildren(QSplitter)}
    assert {name: kept.get(name) for name in moved} == moved


def test_the_named_keys_table_fits_without_scrolling_sideways(open_window, qtbot) -> None:
    window = at_first_size(open_window, qtbot)
    keys = window.sharing.keys
    keys.refresh_requested.disconnect()  # the live table (keys unused) would replace ours
    window.sharing.lan.click()  # the owner's key, then two teammates' keys, all used today
    qtbot.waitUntil(lambda: bool(window.settings.api_key), timeout=WAIT)
    records: list[KeyRecord] = []
    errors: list[str] = []
    for name in ("alice-laptop", "build-server"):
        window.bridge.add_key(name, {}, on_done=lambda made: records.append(made[0]),
                              on_error=errors.append)
    qtbot.waitUntil(lambda: len(records) + len(errors) == 2, timeout=WAIT)
    assert errors == []
    now = time.time()
    used = KeyUsage(requests=1234, prompt_tokens=56_789, completion_tokens=1234, last_used=now - 60)
    table = key_table(records, {r.name: used for r in records} | {CHAT_NAME: used}, (),
                      owner_key_set=True, chart_key=None, span=60, now=now)
    window.show_sharing(keys=True)
    keys.show_table(table)
    qtbot.wait(50)
    assert keys.table.rowCount() == 4
    assert not keys.table.horizontalScrollBar().isVisible()
