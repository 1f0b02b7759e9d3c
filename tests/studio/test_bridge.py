"""The bridge: saving the window's files off the GUI thread, and after shutdown, where
callbacks still queued on the GUI thread may ask for more work."""

from __future__ import annotations

import threading
from pathlib import Path

from backend.models.library import ModelLibrary
from backend.settings import Settings, settings_path
from studio.bridge import ServiceBridge
from tests.studio.conftest import close_and_stop

WAIT = 10_000


def test_work_asked_after_shutdown_is_dropped_not_raised(qapp, studio_home: Path, tmp_path: Path):
    bridge = ServiceBridge(Settings(port=0), log_dir=tmp_path / "logs")
    bridge.shutdown()
    asked: list[str] = []
    future = bridge.run_in_thread(asked.append, "scan", on_done=asked.append)
    assert future.cancelled() and asked == []
    assert bridge.search_models("tiny", "downloads", on_done=asked.append, on_error=asked.append).cancelled()


def test_a_save_asked_after_shutdown_is_written_at_once(qapp, studio_home: Path, tmp_path: Path):
    bridge = ServiceBridge(Settings(port=0), log_dir=tmp_path / "logs")
    bridge.shutdown()
    path = tmp_path / "config" / "settings.json"
    bridge.save_settings(Settings(port=1234), path)
    assert Settings.load(path).port == 1234


def test_the_windows_saves_are_written_off_the_gui_thread(open_window, qtbot, tiny_model: Path,
                                                           monkeypatch):
    writers = record_writing_threads(monkeypatch)
    window = open_window()

    window.open_files([str(tiny_model)])
    window.apply_settings(window.settings.replace(allow_hosts=["studio.lan"]))

    qtbot.waitUntil(lambda: ModelLibrary.load().opened == [str(tiny_model)]
                    and Settings.load().allow_hosts == ["studio.lan"], timeout=WAIT)
    assert set(writers) == {"library", "settings"}
    assert threading.get_ident() not in writers["library"] | writers["settings"]


def test_saves_asked_just_before_quitting_are_written(open_window, qtbot, tiny_model: Path):
    window = open_window()
    qtbot.waitUntil(lambda: bool(window.sharing.urls), timeout=WAIT)
    for connections in range(100, 110):  # a burst, as a spin box's arrow gives
        window.apply_settings(window.settings.replace(max_connections=connections))
    window.open_files([str(tiny_model)])

    close_and_stop(window)

    assert Settings.load().max_connections == 109
    assert ModelLibrary.load().opened == [str(tiny_model)]


def test_a_save_that_fails_is_shown_and_the_settings_still_apply(open_window, qtbot):
    window = open_window()
    qtbot.waitUntil(lambda: bool(window.sharing.urls), timeout=WAIT)
    path = settings_path()
    path.unlink()
    path.mkdir()  # the settings file cannot be replaced

    window.apply_settings(window.settings.replace(allow_hosts=["studio.lan"]))

    qtbot.waitUntil(lambda: "The settings could not be saved: Is a directory."
                    in window.statusBar().currentMessage(), timeout=WAIT)
    qtbot.waitUntil(lambda: window.bridge.service.settings.allow_hosts == ["studio.lan"],
                    timeout=WAIT)


def record_writing_threads(monkeypatch) -> dict[str, set[int]]:
    """The threads that write the library and the settings files (their real `save`s)."""
    writers: dict[str, set[int]] = {}
    for name, cls in (("library", ModelLibrary), ("settings", Settings)):
        def save(self, *args, _name=name, _save=cls.save, **kwargs):
            writers.setdefault(_name, set()).add(threading.get_ident())
            return _save(self, *args, **kwargs)
        monkeypatch.setattr(cls, "save", save)
    return writers
