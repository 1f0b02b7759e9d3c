"""Fixtures for driving the real window: a private home and config, a free port.

Every test runs with HOME, the XDG dirs and the model caches pointed into its tmp_path,
so the window never reads or writes the real user's settings, library or logs.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import pytest
from PySide6.QtWidgets import QApplication

from backend.settings import Settings
from studio.app import build_window
from studio.window import MainWindow


# Qt's offscreen screen is 800 x 600 unless told otherwise; the window (and its saved
# geometry, which Qt keeps on screen) wants a desktop-sized one.
if os.environ.get("QT_QPA_PLATFORM") == "offscreen":
    _screen = Path(tempfile.gettempdir()) / "gguf-studio-test-screen.json"
    _screen.write_text(json.dumps({"screens": [{
        "name": "test", "x": 0, "y": 0, "width": 1600, "height": 1000,
        "logicalDpi": 96, "logicalBaseDpi": 96, "dpr": 1}]}))
    os.environ["QT_QPA_PLATFORM"] = f"offscreen:configfile={_screen}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def private_environment(root: Path) -> dict[str, str]:
    """Environment changes that keep a studio (in or out of process) inside `root`."""
    return {
        "HOME": str(root / "home"),
        "XDG_CONFIG_HOME": str(root / "config"),
        "XDG_STATE_HOME": str(root / "state"),
        "XDG_CACHE_HOME": str(root / "cache"),
        "XDG_DATA_HOME": str(root / "data"),
        "GGUF_STUDIO_DATA_DIR": str(root / "data" / "gguf-studio"),
        "QT_QPA_PLATFORM": os.environ.get("QT_QPA_PLATFORM", "offscreen"),
    }


@pytest.fixture
def studio_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in list(os.environ):
        if name.startswith("GGUF_STUDIO_") or name in ("HF_HOME", "HF_HUB_CACHE", "LLAMA_CACHE"):
            monkeypatch.delenv(name)
    for name, value in private_environment(tmp_path).items():
        monkeypatch.setenv(name, value)
    (tmp_path / "home").mkdir()
    Settings(port=free_port()).save()
    return tmp_path


@pytest.fixture
def with_engine(studio_home: Path, llama_server_binary: Path,
                monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("GGUF_STUDIO_LLAMA_SERVER", str(llama_server_binary))
    return llama_server_binary


@pytest.fixture
def open_window(qapp: QApplication, qtbot, studio_home: Path
                ) -> Iterator[Callable[[], MainWindow]]:
    """Opens windows the way the app does; closes them and stops their service afterwards."""
    qapp.setQuitOnLastWindowClosed(False)
    windows: list[MainWindow] = []

    def open_() -> MainWindow:
        window = build_window()
        windows.append(window)
        window.show()
        qtbot.waitExposed(window)
        return window

    yield open_
    for window in windows:
        # Closing asks whether to stop requests in flight; the test answers yes.
        window.ask = lambda *_args: True  # type: ignore[method-assign]
        window.close()
        window.shutdown()
        window.deleteLater()
    qapp.processEvents()


def close_and_stop(window: MainWindow) -> None:
    # Closing asks whether to stop requests in flight; the test answers yes.
    window.ask = lambda *_args: True  # type: ignore[method-assign]
    window.close()
    window.shutdown()
