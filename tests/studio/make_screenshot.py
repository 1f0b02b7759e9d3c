"""Saves a screenshot of the main window with a model loaded and traffic passing.

    GGUF_STUDIO_LLAMA_SERVER=... python -m tests.studio.make_screenshot MODEL OUT.png [TAB]

Runs offscreen in a private home, so the real user's settings are not touched.  TAB is
the index of the tab to show (0 Sharing, 1 Activity, 2 Logs, 3 Engine).
"""

from __future__ import annotations

import concurrent.futures
import sys
import time
from pathlib import Path

import httpx


def main(model: str, out: str, tab: int = 0) -> int:
    from tests.studio.screenshot_window import private_home, spin, start_window

    private_home("gguf-studio-shot-")

    from backend.llama.load import State

    _app, window = start_window((1240, 860))
    try:
        window.open_files([model])
        spin(lambda: window.model_view.info is not None)
        window.model_view.parallel.setValue(4)
        window.load_selected()
        spin(lambda: window.bridge.snapshot.state is State.READY)
        window.sharing.lan.click()
        spin(lambda: window.bridge.service.settings.host == "0.0.0.0" and bool(window.sharing.urls))
        key, port = window.settings.api_key, window.settings.port

        def chat(_i: int) -> int:
            with httpx.Client(timeout=120) as client:
                return client.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                                   headers={"Authorization": f"Bearer {key}"},
                                   json={"model": "tiny", "max_tokens": 24,
                                         "messages": [{"role": "user", "content": "Hi"}]}).status_code

        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            pending = [pool.submit(chat, i) for i in range(36)]
            spin(lambda: all(f.done() for f in pending), timeout=180)
        window.tabs.setCurrentIndex(tab)
        deadline = time.monotonic() + 2
        spin(lambda: time.monotonic() > deadline)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        window.grab().save(out)
    finally:
        window.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 0))
