"""Real Codex CLI and OpenCode runs of several turns through the window's port: its
Sessions tab shows each client's session, under the client's key and model, with its
turns and the share of its prompt tokens the engine's cache held, as the port's request
inspector (`/requests`) counts them.

The window is the real one (offscreen), serving the tiny model on the real llama-server;
each client runs as the user sets it up for a named key (the window's snippet pasted),
several times, each run continuing the session the first one began: Codex with
`codex exec resume ID`, OpenCode with `opencode run --session ID`.  The clients run on a
worker thread, never on the Qt loop, which keeps turning (the tab refreshes itself).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import re
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
from PySide6.QtCore import Qt

from backend.app.sharing.snippets import codex_snippet, opencode_snippet
from backend.llama.load import State
from backend.settings import Settings
from studio.sessions_view import COLUMNS
from studio.window import SESSIONS_TAB, MainWindow
from tests.clients.conftest import (API_KEY, CLIENT_TIMEOUT, CONTEXT, KEEPALIVE, MODEL_ID,
                                    OUTPUT_CAP, Clients, Codex, OpenCode, Process, Run, add_key,
                                    auth_headers, key_target, pasted_codex_files, pasted_env)
from tests.studio.conftest import free_port, open_window, studio_home, with_engine  # noqa: F401

# A first run installs the clients (scripts/install-clients); each client run is bounded.
pytestmark = pytest.mark.timeout(600)

#: Runs of each client: the first begins its session, the others continue it.
RUNS = 3

T = TypeVar("T")


@pytest.fixture
def window(open_window, with_engine, long_context_model: Path, qtbot) -> MainWindow:  # noqa: F811
    """The window serving the tiny model (one slot, one engine thread) on its port, with
    the owner's key set (the inspector shows the owner every request's cache figures) and
    answers capped (the random model never stops by itself)."""
    Settings(port=free_port(), api_key=API_KEY, max_output_tokens=OUTPUT_CAP,
             keepalive_interval=KEEPALIVE).save()
    window: MainWindow = open_window()
    view = window.model_view
    window.open_files([str(long_context_model)])
    qtbot.waitUntil(lambda: view.info is not None, timeout=15_000)
    view.parallel.setValue(1)
    view.ctx_size.setValue(CONTEXT)
    view.threads.setValue(1)
    qtbot.mouseClick(view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=60_000)
    window.tabs.setCurrentIndex(SESSIONS_TAB)
    return window


async def test_codex_turns_show_as_one_session_with_its_hit_share(window: MainWindow, qtbot,
                                                                  clients: Clients,
                                                                  tmp_path: Path):
    service = window.bridge.service
    secret = await add_key("codex")
    snippet = codex_snippet(key_target(service, secret))

    async def turns(processes: list[Process]) -> list[Run]:
        codex = Codex(clients, tmp_path, processes)

        async def run(prompt: str, *args: str, after: Run | None = None) -> Run:
            done = await (await codex.start(service, prompt, files=pasted_codex_files(snippet),
                                            env=pasted_env(snippet), ephemeral=False,
                                            args=args, continuing=after)).result()
            assert done.returncode == 0 and done.text, done.describe()
            return done

        runs = [await run("Say hello.")]
        thread = codex_session_id(runs[0])
        for prompt in ("Now say it in French.", "And in German.")[:RUNS - 1]:
            runs.append(await run(prompt, "resume", thread, after=runs[0]))
        return runs

    runs = run_clients(qtbot, turns)
    thread = codex_session_id(runs[0])
    # Each resumed run says it continues the same session.
    assert [codex_session_id(run) for run in runs] == [thread] * RUNS, [r.stderr for r in runs]

    row, turns_seen = await_session_row(window, qtbot, key="codex", session=thread)

    assert len(turns_seen) >= RUNS, inspected(window, "codex", None)  # one call per run at least
    assert all(turn["cached_tokens"] > 0 for turn in turns_seen[1:]), turns_seen
    assert (row["Session"], row["Model"], row["Turns"]) == (thread, MODEL_ID, str(len(turns_seen)))
    assert row["Prompt cached"] == hit_share(turns_seen) != "0 %"
    assert row["Prefix lives on"] in ("this machine", "this machine, slot 0"), row
    assert row["Last miss"] == "—", row  # every turn after the first found the one before


async def test_opencode_turns_show_as_one_session_with_its_hit_share(window: MainWindow, qtbot,
                                                                     clients: Clients,
                                                                     tmp_path: Path):
    service = window.bridge.service
    secret = await add_key("opencode")
    snippet = opencode_snippet(key_target(service, secret))
    config = json.loads(snippet.text) | {"autoupdate": False, "share": "disabled"}

    async def turns(processes: list[Process]) -> list[Run]:
        opencode = OpenCode(clients, tmp_path, processes)

        async def run(prompt: str, *args: str, after: Run | None = None) -> Run:
            done = await (await opencode.start(service, prompt, config=config,
                                               env=pasted_env(snippet),
                                               args=("--format", "json", *args),
                                               continuing=after)).result()
            assert done.returncode == 0 and done.text, done.describe()
            return done

        runs = [await run("Say hello.")]
        session = opencode_session_id(runs[0])
        for prompt in ("Now say it in French.", "And in German.")[:RUNS - 1]:
            runs.append(await run(prompt, "--session", session, after=runs[0]))
        return runs

    runs = run_clients(qtbot, turns)
    session = opencode_session_id(runs[0])
    assert [opencode_session_id(run) for run in runs] == [session] * RUNS

    row, turns_seen = await_session_row(window, qtbot, key="opencode", session=session)

    # The first run's title request (another conversation, sent with the session's own
    # headers) is one of the session's turns; each later run's turn found the one before.
    assert len(turns_seen) >= RUNS + 1
    assert all(turn["cached_tokens"] > 0 for turn in turns_seen[-(RUNS - 1):]), turns_seen
    assert (row["Session"], row["Model"], row["Turns"]) == (session, MODEL_ID, str(len(turns_seen)))
    assert row["Prompt cached"] == hit_share(turns_seen) != "0 %"
    assert row["Prefix lives on"] in ("this machine", "this machine, slot 0"), row
    # The title request began another conversation: no miss (it showed "prefix changed at
    # token 12 (tools re-rendered)", the agent's first turn judged against the title).
    assert row["Last miss"] == "—", row


# --- helpers -----------------------------------------------------------------------------

def run_clients(qtbot, turns: Callable[[list[Process]], Awaitable[T]]) -> T:
    """`turns(processes)` on a worker thread's own event loop, while the Qt loop turns;
    any client it started and left running is killed."""

    async def bounded() -> T:
        processes: list[Process] = []
        try:
            return await turns(processes)
        finally:
            for process in processes:
                await process.stop()

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        future = pool.submit(asyncio.run, bounded())
        qtbot.waitUntil(future.done, timeout=int(RUNS * CLIENT_TIMEOUT * 1000) + 30_000)
        return future.result()


def await_session_row(window: MainWindow, qtbot, *, key: str,
                      session: str) -> tuple[dict[str, str], list[dict[str, Any]]]:
    """Once the Sessions tab shows as many turns of `key`'s session `session` as the
    inspector lists: that tab's one row of `key` (every row of `key` must be that session),
    and the inspector's records of the session, oldest first."""
    found: list[tuple[dict[str, str], list[dict[str, Any]]]] = []

    def shown() -> bool:
        rows = [dict(zip(COLUMNS, row)) for row in window.sessions.rows()]
        mine = [row for row in rows if row["Key"] == key]
        records = inspected(window, key, session)
        if len(mine) != 1 or not records or mine[0]["Turns"] != str(len(records)):
            return False
        found.append((mine[0], records))
        return True

    try:
        qtbot.waitUntil(shown, timeout=15_000)
    except qtbot.TimeoutError:
        raise AssertionError(f"the Sessions tab shows {window.sessions.rows()}, the inspector "
                             f"{inspected(window, key, None)}") from None
    return found[-1]


