"""The window without a running model: library, cards, settings, engine, closing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from PySide6.QtCore import Qt
from PySide6.QtGui import QTextDocument

from backend.app.activity import ActivitySample
from backend.app.model_account import ModelAccount, model_account
from backend.llama.engine import BuildProgress
from backend.llama.kv_capacity import KvCapacity
from backend.settings import Settings
from backend.llama.engine_speed import BatchChoice, EngineSpeed, SpeedModel
from backend.llama.load import LoadSettings, Serving, Snapshot, State
from studio.window import ACTIVITY_TAB, ENGINE_TAB, LOGS_TAB
from tests.studio.conftest import close_and_stop, free_port

WAIT = 10_000


def select(qtbot, window, path: Path) -> None:
    qtbot.waitUntil(lambda: window.library_view.select_path(str(path)), timeout=WAIT)


def test_card_shows_the_model_metadata(open_window, qtbot, tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    view = window.model_view
    assert view.title.text() == "tiny"  # as the list names it; general.name on hover
    assert "tiny-test-llama" in view.title.toolTip()
    assert view.facts["architecture"].text() == "llama"
    assert view.facts["quantization"].text() == "F32"
    assert view.facts["context"].text() == "8,192 tokens"
    assert view.facts["template"].text() == "the model's own"
    assert view.facts["size"].text().endswith("MiB")
    assert view.facts["parameters"].text().endswith("M")
    assert not view.problem.isVisible()
    assert view.load_button.isEnabled()


def test_broken_gguf_shows_its_reason(open_window, qtbot, tiny_model: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_model.read_bytes()[: 2_000_000])
    not_gguf = tmp_path / "notes.gguf"
    not_gguf.write_text("hello")
    window = open_window()
    window.open_files([str(truncated), str(not_gguf)])
    view = window.model_view

    select(qtbot, window, truncated)
    qtbot.waitUntil(lambda: "truncated" in view.problem.text(), timeout=WAIT)
    assert view.problem.isVisible()
    assert "Traceback" not in view.problem.text()
    assert not view.load_button.isEnabled()

    select(qtbot, window, not_gguf)
    qtbot.waitUntil(lambda: "not a GGUF model file" in view.problem.text(), timeout=WAIT)


def test_library_discovers_caches_and_searches(open_window, qtbot, studio_home: Path,
                                               tiny_model: Path) -> None:
    hub = studio_home / "home" / ".cache" / "huggingface" / "hub"
    snapshot = hub / "models--someone--Tiny-GGUF" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    shutil.copy(tiny_model, snapshot / "tiny-hf.gguf")
    lms = studio_home / "home" / ".lmstudio" / "models" / "pub" / "Other-GGUF"
    lms.mkdir(parents=True)
    shutil.copy(tiny_model, lms / "other-q4.gguf")
    # XDG_CACHE_HOME points elsewhere in the fixture; the HF cache follows it.
    (studio_home / "cache" / "huggingface").mkdir(parents=True)
    shutil.move(str(hub), str(studio_home / "cache" / "huggingface" / "hub"))

    window = open_window()
    view = window.library_view
    qtbot.waitUntil(lambda: len(view.entries()) == 2, timeout=WAIT)
    assert {(e.name, e.source_label, e.detail) for e in view.entries()} == {
        ("tiny-hf", "Hugging Face", "someone/Tiny-GGUF"), ("other-q4", "LM Studio", "pub/Other-GGUF")}
    qtbot.keyClicks(view.search, "hf")
    assert [e.name for e in view.entries()] == ["tiny-hf"]
    view.search.clear()
    qtbot.keyClicks(view.search, "nothing-like-this")
    assert view.entries() == [] and not view.empty_label.isHidden()


def test_owned_flags_are_refused_with_a_message(open_window, qtbot, tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    window.model_view.extra_args.setText("--port 9000")
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    assert window.model_view.settings_error.isVisible()
    assert "--port" in window.model_view.settings_error.text()
    assert window.bridge.snapshot.state is State.STOPPED


def test_rpc_workers_llama_cpp_cannot_reach_are_refused_with_a_message(open_window, qtbot,
                                                                      tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    window.model_view.rpc.setText("[::1]:50052")
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    assert window.model_view.settings_error.isVisible()
    assert "IPv4 only" in window.model_view.settings_error.text()
    assert window.bridge.snapshot.state is State.STOPPED


def test_effective_slots_are_marked_when_the_server_decided_otherwise(open_window) -> None:
    view = open_window().model_view
    def ready(parallel: str) -> ModelAccount:
        return model_account(Snapshot(state=State.READY, model_id="m",
                                      serving=Serving("http://e", 4, 2048),
                                      requested=LoadSettings(parallel=parallel)), None)

    view.show_account(ready("2"))
    # Plain words first; the engine's detail behind the toggle.
    assert view.state.text() == "Ready — 4 requests at once, up to 2,048 tokens each"
    assert view.slots_icon.isVisible() and view.details.isHidden()
    view.details_button.click()
    assert view.details.isVisible()
    assert "Parallel slots: 4 — you asked for 2; llama-server decided otherwise" in view.details.text()
    view.show_account(ready("4"))
    assert "asked" not in view.details.text() and not view.slots_icon.isVisible()
    view.show_account(ready("auto"))
    assert "Parallel slots: 4 (chosen by llama-server)" in view.details.text()
    view.show_account(model_account(Snapshot(state=State.STARTING, restarting=True,
                                             error="it crashed."), None))
    assert view.state.text() == "Restarting — it crashed." and view.progress.isVisible()
    view.show_account(model_account(Snapshot(state=State.FAILED, error="no memory."), None))
    assert view.state.text() == "Failed — no memory."


def test_settings_survive_a_restart(open_window, qtbot, tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    window.model_view.ctx_size.setValue(4096)
    window.model_view.parallel.setValue(3)
    window.model_view.extra_args.setText("--temp 0.5")
    window.model_view.extra_args.editingFinished.emit()
    window.model_view.rpc.setText("10.0.0.2:50052, Gpu-Box")
    window.model_view.rpc.editingFinished.emit()
    window.sharing.lan.click()
    qtbot.waitUntil(lambda: window.settings.host == "0.0.0.0", timeout=WAIT)
    key, port = window.settings.api_key, window.settings.port
    window.tabs.setCurrentIndex(LOGS_TAB)
    window.resize(1000, 700)
    # 700 high, or the window's minimum where this machine's fonts make it taller
    # (Noto's taller lines: 703): what is restored is the size it really took.
    taken = (1000, max(700, window.minimumHeight()))
    assert taken[1] < 860  # not its first 1240 x 860
    qtbot.waitUntil(lambda: (window.width(), window.height()) == taken, timeout=WAIT)
    close_and_stop(window)

    again = open_window()
    assert again.sharing.lan.isChecked()
    assert again.settings.api_key == key and again.sharing.port.value() == port
    assert again.tabs.currentIndex() == LOGS_TAB
    assert (again.width(), again.height()) == taken
    assert Settings.load().api_key == key
    select(qtbot, again, tiny_model)
    assert again.model_view.load_settings() == LoadSettings(
        ctx_size=4096, parallel="3", extra_args=("--temp", "0.5"),
        rpc=("10.0.0.2:50052", "gpu-box:50052"))
    assert again.model_view.rpc.text() == "10.0.0.2:50052, gpu-box:50052"


def test_on_relaunch_the_network_port_waits_for_a_model(open_window, qtbot, with_engine: Path,
                                                       tiny_model: Path) -> None:
    """Shared on the LAN last time: the relaunched window opens the port on this computer
    only, says so, and shares it on the network once a model is ready."""
    from backend.addresses import client_urls

    Settings(host="0.0.0.0", api_key="owner-key-of-the-relaunch-test-0123", port=free_port()).save()
    window = open_window()
    assert window.sharing.lan.isChecked() and not window.sharing.lan_wait.isHidden()
    qtbot.waitUntil(lambda: bool(window.bridge.urls), timeout=WAIT)
    assert window.bridge.service.settings.host == "127.0.0.1"
    assert window.bridge.urls == client_urls("127.0.0.1", window.settings.port)

    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    window.load_selected()
    qtbot.waitUntil(lambda: window.bridge.service.settings.host == "0.0.0.0", timeout=60_000)
    qtbot.waitUntil(lambda: window.bridge.urls == client_urls("0.0.0.0", window.settings.port),
                    timeout=WAIT)
    assert window.sharing.lan_wait.isHidden()
    assert Settings.load().host == "0.0.0.0"  # what the owner chose stays saved


def test_lan_needs_a_key_and_regenerating_replaces_it(open_window, qtbot) -> None:
    window = open_window()
    assert window.settings.api_key == ""
    window.sharing.lan.click()
    qtbot.waitUntil(lambda: window.settings.host == "0.0.0.0", timeout=WAIT)
    first = window.settings.api_key
    assert first.startswith("gs-") and len(first) > 30
    assert window.sharing.key.echoMode() == window.sharing.key.EchoMode.Password
    assert first not in window.sharing.snippet_tabs.widget(2).findChildren(
        type(window.logs.text))[0].toPlainText()

    window.ask = lambda *_args: False
    window.sharing.generate_key.click()
    assert window.settings.api_key == first
    window.ask = lambda *_args: True
    window.sharing.generate_key.click()
    assert window.settings.api_key != first
    window.sharing.show_key.click()
    assert window.sharing.key.echoMode() == window.sharing.key.EchoMode.Normal
    assert window.settings.api_key in window.sharing.snippets()[-1].text  # curl's

    window.sharing.local_only.click()
    qtbot.waitUntil(lambda: bool(window.sharing.urls) and "127.0.0.1" in window.sharing.urls[0],
                    timeout=WAIT)
    assert window.settings.host == "127.0.0.1"


def test_a_saved_key_that_is_too_short_is_named_and_not_served(open_window, studio_home: Path
                                                                ) -> None:
    """An older version took any key: the window says why it is not used, and the port
    it opens is this computer's only, without the short key."""
    path = studio_home / "config" / "gguf-studio" / "settings.json"
    saved = json.loads(path.read_text())
    path.write_text(json.dumps(dict(saved, host="0.0.0.0", api_key="letmein")))
    window = open_window()
    message = window.statusBar().currentMessage()
    assert "API key is too short (7 characters)" in message and "at least 16" in message
    assert window.settings.api_key == "" and window.settings.host == "127.0.0.1"
    assert window.sharing.local_only.isChecked()


