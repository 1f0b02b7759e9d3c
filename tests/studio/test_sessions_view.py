"""The Sessions tab renders the backend's rows: a session's key, name, model, the share
of its prompt tokens the cache held, where its prefix lives, and its last miss and why."""

from __future__ import annotations

from backend.app.session_rows import session_rows
from backend.admission.prompt import prompt_blocks
from backend.admission.session_book import Sessions
from studio.sessions_view import COLUMNS, SessionsView

HEAD = "You are a coding agent. " * 80


def chat(*texts: str, system: str = HEAD) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": system},
                         *({"role": "user" if i % 2 == 0 else "assistant", "content": t}
                           for i, t in enumerate(texts))]}


def test_the_sessions_view_shows_each_sessions_hit_share_where_it_lives_and_its_last_miss(qtbot):
    clock = [100.0]
    book = Sessions(clock=lambda: clock[0])
    table = book  # one book: where each session lives, and its figures

    def here(session: str | None, flow: str, body: dict[str, object], cached: int,
             computed: int) -> None:
        book.judge(session, flow, "coder", prompt_blocks(body), cached, computed,
                   engine="http://127.0.0.1:9000", label="this machine",
                   engine_alive=lambda key: key == "http://127.0.0.1:9000")

    # Codex's thread: three turns, the second found all of the first; the third's clock
    # line changed.
    here("alice\nthread-1", "alice", chat("read main.py"), 0, 600)
    here("alice\nthread-1", "alice", chat("read main.py", "ok", "run tests"), 599, 201)
    table.record("alice\nthread-1", flow="alice", engine="http://127.0.0.1:9000",
                 label="this machine", slot=1)
    # A conversation another key does not name: placement's hint names it after its start.
    here("bob\n#5e1c0ffee5e1c0ff", "bob", chat("hello"), 0, 500)
    clock[0] = 130.0

    view = SessionsView()
    qtbot.addWidget(view)
    view.show_sessions(session_rows(book.caches(), table, now=clock[0]))

    shown = [dict(zip(COLUMNS, row)) for row in view.rows()]
    assert shown == [
        {"Key": "alice", "Session": "thread-1", "Model": "coder", "Turns": "2",
         "Prompt cached": "43 %", "Prefix lives on": "this machine, slot 1", "Last miss": "—",
         "Idle": "30 s"},
        # One-shot requests (unnamed, one turn) are one row per key and model, not one each.
        {"Key": "bob", "Session": "1 single request (unnamed)", "Model": "coder", "Turns": "1",
         "Prompt cached": "0 %", "Prefix lives on": "—", "Last miss": "—", "Idle": "30 s"},
    ]
    assert view.summary.text() == "2 live sessions."

    # The next turn of the thread, after its engine restarted: a miss, and why.
    book.judge("alice\nthread-1", "alice", "coder",
               prompt_blocks(chat("read main.py", "ok", "run tests", "done", "commit")),
               0, 900, engine="http://127.0.0.1:9001", label="this machine",
               engine_alive=lambda key: key == "http://127.0.0.1:9001")
    table.forget_engine("http://127.0.0.1:9000")
    view.show_sessions(session_rows(book.caches(), table, now=clock[0]))
    thread = dict(zip(COLUMNS, view.rows()[0]))
    assert (thread["Session"], thread["Prompt cached"], thread["Prefix lives on"],
            thread["Last miss"]) == ("thread-1", "26 %", "nowhere", "unloaded")


def test_one_shot_requests_fold_into_one_row_and_a_row_opens_its_details(qtbot):
    book = Sessions(clock=lambda: 50.0)
    for n in range(3):  # curl, three times: three unnamed one-turn sessions
        book.judge(f"bob\n#{n:016x}", "bob", "coder", prompt_blocks(chat(f"question {n}")), 0, 100,
                   engine="e", label="this machine", engine_alive=lambda key: True)
    for turn, cached in ((("hi",), 0), (("hi", "hello", "more"), 90)):  # an unnamed agent
        book.judge("bob\n#abcdefabcdefabcd", "bob", "coder", prompt_blocks(chat(*turn)),
                   cached, 100 - cached, engine="e", label="this machine",
                   engine_alive=lambda key: True)
    view = SessionsView()
    qtbot.addWidget(view)
    view.show_sessions(session_rows(book.caches(), now=60.0))
    assert [dict(zip(COLUMNS, row))["Session"] for row in view.rows()] == [
        "unnamed #abcdefabcdefabcd", "3 single requests (unnamed)"]
    view.table.setCurrentCell(0, 0)
    assert view.details.text().startswith("unnamed #abcdefabcdefabcd — bob, coder: 2 turns")


def test_a_sessions_owner_is_named_as_people_know_them_never_by_a_loopback_address(qtbot):
    book = Sessions(clock=lambda: 10.0)
    for flow in ("address ::ffff:127.0.0.1", "address 127.0.0.1", "address ::1",
                 "address 192.168.1.20", "owner", "alice", "chat tab"):
        book.judge(f"{flow}\nthread", flow, "coder", prompt_blocks(chat("hi")), 0, 100,
                   engine="e", label="this machine", engine_alive=lambda key: True)
    view = SessionsView()
    qtbot.addWidget(view)
    view.show_sessions(session_rows(book.caches(), now=10.0))
    assert [dict(zip(COLUMNS, row))["Key"] for row in view.rows()] == [
        "chat tab", "alice", "owner", "computer at 192.168.1.20", "this computer (owner)",
        "this computer (owner)", "this computer (owner)"]


