"""Saves a screenshot of the Chat tab after two real answers (one with a code block).

    GGUF_STUDIO_LLAMA_SERVER=... xvfb-run -a -s "-screen 0 1600x1000x24" \\
        python -m tests.studio.make_chat_screenshot MODEL OUT.png

Runs in a private home (the real user's settings are not touched), on the X server
`xvfb-run` provides, so the picture is what a desktop shows.
"""

from __future__ import annotations

import os
import sys
import time

QUESTIONS = ("What is the capital of France?",
             "Write a Python function that returns the sum of a list of numbers, in a code block.")


def main(model: str, out: str) -> int:
    from tests.studio.screenshot_window import private_home, spin, start_window

    private_home("gguf-studio-chat-shot-")
    os.environ["QT_QPA_PLATFORM"] = "xcb"

    from backend.app.chat_session import AnswerState
    from backend.llama.load import State
    from studio.window import CHAT_TAB

    _app, window = start_window((1240, 860))
    try:
        window.open_files([model])
        spin(lambda: window.model_view.info is not None)
        window.model_view.ctx_size.setValue(4096)
        window.model_view.extra_args.setText("--no-repack")  # see tests/studio/test_pool_view.py
        window.load_selected()
        spin(lambda: window.bridge.snapshot.state is State.READY)
        window.tabs.setCurrentIndex(CHAT_TAB)
        chat = window.chat
        spin(lambda: chat.model.count() > 0)
        chat.system_prompt.setPlainText("You are a helpful coding assistant.")
        chat.temperature.setValue(0.0)
        chat.max_tokens.setValue(300)
        for question in QUESTIONS:
            chat.input.setPlainText(question)
            chat.send()
            spin(lambda: chat.state.streaming)
            spin(lambda: not chat.state.streaming
                 and chat.state.turns[-1].state is not AnswerState.WAITING)
        settle = time.monotonic() + 0.5  # the last repaint
        spin(lambda: time.monotonic() > settle)
        window.grab().save(out)
        return 0
    finally:
        window.ask = lambda _title, _text: True  # type: ignore[method-assign,assignment]
        window.close()
        window.shutdown()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
