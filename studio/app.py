"""GGUF Studio's desktop app: a QApplication on a qasync loop, and the main window.

The backend service runs on its own thread (see studio.bridge); the Qt loop only ever
draws and reacts.  Quitting stops the engine and closes the port before returning.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Callable, Sequence, cast

import platformdirs
import qasync
from PySide6.QtCore import QTimer
from PySide6.QtGui import QIcon
from PySide6.QtWidgets import QApplication

from backend.app.desktop_entry import find_icon_source
from backend.app.desktop_libraries import platform_problem
from backend.errors import SettingsError
from backend.models.library import ModelLibrary
from backend.settings import APP_NAME, Settings, settings_path
from backend.url_credentials import hide_url_credentials_in_logs

from studio.bridge import ServiceBridge
from studio.window import MainWindow

__all__ = ["app_icon", "build_window", "main", "self_test"]

log = logging.getLogger("gguf_studio.studio")

def main(argv: Sequence[str] | None = None, *,
         on_window: Callable[[MainWindow], None] | None = None) -> int:
    """Open the window and run until it is closed; returns the exit code.

    `on_window` is called with the shown window (the exit-path test drives it).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a == "--self-test" or a.startswith("--self-test=") for a in argv):
        return _self_test_from_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The access log is for the Logs tab; the terminal gets warnings only.
    for handler in logging.getLogger().handlers:
        handler.setLevel(logging.WARNING)
    hide_url_credentials_in_logs()  # an upstream's http://user:password@host
    app = _application(argv)
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    window = build_window()
    _quit_on_signals(app)
    try:
        window.show()
        if on_window is not None:
            on_window(window)
        with loop:
            loop.run_forever()
    finally:
        # Whatever ended the loop (the window, Quit, a signal), the engine must not
        # outlive the app.
        window.save_state()
        window.shutdown()
        asyncio.set_event_loop(None)
    return 0


def self_test(model_path: str, *, llama_server: str | None = None, timeout: float = 180.0) -> int:
    """`--self-test MODEL`: show the window, load MODEL through the window's own service on
    a loopback ephemeral port, answer one chat completion through that port, quit.
    Returns 0 when all of it worked.  The traffic runs on the backend thread; the Qt loop
    only waits for the result."""
    from backend.app.self_test import FAILED

    app = _application([])
    loop = qasync.QEventLoop(app)
    asyncio.set_event_loop(loop)
    try:
        saved = Settings.load()  # the user's chosen engine
    except SettingsError:
        saved = Settings()
    window = build_window(saved.replace(host="127.0.0.1", port=0))  # never the user's port
    code = 1
    try:
        window.show()
        future = window.bridge.run_self_test(model_path, llama_server, timeout)
        with loop:
            try:
                code = loop.run_until_complete(asyncio.wrap_future(future))
            except Exception as exc:
                print(f"{FAILED} {exc!r}", file=sys.stderr)
    finally:
        window.shutdown()
        asyncio.set_event_loop(None)
    return code


def _self_test_from_args(argv: list[str]) -> int:
    import argparse

    from backend.app import self_test as headless

    parser = argparse.ArgumentParser(prog="gguf-studio-app")
    parser.add_argument("--self-test", metavar="MODEL", required=True)
    headless.add_arguments(parser)
    args, _ = parser.parse_known_args(argv)
    return self_test(args.self_test, llama_server=args.llama_server, timeout=args.timeout)


def build_window(settings: Settings | None = None) -> MainWindow:
    """The main window with its service started: settings, library and window state come
    from the platformdirs config dir."""
    problem = ""
    if settings is None:
        try:
            settings = Settings.load()
        except SettingsError as exc:
            problem = f"{exc} Using default settings."
            settings = Settings()
    config_dir = Path(platformdirs.user_config_dir(APP_NAME))
    bridge = ServiceBridge(settings)
    window = MainWindow(bridge, ModelLibrary.load(), settings, settings_path=settings_path(),
                        state_path=config_dir / "window.ini")
    window.setWindowIcon(app_icon())
    window.start()
    if problem:
        window.show_message(problem)
    return window


def _application(argv: list[str]) -> QApplication:
    if QApplication.instance() is None:
        # Qt aborts without naming what is missing; say it and exit cleanly instead.
        problem = platform_problem()
        if problem:
            print(problem, file=sys.stderr)
            raise SystemExit(1)
    app = cast(QApplication, QApplication.instance() or QApplication([sys.argv[0], *argv]))
    app.setApplicationName(APP_NAME)
    app.setApplicationDisplayName("GGUF Studio")
    app.setDesktopFileName("gguf-studio")
    app.setWindowIcon(app_icon())
    return app


def _quit_on_signals(app: QApplication) -> None:
    """Ctrl+C in a terminal and SIGTERM quit like the window's Quit: the engine stops."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_args: app.quit())
    # Python runs signal handlers only between bytecodes; while Qt waits in C++ none
    # run, so wake the interpreter now and then.
    timer = QTimer(app)
    timer.timeout.connect(lambda: None)
    timer.start(250)


def app_icon() -> QIcon:
    path = find_icon_source()
    return QIcon(str(path)) if path is not None else QIcon()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
