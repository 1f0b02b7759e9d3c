"""Runs the real app, has the Chat tab stream an answer from the model, and quits (closing
the window) while the answer still streams.  Run as a child process by
test_chat_exit_path.py: its exit code is the app's.

    python -m tests.studio.chat_exit_probe MODEL

Prints one JSON line: the engine's pid and how much of the answer the tab showed.
"""

from __future__ import annotations

import json
import sys

from PySide6.QtCore import QObject, QTimer

from backend.llama.load import State
from studio.app import main
from studio.window import CHAT_TAB, MainWindow

#: The answer is cut this far in: long enough to be a stream, short of its end.
SHOWN_CHARS = 200


class Driver(QObject):
    def __init__(self, window: MainWindow, model: str) -> None:
        super().__init__()
        self.window = window
        self.loading = self.sent = False
        window.tabs.setCurrentIndex(CHAT_TAB)
        window.open_files([model])
        self._poll = QTimer(self)
        self._poll.timeout.connect(self._step)
        self._poll.start(20)

    def _step(self) -> None:
        window, chat = self.window, self.window.chat
        if window.model_view.info is not None and not self.loading:
            self.loading = True  # once: a second load would supersede the first
            window.load_selected()
        elif chat.model.count() and window.bridge.snapshot.state is State.READY and not self.sent:
            self.sent = True
            chat.max_tokens.setValue(4000)
            chat.input.setPlainText("Tell me a very long story.")
            chat.send()
        elif chat.state.streaming and len(chat.transcript.toPlainText()) > SHOWN_CHARS:
            self._poll.stop()
            print(json.dumps({"pid": window.bridge.snapshot.pid,
                              "shown": len(chat.transcript.toPlainText())}), flush=True)
            window.ask = self._answer_yes  # type: ignore[method-assign]
            window.close()

    def _answer_yes(self, title: str, text: str) -> bool:
        return True  # "Stop serving?": the chat's answer is still running


if __name__ == "__main__":
    drivers: list[Driver] = []
    sys.exit(main([], on_window=lambda window: drivers.append(Driver(window, sys.argv[1]))))
