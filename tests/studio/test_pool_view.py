"""The Pool tab with real engines: two models loaded here, an engine elsewhere added and
removed, each one's state, slots and KV, pin and idle TTL, and the activity of every
engine beside the totals."""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Callable, Iterator

import httpx
import pytest
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QTableWidget
from pytestqt.exceptions import TimeoutError as WaitTimeout

from backend.models.model_names import model_name
from backend.app.pool.pool_state import describe_requests
from backend.llama.load import State
from backend.llama.supervisor import pick_free_port
from backend.port.metrics import ModelTotals
from studio.pool_view import MODEL_COLUMNS, UPSTREAM_COLUMNS, PoolView
from studio.window import POOL_TAB, MainWindow
from tests.backend.llama.test_remote_engine import start_llama_server, stop

LOAD_WAIT = 90_000
WAIT = 20_000
#: SmolLM2's extra arguments. On a CPU with AMX (this test machine's), the engine's AMX
#: kernels for repacked Q4_1 weights crash llama-server during its warm-up (SIGSEGV in
#: ggml_backend_amx_mul_mat); without repacking the same engine runs it.
SMOL_ARGS = "--no-repack"


def rows(table: QTableWidget, columns: tuple[str, ...]) -> list[dict[str, str]]:
    """Every row of `table` as {column: text} (widget cells read as "")."""
    return [{name: (item.text() if (item := table.item(row, column)) is not None else "")
             for column, name in enumerate(columns)}
            for row in range(table.rowCount())]


def model_row(view: PoolView, name: str) -> dict[str, str] | None:
    return next((r for r in rows(view.models, MODEL_COLUMNS)
                 if r["Model"].removesuffix(" (default)") == name), None)


def model_is(view: PoolView, name: str, **cells: str) -> bool:
    """Whether `name`'s row says `cells`, named by column in lower case (runs_on="…")."""
    row = model_row(view, name)
    if row is None:
        return False
    by_key = {column.lower().replace(" ", "_"): text for column, text in row.items()}
    return all(by_key[key] == text for key, text in cells.items())


def until(qtbot, predicate: Callable[[], bool], shown: Callable[[], object],
          timeout: int = 20_000) -> None:
    """qtbot.waitUntil; a timeout says what `shown()` was."""
    try:
        qtbot.waitUntil(predicate, timeout=timeout)
    except WaitTimeout:
        raise AssertionError(f"timed out; it shows {shown()}") from None


def recent_engines(window: MainWindow) -> list[tuple[float, list[tuple[str, str, int]]]]:
    """The last samples' engines (model, where, requests running): what happened lately."""
    return [(round(sample.time, 1), [(e.model, e.engine, e.active) for e in sample.engines])
            for sample in window.activity.history.samples()[-10:]]


def requests_counted(port: int) -> dict[str, str]:
    """Each model's requests as the port's /health counts them, as the cell shows them."""
    models = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["models"]
    return {m["id"]: f"{m['requests']['answered']:,}" for m in models}


def requests_told(port: int) -> list[str]:
    """Each model's requests and their ends in the window's words, as /health counts them."""
    models = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()["models"]
    return [f"{m['id']}: " + describe_requests(ModelTotals(
        m["requests"]["answered"], m["requests"]["refused"], m["requests"]["cancelled"]))
        for m in models]


def wait_for_model(qtbot, view: PoolView, name: str, timeout: int = 20_000, **cells: str) -> None:
    """Until `name`'s row says `cells`; a timeout shows the table as it is."""
    try:
        qtbot.waitUntil(lambda: model_is(view, name, **cells), timeout=timeout)
    except WaitTimeout:
        raise AssertionError(f"{name} never showed {cells}: "
                             f"{rows(view.models, MODEL_COLUMNS)}") from None


def pinned(window: MainWindow, name: str) -> bool:
    status = window.bridge.pool_state.model(name)
    return status is not None and status.pinned


def select(qtbot, window: MainWindow, path: Path) -> None:
    qtbot.waitUntil(lambda: window.library_view.select_path(str(path)), timeout=WAIT)
    qtbot.waitUntil(lambda: window.model_view.path == str(path)
                    and window.model_view.info is not None, timeout=WAIT)


