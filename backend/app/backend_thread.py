"""An asyncio loop in a thread of its own: the backend's, when a GUI owns the main thread.

The window (`studio.bridge`) runs `StudioService` (`backend.app.service`) on it and hands
it coroutines (`submit`) and calls (`call_soon`) from the Qt thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine, TypeVar

from backend import event_loop

__all__ = ["BackendThread"]

T = TypeVar("T")


class BackendThread:
    """An asyncio loop in a thread of its own, for a caller (the window) on another loop."""

    def __init__(self, name: str = "gguf-studio-backend") -> None:
        self.loop = event_loop.new_event_loop()  # uvloop's where installed
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def stop(self, timeout: float = 10.0) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_forever()
        finally:
            pending = asyncio.all_tasks(self.loop)
            for task in pending:
                task.cancel()
            if pending:
                self.loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()