def test_port_in_use_is_reported(open_window, qtbot) -> None:
    import socket

    window = open_window()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        window.sharing.port.setValue(port)
        window.sharing.port.editingFinished.emit()
        qtbot.waitUntil(lambda: not window.sharing.problem.isHidden(), timeout=WAIT)
        assert str(port) in window.sharing.problem.text()


def test_engine_missing_offers_a_build(open_window, qtbot, monkeypatch, tiny_model: Path,
                                       tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    window = open_window()
    engine = window.engine
    assert engine.summary.text() == "No llama-server found"
    assert not engine.build_button.isHidden() and engine.build_button.isEnabled()
    assert not engine.choose_button.isHidden()

    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    qtbot.mouseClick(window.model_view.load_button, Qt.MouseButton.LeftButton)
    qtbot.waitUntil(lambda: window.tabs.currentIndex() == ENGINE_TAB, timeout=WAIT)
    assert "No llama-server found" in window.model_view.state.text()

    # The build's progress events drive the bar (the build itself takes minutes).
    window.bridge.build_progressed.emit([BuildProgress("compile", 40, "[10/25] building"),
                                       BuildProgress("compile", 52.5, "[13/25] building")])
    assert engine.progress.value() == 52 and not engine.build_box.isHidden()
    assert "[13/25] building" in engine.build_log.toPlainText()
    window.bridge.build_finished.emit("Compiling llama-server failed (exit 1).")
    assert "failed" in engine.phase.text()


def test_choosing_a_binary_uses_it(open_window, monkeypatch, tmp_path: Path,
                                   llama_server_binary: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    window = open_window()
    window.engine.binary_chosen.emit(str(llama_server_binary))
    assert window.engine.summary.text() == "llama-server is ready to use"
    assert window.engine.path.text() == str(llama_server_binary)
    assert window.settings.llama_server == str(llama_server_binary)


def test_closing_with_requests_in_flight_asks_first(open_window) -> None:
    window = open_window()
    asked = []

    def ask(*args):
        asked.append(args)
        return False
    window.ask = ask
    window.bridge.requests_in_flight = lambda timeout=1.0: 3
    window.close()
    assert asked and "3 requests" in asked[0][1]
    assert window.isVisible()
    window.ask = lambda *_args: True
    window.close()
    assert not window.isVisible()


def test_closing_while_teammates_used_the_port_lately_names_them(open_window) -> None:
    window = open_window()
    asked = []

    def ask(*args):
        asked.append(args)
        return False
    window.ask = ask
    service = window.bridge.service

    async def teammate_asked() -> None:
        service.requests.add(route="/v1/responses", key="alice", model="tiny")

    window.bridge.backend_thread.submit(teammate_asked()).result(10)
    window.close()
    assert asked and "alice used the port in the last 10 minutes" in asked[0][1]
    assert window.isVisible()


def test_closing_idle_does_not_ask(open_window) -> None:
    window = open_window()
    window.ask = lambda *_args: pytest_fail()
    window.close()
    assert not window.isVisible()


def pytest_fail() -> bool:
    raise AssertionError("asked although nothing was running")


def test_logs_filter_and_sources(open_window) -> None:
    logs = open_window().logs
    logs.add_lines([("llama-server", "main: model loaded"), ("access", "POST /v1/chat 200"),
                    ("llama-server", "slot 0: done")])
    assert logs.visible_text().count("\n") == 2
    logs.filter.setText("slot")
    assert logs.visible_text() == "[engine] slot 0: done"
    logs.filter.clear()
    logs.source.setCurrentIndex(2)
    assert logs.visible_text() == "POST /v1/chat 200"
    logs.add_lines([("llama-server", "ignored here"), ("access", "GET /v1/models 200")])
    assert logs.visible_text() == "POST /v1/chat 200\nGET /v1/models 200"


def test_the_logs_hide_an_idle_engines_routine_lines_until_asked(open_window) -> None:
    logs = open_window().logs
    logs.add_lines([("llama-server", "srv  update_slots: all slots are idle"),
                    ("llama-server", "slot launch_slot_: id  0 | task 3 | processing task"),
                    ("llama-server", "srv  update_slots: all slots are idle"),
                    ("access", "POST /v1/chat/completions 499 (stopped by the client) 812.0ms "
                               "key alice from 10.0.0.7")])
    assert logs.visible_text().splitlines() == [
        "[engine] slot launch_slot_: id  0 | task 3 | processing task",
        "[access] POST /v1/chat/completions 499 (stopped by the client) 812.0ms key alice "
        "from 10.0.0.7"]
    logs.routine.setChecked(True)
    assert logs.visible_text().count("all slots are idle") == 2


def test_chart_repaints_at_most_ten_times_a_second(open_window, qtbot) -> None:
    window = open_window()
    window.tabs.setCurrentIndex(ACTIVITY_TAB)
    chart = window.activity.chart
    qtbot.waitExposed(chart)
    before = chart.paints
    for i in range(200):
        window.activity.add_sample(ActivitySample(time=float(i) / 100, active=i % 3, waiting=i % 5,
                                                  slots_total=4, tokens_per_s=float(i)))
    assert window.activity.values["slots"].text() == "1 / 4"
    qtbot.wait(350)
    assert 1 <= chart.paints - before <= 5


def test_keyboard_reaches_everything_in_order(open_window) -> None:
    from PySide6.QtWidgets import QAbstractButton

    window = open_window()
    for button in window.findChildren(QAbstractButton):
        if button.isVisibleTo(window):
            assert button.text().strip() or button.accessibleName(), button
    lv, mv = window.library_view, window.model_view
    chain = [lv.search, lv.list, lv.open_button, lv.folder_button, lv.rescan_button,
             mv.ctx_size, mv.parallel, mv.threads, mv.gpu_layers, mv.extra_args, mv.rpc]
    for first, second in zip(chain, chain[1:]):
        following = first.nextInFocusChain()
        # Skip what Tab passes over: unfocusable widgets and a spin box's own line edit.
        while following is not second and (following.focusPolicy() == Qt.FocusPolicy.NoFocus
                                            or first.isAncestorOf(following)
                                            or not following.isVisibleTo(window)):
            following = following.nextInFocusChain()
        assert following is second, (first, second, following)
    assert window.windowIcon().isNull() is False


def test_open_log_folder(open_window, monkeypatch, studio_home: Path) -> None:
    from PySide6.QtGui import QDesktopServices

    opened = []

    def open_url(url):
        opened.append(url)
        return True
    monkeypatch.setattr(QDesktopServices, "openUrl", open_url)
    logs = open_window().logs
    logs.open_folder.click()
    assert [url.toLocalFile() for url in opened] == [str(logs.log_dir)]
    assert logs.log_dir.is_dir() and studio_home in logs.log_dir.parents


def test_load_settings_say_what_they_mean_before_loading_and_what_the_engine_gave_after(
        open_window, qtbot, tiny_model: Path) -> None:
    window = open_window()
    window.open_files([str(tiny_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    view = window.model_view
    view.ctx_size.setValue(16384)
    view.parallel.setValue(0)  # Auto
    assert view.plan.text() == ("Up to 4 requests at once; each up to 8,192 tokens; "
                                "one shared pool of 16,384 tokens.")
    view.parallel.setValue(2)
    assert view.plan.text() == "Up to 2 requests at once; each slot has its own 8,192 tokens."
    # The model's own context with a number of slots: llama-server gives each slot the
    # whole trained context (8,192), not a quarter of it, unless --fit shrinks it.
    view.ctx_size.setValue(0)
    view.parallel.setValue(4)
    assert view.plan.text() == ("Up to 4 requests at once; each slot has up to 8,192 tokens of "
                                "its own. The engine may give less to fit the memory (not "
                                "below 16,384 tokens in total).")
    view.show_account(model_account(Snapshot(
        state=State.READY, model_id="m",
        serving=Serving("http://e", 4, 4096, kv=KvCapacity(16384, 4096, unified=True)),
        requested=LoadSettings(parallel="auto", ctx_size=16384)), None))
    assert ("Engine gave: up to 4 requests at once; each up to 4,096 tokens; "
            "one shared pool of 16,384 tokens.") in view.details.text()


def test_the_context_size_says_what_it_takes_and_the_hover_where_it_goes(
        open_window, qtbot, gemma3_model: Path) -> None:
    window = open_window()
    window.open_files([str(gemma3_model)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    view = window.model_view
    view.parallel.setValue(1)
    view.ctx_size.setValue(32768)
    # What llama-server allocates for it: 96 MiB for the 3 global layers, 15 MiB for the
    # 15 sliding ones (a window and a micro-batch each); not 576 MiB of 18 full layers.
    # Memory reads in one unit family everywhere (MiB, GiB).
    assert view.memory_plan.text() == "KV cache 111 MiB"
    assert view.memory_plan.toolTip().startswith(
        "15 of 18 layers keep a 512-token sliding window. 111 MiB: 96 MiB for 32,768 tokens "
        "in 3 layers, 15 MiB for 15 sliding-window layers (512 tokens; 1,024 cells); context "
        "checkpoints may add up to ")
    view.extra_args.setText("--swa-full")
    view.extra_args.editingFinished.emit()
    assert view.memory_plan.text() == "KV cache 576 MiB"


def test_activity_shows_kv_tokens_reserved_next_to_the_slots(open_window) -> None:
    window = open_window()
    window.activity.add_sample(ActivitySample(time=1.0, active=2, slots_total=4,
                                              kv_reserved=13000, kv_capacity=16384))
    assert window.activity.values["kv"].text() == "13,000 / 16,384"
    window.activity.add_sample(ActivitySample(time=2.0))
    assert window.activity.values["kv"].text() == "— / —"


def test_a_models_own_name_is_shown_as_text_never_as_markup(open_window, qtbot, tmp_path: Path,
                                                             vocab_path: Path) -> None:
    """GGUF general.name is the file's to say: markup in it (an image fetched from
    anywhere, a link) is shown as the characters it is, on every label."""
    from PySide6.QtWidgets import QLabel
    from tests.model_factory import write_tiny_model
    name = "<img src='http://evil.example/pixel.png'><b>Evil</b> <a href='http://evil.example'>x</a>"
    hostile = write_tiny_model(tmp_path / "hostile.gguf", vocab_path, name=name)
    window = open_window()
    window.open_files([str(hostile)])
    qtbot.waitUntil(lambda: window.model_view.info is not None, timeout=WAIT)
    # The heading names the file; the name inside it is its hover, escaped.
    shown = QTextDocument()
    shown.setHtml(window.model_view.title.toolTip())
    assert shown.toPlainText() == f"Named in the file: {name}"
    showing = [label for label in window.findChildren(QLabel) if name in label.text()]
    assert [label.textFormat() for label in showing] == [Qt.TextFormat.PlainText] * len(showing)
    rich = [label.text()[:40] for label in window.findChildren(QLabel)
            if label.textFormat() != Qt.TextFormat.PlainText]
    assert all(name not in text for text in rich)


def test_the_model_tab_shows_the_engines_measured_speed_and_its_batch(open_window) -> None:
    view = open_window().model_view
    choice = BatchChoice(256, 256, "the largest whose step stays within the 250 ms stall budget")
    speed = EngineSpeed(1234.0, 0.031, SpeedModel(0.0008, 1e-7, 0.031), choice, 0.24)
    view.show_account(model_account(Snapshot(
        state=State.READY, model_id="m", serving=Serving("http://e", 4, 8192, speed=speed),
        requested=LoadSettings(parallel="4")), None))
    assert "stall budget" not in view.state.text()  # the jargon stays behind Details
    assert ("Prompts at 1,234 tokens/s, a step 31 ms; batch 256 (micro-batch 256): the "
            "largest whose step stays within the 250 ms stall budget") in view.details.text()