@pytest.fixture
def engine_elsewhere(llama_server_binary: Path, tiny_model: Path) -> Iterator[str]:
    """A real llama-server on loopback, as another machine would run it (two slots of
    8,192 tokens, its model called "elsewhere", its token counters on /metrics)."""
    port = pick_free_port()
    process = start_llama_server(llama_server_binary, tiny_model, port, parallel=2, ctx=16384,
                                 extra=("--metrics",))
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stop(process)


class Streams:
    """Long streamed chats from threads of the test (never the Qt loop), each held open
    after its first token until `release`."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.started: dict[str, threading.Event] = {}
        self._release = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(4)
        self._running: list[concurrent.futures.Future[int]] = []

    def start(self, model: str, max_tokens: int) -> None:
        started = self.started[model] = threading.Event()
        self._running.append(self._pool.submit(self._one, model, max_tokens, started))

    def release(self) -> list[int]:
        self._release.set()
        codes = [f.result(timeout=120) for f in self._running]
        self._pool.shutdown()
        return codes

    def _one(self, model: str, max_tokens: int, started: threading.Event) -> int:
        body = {"model": model, "stream": True, "max_tokens": max_tokens, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell me a long story."}]}
        with httpx.Client(timeout=120) as client:
            with client.stream("POST", f"{self.base_url}/v1/chat/completions",
                               json=body) as answer:
                # Held while it waits: a line iterator let go of closes the answer.
                lines = answer.iter_lines()
                for line in lines:
                    if line.startswith("data: {"):
                        started.set()
                        break
                self._release.wait(120)
                return answer.status_code  # leaving closes it: the port frees the slot


def test_two_models_loaded_an_engine_elsewhere_added_and_activity_per_engine(
        open_window, qtbot, with_engine: Path, tiny_model: Path, smollm2_model: Path,
        engine_elsewhere: str) -> None:
    window = open_window()
    view, pool = window.model_view, window.pool
    window.open_files([str(tiny_model), str(smollm2_model)])
    smol = model_name(smollm2_model)

    # One model loaded the usual way, a second one beside it: both run on this machine.
    select(qtbot, window, tiny_model)
    view.parallel.setValue(2)
    view.ctx_size.setValue(16384)
    qtbot.mouseClick(view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    select(qtbot, window, smollm2_model)
    view.parallel.setValue(1)
    view.ctx_size.setValue(8192)
    view.extra_args.setText(SMOL_ARGS)
    qtbot.mouseClick(view.add_button, Qt.MouseButton.LeftButton)
    assert window.tabs.currentIndex() == POOL_TAB
    qtbot.waitUntil(lambda: model_is(pool, smol, state="loading")
                    or model_is(pool, smol, state="ready"), timeout=WAIT)
    wait_for_model(qtbot, pool, smol, LOAD_WAIT, state="ready")
    assert model_is(pool, "tiny", model="tiny (default)", runs_on="this machine",
                    slots_busy="0 / 2", kv_in_use="0 / 16,384", requests="0")
    assert model_is(pool, smol, runs_on="this machine", slots_busy="0 / 1",
                    kv_in_use="0 / 8,192")
    assert "added" in pool.model_rows[smol].cells[MODEL_COLUMNS.index("Last decision")].text()
    # The default model loaded from the Model tab is pinned; the one added beside is not.
    assert pool.model_rows["tiny"].pinned.isChecked()
    assert not pool.model_rows[smol].pinned.isChecked()
    assert window.bridge.snapshot.model_id == "tiny"  # the default stays the default

    # An engine elsewhere, with its address and KV layout: it joins with its own model.
    qtbot.keyClicks(pool.url, engine_elsewhere)
    pool.layout_box.setCurrentIndex(pool.layout_box.findData("split"))
    qtbot.mouseClick(pool.add_upstream_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: [r["Health"] for r in rows(pool.upstreams, UPSTREAM_COLUMNS)]
                    == ["ready"], timeout=LOAD_WAIT)
    assert pool.url.text() == "" and not pool.upstream_problem.isVisible()
    upstream = rows(pool.upstreams, UPSTREAM_COLUMNS)[0]
    assert (upstream["Engine"], upstream["Address"], upstream["Models"], upstream["Slots busy"],
            upstream["KV in use"]) == ("upstream 1", engine_elsewhere, "elsewhere", "0 / 2",
                                       "0 / 16,384")
    qtbot.waitUntil(lambda: model_is(pool, "elsewhere", runs_on="upstream 1", state="ready",
                                     pinned="—", idle_ttl="—"), timeout=WAIT)
    assert not pool.model_rows["elsewhere"].pinned.isVisibleTo(pool)
    far = pool.model_rows["elsewhere"]
    assert not any(widget.isVisibleTo(pool) for widget in (far.idle_ttl, far.load, far.unload,
                                                           far.remove))

    # A long chat on every engine at once (each could run for minutes; they are ended
    # once seen): each engine's row and the totals show it.
    streams = Streams(f"http://127.0.0.1:{window.settings.port}")
    for model in ("tiny", smol, "elsewhere"):
        streams.start(model, 8000)
    try:
        for started in streams.started.values():
            qtbot.waitUntil(started.is_set, timeout=LOAD_WAIT)
        until(qtbot, lambda: model_is(pool, "tiny", slots_busy="1 / 2")
              and model_is(pool, smol, slots_busy="1 / 1")
              and model_is(pool, "elsewhere", slots_busy="1 / 2"),
              lambda: (rows(pool.models, MODEL_COLUMNS), recent_engines(window)))
        assert rows(pool.upstreams, UPSTREAM_COLUMNS)[0]["Slots busy"] == "1 / 2"
        activity = window.activity
        expected = [("tiny", "this machine", "1 / 2"), (smol, "this machine", "1 / 1"),
                    ("elsewhere", "upstream 1", "1 / 2")]
        until(qtbot, lambda: [row[:3] for row in activity.engine_rows()] == expected,
              activity.engine_rows)
        assert activity.engines_box.isVisibleTo(activity)
        assert activity.values["slots"].text() == "3 / 5"  # the totals: every engine's slots
    finally:
        codes = streams.release()
    assert codes == [200, 200, 200]
    until(qtbot, lambda: [row[2] for row in window.activity.engine_rows()]
          == ["0 / 2", "0 / 1", "0 / 2"], window.activity.engine_rows)
    # Each engine's own tokens, read from its own /metrics (llama-server counts a
    # request's tokens when it ends).
    until(qtbot, lambda: all(row[6] not in ("—", "0") for row in window.activity.engine_rows()),
          window.activity.engine_rows)
    assert window.activity.history.peak("tokens_per_s") > 0
    # Each model's requests, the same as /health counts them (read again each second).
    names = ("tiny", smol, "elsewhere")

    def requests_shown() -> dict[str, str | None]:
        return {name: (model_row(pool, name) or {}).get("Requests") for name in names}

    def requests_as_counted() -> bool:
        counted = requests_counted(window.settings.port)
        return all(requests_shown()[name] == counted.get(name) != "0" for name in names)

    until(qtbot, requests_as_counted,
          lambda: (requests_shown(), requests_counted(window.settings.port)))
    # ... and in full below the table, in the words of every tab.
    until(qtbot, lambda: all(told in pool.decisions.text()
                             for told in requests_told(window.settings.port)),
          lambda: (pool.decisions.text(), requests_told(window.settings.port)))

    # The engine elsewhere removed: its row and its model leave the pool.
    qtbot.mouseClick(pool.upstream_rows[engine_elsewhere].remove, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: pool.upstreams.rowCount() == 0
                    and model_row(pool, "elsewhere") is None, timeout=WAIT)
    qtbot.waitUntil(lambda: [row[:2] for row in window.activity.engine_rows()] == [
        ("tiny", "this machine"), (smol, "this machine")], timeout=WAIT)


def test_pin_idle_ttl_unload_and_load_from_the_pool_tab(open_window, qtbot, with_engine: Path,
                                                       tiny_model: Path,
                                                       smollm2_model: Path) -> None:
    window = open_window()
    view, pool = window.model_view, window.pool
    window.open_files([str(tiny_model), str(smollm2_model)])
    smol = model_name(smollm2_model)
    select(qtbot, window, smollm2_model)
    view.ctx_size.setValue(2048)
    view.extra_args.setText(SMOL_ARGS)
    qtbot.mouseClick(view.add_button, Qt.MouseButton.LeftButton)
    wait_for_model(qtbot, pool, smol, LOAD_WAIT, state="ready")
    row = pool.model_rows[smol]

    # An idle TTL typed in: the model is unloaded when idle that long, and says why.
    row.idle_ttl.setValue(1)
    row.idle_ttl.editingFinished.emit()
    wait_for_model(qtbot, pool, smol, WAIT, state="evicted")
    assert "idle for 1 s" in row.cells[MODEL_COLUMNS.index("Last decision")].text()
    assert row.load.isEnabled() and not row.unload.isEnabled()

    # Loaded again, pinned: pinning drops the TTL; it stays loaded.
    qtbot.mouseClick(row.load, Qt.MouseButton.LeftButton)
    wait_for_model(qtbot, pool, smol, LOAD_WAIT, state="ready")
    row.pinned.click()
    qtbot.waitUntil(lambda: pinned(window, smol), timeout=WAIT)
    assert row.idle_ttl.value() == 0 and row.idle_ttl.text() == "Never"
    assert not row.idle_ttl.isEnabled()

    # Unloaded by hand, then removed from the pool.
    qtbot.mouseClick(row.unload, Qt.MouseButton.LeftButton)
    wait_for_model(qtbot, pool, smol, WAIT, state="unloaded")
    qtbot.mouseClick(pool.model_rows[smol].remove, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: model_row(pool, smol) is None, timeout=WAIT)
    assert pool.models_empty.isVisibleTo(pool)


def test_a_model_that_fails_to_load_beside_shows_failed_and_why(open_window, qtbot,
                                                               with_engine: Path,
                                                               tiny_model: Path) -> None:
    window = open_window()
    view, pool = window.model_view, window.pool
    window.open_files([str(tiny_model)])
    select(qtbot, window, tiny_model)
    view.extra_args.setText("--cache-type-k no-such-type")
    messages: list[str] = []
    window.statusBar().messageChanged.connect(messages.append)
    qtbot.mouseClick(view.add_button, Qt.MouseButton.LeftButton)
    wait_for_model(qtbot, pool, "tiny", LOAD_WAIT, state="failed")
    decision = pool.model_rows["tiny"].cells[MODEL_COLUMNS.index("Last decision")].text()
    assert decision.startswith("failed to load")
    assert pool.model_rows["tiny"].load.isEnabled()
    until(qtbot, lambda: any(m.startswith("tiny did not load: llama-server exited")
                             and "no-such-type" in m for m in messages), lambda: messages)


def test_an_engine_elsewhere_that_does_not_answer_says_so_and_can_be_removed(
        open_window, qtbot, studio_home: Path) -> None:
    window = open_window()
    pool = window.pool
    address = f"http://127.0.0.1:{pick_free_port()}"
    qtbot.mouseClick(pool.add_upstream_button, Qt.MouseButton.LeftButton)
    assert "Type the engine's address" in pool.upstream_problem.text()
    qtbot.keyClicks(pool.url, address)
    qtbot.keyClick(pool.url, Qt.Key.Key_Return)
    qtbot.waitUntil(lambda: [r["Health"] for r in rows(pool.upstreams, UPSTREAM_COLUMNS)]
                    == ["out of the pool — The upstream does not answer."], timeout=WAIT)
    upstream = rows(pool.upstreams, UPSTREAM_COLUMNS)[0]
    assert (upstream["Engine"], upstream["Models"], upstream["Slots busy"]) == (
        "upstream 1", "—", "—")
    assert model_row(pool, "elsewhere") is None  # nothing served through it
    qtbot.mouseClick(pool.upstream_rows[address].remove, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: pool.upstreams.rowCount() == 0, timeout=WAIT)

    qtbot.keyClicks(pool.url, "ftp://nowhere")
    qtbot.mouseClick(pool.add_upstream_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: "http(s) URL" in pool.upstream_problem.text(), timeout=WAIT)