def test_a_prefix_on_a_stopped_engine_shows_as_parked_when_saved_else_nowhere(qtbot):
    book = Sessions(clock=lambda: 10.0)
    table = book
    for name, slot in (("kept", 0), ("lost", 1), ("taken", 2)):
        book.judge(f"alice\n{name}", "alice", "coder", prompt_blocks(chat(name)), 0, 100,
                   engine="e1", label="this machine", slot=slot, engine_alive=lambda key: True)
        table.record(f"alice\n{name}", flow="alice", engine="e1", label="this machine", slot=slot)
    # Another session's turn took slot 2: the engine's RAM cache may keep "taken".
    table.record("alice\nother", flow="alice", engine="e1", label="this machine", slot=2)
    view = SessionsView()
    qtbot.addWidget(view)

    def places(serving: set[str]) -> dict[str, str]:
        view.show_sessions(session_rows(book.caches(), table, now=10.0, serving=serving,
                                        parked={"alice\nkept"}))
        return {row["Session"]: row["Prefix lives on"]
                for row in (dict(zip(COLUMNS, r)) for r in view.rows())}

    assert places({"e1"}) == {"kept": "this machine, slot 0", "lost": "this machine, slot 1",
                              "taken": "this machine"}
    # Its engine stopped (unloaded): what was saved is parked, the rest is nowhere.
    assert places(set()) == {"kept": "parked", "lost": "nowhere", "taken": "nowhere"}


def test_an_agents_turns_through_the_port_show_in_the_sessions_tab_with_their_hit_share(
        open_window, qtbot, with_engine, tiny_model):
    import concurrent.futures

    import httpx

    from studio.window import SESSIONS_TAB

    window = window_serving(open_window, qtbot, tiny_model)

    def two_turns() -> list[int]:
        """Codex's way: its thread id as `prompt_cache_key`, the whole history each turn."""
        url = f"http://127.0.0.1:{window.settings.port}/v1/chat/completions"
        messages = [{"role": "system", "content": HEAD}, {"role": "user", "content": "hi"}]
        cached = []
        with httpx.Client(timeout=60) as client:
            for text in ("read main.py", "run the tests"):
                answer = client.post(url, json={"model": "tiny", "messages": messages,
                                                "max_tokens": 4, "prompt_cache_key": "thread-7"})
                assert answer.status_code == 200, answer.text
                cached.append(answer.json()["timings"]["cache_n"])
                messages += [{"role": "assistant", "content": "ok"},
                             {"role": "user", "content": text}]
        return cached

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # never on the Qt loop
        future = pool.submit(two_turns)
        qtbot.waitUntil(future.done, timeout=120_000)
        cached = future.result()
    assert cached[1] > 0

    window.tabs.setCurrentIndex(SESSIONS_TAB)
    qtbot.waitUntil(lambda: len(window.sessions.rows()) == 1, timeout=15_000)
    row = dict(zip(COLUMNS, window.sessions.rows()[0]))
    assert (row["Session"], row["Model"], row["Turns"]) == ("thread-7", "tiny", "2")
    assert row["Key"] == "this computer (owner)"  # no key, from this machine: not "address 127.0.0.1"
    # This machine's engine; its slot too where placement pinned the turn to one.
    assert row["Prefix lives on"] in ("this machine", "this machine, slot 0")
    assert 0 < int(row["Prompt cached"].removesuffix(" %")) < 100


def test_a_sessions_row_says_parked_once_its_model_is_unloaded_with_its_prefix_saved(
        open_window, qtbot, with_engine, tiny_model):
    """The book alone says where the last turn ran ("this machine, slot 0") long after that
    engine is gone; the session table and the parked files say where the prefix is now."""
    import concurrent.futures

    import httpx

    from studio.window import SESSIONS_TAB

    window = window_serving(open_window, qtbot, tiny_model)

    def turns() -> None:
        url = f"http://127.0.0.1:{window.settings.port}/v1/chat/completions"
        messages = [{"role": "system", "content": HEAD}, {"role": "user", "content": "hi"}]
        with httpx.Client(timeout=60) as client:
            for text in ("read main.py", "run the tests"):
                answer = client.post(url, json={"model": "tiny", "messages": messages,
                                                "max_tokens": 4, "prompt_cache_key": "thread-8"})
                assert answer.status_code == 200, answer.text
                messages += [{"role": "assistant", "content": "ok"},
                             {"role": "user", "content": text}]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # never on the Qt loop
        future = pool.submit(turns)
        qtbot.waitUntil(future.done, timeout=120_000)
        future.result()

    def where() -> str | None:
        rows = window.sessions.rows()
        return dict(zip(COLUMNS, rows[0]))["Prefix lives on"] if rows else None

    window.tabs.setCurrentIndex(SESSIONS_TAB)
    qtbot.waitUntil(lambda: where() is not None, timeout=15_000)
    assert where() == "this machine, slot 0"  # the table's place: the slot it was pinned to

    # An unload is a planned loss: the session's slot is saved before the engine stops.
    window.bridge.unload_model("tiny").result(timeout=60)
    assert window.bridge.service.parking.counts["parked"] == 1

    def shown() -> str | None:
        window.refresh_sessions()
        return where()

    qtbot.waitUntil(lambda: shown() == "parked", timeout=15_000)


def window_serving(open_window, qtbot, model):
    """The window with `model` loaded on one slot of 2,048 tokens, as a user does it."""
    from PySide6.QtCore import Qt

    from backend.llama.load import State

    window = open_window()
    view = window.model_view
    window.open_files([str(model)])
    qtbot.waitUntil(lambda: view.info is not None, timeout=15_000)
    view.parallel.setValue(1)
    view.ctx_size.setValue(2048)
    qtbot.mouseClick(view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=60_000)
    return window