def inspected(window: MainWindow, key: str, session: str | None) -> list[dict[str, Any]]:
    """The inspector's answered records of `key` (and `session`, unless None), as the
    owner reads them."""
    port = window.bridge.gateway_port
    answer = httpx.get(f"http://127.0.0.1:{port}/requests", headers=auth_headers(), timeout=10)
    assert answer.status_code == 200, answer.text
    return [record for record in answer.json()["data"]
            if record["key"] == key and record["status"] == 200
            and (session is None or record["session"] == session)]


def hit_share(records: list[dict[str, Any]]) -> str:
    """The share of the records' prompt tokens the engine's cache held, as the tab shows it."""
    cached = sum(record["cached_tokens"] for record in records)
    computed = sum(record["computed_tokens"] for record in records)
    return f"{round(100 * cached / (cached + computed), 1):.0f} %"


def codex_session_id(run: Run) -> str:
    """The session id Codex prints in its header (stderr)."""
    found = re.search(r"^session id: (\S+)$", run.stderr, re.MULTILINE)
    assert found, run.describe()
    return found.group(1)


def opencode_session_id(run: Run) -> str:
    """The session id of `opencode run --format json`'s events (each names it)."""
    ids = {event["sessionID"] for line in run.stdout.splitlines() if line.startswith("{")
           for event in [json.loads(line)] if "sessionID" in event}
    assert len(ids) == 1, run.describe()
    return ids.pop()
