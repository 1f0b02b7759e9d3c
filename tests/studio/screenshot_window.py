"""What the screenshot scripts share (`screenshots`, `make_screenshot`,
`make_chat_screenshot`): a private home for the run, the window started in it as a user
starts it, and a wait that keeps Qt's events flowing meanwhile."""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from PySide6.QtWidgets import QApplication

    from studio.window import MainWindow


def private_home(prefix: str) -> Path:
    """A new temporary folder made this process's HOME and XDG dirs, its `home` made: the
    real user's settings, library, keys and logs are never read or touched."""
    from tests.studio.conftest import private_environment

    home = Path(tempfile.mkdtemp(prefix=prefix))
    os.environ.update(private_environment(home))
    (home / "home").mkdir()
    return home


def start_window(size: tuple[int, int] | None = None) -> tuple[QApplication, MainWindow]:
    """The application and its window, shown (at `size`, else its own), with the port on
    a free port.  Imported here, once the environment is the private home's."""
    from PySide6.QtWidgets import QApplication

    from backend.settings import Settings
    from studio.app import app_icon, build_window
    from tests.studio.conftest import free_port

    app = QApplication([sys.argv[0]])
    app.setWindowIcon(app_icon())
    Settings(port=free_port()).save()
    window = build_window()
    if size is not None:
        window.resize(*size)
    window.show()
    return app, window


def spin(until: Callable[[], bool], timeout: float = 120) -> None:
    """Process Qt's events until `until()` holds; TimeoutError after `timeout` seconds."""
    from PySide6.QtWidgets import QApplication

    deadline = time.monotonic() + timeout
    while not until():
        if time.monotonic() > deadline:
            raise TimeoutError
        QApplication.processEvents()
        time.sleep(0.01)
