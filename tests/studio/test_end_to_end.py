"""The real window, the real engine and the tiny model: pick, load, share, serve, unload."""

from __future__ import annotations

import concurrent.futures
import json
import tomllib
from pathlib import Path

import httpx
from PySide6.QtCore import Qt

from backend.addresses import client_urls
from backend.app.sharing.snippets import KEY_ENV_VAR, PROVIDER_ID
from backend.llama.load import State
from studio.window import ACTIVITY_TAB

LOAD_WAIT = 60_000
WAIT = 15_000


def chat(base_url: str, key: str | None, n: int = 8, max_tokens: int = 8) -> list[httpx.Response]:
    """`n` chat completions at once, from threads of the test: never on the Qt loop."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": "tiny", "max_tokens": max_tokens,
            "messages": [{"role": "user", "content": "Hello there"}]}

    def one(_i: int) -> httpx.Response:
        with httpx.Client(timeout=60) as client:
            return client.post(f"{base_url}/chat/completions", json=body, headers=headers)

    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        return list(pool.map(one, range(n)))


def test_pick_load_share_serve_unload(open_window, qtbot, with_engine: Path,
                                      tiny_model: Path) -> None:
    window = open_window()
    view = window.model_view

    # Pick a model: the card shows its metadata.
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: view.info is not None, timeout=WAIT)
    assert view.facts["architecture"].text() == "llama"

    # Load with two slots: ready, and the slots the server reports are shown.
    view.parallel.setValue(2)
    view.ctx_size.setValue(2048)
    qtbot.mouseClick(view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.STARTING, timeout=WAIT)
    qtbot.waitUntil(lambda: not view.progress.isHidden(), timeout=WAIT)  # its own engine loads
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    qtbot.waitUntil(lambda: view.state.text().startswith(
        "Ready (the default model) — 2 requests at once, up to 1,024 tokens each; on the CPU"),
        timeout=WAIT)
    assert view.details.text().startswith("Parallel slots: 2\n")  # as asked: nothing to say
    # A dense model parks with no checkpoints: the Model tab says so.
    assert "Parking: a session's prompt is saved before its model unloads" in view.details.text()
    assert "checkpoints" not in view.details.text()
    assert not view.slots_icon.isVisible()
    # The click's settings came back inside the snapshot, next to the effective values.
    requested = window.bridge.snapshot.requested
    assert requested is not None and (requested.parallel, requested.ctx_size) == ("2", 2048)
    assert view.progress.isHidden()
    assert window.library_view.entries()[0].last_used is not None

    # Share on the network: a key is made, every address is listed, snippets are filled.
    window.sharing.lan.click()
    qtbot.waitUntil(lambda: window.bridge.service.settings.host == "0.0.0.0", timeout=WAIT)
    key = window.settings.api_key
    assert key
    port = window.settings.port
    expected_urls = client_urls("0.0.0.0", port)
    qtbot.waitUntil(lambda: window.sharing.urls == expected_urls, timeout=WAIT)
    assert [field.text() for field in window.sharing.url_rows] == expected_urls
    base_url = expected_urls[0]
    codex, opencode, claude, curl = window.sharing.snippets()
    provider = tomllib.loads(codex.text)["model_providers"][PROVIDER_ID]
    assert provider["base_url"] == base_url and provider["wire_api"] == "responses"
    assert provider["env_key"] == KEY_ENV_VAR and key in codex.shell
    assert tomllib.loads(codex.text)["model"] == "default"  # the loaded model, whichever it is
    per_slot = window.bridge.snapshot.serving.context_length
    opencode_model = json.loads(opencode.text)["provider"][PROVIDER_ID]["models"]["default"]
    assert opencode_model["limit"]["context"] == per_slot
    claude_env = json.loads(claude.text)["env"]
    assert claude_env["ANTHROPIC_BASE_URL"] + "/v1" == base_url and key in claude.shell
    assert claude_env["ANTHROPIC_MODEL"] == "default"
    assert claude_env["CLAUDE_CODE_MAX_CONTEXT_TOKENS"] == str(per_slot)
    assert base_url in curl.text and key in curl.text

    # Without the key the port refuses; with it, requests go through.
    local = f"http://127.0.0.1:{port}/v1"
    refused = chat(local, None, n=1)[0]
    assert refused.status_code == 401
    window.tabs.setCurrentIndex(ACTIVITY_TAB)
    paints = window.activity.chart.paints
    answers = chat(local, key, n=8)
    assert [r.status_code for r in answers] == [200] * 8
    assert all(r.json()["choices"][0]["message"] for r in answers)

    # The activity numbers and the chart move.
    qtbot.waitUntil(lambda: window.activity.history.latest is not None
                    and window.activity.history.latest.requests >= 8, timeout=WAIT)
    values = window.activity.values
    # The models' requests, as the Requests tab lists them; the one without a key was
    # refused before it had a model: it counts among the refusals only.
    assert values["requests"].text() == "8"
    assert values["slots"].text().endswith("/ 2")
    assert "wrong or missing key: 1" in values["rejections"].text()
    assert window.activity.history.peak("requests_per_s") > 0
    assert window.activity.history.peak("active_peak") >= 1
    qtbot.waitUntil(lambda: window.activity.history.peak("tokens_per_s") > 0, timeout=WAIT)
    qtbot.waitUntil(lambda: window.activity.chart.paints > paints, timeout=WAIT)

    # The logs show the engine's output and the access log.
    qtbot.waitUntil(lambda: "POST /v1/chat/completions 200" in window.logs.visible_text(),
                    timeout=WAIT)
    assert "[engine]" in window.logs.visible_text()

    # Unload: the state and the slots reset.
    qtbot.mouseClick(view.unload_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.STOPPED, timeout=WAIT)
    qtbot.waitUntil(lambda: view.state.text() == "Not loaded. Press Load to serve it.",
                    timeout=WAIT)
    assert not view.details_button.isEnabled()
    qtbot.waitUntil(lambda: values["slots"].text() == "— / —", timeout=WAIT)
    assert chat(local, key, n=1)[0].status_code == 503


def test_the_model_tab_says_what_parking_does_for_a_hybrid(open_window, qtbot, with_engine: Path,
                                                           hybrid_model: Path) -> None:
    """A model whose recurrent state cannot be rolled back parks only with the slot's
    context checkpoints: the Model tab says so, and that this engine keeps them."""
    window = open_window()
    view = window.model_view
    window.open_files([str(hybrid_model)])
    qtbot.waitUntil(lambda: view.info is not None, timeout=WAIT)
    view.parallel.setValue(2)
    view.ctx_size.setValue(4096)
    qtbot.mouseClick(view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.READY, timeout=LOAD_WAIT)
    qtbot.waitUntil(lambda: "Parking:" in view.details.text(), timeout=WAIT)
    parking = next(line for line in view.details.text().splitlines()
                   if line.startswith("Parking:"))
    assert "a recurrent state" in parking
    assert "its engine saves them with the slot (up to 4 a slot" in parking
    qtbot.mouseClick(view.unload_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.bridge.snapshot.state is State.STOPPED, timeout=WAIT)
